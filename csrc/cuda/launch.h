// Launchers of the CUDA kernels (kernels.cu). Torch-free and CUDA-header-free: the binding
// passes raw pointers, the device-resident tensor table and the stream as void*, so this
// header compiles anywhere and the .cu compiles with plain nvcc.
//
// Every launcher returns nullptr on success, else the CUDA error string. `table` is a device
// copy of n TensorEntry (multi_tensor.h) numbered by assign_chunks(entries, n, kChunkElems),
// which also returned `total_chunks`. Scalars that live on the device (GradScaler's scale, the
// clip coefficient) are read there: no host synchronisation. A null one means 1.
#pragma once

#include <cstdint>

#include "../math.h"
#include "../multi_tensor.h"

namespace accum_fused::cuda {

// Elements per chunk: one block's unit of work (a block strides over chunks). 16K elements =
// 8 iterations of 256 threads x 8 elements, 64-128 KB of traffic per array per chunk.
constexpr int64_t kChunkElems = 16384;

struct DeviceFold {
  bool present;            // the last micro-batch (grad slot) is folded into the update
  DType grad_dtype;
  AccumScalars accum;
  const float* grad_scale; // device, 1 element, or null
};

// acc_i <- (overwrite ? 0 : acc_i) + w * g_i / scale. With norms_out (device, n floats):
// norms_out[i] = ||acc_i / norm_weight_sum||_2, through partials (device, total_chunks floats).
const char* launch_accumulate(const TensorEntry* table, int64_t n, int64_t total_chunks, DType grad_dtype,
                              AccumScalars accum, const float* grad_scale, float norm_weight_sum, float* partials,
                              float* norms_out, void* stream);

// norms_out[i] = ||acc_i / weight_sum||_2 (partials: device, total_chunks floats).
const char* launch_window_norms(const TensorEntry* table, int64_t n, int64_t total_chunks, float weight_sum,
                                float* partials, float* norms_out, void* stream);

const char* launch_sgd(const TensorEntry* table, int64_t n, int64_t total_chunks, DType param_dtype,
                       const DeviceFold& fold, WindowScalars window, const float* clip_coef, const SgdScalars& sgd,
                       void* stream);

const char* launch_adam(const TensorEntry* table, int64_t n, int64_t total_chunks, DType param_dtype,
                        const DeviceFold& fold, WindowScalars window, const float* clip_coef,
                        const AdamScalars& adam, void* stream);

}  // namespace accum_fused::cuda
