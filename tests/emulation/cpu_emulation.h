// CPU emulation of the CUDA subset the Echo, routing and grouped-GEMM argument kernels use, for
// testing their logic bit for bit on a machine without a GPU (tests/echo_emulated.rs compiles
// csrc/echo/echo_plan.cu against it, tests/echo_weights_emulated.rs csrc/echo/echo_weights.cu,
// tests/routing_emulated.rs the csrc/routing/*.cu kernels, tests/grouped_gemm_emulated.rs
// csrc/grouped_gemm/arguments.cuh, tests/fused_tiles_emulated.rs csrc/fused/tile_list.cuh and
// csrc/fused/tile_schedule.cuh;
// tests/emulation/cub/ stands in for the CUB they use).
//
// Model: a launch runs its blocks one after another; the CUDA threads of a block are
// coroutines on one OS thread, so __syncthreads, the warp shuffles / ballots / reductions and
// __syncwarp are real barriers: a lane that skips one is reported as a deadlock instead of
// passing. Dynamic shared memory is a fresh, poisoned buffer per block, so reading what was
// never written shows up as a wrong result (static __shared__ variables are function-local
// statics instead: not poisoned, they keep the previous block's values). Threads run one at a
// time, so atomics are plain read-modify-writes. Launches past the SM90/SM100 limits fail (more
// than 1024 threads, dynamic shared memory past 48 KB without the opt-in attribute or past
// 227 KB, a grid past 2^31-1 x 65535 x 65535). Grids may be 1-, 2- or 3-D (blocks run x fastest);
// blocks are 1-D only. The threads of a block resume first-to-last, or last-to-first with
// CAPMOE_EMULATION_ORDER=reverse; a missing barrier between a write and a read shows in one of
// the two. Not modelled: the overlap of a programmatic dependent launch with its primary (the
// dependent simply runs after it, which is what griddepcontrol.wait guarantees), races between
// blocks, timing.
//
// Host C++ has no `kernel<<<...>>>(args)` and no `extern __shared__`: the kernels launch through
// capmoe::launch (csrc/common/launch.cuh, cudaLaunchKernelEx) and take dynamic shared memory
// through CAPMOE_DYNAMIC_SMEM, which this file supplies.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include <setjmp.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Blocks run one after another, so a function-local static is one block's shared variable.
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uchar4 { unsigned char x, y, z, w; };
struct longlong2 { long long x, y; };
struct float2 { float x, y; };
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
constexpr unsigned kMaxGridX = 0x7fffffffu, kMaxGridYZ = 65535;
inline std::map<const void*, size_t>& smem_opt_in() {
  static std::map<const void*, size_t> m;
  return m;
}
// A new CUDA context (a second one, or the primary context after a device reset) starts with
// every kernel attribute at its default: the opt-in shared memory is forgotten.
inline void new_context() { smem_opt_in().clear(); }
// Launches that ran with more than the default dynamic shared memory (so needed the opt-in).
inline size_t& opted_in_launches() {
  static size_t n = 0;
  return n;
}
}  // namespace emu
inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute, int bytes) {
  if (bytes < 0 || (size_t)bytes > emu::kMaxDynamicSmem) return cudaErrorInvalidValue;
  emu::smem_opt_in()[kernel] = (size_t)bytes;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }  // launches return their errors
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

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

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
// The lanes whose (integer) value equals this lane's.
template <class T> inline unsigned __match_any_sync(unsigned, T v) {
  static_assert(std::is_integral_v<T>, "__match_any_sync: integer keys only");
  const uint64_t mine = (uint64_t)(std::make_unsigned_t<T>)v;
  return (unsigned)emu::combine(mine, [mine](uint64_t r, uint64_t u, int i) { return u == mine ? r | (1ull << i) : r; });
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
// Atomics: the threads run one at a time, so plain read-modify-writes are atomic.
template <class T, class V> inline T atomicOr(T* p, V v) { T old = *p; *p = old | (T)v; return old; }
template <class T, class V> inline T atomicAdd(T* p, V v) { T old = *p; *p = old + (T)v; return old; }
template <class T, class V> inline T atomicMin(T* p, V v) { T old = *p; *p = (T)v < old ? (T)v : old; return old; }
template <class T, class V> inline T atomicExch(T* p, V v) { T old = *p; *p = (T)v; return old; }
// Blocks and threads run one at a time: every write is seen by every later read.
inline void __threadfence() {}
template <class T> inline T __ldg(const T* p) { return *p; }
// Correctly rounded float operations: volatile keeps the host compiler from contracting them
// (build with -ffp-contract=off as well).
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __int2float_rn(int a) { return (float)a; }
inline float __ll2float_rn(long long a) { return (float)a; }
// The GPU's __expf is an approximation (ex2.approx); the host's correctly rounded-ish expf
// differs from it in the last bits, so results through it match the GPU within a tolerance only.
inline float __expf(float x) { return std::exp(x); }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }

// ------------------------------------------------------------------ 2-byte float types
// Storage only (the bits); the kernels convert to fp32, compute, and round back once, so exact
// round-to-nearest-even conversions are all the arithmetic needed.
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half { uint16_t x; };
struct __half2 { __half x, y; };

namespace emu {
inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16 is the top half of an fp32: drop 16 bits, rounding to nearest even (NaN -> 0x7fff as
// on the GPU).
inline uint16_t bf16_bits(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> fp16, round to nearest even, with fp16 subnormals and overflow to infinity.
inline uint16_t f16_bits(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;                     // NaN (the GPU's canonical one)
  if (a >= 0x477ff000u) return sign | 0x7c00;             // >= 65520 rounds to infinity
  if (a < 0x38800000u)                                    // below 2^-14: subnormal or zero;
    return sign | (uint16_t)std::nearbyint(float_of(a) * 16777216.0f);  // exact * 2^24, RNE
  a -= 112u << 23;                                        // rebias the exponent 127 -> 15
  return sign | (uint16_t)((a + 0xfffu + ((a >> 13) & 1u)) >> 13);   // RNE into 10 bits
}

inline float f16_value(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // subnormal or zero: man * 2^-24, exact in fp32
    const float v = (float)man * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (man << 13));  // inf / NaN
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}
}  // namespace emu

inline float __bfloat162float(__nv_bfloat16 b) { return emu::float_of((uint32_t)b.x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {emu::bf16_bits(f)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline float __half2float(__half h) { return emu::f16_value(h.x); }
inline __half __float2half_rn(float f) { return {emu::f16_bits(f)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }

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

// The kernel call of the launch in progress (the kernel with the launch's arguments), which
// every coroutine starts in.
inline const std::function<void()>* kernel_call;
inline void thread_entry() {
  (*kernel_call)();
  block->threads[block->current].finished = true;
  _longjmp(block->scheduler, 1);
}

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
      std::fprintf(stderr, "emulation: deadlock in block (%u, %u, %u): %d threads wait at barriers the others never reach\n",
                   blockIdx.x, blockIdx.y, blockIdx.z, left);
      std::abort();
    }
  }
}
}  // namespace emu

namespace emu {
inline bool grid_in_limits(const dim3& g) {
  return g.x >= 1 && g.y >= 1 && g.z >= 1 && g.x <= kMaxGridX && g.y <= kMaxGridYZ && g.z <= kMaxGridYZ;
}

// Runs one block (blockIdx set) of the launch in progress.
inline void run_one_block(unsigned threads, size_t smem_bytes) {
  Block blk;
  blk.bar.expected = (int)threads;
  blk.warp_bars.resize((threads + 31) / 32);
  for (auto& w : blk.warp_bars) w.expected = 32;
  blk.lane_value.assign(threads, 0);
  std::vector<unsigned char> smem(smem_bytes + 1, 0xA7);  // poisoned
  blk.smem = smem.data();
  blk.threads.resize(threads);
  for (unsigned i = 0; i < threads; ++i) {
    Thread& t = blk.threads[i];
    t.stack = stack_of((int)i);
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack;
    t.context.uc_stack.ss_size = kStackBytes;
    t.context.uc_link = nullptr;  // thread_entry never returns
    makecontext(&t.context, &thread_entry, 0);
  }
  block = &blk;
  run_block(blk);
}

// Runs `call` as every thread of every block of the launch `c` of `kernel`.
inline cudaError_t launch(const cudaLaunchConfig_t* c, const void* kernel, const std::function<void()>& call) {
  if (c->blockDim.y != 1 || c->blockDim.z != 1) {
    std::fprintf(stderr, "emulation: 2-D / 3-D blocks are not modelled\n");
    std::abort();
  }
  const unsigned threads = c->blockDim.x;
  size_t smem_limit = kDefaultDynamicSmem;
  const auto opt_in = smem_opt_in().find(kernel);
  if (opt_in != smem_opt_in().end() && opt_in->second > smem_limit) smem_limit = opt_in->second;
  // (threads % 32: the emulated warp barriers count whole warps; the kernels launch whole warps)
  if (!grid_in_limits(c->gridDim) || threads == 0 || threads > kMaxThreadsPerBlock || threads % 32 != 0 ||
      c->dynamicSmemBytes > smem_limit)
    return cudaErrorInvalidConfiguration;
  if (c->dynamicSmemBytes > kDefaultDynamicSmem) ++opted_in_launches();
  kernel_call = &call;
  blockDim = dim3(threads);
  gridDim = c->gridDim;
  for (unsigned z = 0; z < gridDim.z; ++z)
    for (unsigned y = 0; y < gridDim.y; ++y)
      for (unsigned x = 0; x < gridDim.x; ++x) {
        blockIdx = dim3(x, y, z);
        run_one_block(threads, c->dynamicSmemBytes);
      }
  return cudaSuccess;
}
}  // namespace emu

// As in the CUDA runtime, the arguments are converted to the kernel's parameter types once;
// the kernel takes them by value, so each thread works on its own copies.
template <class... P, class... A>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* c, void (*kernel)(P...), A&&... args) {
  return [&](P... converted) {
    const std::function<void()> call = [&] { kernel(converted...); };
    return emu::launch(c, reinterpret_cast<const void*>(kernel), call);
  }(std::forward<A>(args)...);
}
