// The main() of the emulation drivers that read cases from one file and write results to
// another: `driver CASES_FILE OUTPUT_FILE`; prints "N cases" for the Rust side to check.
#pragma once
#include <cstdio>

// `run_case(in, out)` runs the next case and returns 1, or 0 at the end of the file, or -1 on a
// truncated case.
template <class RunCase>
int run_cases_main(int argc, char** argv, RunCase run_case) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CASES_FILE OUTPUT_FILE\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (in == nullptr || out == nullptr) {
    std::perror(argv[0]);
    return 2;
  }
  int n = 0, r;
  while ((r = run_case(in, out)) == 1) ++n;
  std::fclose(out);
  if (r < 0) {
    std::fprintf(stderr, "case %d: truncated input\n", n);
    return 1;
  }
  std::printf("%d cases\n", n);
  return 0;
}
