// Runs the grouped GEMM's argument kernel and WGRAD zero fill (csrc/grouped_gemm/arguments.cuh)
// under the CPU emulation on the cases tests/grouped_gemm_emulated.rs writes, and writes back
// what they produced for the Rust side to compare with its reference. The CUTLASS GEMM itself
// is not emulated: the kernel's `Arrays` here records each group as written.
//
// Case (little-endian int64): op, splits_are_i64, weights_as_pointers, weights_transposed,
// experts E, n, k, capacity, d_bytes (2 or 4), zero_fill; then the E counts (as int64, narrowed
// to int32 when !splits_are_i64); then, with weights_as_pointers, E pointer kinds
// (kPointerKind). The operands are three byte buffers A, B, D (the kernel's a, b, d); the
// weight-shaped operand (B for FPROP/DGRAD, D for WGRAD) holds E matrices of n x k, which the
// per-expert pointers point at.
// Output per case (int64): status, overflow flags, row_offsets [E + 1], then per expert m, n,
// k and (buffer, byte offset) of a, b and d (kBuffer), then with zero_fill the weight-shaped
// buffer's E*n*k*d_bytes bytes after the fill (it starts as 0x5a bytes).
// Usage: grouped_gemm_driver CASES_FILE OUTPUT_FILE.
#include <cstdio>
#include <cstring>
#include <vector>

#include "grouped_gemm/arguments.cuh"
#include "driver_main.h"

namespace {

using capmoe::gg::Group;

enum kPointerKind : int64_t { kValid = 0, kNull = 1, kMisaligned = 2 };
enum kBuffer : int64_t { kBufferA = 0, kBufferB = 1, kBufferD = 2, kNullPointer = 3, kElsewhere = 4 };

// CUTLASS's argument arrays reduced to what the kernel writes: one Group per expert.
template <class ElementD_>
struct RecordedArrays {
  using ElementA = uint16_t;
  using ElementB = uint16_t;
  using ElementD = ElementD_;
  int64_t* row_offsets;
  Group* groups;
  void store(int64_t e, const Group& g) const { groups[e] = g; }
};

struct Buffer {
  std::vector<unsigned char> bytes;  // operator new aligns to 16
  explicit Buffer(size_t n) : bytes(n + 16, 0x5a) {}
  unsigned char* data() { return bytes.data(); }
  bool holds(const void* p) const {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= bytes.data() && c <= bytes.data() + bytes.size();
  }
};

struct Case {
  int64_t op, splits_i64, pointers, transposed, experts, n, k, capacity, d_bytes, zero_fill;
  std::vector<int64_t> counts, kinds;

  // 1 after a case, 0 at the end of the file, -1 on a truncated case.
  int read(FILE* f) {
    int64_t h[10];
    const size_t got = std::fread(h, sizeof(int64_t), 10, f);
    if (got != 10) return got == 0 ? 0 : -1;
    op = h[0], splits_i64 = h[1], pointers = h[2], transposed = h[3], experts = h[4];
    n = h[5], k = h[6], capacity = h[7], d_bytes = h[8], zero_fill = h[9];
    counts.resize(experts);
    kinds.assign(experts, kValid);
    bool ok = std::fread(counts.data(), sizeof(int64_t), experts, f) == (size_t)experts;
    if (pointers) ok = ok && std::fread(kinds.data(), sizeof(int64_t), experts, f) == (size_t)experts;
    return ok ? 1 : -1;
  }
  bool wgrad() const { return op == CAPMOE_GEMM_WGRAD; }
  size_t weight_bytes() const { return (size_t)(experts * n * k) * (wgrad() ? d_bytes : 2); }
};

void put(FILE* out, int64_t v) { std::fwrite(&v, sizeof v, 1, out); }

struct Located {
  int64_t buffer, offset;
};

template <class ElementD>
void run_case(const Case& c, FILE* out) {
  const size_t widest = (size_t)(c.n > c.k ? c.n : c.k);
  const size_t rows_bytes = (size_t)c.capacity * widest * 4;
  Buffer a(rows_bytes), b(c.wgrad() ? rows_bytes : c.weight_bytes()), d(c.wgrad() ? c.weight_bytes() : rows_bytes);
  Buffer& weights = c.wgrad() ? d : b;

  // The per-expert pointers into the weight-shaped buffer, with the planted faults.
  std::vector<void*> expert_pointers(c.experts);
  const size_t matrix_bytes = c.weight_bytes() / c.experts;
  const size_t element_bytes = c.wgrad() ? c.d_bytes : 2;
  for (int64_t e = 0; e < c.experts; ++e) {
    unsigned char* p = weights.data() + e * matrix_bytes;
    expert_pointers[e] = c.kinds[e] == kNull ? nullptr : c.kinds[e] == kMisaligned ? p + element_bytes : p;
  }
  std::vector<int32_t> splits32(c.counts.begin(), c.counts.end());
  std::vector<int64_t> row_offsets(c.experts + 1, -7777);
  std::vector<Group> groups(c.experts, Group{-1, -1, -1, nullptr, nullptr, nullptr});
  int32_t flags = 0;

  capmoe::gg::ArgumentParams<RecordedArrays<ElementD>> p{};
  p.arrays = {row_offsets.data(), groups.data()};
  p.m_splits = c.splits_i64 ? static_cast<const void*>(c.counts.data()) : splits32.data();
  p.splits_are_i64 = c.splits_i64 != 0;
  p.op = (int32_t)c.op;
  p.weights_as_pointers = c.pointers != 0;
  p.weights_transposed = c.transposed != 0;
  p.experts = c.experts, p.n = c.n, p.k = c.k, p.capacity = c.capacity;
  p.a = a.data();
  p.b = c.pointers && !c.wgrad() ? static_cast<void*>(expert_pointers.data()) : b.data();
  p.d = c.pointers && c.wgrad() ? static_cast<void*>(expert_pointers.data()) : d.data();
  p.overflow_flags = &flags;
  capmoe_status_t status = capmoe::gg::launch_write_arguments(p, nullptr);
  if (status == CAPMOE_OK && c.zero_fill) {
    status = capmoe::gg::launch_zero_empty_experts<ElementD>(row_offsets.data(), p.d, p.weights_as_pointers, c.experts,
                                                             c.n * c.k, nullptr);
  }

  auto locate = [&](const void* ptr) -> Located {
    if (ptr == nullptr) return {kNullPointer, 0};
    Buffer* buffers[3] = {&a, &b, &d};
    for (int64_t i = 0; i < 3; ++i)
      if (buffers[i]->holds(ptr)) return {i, static_cast<const unsigned char*>(ptr) - buffers[i]->data()};
    return {kElsewhere, 0};
  };
  put(out, status);
  put(out, flags);
  for (int64_t v : row_offsets) put(out, v);
  for (const Group& g : groups) {
    put(out, g.m), put(out, g.n), put(out, g.k);
    for (const void* ptr : {g.a, g.b, static_cast<const void*>(g.d)}) {
      const Located l = locate(ptr);
      put(out, l.buffer), put(out, l.offset);
    }
  }
  if (c.zero_fill) std::fwrite(weights.data(), 1, c.weight_bytes(), out);
}

}  // namespace

int main(int argc, char** argv) {
  return run_cases_main(argc, argv, [](FILE* in, FILE* out) {
    Case c;
    const int r = c.read(in);
    if (r != 1) return r;
    if (c.d_bytes == 4) run_case<float>(c, out);
    else run_case<uint16_t>(c, out);
    return 1;
  });
}
