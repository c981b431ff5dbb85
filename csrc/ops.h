// The ops of bindings.cpp that other translation units call (hooks.cpp), and the table's row
// (step_table.cpp and hooks.cpp).
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

// accumulate_op of one CPU gradient into its buffer, which the caller checked as accumulate_op
// would (fp32 buffer, a float gradient of its shape and memory layout, both on the CPU), without
// the call's lists, plan and norm tensor; returns the norm as a float (in_backward's hooks, once
// per gradient).
std::optional<float> accumulate_one_cpu(const at::Tensor& grad, const at::Tensor& buffer, double weight, bool overwrite,
                                        std::optional<double> norm_weight_sum);

// ||buffers[i] / weight_sum|| per tensor (bindings.cpp's window_norms).
at::Tensor window_norms_op(const std::vector<at::Tensor>& buffers, double weight_sum);

// The update ops (bindings.cpp's sgd_update / adam_update, whose arguments
// accum_fused/backends/cpp_backend.py computes).
void sgd_update_op(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& buffers,
                   const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& first_momentum,
                   double weight_sum, const std::optional<at::Tensor>& clip_coef, double neg_lr, double momentum,
                   double one_minus_dampening, double weight_decay, bool nesterov, bool maximize,
                   const std::optional<std::vector<at::Tensor>>& grads, double weight, bool overwrite,
                   const std::optional<at::Tensor>& grad_scale);
void adam_update_op(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& buffers,
                    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& max_exp_avg_sqs, double weight_sum,
                    const std::optional<at::Tensor>& clip_coef, double decay_factor, double weight_decay,
                    double lerp_weight, double beta2, double one_minus_beta2, double bc2_sqrt, double eps,
                    double neg_step_size, bool decoupled, bool amsgrad, bool maximize,
                    const std::optional<std::vector<at::Tensor>>& grads, double weight, bool overwrite,
                    const std::optional<at::Tensor>& grad_scale);

// Whether `t` walks memory in the order `buffer` does (the kernels' requirement).
bool same_memory_layout(const at::Tensor& t, const at::Tensor& buffer);
// Whether t's memory holds its values: not a ZeroTensor (no memory) nor a view whose negation or
// conjugation is a flag. Autograd can hand either as a gradient; Python materializes them
// (layout.readable_grad) and the ops refuse them.
bool plain_memory(const at::Tensor& t);

// The per-tensor rules the Python side states in accum_fused/layout.py, once for the
// extension (bindings.cpp defines them; step_table.cpp and hooks.cpp ask them; tests compare
// them with Python's through state_fits and the tables' choices):
// the parameter and gradient dtypes the kernels take (layout.KERNEL_DTYPES);
bool kernel_dtype(at::ScalarType d);
// a gradient the kernels can read as it is: strided, of a kernel dtype, its memory its values;
bool kernel_grad(const at::Tensor& g);
// the dtype of a parameter's buffer and state (layout.state_dtype; Undefined: not a real dtype
// the extension knows, the Python side's to check);
at::ScalarType state_dtype(at::ScalarType param);
// a buffer or state tensor that still fits its parameter (layout.fits): dtype, device, shape;
bool fits(const at::Tensor& t, const at::Tensor& param);
// a window's first gradient that can become its buffer (layout.adoptable, for plain tensors;
// whether anything else holds it is the caller's);
bool adoptable(const at::Tensor& grad, const at::Tensor& param);
// what a fast path's row was built for: its parameter's dtype, device, shape and contiguity. A
// parameter cast, moved or resized since (`p.data = ...`, `model.to(...)` between windows) is
// handed to the spec, which follows or refuses it with its own messages.
struct BuiltFor {
  at::ScalarType dtype = at::ScalarType::Undefined;
  c10::Device device{c10::kCPU};
  std::vector<int64_t> shape;
  bool contiguous = false;
  BuiltFor() = default;
  explicit BuiltFor(const at::Tensor& p)
      : dtype(p.scalar_type()), device(p.device()), shape(p.sizes().vec()), contiguous(p.is_contiguous()) {}
  bool stands(const at::Tensor& p) const {
    return p.scalar_type() == dtype && p.device() == device && p.sizes() == shape && p.is_contiguous() == contiguous;
  }
};

// One parameter's row of the table, as both fast paths keep it (step_table.cpp's StepTable for
// plain mode, hooks.cpp's HookState for the in-backward modes): its route, decided in Python
// once per layout epoch (window.table.route) and executed here, never decided again; what the
// route was decided for; and the window's state of it, which every writer keeps true.
struct Row {
  bool takes = false;      // the fast path may take its gradients
  bool may_adopt = false;  // a window's first gradient may become its buffer (zero-copy)
  bool torch_ops = false;  // its gradients go in by torch's ops, not the kernels (in_backward.by_torch_ops)
  BuiltFor built_for;
  at::Tensor buffer;  // undefined: none yet
  bool live = false;
  bool adopted = false;  // the buffer is an adopted gradient (or a fresh one the window lets go of as it ends)

  // The window's state of the parameter (as Python's window holds it: a live or adopted buffer).
  void hold(const std::optional<at::Tensor>& buf, bool is_live, bool is_adopted) {
    buffer = buf.value_or(at::Tensor());
    live = is_live && buffer.defined();
    adopted = is_adopted && buffer.defined();
  }
  // The window ended: nothing is live, and an adopted buffer is let go of (Window.discard).
  void end_window() {
    live = false;
    if (adopted) {
      buffer = at::Tensor();
      adopted = false;
    }
  }
};

// The rows as window.table.row_lists gives them (its keys; tests compare the two after every
// micro-batch: each writer keeps them true to the window).
template <typename Rows>
pybind11::dict row_lists_of(const Rows& rows) {
  std::vector<bool> takes, may_adopt, torch_ops, live, adopted;
  std::vector<std::optional<at::Tensor>> buffers;
  for (const Row& row : rows) {
    takes.push_back(row.takes);
    may_adopt.push_back(row.may_adopt);
    torch_ops.push_back(row.torch_ops);
    buffers.push_back(row.buffer.defined() ? std::optional<at::Tensor>(row.buffer) : std::nullopt);
    live.push_back(row.live);
    adopted.push_back(row.adopted);
  }
  pybind11::dict lists;
  lists["takes"] = takes;
  lists["may_adopt"] = may_adopt;
  lists["torch_ops"] = torch_ops;
  lists["buffers"] = buffers;
  lists["live"] = live;
  lists["adopted"] = adopted;
  return lists;
}

// Every row anew, from window.table.row_lists' lists (one entry per parameter, in order).
std::vector<Row> make_rows(const std::vector<at::Tensor>& params, const std::vector<bool>& takes,
                           const std::vector<bool>& may_adopt, const std::vector<bool>& torch_ops,
                           const std::vector<std::optional<at::Tensor>>& buffers, const std::vector<bool>& live,
                           const std::vector<bool>& adopted);

void register_hooks(pybind11::module& m);
void register_step_table(pybind11::module& m);  // step_table.cpp

}  // namespace accum_fused
