// Runs the routing kernels (csrc/routing/{build,permute,swiglu,row_probs}.cu) under the CPU emulation on
// the cases tests/routing_emulated.rs writes, through the C ABI of capturable_moe/routing.h, and
// writes every output buffer back for the Rust side to compare with its CPU reference.
//
// Case (little-endian): 14 int64 (E, H, F, k, T_max, capacity, expert_capacity, dtype,
// prob_dtype, host T, device T, use the device T, run from_map a second time with flags NULL,
// dprob slices S), then expert_ids [T_max k] int32,
// x [T_max H], probs [T_max k], out [capacity H], dy [T_max H], h [capacity 2F],
// dact [capacity F], routing_map [T_max E] uint8, map_probs [T_max E] (prob dtype),
// dprob partials [capacity S] fp32. Every
// output buffer gets kGuard poisoned elements past its end and starts poisoned (Buf below), so
// an element never written or one written past the end shows; every input gets a poisoned
// tail (a NaN for 2-byte activations), so a read past its end shows.
// Output per case: 13 int32 statuses (the 11th 0 without the second from_map), then the
// buffers in the order they are written below.
// Usage: routing_driver CASES_FILE OUTPUT_FILE.
#include <cstdio>
#include <cstring>
#include <vector>

#include "capturable_moe/routing.h"
#include "driver_main.h"

namespace {

constexpr size_t kGuard = 64;

// A buffer of n elements of `size` bytes plus the guard, filled with the poison of its size:
// 0x5a (a routed entry of a routing map), 0x7fa5 (a NaN in bf16 and fp16), 0x5a5a5a5a,
// 0x5a5a5a5a5a5a5a5a.
struct Buf {
  size_t size = 0;
  std::vector<unsigned char> bytes;  // operator new aligns to 16, as the ABI asks
  Buf(size_t n, size_t elem) : size(elem), bytes((n + kGuard) * elem) {
    for (size_t i = 0; i < bytes.size(); i += elem) {
      if (elem == 2) {
        const uint16_t v = 0x7fa5;
        std::memcpy(&bytes[i], &v, 2);
      } else {
        std::memset(&bytes[i], 0x5a, elem);
      }
    }
  }
  void* data() { return bytes.data(); }
};

struct Reader {
  FILE* f;
  bool ok = true;
  // Reads n elements of `elem` bytes into a buffer with a poisoned tail.
  Buf input(size_t n, size_t elem) {
    Buf b(n, elem);
    ok = ok && (n == 0 || std::fread(b.data(), elem, n, f) == n);
    return b;
  }
};

size_t dtype_bytes(int64_t d) { return d == CAPMOE_DTYPE_F32 ? 4 : 2; }

// What from_map's flags word holds before the call: a bit no routing flag uses, which must
// survive (flags are OR-ed into, never overwritten).
constexpr int32_t kFromMapFlagsBefore = 0x100;

// from_map's [T_max, k] ids and probs (poisoned) and its flags word.
struct FromMapOutputs {
  Buf ids, probs, flags;
  FromMapOutputs(size_t routes, size_t prob_bytes) : ids(routes, 4), probs(routes, prob_bytes), flags(1, 4) {}
};

int run_case(Reader& in, FILE* out) {
  int64_t h[14];
  if (std::fread(h, sizeof(int64_t), 14, in.f) != 14) return 0;
  capmoe_routing_desc_t d{};
  d.num_experts = h[0];
  d.hidden = h[1];
  d.ffn = h[2];
  d.topk = h[3];
  d.max_tokens = h[4];
  d.capacity = h[5];
  d.expert_capacity = h[6];
  d.dtype = (capmoe_dtype_t)h[7];
  d.prob_dtype = (capmoe_dtype_t)h[8];
  const int64_t host_t = h[9];
  int32_t device_t = (int32_t)h[10];
  const int32_t* t_dev = h[11] ? &device_t : nullptr;
  const size_t E = h[0], H = h[1], F = h[2], k = h[3], T = h[4], cap = h[5], slices = h[13];
  const size_t es = dtype_bytes(d.dtype), ps = dtype_bytes(d.prob_dtype);

  Buf ids = in.input(T * k, 4), x = in.input(T * H, es), probs = in.input(T * k, ps);
  Buf rows_in = in.input(cap * H, es), dy = in.input(T * H, es);
  Buf hbuf = in.input(cap * 2 * F, es), dact = in.input(cap * F, es);
  Buf routing_map = in.input(T * E, 1), map_probs = in.input(T * E, ps);
  Buf partials = in.input(cap * slices, 4);
  if (!in.ok) return -1;

  uint64_t ws_bytes = 0;
  int32_t status[13] = {};
  status[0] = capmoe_routing_workspace_size(&d, &ws_bytes);
  std::vector<unsigned char> ws(ws_bytes + 16, 0xa5);

  Buf m32(E, 4), m64(E, 8), offsets(E + 1, 8), row_of_route(T * k, 4), token_of_row(cap, 4);
  Buf counts(E, 4), flags(1, 4);
  std::memset(flags.data(), 0, 4);
  status[1] = capmoe_routing_build(&d, (const int32_t*)ids.data(), host_t, t_dev, (int32_t*)m32.data(),
                                   (int64_t*)m64.data(), (int64_t*)offsets.data(), (int32_t*)row_of_route.data(),
                                   (int32_t*)token_of_row.data(), (int32_t*)counts.data(), (int32_t*)flags.data(),
                                   ws.data(), ws_bytes, nullptr);
  // Again with every optional output left out: offsets and row_of_route must not change.
  Buf offsets2(E + 1, 8), row_of_route2(T * k, 4);
  std::vector<unsigned char> ws2(ws_bytes + 16, 0xa5);
  status[2] = capmoe_routing_build(&d, (const int32_t*)ids.data(), host_t, t_dev, nullptr, nullptr,
                                   (int64_t*)offsets2.data(), (int32_t*)row_of_route2.data(), nullptr,
                                   nullptr, nullptr, ws2.data(), ws_bytes, nullptr);
  const int32_t* map = (const int32_t*)row_of_route.data();

  Buf rows(cap * H, es), y(T * H, es), dx(T * H, es), drows(cap * H, es), dprobs(T * k, ps);
  Buf act(cap * F, es), dh(cap * 2 * F, es);
  status[3] = capmoe_routing_permute(&d, x.data(), map, host_t, t_dev, rows.data(), nullptr);
  status[4] = capmoe_routing_unpermute(&d, rows_in.data(), map, probs.data(), host_t, t_dev, y.data(), nullptr);
  status[5] = capmoe_routing_permute_backward(&d, rows_in.data(), map, host_t, t_dev, dx.data(), nullptr);
  status[6] = capmoe_routing_unpermute_backward(&d, dy.data(), rows_in.data(), map, probs.data(), host_t,
                                                t_dev, drows.data(), dprobs.data(), nullptr);
  const int64_t* offs = (const int64_t*)offsets.data();
  status[7] = capmoe_routing_swiglu(&d, hbuf.data(), offs, act.data(), nullptr);
  status[8] = capmoe_routing_swiglu_backward(&d, dact.data(), hbuf.data(), offs, dh.data(), nullptr);

  FromMapOutputs fm(T * k, ps), fm_no_flags(T * k, ps);
  std::memcpy(fm.flags.data(), &kFromMapFlagsBefore, 4);
  status[9] = capmoe_routing_from_map(&d, (const uint8_t*)routing_map.data(), map_probs.data(), host_t, t_dev,
                                      (int32_t*)fm.ids.data(), fm.probs.data(), (int32_t*)fm.flags.data(), nullptr);
  const bool without_flags = h[12] != 0;
  if (without_flags)
    status[10] = capmoe_routing_from_map(&d, (const uint8_t*)routing_map.data(), map_probs.data(), host_t, t_dev,
                                         (int32_t*)fm_no_flags.ids.data(), fm_no_flags.probs.data(), nullptr, nullptr);

  Buf prob_of_row(cap, 4), route_dprobs(T * k, ps);
  status[11] = capmoe_routing_row_probs(&d, map, probs.data(), host_t, t_dev, (float*)prob_of_row.data(), nullptr);
  status[12] = capmoe_routing_route_dprobs(&d, map, (const float*)partials.data(), (int64_t)slices, host_t, t_dev,
                                           route_dprobs.data(), nullptr);

  std::fwrite(status, sizeof(int32_t), 13, out);
  for (Buf* b : {&m32, &m64, &offsets, &row_of_route, &token_of_row, &counts, &flags, &offsets2,
                 &row_of_route2, &rows, &y, &dx, &drows, &dprobs, &act, &dh, &fm.ids, &fm.probs, &fm.flags,
                 &prob_of_row, &route_dprobs})
    std::fwrite(b->data(), 1, b->bytes.size(), out);
  if (without_flags)
    for (Buf* b : {&fm_no_flags.ids, &fm_no_flags.probs}) std::fwrite(b->data(), 1, b->bytes.size(), out);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  return run_cases_main(argc, argv, [](FILE* in, FILE* out) {
    Reader reader{in};
    return run_case(reader, out);
  });
}
