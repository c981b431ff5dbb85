// CPU entry points called by the binding: plan the chunks of a call, pick the kernel build for
// this CPU, run, reduce norm partials. Tables are filled by the caller (bindings.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace accum_fused::cpu {

// "AVX2" or "DEFAULT": the kernel build in use (see kernels_avx2.cpp).
const char* kernel_variant();

// norms_out: null, or one float per tensor (||acc_i / norm_weight_sum||_2 after the update).
void accumulate(const std::vector<TensorEntry>& tensors, DType grad_dtype, AccumScalars accum, float grad_scale,
                float norm_weight_sum, float* norms_out);
// One tensor, as accumulate runs it (the same plan: the in-backward hooks' call per gradient),
// with no vectors to allocate: its plan is on the stack.
void accumulate_one(const TensorEntry& tensor, DType grad_dtype, AccumScalars accum, float grad_scale,
                    float norm_weight_sum, float* norm_out);
void window_norms(const std::vector<TensorEntry>& tensors, float weight_sum, float* norms_out);
void sgd_update(const std::vector<TensorEntry>& tensors, DType param_dtype, const FoldScalars& fold,
                WindowScalars window, float clip_coef, const SgdScalars& sgd);
void adam_update(const std::vector<TensorEntry>& tensors, DType param_dtype, const FoldScalars& fold,
                 WindowScalars window, float clip_coef, const AdamScalars& adam);

}  // namespace accum_fused::cpu
