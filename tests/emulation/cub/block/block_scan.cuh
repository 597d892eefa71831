// Stands in for CUB's BlockScan under the CPU emulation (cpu_emulation.h): the subset the
// kernels use (ExclusiveSum with the block aggregate), through shared memory and real barriers.
// Thread 0 scans sequentially; the device code uses the real CUB.
#pragma once
#include "cpu_emulation.h"

namespace cub {

template <class T, int kThreads>
class BlockScan {
 public:
  struct TempStorage {
    T values[kThreads];
    T aggregate;
  };
  explicit BlockScan(TempStorage& storage) : storage_(storage) {}

  // output = sum of the inputs of the threads before this one; aggregate = sum of all.
  void ExclusiveSum(T input, T& output, T& aggregate) {
    storage_.values[threadIdx.x] = input;
    __syncthreads();
    if (threadIdx.x == 0) {
      T running{};
      for (int i = 0; i < kThreads; ++i) {
        const T v = storage_.values[i];
        storage_.values[i] = running;
        running += v;
      }
      storage_.aggregate = running;
    }
    __syncthreads();
    output = storage_.values[threadIdx.x];
    aggregate = storage_.aggregate;
    // No barrier after the reads, as in CUB: reusing the storage needs the caller's
    // __syncthreads, and a missing one shows here as a wrong result in one thread order.
  }

 private:
  TempStorage& storage_;
};

}  // namespace cub
