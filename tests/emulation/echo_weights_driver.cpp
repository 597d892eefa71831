// Runs the spare-slot weight kernels (csrc/echo/echo_weights.cu) under the CPU emulation on the
// cases tests/echo_weights_emulated.rs writes, through the C ABI of capturable_moe/echo.h, and
// writes the status, the error word and the output buffer back for the Rust side to compare
// with its reference.
//
// Case (little-endian): 13 int64 (op: 0 fill / 1 fold, num_experts, slot_begin, num_slots,
// per_expert: bytes for fill, f32 elements for fold, error word: 0 none (NULL) / 1 given,
// its initial value, byte offset of the input from a 16-byte boundary, the same for the
// output, which pointers to pass as NULL: bit 0 slot_expert, bit 1 input, bit 2 output,
// slot_expert length, input bytes, output bytes), then slot_expert [int64], the input
// (home or dw_slot) and the output's initial bytes (spare or dw_home). The Rust side poisons
// and sizes every buffer itself, guard tails included, so the driver only places them.
// Output per case: int32 status, int64 error word, the output buffer.
// Usage: echo_weights_driver CASES_FILE OUTPUT_FILE.
#include <cstdio>
#include <vector>

#include "capturable_moe/echo.h"
#include "driver_main.h"

namespace {

// Bytes read from the case file, placed `offset` bytes past a 16-byte boundary (operator new
// aligns to 16).
struct Placed {
  std::vector<unsigned char> storage;
  size_t offset = 0, size = 0;
  unsigned char* data() { return storage.data() + offset; }
  bool read(FILE* f, size_t n, size_t off) {
    storage.assign(n + off + 16, 0);
    offset = off;
    size = n;
    return n == 0 || std::fread(data(), 1, n, f) == n;
  }
};

struct Case {
  int64_t op, num_experts, slot_begin, num_slots, per_expert, has_errors, errors;
  int64_t in_offset, out_offset, null_mask, n_slot_expert, in_bytes, out_bytes;
  Placed slot_expert, input, output;

  // 1 after a case, 0 at the end of the file, -1 on a truncated case.
  int read(FILE* f) {
    int64_t h[13];
    const size_t got = std::fread(h, sizeof(int64_t), 13, f);
    if (got != 13) return got == 0 ? 0 : -1;
    op = h[0], num_experts = h[1], slot_begin = h[2], num_slots = h[3], per_expert = h[4];
    has_errors = h[5], errors = h[6], in_offset = h[7], out_offset = h[8], null_mask = h[9];
    n_slot_expert = h[10], in_bytes = h[11], out_bytes = h[12];
    const bool ok = slot_expert.read(f, n_slot_expert * sizeof(int64_t), 0) &&
                    input.read(f, in_bytes, in_offset) && output.read(f, out_bytes, out_offset);
    return ok ? 1 : -1;
  }
  void* pointer(Placed& p, int bit) { return (null_mask >> bit) & 1 ? nullptr : p.data(); }
};

// Runs the next case: 1 after a case, 0 at the end of the file, -1 on a truncated case.
int run_case(FILE* in, FILE* out) {
  Case c;
  const int r = c.read(in);
  if (r != 1) return r;
  const int64_t* slot_expert = static_cast<const int64_t*>(c.pointer(c.slot_expert, 0));
  int64_t* errors = c.has_errors ? &c.errors : nullptr;
  int32_t status;
  if (c.op == 0) {
    status = capmoe_echo_fill_spare_weights(slot_expert, c.num_experts, c.slot_begin, c.num_slots,
                                            c.pointer(c.input, 1), c.pointer(c.output, 2),
                                            c.per_expert, errors, nullptr);
  } else {
    status = capmoe_echo_fold_spare_grads(slot_expert, c.num_experts, c.num_slots,
                                          static_cast<const float*>(c.pointer(c.input, 1)),
                                          static_cast<float*>(c.pointer(c.output, 2)), c.per_expert,
                                          errors, nullptr);
  }
  std::fwrite(&status, sizeof status, 1, out);
  std::fwrite(&c.errors, sizeof c.errors, 1, out);
  std::fwrite(c.output.data(), 1, c.output.size, out);
  return 1;
}

}  // namespace

int main(int argc, char** argv) { return run_cases_main(argc, argv, run_case); }
