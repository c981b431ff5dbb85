// The ops of bindings.cpp that other translation units call (hooks.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace accum_fused {

// buffers[i] (+)= weight * grads[i] (overwrite: =), one multi-tensor pass; with
// norm_weight_sum, also returns ||buffers[i] / norm_weight_sum|| per tensor. Validates every
// tensor before anything is written; bumps the buffers' version counters.
std::optional<at::Tensor> accumulate_op(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& buffers,
                                        double weight, bool overwrite, const std::optional<at::Tensor>& grad_scale,
                                        std::optional<double> norm_weight_sum);

// Whether `t` walks memory in the order `buffer` does (the kernels' requirement).
bool same_memory_layout(const at::Tensor& t, const at::Tensor& buffer);

void register_hooks(pybind11::module& m);

}  // namespace accum_fused
