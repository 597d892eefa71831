// Runs csrc/echo/echo_plan.cu under the CPU emulation on the cases tests/echo_emulated.rs
// writes (inputs + the Rust CPU reference's results) and compares every stage and output bit
// for bit. Each reroute case runs with the token count on the host, then from "device" memory
// under a larger bound with junk routes past T (which must be neither read nor written), then
// with out-of-range device counts (which must set CAPMOE_ECHO_ERR_BAD_TOKENS, also under a bound
// of zero rows); a misaligned plan state or count matrix must be refused. Every launch starts in
// a "new context" (the emulated kernel attributes are forgotten), so a launch that needs more
// than 48 KB of shared memory fails unless the entry point opts in every time.
// Usage: echo_driver CASES_FILE. Exit status 0 iff every case matched.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "capturable_moe/echo.h"
#include "cuda_runtime.h"  // the emulation's: emu::new_context()

namespace {

int failures = 0;

void fail(int id, const std::string& what) {
  std::printf("case %d: %s\n", id, what.c_str());
  ++failures;
}

template <class A, class B>
void same(int id, const char* what, const std::vector<A>& got, const std::vector<B>& want) {
  if (got.size() != want.size()) {
    fail(id, std::string(what) + ": length " + std::to_string(got.size()) + " vs " + std::to_string(want.size()));
    return;
  }
  for (size_t i = 0; i < got.size(); ++i)
    if ((int64_t)got[i] != (int64_t)want[i]) {
      fail(id, std::string(what) + "[" + std::to_string(i) + "]: got " + std::to_string((int64_t)got[i]) +
                   ", want " + std::to_string((int64_t)want[i]));
      return;
    }
}

struct Reader {
  FILE* f;
  template <class T>
  bool read(std::vector<T>& v, size_t n) {
    v.resize(n);
    return n == 0 || std::fread(v.data(), sizeof(T), n, f) == n;
  }
};

// One case as the Rust side writes it.
struct Case {
  capmoe_echo_config_t cfg;
  int t, S, W;
  bool plan_only;
  int64_t block_capacity;  // >= 0: the capped top-k form alone (block balancing); -1: none
  std::vector<int64_t> counts;
  std::vector<int32_t> ids;
  std::vector<uint32_t> probs;
  // The reference plan, spec notation.
  std::vector<int64_t> n, load, avg, spill, cap, pre, H, se, F, fpho, Rm, D, Ftot, ho, la;
  std::vector<int64_t> balanced_ftot;  // capped: this rank's row of Ftot after balancing
  std::vector<int32_t> dest;
  std::vector<uint8_t> dense_map;
  std::vector<uint32_t> dense_probs;

  bool read(Reader& r) {
    std::vector<int64_t> h;
    if (!r.read(h, 10)) return false;
    float thr;
    const uint32_t thr_bits = (uint32_t)h[6];
    std::memcpy(&thr, &thr_bits, 4);
    cfg = capmoe_echo_config_t{h[0], h[1], h[2], h[3], h[4], (int32_t)h[5], thr};
    t = (int)h[7];
    plan_only = h[8] != 0;
    block_capacity = h[9];
    const size_t ep = h[0], ne = h[1], k = h[4];
    S = (int)(ep * h[2]);
    W = (int)ne + S;
    r.read(counts, ep * ne);
    r.read(ids, (size_t)t * k);
    r.read(probs, (size_t)t * k);
    r.read(n, ne), r.read(load, ep), r.read(avg, 1), r.read(spill, ne), r.read(cap, ep);
    r.read(pre, ne * S), r.read(H, ne * S), r.read(se, S), r.read(F, ep * S), r.read(fpho, ep * ne);
    r.read(Rm, ne * S), r.read(D, ep * S), r.read(Ftot, ep * S), r.read(ho, ep * ne), r.read(la, ep);
    const size_t rows = plan_only ? 0 : (size_t)t;  // no outputs without tokens
    if (block_capacity >= 0) {
      if (rows > 0) r.read(balanced_ftot, (size_t)S);
      return r.read(dest, rows * k);
    }
    r.read(dest, rows * k);
    r.read(dense_map, rows * W);
    return r.read(dense_probs, rows * W);
  }
};

// Decodes the state as EchoPlan::read_stages does and compares every stage.
void check_state(int id, const Case& c, const capmoe_echo_layout_t& lay, const std::vector<int64_t>& st) {
  const int ep = (int)c.cfg.ep, ne = (int)c.cfg.num_experts, S = c.S;
  auto i32 = [&](int64_t off, size_t i) { return (int64_t) reinterpret_cast<const int32_t*>(st.data() + off)[i]; };
  auto section = [&](int64_t off, size_t len) { return std::vector<int64_t>(st.begin() + off, st.begin() + off + len); };
  std::vector<int64_t> pre(ne * S), H(ne * S), Rm(ne * S), F(ep * S), D(ep * S), Ftot(ep * S), fpho(ep * ne), ho(ep * ne);
  const std::vector<int64_t> se = section(lay.off_slot_expert, S);
  for (int j = 0; j < S; ++j) {
    const int64_t pe = st[lay.off_pre_reclaim_expert + j];
    if (pe >= 0 && pe < ne) pre[pe * S + j] = st[lay.off_pre_reclaim_tokens + j];
    const int64_t e = se[j];
    if (e < 0 || e >= ne) continue;
    H[e * S + j] = st[lay.off_slot_tokens + j];
    Rm[e * S + j] = st[lay.off_remaining_capacity + j];
    for (int q = 0; q < ep; ++q) {
      const int64_t f = i32(lay.off_first_pass, (size_t)j * ep + q), d = i32(lay.off_second_pass, (size_t)j * ep + q);
      F[q * S + j] = f, D[q * S + j] = d, Ftot[q * S + j] = f + d;
      fpho[q * ne + e] += f, ho[q * ne + e] += f + d;
    }
  }
  same(id, "n", section(lay.off_tokens_per_expert, ne), c.n);
  same(id, "load", section(lay.off_load_per_rank, ep), c.load);
  same(id, "avg", section(lay.off_avg, 1), c.avg);
  same(id, "spill", section(lay.off_spill, ne), c.spill);
  same(id, "cap", section(lay.off_spare_capacity, ep), c.cap);
  same(id, "H before reclaim", pre, c.pre);
  same(id, "H", H, c.H);
  same(id, "slot_expert", se, c.se);
  same(id, "F", F, c.F);
  same(id, "C - C1", fpho, c.fpho);
  same(id, "Rm", Rm, c.Rm);
  same(id, "D", D, c.D);
  same(id, "Ftot", Ftot, c.Ftot);
  same(id, "C - C2", ho, c.ho);
  same(id, "load_after", section(lay.off_load_after, ep), c.la);
  // Offload map: M[e][j] = 1 iff slot j's home expert is e.
  const uint8_t* m = reinterpret_cast<const uint8_t*>(st.data() + lay.off_offload_map);
  std::vector<int64_t> got_m(m, m + (size_t)ne * S), want_m((size_t)ne * S, 0);
  for (int j = 0; j < S; ++j)
    if (c.se[j] >= 0) want_m[c.se[j] * S + j] = 1;
  same(id, "offload map", got_m, want_m);
}

// Capped form: this rank's slot ranges (slot_route) hold the balanced counts, consecutive per
// expert in slot order from 0, and expert_route the expert's total off its home column.
void check_balanced_ranges(int id, const Case& c, const capmoe_echo_layout_t& lay, const std::vector<int64_t>& st) {
  const int ne = (int)c.cfg.num_experts, S = c.S;
  const int32_t* sr = reinterpret_cast<const int32_t*>(st.data() + lay.off_slot_route);
  const int32_t* er = reinterpret_cast<const int32_t*>(st.data() + lay.off_expert_route);
  std::vector<int64_t> got(S, 0), next_start(ne, 0);
  for (int j = 0; j < S; ++j) {
    const int32_t e = sr[4 * j], start = sr[4 * j + 2], end = sr[4 * j + 3];
    if (e < 0) continue;
    if (start != next_start[e]) return fail(id, "capped: slot " + std::to_string(j) + "'s range does not follow its expert's previous one");
    got[j] = end - start;
    next_start[e] = end;
  }
  same(id, "capped: balanced Ftot row", got, c.balanced_ftot);
  for (int e = 0; e < ne; ++e)
    if (er[2 * e] >= 0 && er[2 * e + 1] != next_start[e]) return fail(id, "capped: home offload of expert " + std::to_string(e));
}

enum Form { kPlanOnly, kTopk, kDense };

// One launch sequence: `bound` token rows in the buffers (T itself, or a larger bound with a
// device count), rows past T filled with junk routes.
void run(int id, const Case& c, Form form, int bound, const int32_t* t_device, int64_t want_error) {
  emu::new_context();
  const int ne = (int)c.cfg.num_experts, k = (int)c.cfg.topk, W = c.W, t = c.t;
  capmoe_echo_layout_t lay;
  int64_t ws_len;
  if (capmoe_echo_layout(&c.cfg, bound > 0 ? bound : 1, &lay, &ws_len) != 0) return fail(id, "layout rejected");
  std::vector<int32_t> ids((size_t)bound * k);
  std::vector<uint32_t> probs((size_t)bound * k, 0x3f000000u);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i < c.ids.size() ? c.ids[i] : (int32_t)((i % k + i / k) % ne);
  std::copy_n(c.probs.begin(), std::min(c.probs.size(), probs.size()), probs.begin());  // bound may be < T
  std::vector<uint8_t> map((size_t)bound * ne + 1, 0), out_map((size_t)bound * W + 1, 0xA5);
  std::vector<uint32_t> map_probs((size_t)bound * ne + 1, 0), out_probs((size_t)bound * W + 1, 0xdeadbeefu);
  for (size_t i = 0; i < ids.size(); ++i) {
    map[(i / k) * ne + ids[i]] = 1;
    map_probs[(i / k) * ne + ids[i]] = probs[i];
  }
  std::vector<int64_t> st(lay.state_len, -99);
  std::vector<int32_t> ws(ws_len > 0 ? ws_len : 1, -7777), out_dest((size_t)bound * k + 1, -7777);
  std::vector<uint32_t> out_probs_k((size_t)bound * k + 1, 0xdeadbeefu);
  const float* pk = reinterpret_cast<const float*>(probs.data());
  capmoe_status_t status;
  if (form == kPlanOnly) {
    status = capmoe_echo_plan(&c.cfg, c.counts.data(), st.data(), nullptr);
  } else if (form == kTopk && c.block_capacity >= 0) {
    status = capmoe_echo_plan_reroute_topk_capped(&c.cfg, c.block_capacity, c.counts.data(), ids.data(), pk, bound, t_device,
                                                  st.data(), ws.data(), ws_len, out_dest.data(),
                                                  reinterpret_cast<float*>(out_probs_k.data()), nullptr);
  } else if (form == kTopk) {
    status = capmoe_echo_plan_reroute_topk(&c.cfg, c.counts.data(), ids.data(), pk, bound, t_device, st.data(), ws.data(),
                                           ws_len, out_dest.data(), reinterpret_cast<float*>(out_probs_k.data()), nullptr);
  } else {
    status = capmoe_echo_plan_reroute_dense(&c.cfg, c.counts.data(), map.data(), reinterpret_cast<const float*>(map_probs.data()),
                                            bound, t_device, st.data(), ws.data(), ws_len, out_map.data(),
                                            reinterpret_cast<float*>(out_probs.data()), nullptr);
  }
  if (status != 0) return fail(id, "status " + std::to_string(status));
  if (want_error != 0) {  // only the error bits are specified
    if (!(st[lay.off_error] & want_error)) fail(id, "error bit " + std::to_string(want_error) + " not set");
    return;
  }
  if (st[lay.off_error] != 0) fail(id, "error word " + std::to_string(st[lay.off_error]));
  check_state(id, c, lay, st);  // balancing leaves every section but this rank's ranges
  if (c.block_capacity >= 0 && t > 0) check_balanced_ranges(id, c, lay, st);
  if (form == kTopk) {
    same(id, "top-k destinations", std::vector<int32_t>(out_dest.begin(), out_dest.begin() + (size_t)t * k), c.dest);
    same(id, "top-k probs", std::vector<uint32_t>(out_probs_k.begin(), out_probs_k.begin() + (size_t)t * k), c.probs);
    for (size_t i = (size_t)t * k; i < (size_t)bound * k; ++i)
      if (out_dest[i] != -7777 || out_probs_k[i] != 0xdeadbeefu) return fail(id, "top-k output written past T");
  }
  if (form == kDense) {
    same(id, "dense map", std::vector<uint8_t>(out_map.begin(), out_map.begin() + (size_t)t * W), c.dense_map);
    same(id, "dense probs", std::vector<uint32_t>(out_probs.begin(), out_probs.begin() + (size_t)t * W), c.dense_probs);
    for (size_t i = (size_t)t * W; i < (size_t)bound * W; ++i)
      if (out_map[i] != 0xA5 || out_probs[i] != 0xdeadbeefu) return fail(id, "dense output written past T");
  }
}

// A plan state off 16-byte alignment (one element off) or counts off 8-byte alignment are
// refused before any launch.
void check_misaligned_pointers(int id, const Case& c) {
  capmoe_echo_layout_t lay;
  int64_t ws_len;
  if (capmoe_echo_layout(&c.cfg, 1, &lay, &ws_len) != 0) return fail(id, "layout rejected");
  std::vector<int64_t> st(lay.state_len + 2, -99);
  int64_t* aligned = reinterpret_cast<uintptr_t>(st.data()) % 16 == 0 ? st.data() : st.data() + 1;
  std::vector<unsigned char> counts_storage(c.counts.size() * 8 + 8);
  std::memcpy(counts_storage.data() + 4, c.counts.data(), c.counts.size() * 8);
  const auto* counts_off = reinterpret_cast<const int64_t*>(counts_storage.data() + 4);
  const struct {
    const char* what;
    const int64_t* counts;
    int64_t* state;
  } tries[] = {{"state", c.counts.data(), aligned + 1}, {"counts", counts_off, aligned}};
  for (const auto& t : tries) {
    const capmoe_status_t status = capmoe_echo_plan(&c.cfg, t.counts, t.state, nullptr);
    if (status != CAPMOE_ERR_MISALIGNED) fail(id, std::string("misaligned ") + t.what + ": status " + std::to_string(status));
  }
  for (int64_t v : st)
    if (v != -99) return fail(id, "misaligned pointers: the plan ran");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CASES_FILE\n", argv[0]);
    return 2;
  }
  FILE* f = std::fopen(argv[1], "rb");
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", argv[1]);
    return 2;
  }
  Reader r{f};
  int id = 0;
  for (Case c; c.read(r); ++id) {
    if (id == 0) check_misaligned_pointers(id, c);
    if (c.plan_only) {
      run(id, c, kPlanOnly, c.t, nullptr, 0);
      continue;
    }
    const int bound = c.t + 37 + c.t / 3;
    const int32_t t = c.t, below = -3, above = bound + 5, one = 1;
    const bool capped = c.block_capacity >= 0;  // the capped form has no dense twin
    for (Form form : {kTopk, kDense}) {
      if (capped && form == kDense) continue;
      run(id, c, form, c.t, nullptr, 0);
      run(id, c, form, bound, &t, 0);
      run(id, c, form, 0, &one, CAPMOE_ECHO_ERR_BAD_TOKENS);  // no token rows: only the plan runs
    }
    run(id, c, kTopk, bound, &below, CAPMOE_ECHO_ERR_BAD_TOKENS);
    run(id, c, kTopk, bound, &above, CAPMOE_ECHO_ERR_BAD_TOKENS);
    if (failures > 20) break;
  }
  std::printf("%zu launches past 48 KB of shared memory\n", emu::opted_in_launches());
  std::printf("%d cases, %d failures\n", id, failures);
  return failures == 0 && id > 0 ? 0 : 1;
}
