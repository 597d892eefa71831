// Phase profile of the Echo planner at issue 17's target shape (E256 EP64 T8192 k8), a
// diagnostic, not part of the crate's build. echo_plan.cu is compiled into this program with
// CAPMOE_ECHO_PROF, which makes the plan block's thread 0 write clock64() at each phase boundary
// (A load C .. I state) into g_echo_prof; the program reads them back after each run and prints
// the median cycles of every phase, then the CUDA-event time of the plan launch alone and of
// plan + reroute, per form and algorithm (eager launches, back to back, one sync per run), and
// the same launches captured once in a CUDA graph and replayed (what issue 17's target times).
// Each (S_per, form) ends with one `SUMMARY` line of key=value medians for scripts.
//
//   bash bench/tools/build-echo-phases.sh      # here: writes gpu-bundle/extra/echo_phases
//   gpu-bundle/extra/echo_phases [runs]        # on the GPU machine
#define CAPMOE_ECHO_PROF 1
#include "echo/echo_plan.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

#define CHECK(x)                                                                     \
  do {                                                                               \
    auto status_ = (x);                                                              \
    if (status_ != 0) {                                                              \
      std::fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #x, (int)status_); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

uint64_t g_state = 0x9E3779B97F4A7C15ull;
uint64_t next_random() {
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return g_state;
}

// Skewed routing as src/echo/synthetic.rs draws it: a few hot experts, this rank's ids
// consistent with counts[0], random skewed counts on the other ranks.
struct Inputs {
  std::vector<int64_t> counts;
  std::vector<int32_t> ids;
  std::vector<float> probs;
  std::vector<uint8_t> map;
  std::vector<float> dense_probs;
};

Inputs make_inputs(int ep, int ne, int t, int k) {
  Inputs in;
  std::vector<uint64_t> weight(ne);
  uint64_t total = 0;
  for (auto& w : weight) {
    const uint64_t r = next_random() % 8;
    w = 1 + r * r * r;
    total += w;
  }
  in.counts.assign((size_t)ep * ne, 0);
  in.map.assign((size_t)t * ne, 0);
  in.dense_probs.assign((size_t)t * ne, 0.f);
  for (int i = 0; i < t; ++i) {
    std::vector<int32_t> row;
    while ((int)row.size() < k) {
      uint64_t u = next_random() % total;
      int x = 0;
      while (u >= weight[x]) u -= weight[x++];
      if (std::find(row.begin(), row.end(), x) == row.end()) row.push_back(x);
    }
    std::sort(row.begin(), row.end());
    for (int j = 0; j < k; ++j) {
      const float p = float((i * k + j) % 97 + 1) / 98.f;
      in.counts[row[j]] += 1;
      in.ids.push_back(row[j]);
      in.probs.push_back(p);
      in.map[(size_t)i * ne + row[j]] = 1;
      in.dense_probs[(size_t)i * ne + row[j]] = p;
    }
  }
  for (int r = 1; r < ep; ++r)
    for (int x = 0; x < ne; ++x)
      in.counts[(size_t)r * ne + x] = (int64_t)((next_random() % (2ull * t * k / ne + 1)) * weight[x] / 8);
  return in;
}

template <class T>
T* upload(const std::vector<T>& host) {
  T* dev = nullptr;
  CHECK(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * sizeof(T)));
  CHECK(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

template <class T>
T* zeros(size_t n) {
  T* dev = nullptr;
  CHECK(cudaMalloc(&dev, std::max<size_t>(n, 1) * sizeof(T)));
  CHECK(cudaMemset(dev, 0, std::max<size_t>(n, 1) * sizeof(T)));
  return dev;
}

// g_echo_ns's points (echo_plan.cu's ECHO_NS_FIRST / ECHO_NS_LAST).
constexpr int kTimeline = 12;
const char* kTimelineNames[kTimeline] = {"plan first block",  "plan block start",       "plan block end",
                                         "last count block",  "reroute first block",    "reroute loads done",
                                         "reroute past wait", "reroute prefix done",    "reroute last block end",
                                         "reroute last past wait", "reroute prefix loads issued+summed",
                                         "reroute tables in smem"};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds of one replay of `launch` captured in a CUDA graph (after 10 replays of
// warm-up), each replay timed alone with events.
template <class Launch>
double graph_replay_us(Launch launch, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop, int runs) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const auto captured = launch();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(captured);
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<double> us;
  for (int i = 0; i < runs + 10; ++i) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaStreamSynchronize(stream));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 10) us.push_back(ms * 1e3);
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return median(us);
}

}  // namespace

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::atoi(argv[1]) : 200;
  const int ep = 64, ne = 256, t = 8192, k = 8;
  const Inputs in = make_inputs(ep, ne, t, k);
  int64_t* counts = upload(in.counts);
  int32_t* ids = upload(in.ids);
  float* probs = upload(in.probs);
  uint8_t* map = upload(in.map);
  float* dense_probs = upload(in.dense_probs);
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const char* phase_names[] = {"A load C", "B n", "C load/spill", "D compact", "E rank",
                               "F assign", "G reclaim/P4", "H P5-P7", "I state"};
  std::printf("echo_phases: E%d EP%d T%d k%d, %d runs; plan-block phases in cycles (median)\n", ne, ep, t, k, runs);
  for (int spare : {1, 2}) {
    capmoe_echo_config_t cfg{ep, ne, spare, 0, k, spare == 1 ? CAPMOE_ECHO_APPROX : CAPMOE_ECHO_GREEDY, 0.f};
    capmoe_echo_layout_t layout;
    int64_t workspace_len = 0;
    CHECK(capmoe_echo_layout(&cfg, t, &layout, &workspace_len));
    int64_t* state = zeros<int64_t>(layout.state_len);
    int32_t* workspace = zeros<int32_t>(workspace_len);
    const int columns = ne + ep * spare;
    uint8_t* out_map = zeros<uint8_t>((size_t)t * columns);
    float* out_probs = zeros<float>((size_t)t * columns);
    int32_t* out_dest = zeros<int32_t>((size_t)t * k);
    float* out_pk = zeros<float>((size_t)t * k);
    for (int form = 0; form < 3; ++form) {
      const char* form_name = form == 0 ? "plan only" : form == 1 ? "plan+reroute topk" : "plan+reroute dense";
      auto launch = [&] {
        if (form == 0) return capmoe_echo_plan(&cfg, counts, state, stream);
        if (form == 1)
          return capmoe_echo_plan_reroute_topk(&cfg, counts, ids, probs, t, nullptr, state, workspace, workspace_len,
                                               out_dest, out_pk, stream);
        return capmoe_echo_plan_reroute_dense(&cfg, counts, map, dense_probs, t, nullptr, state, workspace,
                                              workspace_len, out_map, out_probs, stream);
      };
      std::vector<std::vector<double>> phase(9), queue(1), ns(kTimeline);
      std::vector<double> us;
      for (int i = 0; i < runs + 10; ++i) {
        unsigned long long reset[16];
        for (int j = 0; j < 16; ++j) reset[j] = (j == 0 || j == 4 || j == 6) ? ~0ull : 0ull;
        CHECK(cudaMemcpyToSymbol(capmoe::echo::g_echo_ns, reset, sizeof(reset)));
        CHECK(cudaEventRecord(start, stream));
        CHECK(launch());
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaStreamSynchronize(stream));
        long long clocks[32];
        CHECK(cudaMemcpyFromSymbol(clocks, capmoe::echo::g_echo_prof, sizeof(clocks)));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        unsigned long long stamps[16];
        CHECK(cudaMemcpyFromSymbol(stamps, capmoe::echo::g_echo_ns, sizeof(stamps)));
        if (i < 10) continue;  // warm-up
        us.push_back(ms * 1e3);
        for (int p = 0; p < 9; ++p) phase[p].push_back(double(clocks[p + 1] - clocks[p]));
        if (spare == 1) queue[0].push_back(double(clocks[10] - clocks[5]));
        for (int j = 1; j < kTimeline; ++j) {
          const bool stamped = stamps[j] != 0 && stamps[j] != ~0ull;
          ns[j].push_back(stamped ? double((long long)(stamps[j] - stamps[0])) * 1e-3 : -1.0);
        }
      }
      const double graph = graph_replay_us(launch, stream, start, stop, runs);
      double total = 0;
      std::printf("S_per=%d %-20s event %6.1f us, graph replay %6.1f us | ", spare, form_name, median(us), graph);
      for (int p = 0; p < 9; ++p) {
        const double c = median(phase[p]);
        total += c;
        std::printf("%s %.0f, ", phase_names[p], c);
      }
      std::printf("block total %.0f cycles", total);
      if (spare == 1) {
        long long last[32];
        CHECK(cudaMemcpyFromSymbol(last, capmoe::echo::g_echo_prof, sizeof(last)));
        std::printf(" (F: queues built after %.0f; last run: %lld pops, Q %lld ranks with capacity, P %lld spilling experts; first pops at cycles after the queues:",
                    median(queue[0]), last[11], last[12], last[13]);
        for (int b = 0; b < 16 && b < last[11]; ++b) std::printf(" %lld", last[16 + b] - last[10]);
        std::printf(")");
      }
      std::printf("\n    timeline, us after the plan's first block starts (median; -1: not reached):");
      for (int j = 1; j < kTimeline; ++j) std::printf(" %s %.2f,", kTimelineNames[j], median(ns[j]));
      std::printf("\n");
      std::printf("SUMMARY S=%d form=%s graph_us=%.2f event_us=%.2f block_cycles=%.0f plan_end_us=%.2f "
                  "reroute_end_us=%.2f",
                  spare, form == 0 ? "plan" : form == 1 ? "topk" : "dense", graph, median(us), total, median(ns[2]),
                  median(ns[8]));
      for (int p = 0; p < 9; ++p) std::printf(" %c=%.0f", 'A' + p, median(phase[p]));
      if (spare == 1) std::printf(" queues=%.0f", median(queue[0]));
      std::printf("\n");
    }
  }
  return 0;
}
