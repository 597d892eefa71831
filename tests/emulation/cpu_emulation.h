// CPU emulation of the CUDA subset the Echo kernels use, for testing their logic bit for bit on
// a machine without a GPU (tests/echo_emulated.rs compiles csrc/echo/echo_plan.cu against it).
//
// Model: a launch runs its blocks one after another; the CUDA threads of a block are
// coroutines on one OS thread, so __syncthreads, the warp shuffles / ballots / reductions and
// __syncwarp are real barriers: a lane that skips one is reported as a deadlock instead of
// passing. Shared memory is a fresh, poisoned buffer per block, so reading what was never
// written shows up as a wrong result. Threads run one at a time, so atomics are plain
// read-modify-writes. Launches past the SM90/SM100 limits fail (more than 1024 threads,
// dynamic shared memory past 48 KB without the opt-in attribute or past 227 KB). Not modelled: the overlap of a programmatic dependent launch with its
// primary (the dependent simply runs after it, which is what griddepcontrol.wait guarantees),
// races between blocks or within one (a data race runs in one fixed order here), timing.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <map>
#include <vector>

#include <setjmp.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uchar4 { unsigned char x, y, z, w; };
struct longlong2 { long long x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uchar4 make_uchar4(unsigned a, unsigned b, unsigned c, unsigned d) {
  return {(unsigned char)a, (unsigned char)b, (unsigned char)c, (unsigned char)d};
}

// ------------------------------------------------------------------ runtime API subset
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
typedef void* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
// Launch limits of the GPUs the kernels target (SM90 / SM100): a launch past them fails there,
// so it fails here too.
namespace emu {
constexpr size_t kDefaultDynamicSmem = 48 * 1024;  // without the opt-in attribute
constexpr size_t kMaxDynamicSmem = 227 * 1024;     // per block, with it
constexpr unsigned kMaxThreadsPerBlock = 1024;
inline std::map<const void*, size_t>& smem_opt_in() {
  static std::map<const void*, size_t> m;
  return m;
}
}  // namespace emu
inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute, int bytes) {
  if (bytes < 0 || (size_t)bytes > emu::kMaxDynamicSmem) return cudaErrorInvalidValue;
  emu::smem_opt_in()[kernel] = (size_t)bytes;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
enum cudaLaunchAttributeID { cudaLaunchAttributeProgrammaticStreamSerialization = 1 };
struct cudaLaunchAttributeValue { int programmaticStreamSerializationAllowed; };
struct cudaLaunchAttribute { cudaLaunchAttributeID id; cudaLaunchAttributeValue val; };
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};

// ------------------------------------------------------------------ execution model
// The CUDA threads of a block are coroutines on the calling OS thread (started with
// makecontext, then switched with _setjmp/_longjmp, which unlike swapcontext make no system
// call; build with -U_FORTIFY_SOURCE so glibc's longjmp check allows the stack switch), resumed
// round-robin; a barrier suspends a coroutine until every member has arrived. Everything is
// sequential and deterministic, and a barrier that some thread never reaches is reported as a
// deadlock instead of hanging.
namespace emu {
struct Barrier {
  int expected = 0, arrived = 0;
  uint64_t generation = 0;
};
struct Thread {
  ucontext_t context;  // first entry only
  jmp_buf resume;
  char* stack = nullptr;
  bool started = false;
  bool finished = false;
  int vote_phase = 0;
};
struct Block {
  Barrier bar;
  std::vector<Barrier> warp_bars;
  std::vector<uint64_t> lane_value;  // one slot per thread, for the warp exchanges
  int vote[2] = {0, 0};
  unsigned char* smem = nullptr;
  std::vector<Thread> threads;
  ucontext_t scheduler_context;
  jmp_buf scheduler;
  int current = 0;
};
inline Block* block;
inline uint64_t arrivals;  // progress: barrier arrivals so far
void yield();
inline void arrive_and_wait(Barrier& b) {
  ++arrivals;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  const uint64_t gen = b.generation;
  while (b.generation == gen) yield();
}
}  // namespace emu

inline dim3 threadIdx, blockIdx, blockDim;

inline void __syncthreads() { emu::arrive_and_wait(emu::block->bar); }
inline int __syncthreads_or(int p) {
  emu::Block* b = emu::block;
  int& phase = b->threads[b->current].vote_phase;
  const int ph = phase;
  phase ^= 1;  // alternate slots: the next vote may start before this one is reset
  if (p) b->vote[ph] = 1;
  __syncthreads();
  const int r = b->vote[ph];
  __syncthreads();
  if (threadIdx.x == 0) b->vote[ph] = 0;
  return r;
}

namespace emu {
inline int lane() { return threadIdx.x & 31; }
inline int warp_base() { return threadIdx.x & ~31; }
inline void warp_barrier() { arrive_and_wait(block->warp_bars[threadIdx.x >> 5]); }
template <class T>
inline T exchange(T v, int src) {  // every lane publishes v, then reads lane src's
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  block->lane_value[threadIdx.x] = u;
  warp_barrier();
  T r;
  std::memcpy(&r, &block->lane_value[warp_base() + src], sizeof(T));
  warp_barrier();
  return r;
}
template <class F>
inline uint64_t combine(uint64_t mine, F f) {  // every lane gets f over all 32 lane values
  block->lane_value[threadIdx.x] = mine;
  warp_barrier();
  uint64_t r = 0;
  for (int i = 0; i < 32; ++i) r = f(r, block->lane_value[warp_base() + i], i);
  warp_barrier();
  return r;
}
}  // namespace emu

inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return emu::exchange(v, src & 31); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu::exchange(v, emu::lane() ^ o); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int d) {
  const int src = emu::lane() - d;
  return emu::exchange(v, src < 0 ? emu::lane() : src);
}
inline unsigned __ballot_sync(unsigned, int p) {
  return (unsigned)emu::combine(p ? 1 : 0, [](uint64_t r, uint64_t v, int i) { return r | (v << i); });
}
inline int __reduce_add_sync(unsigned, int v) {
  return (int)(uint32_t)emu::combine((uint32_t)v, [](uint64_t r, uint64_t v, int) { return (uint32_t)(r + v); });
}
inline unsigned __reduce_add_sync(unsigned m, unsigned v) { return (unsigned)__reduce_add_sync(m, (int)v); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
// Atomics: the threads run one at a time, so plain read-modify-writes are atomic.
template <class T, class V> inline T atomicOr(T* p, V v) { T old = *p; *p = old | (T)v; return old; }
template <class T, class V> inline T atomicAdd(T* p, V v) { T old = *p; *p = old + (T)v; return old; }
template <class T, class V> inline T atomicMin(T* p, V v) { T old = *p; *p = (T)v < old ? (T)v : old; return old; }
template <class T> inline T __ldg(const T* p) { return *p; }
// Correctly rounded float operations: volatile keeps the host compiler from contracting them
// (build with -ffp-contract=off as well).
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __int2float_rn(int a) { return (float)a; }
inline float __ll2float_rn(long long a) { return (float)a; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }

// ------------------------------------------------------------------ csrc/common/device_primitives.cuh
namespace capmoe {
inline void grid_dependency_wait() {}  // the dependent launch runs after its primary
inline void launch_dependents() {}
inline unsigned lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }
inline void cp_async16(void* smem, const void* gmem) { std::memcpy(smem, gmem, 16); }
inline void cp_async_wait_all() {}
inline void keep_in_register(int&) {}
}  // namespace capmoe
#define CAPMOE_DYNAMIC_SMEM(name) unsigned char* name = emu::block->smem

// ------------------------------------------------------------------ launches
namespace emu {
constexpr size_t kStackBytes = 128 * 1024;

// Coroutine stacks, allocated once and reused by every block (a block has <= 1024 threads).
inline char* stack_of(int thread) {
  static std::vector<std::unique_ptr<char[]>> stacks(1024);
  if (!stacks[thread]) stacks[thread].reset(new char[kStackBytes]);
  return stacks[thread].get();
}

inline void yield() {
  Block* b = block;
  if (!_setjmp(b->threads[b->current].resume)) _longjmp(b->scheduler, 1);
}

template <class P>
struct Entry {
  static inline void (*kernel)(P);
  static inline const P* params;
  static void run() {
    kernel(*params);
    block->threads[block->current].finished = true;
    _longjmp(block->scheduler, 1);
  }
};

// CAPMOE_EMULATION_ORDER=reverse resumes the threads from the last to the first. A write and a
// read of shared memory by two threads with no barrier between them pass in one order and
// fail in the other, so running both orders finds such missing barriers.
inline bool reverse_order() {
  static const bool reverse = [] {
    const char* v = std::getenv("CAPMOE_EMULATION_ORDER");
    return v != nullptr && std::strcmp(v, "reverse") == 0;
  }();
  return reverse;
}

// Resumes the unfinished threads round-robin until all have returned.
inline void run_block(Block& b) {
  const int n = (int)b.threads.size();
  for (int left = n; left > 0;) {
    const uint64_t before = arrivals;
    const int was_left = left;
    left = 0;
    for (int i = 0; i < n; ++i) {
      const int t = reverse_order() ? n - 1 - i : i;
      if (b.threads[t].finished) continue;
      b.current = t;
      threadIdx = dim3((unsigned)t);
      Thread& th = b.threads[t];
      if (!_setjmp(b.scheduler)) {
        if (th.started) _longjmp(th.resume, 1);
        th.started = true;
        swapcontext(&b.scheduler_context, &th.context);
      }
      left += !b.threads[t].finished;
    }
    // A full round in which no thread arrived anywhere or returned would repeat forever.
    if (left > 0 && left == was_left && arrivals == before) {
      std::fprintf(stderr, "emulation: deadlock in block %u: %d threads wait at barriers the others never reach\n", blockIdx.x, left);
      std::abort();
    }
  }
}
}  // namespace emu

template <class P>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* c, void (*kernel)(P), const P& params) {
  const unsigned threads = c->blockDim.x;
  size_t smem_limit = emu::kDefaultDynamicSmem;
  const auto opt_in = emu::smem_opt_in().find(reinterpret_cast<const void*>(kernel));
  if (opt_in != emu::smem_opt_in().end() && opt_in->second > smem_limit) smem_limit = opt_in->second;
  // (threads % 32: the emulated warp barriers count whole warps; the kernels launch whole warps)
  if (c->gridDim.x == 0 || threads == 0 || threads > emu::kMaxThreadsPerBlock || threads % 32 != 0 ||
      c->dynamicSmemBytes > smem_limit)
    return cudaErrorInvalidConfiguration;
  emu::Entry<P>::kernel = kernel;
  emu::Entry<P>::params = &params;
  blockDim = dim3(threads);
  for (unsigned b = 0; b < c->gridDim.x; ++b) {
    emu::Block blk;
    blk.bar.expected = (int)threads;
    blk.warp_bars.resize((threads + 31) / 32);
    for (auto& w : blk.warp_bars) w.expected = 32;
    blk.lane_value.assign(threads, 0);
    std::vector<unsigned char> smem(c->dynamicSmemBytes + 1, 0xA7);  // poisoned
    blk.smem = smem.data();
    blk.threads.resize(threads);
    for (unsigned i = 0; i < threads; ++i) {
      emu::Thread& t = blk.threads[i];
      t.stack = emu::stack_of((int)i);
      getcontext(&t.context);
      t.context.uc_stack.ss_sp = t.stack;
      t.context.uc_stack.ss_size = emu::kStackBytes;
      t.context.uc_link = nullptr;  // Entry::run never returns
      makecontext(&t.context, &emu::Entry<P>::run, 0);
    }
    blockIdx = dim3(b);
    emu::block = &blk;
    emu::run_block(blk);
  }
  return cudaSuccess;
}
