// CPU kernels: the interface between the capability-independent driver (cpu/driver.cpp) and
// the per-capability kernel builds of cpu/kernels.cpp (DEFAULT, and AVX2+FMA on x86-64 with GCC
// through cpu/kernels_avx2.cpp). Torch-free apart from what the kernel sources include.
//
// A call's work is one flat list of chunks: the tensors laid end to end (each padded to a
// multiple of kCpuAlign elements), cut into tasks of kCpuTaskElems elements, each task's range
// cut again at tensor boundaries. One at::parallel_for runs over the tasks; a chunk never spans
// two tensors, so per-tensor norm partial sums are kept per chunk and reduced in chunk order
// afterwards (deterministic whatever the thread count).
#pragma once

#include <cstdint>

#include "../math.h"
#include "../multi_tensor.h"

namespace accum_fused::cpu {

// Elements per task: small enough to split a few 100K-element calls over 2 threads, large
// enough that per-task overhead (a few ns) is nothing next to ~10 us of memory traffic.
constexpr int64_t kCpuTaskElems = 32768;
// Task boundaries fall on multiples of this many elements inside every tensor (one 64-byte
// cache line of fp32 or more), so two threads never write the same cache line.
constexpr int64_t kCpuAlign = 64;
// Overwrite passes writing more buffer bytes than this (about an L3 cache) use streaming stores.
constexpr int64_t kCpuStreamBytes = int64_t(32) << 20;
// Below this many elements a call runs on the calling thread (no parallel region).
constexpr int64_t kCpuSerialElems = 65536;

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

struct Plan {
  const TensorEntry* tensors;
  int64_t num_tensors;
  const Chunk* chunks;
  int64_t num_chunks;
  const int64_t* task_begin;  // num_tasks + 1 offsets into chunks
  int64_t num_tasks;
  int64_t grain;              // tasks per thread below which at::parallel_for stays serial
};

// The fused last micro-batch of an update (grads slot set), or none.
struct FoldScalars {
  bool present;
  DType grad_dtype;
  AccumScalars accum;
  float grad_scale;
};

// One set of kernels per CPU capability. `partials`: one double per chunk (sum of squares of
// acc / W over the chunk), or null when no norms are wanted.
struct Kernels {
  const char* name;
  void (*accumulate)(const Plan& plan, DType grad_dtype, AccumScalars accum, float grad_scale,
                     float norm_weight_sum, double* partials);
  void (*window_norms)(const Plan& plan, float weight_sum, double* partials);
  void (*sgd)(const Plan& plan, DType param_dtype, const FoldScalars& fold, WindowScalars window,
              float clip_coef, const SgdScalars& sgd);
  void (*adam)(const Plan& plan, DType param_dtype, const FoldScalars& fold, WindowScalars window,
               float clip_coef, const AdamScalars& adam);
};

namespace DEFAULT {
extern const Kernels kernels;
}
namespace AVX2 {
// Null when this build has no AVX2 variant (non-x86 target or a compiler other than GCC).
extern const Kernels* const kernels_ptr;
}


}  // namespace accum_fused::cpu
