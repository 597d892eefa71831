/* capturable-moe from C: the grouped GEMM through the C ABI (csrc/include/capturable_moe.h).
 *
 *   capmoe-c-example           plan-time checks only (no GPU needed), then the GPU run if a
 *                              GPU is visible
 *   capmoe-c-example --gpu     the GPU run is required: no GPU is a failure
 *   capmoe-c-example --no-gpu  plan-time checks only
 *
 * Plan-time checks: descriptors and pointers the library must refuse before launching anything;
 * each prints the status it got and the program fails if one is not the documented code. GPU
 * run: a bf16 FPROP over 4 experts whose row counts (m_splits) live on the device only, checked
 * element by element against a host reference; the rows past the device-side total must keep
 * their poison. Exit status 0 only when every check passed. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "capturable_moe.h"

static int failures = 0;

static void expect(const char* what, capmoe_status_t got, capmoe_status_t want) {
  int ok = got == want;
  printf("%-4s %-52s -> %s", ok ? "ok" : "FAIL", what, capmoe_status_string(got));
  if (!ok) printf(" (expected %s)", capmoe_status_string(want));
  if (got == CAPMOE_ERR_CUDA) printf(" [cudaError_t %d]", (int)capmoe_last_cuda_error());
  printf("\n");
  failures += !ok;
}

static capmoe_grouped_gemm_desc_t fprop_desc(int32_t arch, int32_t sm_count, int64_t experts, int64_t n,
                                             int64_t k, int64_t capacity) {
  capmoe_grouped_gemm_desc_t desc;
  memset(&desc, 0, sizeof desc);
  desc.op = CAPMOE_GEMM_FPROP;
  desc.arch = arch;
  desc.dtype = CAPMOE_DTYPE_BF16;
  desc.out_dtype = CAPMOE_DTYPE_BF16;
  desc.split_dtype = CAPMOE_DTYPE_I32;
  desc.weight_layout = CAPMOE_WEIGHT_ENK;
  desc.config = CAPMOE_CONFIG_AUTO;
  desc.sm_count = sm_count;
  desc.num_experts = experts;
  desc.n = n;
  desc.k = k;
  desc.capacity = capacity;
  return desc;
}

/* A 256-byte aligned address that is never dereferenced: every call it reaches fails first. */
static void* fake(uintptr_t offset) { return (void*)((uintptr_t)0x7f0000000000ull + offset); }

static void plan_time_checks(void) {
  capmoe_grouped_gemm_desc_t good = fprop_desc(90, 132, 8, 256, 128, 1024);
  capmoe_grouped_gemm_desc_t bad;
  capmoe_gemm_config_t config = -1;
  uint64_t bytes = 0;

  printf("== plan-time checks (no GPU needed)\n");
  expect("resolve_config: SM90 bf16 FPROP, AUTO", capmoe_grouped_gemm_resolve_config(&good, &config), CAPMOE_OK);
  printf("     AUTO resolves to config %d\n", (int)config);
  expect("workspace_size: the same descriptor", capmoe_grouped_gemm_workspace_size(&good, &bytes), CAPMOE_OK);
  printf("     workspace: %llu bytes\n", (unsigned long long)bytes);
  if (bytes == 0) {
    printf("FAIL a valid descriptor reported a 0-byte workspace\n");
    failures++;
  }

  bad = good, bad.n = 100; /* TMA moves 16-byte rows */
  expect("workspace_size: N = 100 (not a multiple of 8)", capmoe_grouped_gemm_workspace_size(&bad, &bytes), CAPMOE_ERR_MISALIGNED);
  bad = good, bad.k = 0;
  expect("workspace_size: K = 0", capmoe_grouped_gemm_workspace_size(&bad, &bytes), CAPMOE_ERR_INVALID_ARGUMENT);
  bad = good, bad.num_experts = 0;
  expect("workspace_size: 0 experts", capmoe_grouped_gemm_workspace_size(&bad, &bytes), CAPMOE_ERR_INVALID_ARGUMENT);
  bad = good, bad.capacity = -1;
  expect("workspace_size: negative capacity", capmoe_grouped_gemm_workspace_size(&bad, &bytes), CAPMOE_ERR_INVALID_ARGUMENT);
  bad = good, bad.arch = 7;
  expect("resolve_config: unknown arch", capmoe_grouped_gemm_resolve_config(&bad, &config), CAPMOE_ERR_UNSUPPORTED);
  bad = good, bad.config = 42;
  expect("resolve_config: unknown config value", capmoe_grouped_gemm_resolve_config(&bad, &config), CAPMOE_ERR_UNSUPPORTED);
  bad = good, bad.config = CAPMOE_CONFIG_SM100_2SM;
  expect("resolve_config: an SM100 config on SM90", capmoe_grouped_gemm_resolve_config(&bad, &config), CAPMOE_ERR_UNSUPPORTED);

  expect("run: overflow_flags off 4-byte alignment",
         capmoe_grouped_gemm_run(&good, fake(0), fake(0), fake(0), fake(0), (int32_t*)fake(2), fake(0), 1u << 20, NULL),
         CAPMOE_ERR_MISALIGNED);
  expect("run: int32 m_splits off 4-byte alignment",
         capmoe_grouped_gemm_run(&good, fake(0), fake(0), fake(0), fake(2), NULL, fake(0), 1u << 20, NULL),
         CAPMOE_ERR_MISALIGNED);
  expect("run: activations off 16-byte alignment",
         capmoe_grouped_gemm_run(&good, fake(8), fake(0), fake(0), fake(0), NULL, fake(0), 1u << 20, NULL),
         CAPMOE_ERR_MISALIGNED);
  expect("run: workspace off 256-byte alignment",
         capmoe_grouped_gemm_run(&good, fake(0), fake(0), fake(0), fake(0), NULL, fake(16), 1u << 20, NULL),
         CAPMOE_ERR_MISALIGNED);
  expect("run: NULL m_splits",
         capmoe_grouped_gemm_run(&good, fake(0), fake(0), fake(0), NULL, NULL, fake(0), 1u << 20, NULL),
         CAPMOE_ERR_INVALID_ARGUMENT);
  expect("run: workspace smaller than workspace_size",
         capmoe_grouped_gemm_run(&good, fake(0), fake(0), fake(0), fake(0), NULL, fake(0), 256, NULL),
         CAPMOE_ERR_WORKSPACE_TOO_SMALL);
}

/* bf16 as raw bits: C99 has no such type. Round to nearest even (inputs are finite). */
static uint16_t to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static float from_bf16(uint16_t half) {
  uint32_t bits = (uint32_t)half << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

#define CUDA_OR_FAIL(call)                                                          \
  do {                                                                              \
    cudaError_t err_ = (call);                                                      \
    if (err_ != cudaSuccess) {                                                      \
      printf("FAIL %s: %s\n", #call, cudaGetErrorString(err_));                     \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

enum { EXPERTS = 4, N = 64, K = 128, CAPACITY = 96 };
static const int32_t M_SPLITS[EXPERTS] = {5, 0, 17, 40}; /* total 62 of 96 rows; one empty expert */
static const uint16_t POISON = 0x7fc1;                   /* a NaN no GEMM writes */

/* Returns 0 when every output element matches the host reference. */
static int gpu_grouped_gemm(int device) {
  static uint16_t x[CAPACITY * K], w[EXPERTS * N * K], y[CAPACITY * N];
  int total = 0, row = 0, e, i, j, t, major = 0, minor = 0, sm_count = 0, mismatches = 0;
  void *d_x, *d_w, *d_y, *d_splits, *d_workspace;
  int32_t *d_flags, flags = 0;
  uint64_t workspace_bytes = 0;
  cudaStream_t stream;
  capmoe_grouped_gemm_desc_t desc;
  capmoe_status_t status;
  double max_err = 0.0;

  CUDA_OR_FAIL(cudaSetDevice(device));
  CUDA_OR_FAIL(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_OR_FAIL(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  CUDA_OR_FAIL(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  printf("== GPU run on device %d (sm_%d%d, %d SMs)\n", device, major, minor, sm_count);
  for (e = 0; e < EXPERTS; e++) total += M_SPLITS[e];

  srand(12345);
  for (i = 0; i < CAPACITY * K; i++) x[i] = to_bf16((float)(rand() % 17 - 8) / 8.0f);
  for (i = 0; i < EXPERTS * N * K; i++) w[i] = to_bf16((float)(rand() % 13 - 6) / 16.0f);
  for (i = 0; i < CAPACITY * N; i++) y[i] = POISON;

  desc = fprop_desc(major * 10, sm_count, EXPERTS, N, K, CAPACITY);
  status = capmoe_grouped_gemm_workspace_size(&desc, &workspace_bytes);
  expect("workspace_size on this GPU", status, CAPMOE_OK);
  if (status != CAPMOE_OK) return 1;

  CUDA_OR_FAIL(cudaStreamCreate(&stream));
  CUDA_OR_FAIL(cudaMalloc(&d_x, sizeof x));
  CUDA_OR_FAIL(cudaMalloc(&d_w, sizeof w));
  CUDA_OR_FAIL(cudaMalloc(&d_y, sizeof y));
  CUDA_OR_FAIL(cudaMalloc(&d_splits, sizeof M_SPLITS));
  CUDA_OR_FAIL(cudaMalloc((void**)&d_flags, sizeof flags));
  CUDA_OR_FAIL(cudaMalloc(&d_workspace, workspace_bytes));
  CUDA_OR_FAIL(cudaMemcpy(d_x, x, sizeof x, cudaMemcpyHostToDevice));
  CUDA_OR_FAIL(cudaMemcpy(d_w, w, sizeof w, cudaMemcpyHostToDevice));
  CUDA_OR_FAIL(cudaMemcpy(d_y, y, sizeof y, cudaMemcpyHostToDevice));
  CUDA_OR_FAIL(cudaMemcpy(d_splits, M_SPLITS, sizeof M_SPLITS, cudaMemcpyHostToDevice));
  CUDA_OR_FAIL(cudaMemcpy(d_flags, &flags, sizeof flags, cudaMemcpyHostToDevice));

  /* The counts stay on the device: the host never tells the library how many rows each has. */
  status = capmoe_grouped_gemm_run(&desc, d_x, d_w, d_y, d_splits, d_flags, d_workspace, workspace_bytes, stream);
  expect("run: bf16 FPROP, 4 experts, device m_splits", status, CAPMOE_OK);
  if (status != CAPMOE_OK) return 1;
  CUDA_OR_FAIL(cudaStreamSynchronize(stream));
  CUDA_OR_FAIL(cudaMemcpy(y, d_y, sizeof y, cudaMemcpyDeviceToHost));
  CUDA_OR_FAIL(cudaMemcpy(&flags, d_flags, sizeof flags, cudaMemcpyDeviceToHost));

  for (e = 0; e < EXPERTS; e++) {
    for (t = 0; t < M_SPLITS[e]; t++, row++) {
      for (j = 0; j < N; j++) { /* Y_e = X_e W_e^T, W_e [N, K] */
        double want = 0.0, got = from_bf16(y[row * N + j]), err;
        for (i = 0; i < K; i++) want += (double)from_bf16(x[row * K + i]) * from_bf16(w[(e * N + j) * K + i]);
        err = fabs(got - want);
        if (err > max_err || got != got) max_err = got != got ? INFINITY : err;
        /* bf16 output: 8 significant bits, so allow one rounding step of |want| plus a floor. */
        if (!(err <= fabs(want) / 128.0 + 1e-2)) mismatches++;
      }
    }
  }
  for (i = total * N; i < CAPACITY * N; i++) mismatches += y[i] != POISON;
  printf("%-4s %d rows checked against the host reference (max |err| %.3g), %d rows past the total untouched\n",
         mismatches ? "FAIL" : "ok", total, max_err, CAPACITY - total);
  if (flags != 0) printf("FAIL overflow flags = %d (expected 0)\n", (int)flags);

  cudaFree(d_x), cudaFree(d_w), cudaFree(d_y), cudaFree(d_splits), cudaFree(d_flags), cudaFree(d_workspace);
  cudaStreamDestroy(stream);
  return mismatches != 0 || flags != 0;
}

int main(int argc, char** argv) {
  int want_gpu = -1, devices = 0; /* -1: run on the GPU if there is one */
  if (argc > 1 && strcmp(argv[1], "--gpu") == 0) want_gpu = 1;
  if (argc > 1 && strcmp(argv[1], "--no-gpu") == 0) want_gpu = 0;

  plan_time_checks();
  if (want_gpu != 0) {
    cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
      printf("%s: no usable GPU (%s)\n", want_gpu == 1 ? "FAIL" : "skipping", cudaGetErrorString(err));
      failures += want_gpu == 1;
    } else {
      failures += gpu_grouped_gemm(0);
    }
  }
  printf("%s\n", failures ? "capmoe-c-example: FAILED" : "capmoe-c-example: all checks passed");
  return failures ? 1 : 0;
}
