// Runs the EP kernels (csrc/ep/{dispatch,weights}.cu) under the CPU emulation on the cases
// tests/ep_emulated.rs writes, through the C ABI of capturable_moe/ep.h, and writes the status,
// the flags word and every buffer back for the Rust side to compare with its reference.
//
// Case (little-endian): 17 int64 (op, the 9 descriptor fields in ep.h's order, host token
// count, device token count, use the device count, size: bytes_per_expert for pack / select,
// per_expert for fold, flags given (0: NULL), the flags word's initial value, buffer count),
// then per buffer an int64 byte length (-1: pass NULL), an int64 byte offset from a 16-byte
// boundary (to pass a misaligned pointer) and its bytes. Buffers are the op's
// pointer arguments in the order of its signature (flags and the token count excluded); the
// Rust side sizes and poisons them, guard tails included, so the driver only places them
// (16-byte aligned) and calls. Ops: 0 count_routes, 1 dispatch_layout, 2 gather_rows,
// 3 reduce_rows, 4 gather_route_values, 5 pack_spare_weights, 6 select_spare_weights,
// 7 fold_spare_grads, 8 check_desc.
// Output per case: int32 status, int32 flags word, then every buffer (inputs too, so that a
// write into an input shows).
// Usage: ep_driver CASES_FILE OUTPUT_FILE.
#include <cstdio>
#include <vector>

#include "capturable_moe/ep.h"
#include "driver_main.h"

namespace {

struct Buffer {
  std::vector<unsigned char> storage;  // operator new aligns to 16
  size_t offset = 0, size = 0;
  bool null = false;
  void* data() { return null ? nullptr : storage.data() + offset; }
  unsigned char* bytes() { return storage.data() + offset; }
};

template <class T>
T* as(Buffer& b) {
  return static_cast<T*>(b.data());
}

int run_case(FILE* in, FILE* out) {
  int64_t h[17];
  const size_t got = std::fread(h, sizeof(int64_t), 17, in);
  if (got != 17) return got == 0 ? 0 : -1;
  const int64_t op = h[0];
  capmoe_ep_desc_t d{};
  d.ranks = h[1];
  d.rank = h[2];
  d.num_experts = h[3];
  d.spare_per_rank = h[4];
  d.hidden = h[5];
  d.topk = h[6];
  d.max_tokens = h[7];
  d.capacity = h[8];
  d.dtype = static_cast<capmoe_dtype_t>(h[9]);
  const int64_t host_tokens = h[10];
  int32_t device_tokens = static_cast<int32_t>(h[11]);
  const int32_t* tokens_dev = h[12] ? &device_tokens : nullptr;
  const int64_t size = h[13];
  int32_t flags = static_cast<int32_t>(h[15]);
  int32_t* flags_ptr = h[14] ? &flags : nullptr;
  std::vector<Buffer> b(static_cast<size_t>(h[16]));
  for (Buffer& buf : b) {
    int64_t shape[2];
    if (std::fread(shape, sizeof(int64_t), 2, in) != 2) return -1;
    buf.null = shape[0] < 0;
    buf.size = shape[0] < 0 ? 0 : static_cast<size_t>(shape[0]);
    buf.offset = static_cast<size_t>(shape[1]);
    buf.storage.assign(buf.size + buf.offset + 16, 0);
    if (buf.size > 0 && std::fread(buf.bytes(), 1, buf.size, in) != buf.size) return -1;
  }
  auto need = [&](size_t n) { return b.size() == n; };
  int32_t status = CAPMOE_ERR_INTERNAL;
  switch (op) {
    case 0:
      if (need(2))
        status = capmoe_ep_count_routes(&d, as<const int32_t>(b[0]), host_tokens, tokens_dev,
                                        as<int64_t>(b[1]), flags_ptr, nullptr);
      break;
    case 1:
      if (need(8))
        status = capmoe_ep_dispatch_layout(&d, as<const int32_t>(b[0]), as<const float>(b[1]),
                                           host_tokens, tokens_dev, as<int32_t>(b[2]),
                                           as<int32_t>(b[3]), as<float>(b[4]), as<int32_t>(b[5]),
                                           as<int32_t>(b[6]), as<int32_t>(b[7]), flags_ptr, nullptr);
      break;
    case 2:
      if (need(3))
        status = capmoe_ep_gather_rows(&d, b[0].data(), as<const int32_t>(b[1]), host_tokens,
                                       tokens_dev, b[2].data(), nullptr);
      break;
    case 3:
      if (need(3))
        status = capmoe_ep_reduce_rows(&d, b[0].data(), as<const int32_t>(b[1]), host_tokens,
                                       tokens_dev, b[2].data(), nullptr);
      break;
    case 4:
      if (need(3))
        status = capmoe_ep_gather_route_values(&d, as<const float>(b[0]), as<const int32_t>(b[1]),
                                               host_tokens, tokens_dev, as<float>(b[2]), nullptr);
      break;
    case 5:
      if (need(3))
        status = capmoe_ep_pack_spare_weights(&d, as<const int64_t>(b[0]), b[1].data(), size,
                                              b[2].data(), flags_ptr, nullptr);
      break;
    case 6:
      if (need(3))
        status = capmoe_ep_select_spare_weights(&d, as<const int64_t>(b[0]), b[1].data(), size,
                                                b[2].data(), flags_ptr, nullptr);
      break;
    case 7:
      if (need(3))
        status = capmoe_ep_fold_spare_grads(&d, as<const int64_t>(b[0]), as<const float>(b[1]),
                                            size, as<float>(b[2]), flags_ptr, nullptr);
      break;
    case 8:
      status = capmoe_ep_check_desc(&d);
      break;
    default:
      break;
  }
  std::fwrite(&status, sizeof status, 1, out);
  std::fwrite(&flags, sizeof flags, 1, out);
  for (Buffer& buf : b) std::fwrite(buf.bytes(), 1, buf.size, out);
  return 1;
}

}  // namespace

int main(int argc, char** argv) { return run_cases_main(argc, argv, run_case); }
