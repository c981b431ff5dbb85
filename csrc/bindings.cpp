// Python bindings of accum_fused._C: argument checks, tensor tables, dispatch to the CPU
// driver (cpu/driver.h) or, in a WITH_CUDA build, the CUDA launchers (cuda/launch.h) under a
// device guard on the current stream. No math here.
//
// The Python side (accum_fused/backends/cpp_backend.py) computes every scalar coefficient the
// way the reference does and hands them over as doubles; they are rounded to float here, as
// torch rounds Python scalars inside its fp32 kernels.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "cpu/driver.h"
#include "ops.h"
#include "torch_compat.h"

#ifdef WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/launch.h"
#endif

namespace accum_fused {
namespace {

using at::Tensor;
using TensorList = std::vector<Tensor>;

// An argument's name for error messages, "list[i]" (or "list" when i < 0), formatted only when
// a check fails: building the string for every tensor of every call cost ~0.1 us per tensor,
// a measurable share of an in-backward hook's C++ call.
struct Name {
  const char* list;
  int64_t index = -1;
};

std::ostream& operator<<(std::ostream& os, const Name& n) {
  os << n.list;
  if (n.index >= 0) os << '[' << n.index << ']';
  return os;
}

DType to_dtype(const Tensor& t, const Name& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kBFloat16: return kBFloat16;
    case at::kHalf: return kFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return kFloat32;
}

Name item(const char* list, size_t i) { return Name{list, static_cast<int64_t>(i)}; }

// Kernels walk every tensor as a flat array in memory order, so each tensor of an entry must
// have its buffer's memory layout (the Python side re-lays out the rare ones that do not).
bool same_layout(const Tensor& t, const Tensor& buffer);

void check_tensor(const Tensor& t, const Name& name, const Tensor& buffer, const Name& buffer_name) {
  TORCH_CHECK(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK(t.device() == buffer.device(), name, " must be on ", buffer.device(), " like ", buffer_name,
              ", got ", t.device());
  TORCH_CHECK(t.sizes() == buffer.sizes(), name, " must have the shape of ", buffer_name, " ", buffer.sizes(),
              ", got ", t.sizes());
  TORCH_CHECK(same_layout(t, buffer), name, " must be contiguous (or have the strides of ", buffer_name, ")");
  TORCH_CHECK(plain_memory(t), name, " is a ZeroTensor or a view with a negation or conjugation flag, whose memory ",
              "does not hold its values: pass torch.zeros_like(t) or t.resolve_conj().resolve_neg()");
}

void check_fp32(const Tensor& t, const Name& name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
}

void check_length(const TensorList& list, const char* name, size_t expected, const char* reference) {
  TORCH_CHECK(list.size() == expected, name, " must have as many tensors as ", reference, " (", expected, "), got ",
              list.size());
}

// The call's tensors, one table entry per buffer.
struct Call {
  std::vector<TensorEntry> entries;
  at::Device device{at::kCPU};
  bool is_cuda() const { return device.is_cuda(); }
};

Call start_call(const TensorList& buffers) {
  Call call;
  call.entries.resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Tensor& b = buffers[i];
    const Name name = item("buffers", i);
    TORCH_CHECK(b.defined(), name, " must be a tensor, got None");
    check_fp32(b, name);
    if (i == 0) call.device = b.device();
    TORCH_CHECK(b.device() == call.device, name, " must be on ", call.device, " like buffers[0], got ", b.device());
    TORCH_CHECK(b.is_non_overlapping_and_dense(), name, " must be contiguous");
    TensorEntry& e = call.entries[i];
    e = TensorEntry{};
    e.numel = b.numel();
    e.ptr[kBuffer] = b.data_ptr();
  }
  TORCH_CHECK(call.device.is_cpu() || call.device.is_cuda(), "buffers must be on CPU or CUDA, got ", call.device);
#ifndef WITH_CUDA
  TORCH_CHECK(!call.is_cuda(), "accum_fused._C was built without CUDA; buffers are on ", call.device);
#endif
  return call;
}

// Adds one list of tensors to the call's slot `slot`; returns its (common) dtype.
DType add_list(Call& call, const TensorList& list, const char* name, const TensorList& buffers, Slot slot,
               bool fp32_only) {
  check_length(list, name, buffers.size(), "buffers");
  DType dtype = kFloat32;
  for (size_t i = 0; i < list.size(); ++i) {
    const Name n = item(name, i);
    check_tensor(list[i], n, buffers[i], item("buffers", i));
    if (fp32_only) {
      check_fp32(list[i], n);
    } else {
      const DType d = to_dtype(list[i], n);
      if (i == 0) dtype = d;
      TORCH_CHECK_TYPE(d == dtype, n, " must have the dtype of ", name, "[0] (", list[0].scalar_type(), "), got ",
                       list[i].scalar_type());
    }
    call.entries[i].ptr[slot] = list[i].data_ptr();
  }
  return dtype;
}

// GradScaler's scale / the clip coefficient: a 1-element float32 tensor on the call's device
// (CUDA reads it there), or absent (1).
void check_scalar_tensor(const std::optional<Tensor>& t, const char* name, const Call& call) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->numel() == 1, name, " must have one element, got ", t->numel());
  check_fp32(*t, Name{name});
  TORCH_CHECK(t->device() == call.device || (!call.is_cuda() && t->device().is_cpu()), name, " must be on ",
              call.device, ", got ", t->device());
}

float host_value(const std::optional<Tensor>& t) { return t.has_value() ? t->item<float>() : 1.0f; }

#ifdef WITH_CUDA
const float* device_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

struct CudaCall {
  c10::cuda::CUDAGuard guard;
  c10::cuda::CUDAStream stream;
  Tensor table;  // device copy of the entries (kept alive until the launch is enqueued)
  int64_t total_chunks;

  explicit CudaCall(Call& call)
      : guard(call.device), stream(c10::cuda::getCurrentCUDAStream(call.device.index())) {
    total_chunks = assign_chunks(call.entries.data(), static_cast<int64_t>(call.entries.size()), cuda::kChunkElems);
    const int64_t bytes = static_cast<int64_t>(call.entries.size() * sizeof(TensorEntry));
    // Pinned staging + non_blocking copy on the current stream: no host synchronisation; the
    // caching allocators keep both buffers alive until the stream has used them.
    Tensor host = at::empty({std::max<int64_t>(bytes, 1)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    if (bytes > 0) std::memcpy(host.data_ptr(), call.entries.data(), bytes);
    table = host.to(call.device, at::kByte, /*non_blocking=*/true);
  }
  const TensorEntry* entries() const { return static_cast<const TensorEntry*>(table.data_ptr()); }
  int64_t n() const { return table.numel() / static_cast<int64_t>(sizeof(TensorEntry)); }
  void* raw_stream() const { return static_cast<void*>(stream.stream()); }
};

void check_launch(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "accum_fused CUDA ", op, " failed: ", err ? err : "");
}
#endif

bool same_layout(const Tensor& t, const Tensor& buffer) {
  return (t.is_contiguous() && buffer.is_contiguous()) || t.strides() == buffer.strides();
}

// Indices i where tensors[i] does not have buffers[i]'s memory layout (the Python side re-lays
// those out; one call instead of a Python loop over strides).
std::vector<int64_t> layout_mismatches(const TensorList& tensors, const TensorList& buffers) {
  // Unequal lengths or undefined tensors are left to the op's own checks, which name them.
  std::vector<int64_t> out;
  for (size_t i = 0; i < std::min(tensors.size(), buffers.size()); ++i) {
    if (tensors[i].defined() && buffers[i].defined() && tensors[i].sizes() == buffers[i].sizes() &&
        !same_layout(tensors[i], buffers[i])) {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

// Whether every tensor of every list fits the parameter at its index as Window.conform and
// layout.conform_state require (no-op there): state_dtype(param) -- fp32 for fp32, bf16 and fp16
// parameters, fp64 for fp64 --, the parameter's device and shape. Undefined tensors fit. One
// call instead of a Python loop over the parameters at every window's close (in_backward).
bool state_fits(const TensorList& params, const std::vector<TensorList>& lists) {
  for (const TensorList& list : lists) {
    if (list.size() != params.size()) return false;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (state_dtype(params[i].scalar_type()) == at::ScalarType::Undefined) return false;  // (Python's check)
    for (const TensorList& list : lists) {
      if (list[i].defined() && !fits(list[i], params[i])) return false;
    }
  }
  return true;
}

// Whether every tensor holds the same single value, for one-element CPU tensors of one floating
// dtype (Adam's step counts: one read each, where torch.stack and a comparison cost ~1 us per
// tensor); None for anything else (the caller compares them with torch).
std::optional<bool> equal_scalars(const TensorList& tensors) {
  if (tensors.empty()) return true;
  const at::ScalarType dtype = tensors[0].scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return std::nullopt;
  std::optional<double> first;
  bool equal = true;
  for (const Tensor& t : tensors) {
    if (!t.defined() || !t.device().is_cpu() || t.scalar_type() != dtype || t.numel() != 1) return std::nullopt;
    const double value = dtype == at::kFloat ? static_cast<double>(*t.const_data_ptr<float>())
                                             : *t.const_data_ptr<double>();
    if (!first.has_value()) first = value;
    equal &= value == *first;
  }
  return equal;
}

// The kernels write through raw pointers, which autograd does not see: every tensor a call
// writes in place gets its version counter bumped, as torch's in-place ops do, so that a
// backward that saved one of them (a GAN's `out = D(x)` kept across an update) raises
// autograd's in-place error instead of silently using the new values. Inference tensors have
// no counter (torch.autograd.graph.increment_version skips them too).
void bump_versions(const TensorList& written) {
  for (const Tensor& t : written) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

Tensor float_out(const Call& call, int64_t n) {
  return at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(call.device));
}

// ------------------------------------------------------------------------------- ops
std::optional<Tensor> accumulate(const TensorList& grads, const TensorList& buffers, double weight, bool overwrite,
                                 const std::optional<Tensor>& grad_scale, std::optional<double> norm_weight_sum) {
  Call call = start_call(buffers);
  const DType grad_dtype = add_list(call, grads, "grads", buffers, kGrad, /*fp32_only=*/false);
  check_scalar_tensor(grad_scale, "grad_scale", call);
  const AccumScalars accum{static_cast<float>(weight), overwrite};
  const float nws = norm_weight_sum.has_value() ? static_cast<float>(*norm_weight_sum) : 1.0f;
  std::optional<Tensor> norms;
  if (norm_weight_sum.has_value()) norms = float_out(call, static_cast<int64_t>(buffers.size()));
  if (call.is_cuda()) {
#ifdef WITH_CUDA
    CudaCall cuda_call(call);
    Tensor partials = float_out(call, std::max<int64_t>(cuda_call.total_chunks, 1));
    check_launch(cuda::launch_accumulate(cuda_call.entries(), cuda_call.n(), cuda_call.total_chunks, grad_dtype, accum,
                                         device_ptr(grad_scale), nws, partials.data_ptr<float>(),
                                         norms ? norms->data_ptr<float>() : nullptr, cuda_call.raw_stream()),
                 "accumulate");
#endif
  } else {
    cpu::accumulate(call.entries, grad_dtype, accum, host_value(grad_scale), nws,
                    norms ? norms->data_ptr<float>() : nullptr);
  }
  bump_versions(buffers);
  return norms;
}

Tensor window_norms(const TensorList& buffers, double weight_sum) {
  Call call = start_call(buffers);
  Tensor norms = float_out(call, static_cast<int64_t>(buffers.size()));
  if (call.is_cuda()) {
#ifdef WITH_CUDA
    CudaCall cuda_call(call);
    Tensor partials = float_out(call, std::max<int64_t>(cuda_call.total_chunks, 1));
    check_launch(cuda::launch_window_norms(cuda_call.entries(), cuda_call.n(), cuda_call.total_chunks,
                                           static_cast<float>(weight_sum), partials.data_ptr<float>(),
                                           norms.data_ptr<float>(), cuda_call.raw_stream()),
                 "window_norms");
#endif
  } else {
    cpu::window_norms(call.entries, static_cast<float>(weight_sum), norms.data_ptr<float>());
  }
  return norms;
}

// The parts every update shares: params, the optional fused last micro-batch, clip coefficient.
struct Update {
  Call call;
  DType param_dtype = kFloat32;
  cpu::FoldScalars fold{};
  WindowScalars window{};
};

Update start_update(const TensorList& params, const TensorList& buffers, double weight_sum, bool maximize,
                    const std::optional<Tensor>& clip_coef, const std::optional<TensorList>& grads, double weight,
                    bool overwrite, const std::optional<Tensor>& grad_scale) {
  Update u{start_call(buffers)};
  u.param_dtype = add_list(u.call, params, "params", buffers, kParam, /*fp32_only=*/false);
  check_scalar_tensor(clip_coef, "clip_coef", u.call);
  u.window = WindowScalars{static_cast<float>(weight_sum), maximize, kRoundNearest};
  u.fold.present = grads.has_value();
  u.fold.accum = AccumScalars{static_cast<float>(weight), overwrite};
  if (grads.has_value()) {
    u.fold.grad_dtype = add_list(u.call, *grads, "grads", buffers, kGrad, /*fp32_only=*/false);
    check_scalar_tensor(grad_scale, "grad_scale", u.call);
  }
  return u;
}

// bf16_update: how the update writes bf16 parameters (ParamRounding in math.h): stochastic
// rounding takes one 32-bit key per tensor, Kahan one bf16 compensation tensor per parameter.
void add_rounding(Update& u, const TensorList& buffers, int64_t rounding, const std::vector<int64_t>& rounding_keys,
                  const TensorList& compensations) {
  TORCH_CHECK(rounding >= kRoundNearest && rounding <= kRoundKahan, "rounding must be 0 (nearest), 1 (stochastic) or ",
              "2 (kahan), got ", rounding);
  u.window.rounding = static_cast<ParamRounding>(rounding);
  TORCH_CHECK(rounding == kRoundNearest || u.param_dtype == kBFloat16 || buffers.empty(),
              "stochastic and Kahan rounding are for bf16 parameters; these are ",
              u.param_dtype == kFloat32 ? "float32" : "float16");
  if (rounding == kRoundStochastic) {
    TORCH_CHECK(rounding_keys.size() == buffers.size(), "rounding_keys must have as many entries as buffers (",
                buffers.size(), "), got ", rounding_keys.size());
    for (size_t i = 0; i < buffers.size(); ++i) u.call.entries[i].rounding_key = static_cast<uint32_t>(rounding_keys[i]);
  }
  if (rounding == kRoundKahan) {
    const DType comp_dtype = add_list(u.call, compensations, "compensations", buffers, kComp, /*fp32_only=*/false);
    TORCH_CHECK_TYPE(buffers.empty() || comp_dtype == kBFloat16, "compensations must be bfloat16");
  }
}

void sgd_update(const TensorList& params, const TensorList& buffers, const TensorList& momentum_buffers,
                const std::vector<bool>& first_momentum, double weight_sum, const std::optional<Tensor>& clip_coef,
                double neg_lr, double momentum, double one_minus_dampening, double weight_decay, bool nesterov,
                bool maximize, const std::optional<TensorList>& grads, double weight, bool overwrite,
                const std::optional<Tensor>& grad_scale, int64_t rounding = kRoundNearest,
                const std::vector<int64_t>& rounding_keys = {}, const TensorList& compensations = {}) {
  Update u = start_update(params, buffers, weight_sum, maximize, clip_coef, grads, weight, overwrite, grad_scale);
  add_rounding(u, buffers, rounding, rounding_keys, compensations);
  const SgdScalars s{static_cast<float>(weight_decay), static_cast<float>(momentum),
                     static_cast<float>(one_minus_dampening), static_cast<float>(neg_lr), weight_decay != 0.0,
                     momentum != 0.0, nesterov};
  if (s.has_momentum) {
    add_list(u.call, momentum_buffers, "momentum_buffers", buffers, kState0, /*fp32_only=*/true);
    TORCH_CHECK(first_momentum.size() == buffers.size(), "first_momentum must have as many entries as buffers (",
                buffers.size(), "), got ", first_momentum.size());
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (first_momentum[i]) u.call.entries[i].flags |= kFirstMomentum;
    }
  }
  if (u.call.is_cuda()) {
#ifdef WITH_CUDA
    CudaCall cuda_call(u.call);
    const cuda::DeviceFold fold{u.fold.present, u.fold.grad_dtype, u.fold.accum, device_ptr(grad_scale)};
    check_launch(cuda::launch_sgd(cuda_call.entries(), cuda_call.n(), cuda_call.total_chunks, u.param_dtype, fold,
                                  u.window, device_ptr(clip_coef), s, cuda_call.raw_stream()),
                 "sgd_update");
#endif
  } else {
    u.fold.grad_scale = u.fold.present ? host_value(grad_scale) : 1.0f;
    cpu::sgd_update(u.call.entries, u.param_dtype, u.fold, u.window, host_value(clip_coef), s);
  }
  bump_versions(params);
  if (s.has_momentum) bump_versions(momentum_buffers);
  if (rounding == kRoundKahan) bump_versions(compensations);
}

void adam_update(const TensorList& params, const TensorList& buffers, const TensorList& exp_avgs,
                 const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, double weight_sum,
                 const std::optional<Tensor>& clip_coef, double decay_factor, double weight_decay, double lerp_weight,
                 double beta2, double one_minus_beta2, double bc2_sqrt, double eps, double neg_step_size,
                 bool decoupled, bool amsgrad, bool maximize, const std::optional<TensorList>& grads, double weight,
                 bool overwrite, const std::optional<Tensor>& grad_scale, int64_t rounding = kRoundNearest,
                 const std::vector<int64_t>& rounding_keys = {}, const TensorList& compensations = {}) {
  Update u = start_update(params, buffers, weight_sum, maximize, clip_coef, grads, weight, overwrite, grad_scale);
  add_rounding(u, buffers, rounding, rounding_keys, compensations);
  add_list(u.call, exp_avgs, "exp_avgs", buffers, kState0, /*fp32_only=*/true);
  add_list(u.call, exp_avg_sqs, "exp_avg_sqs", buffers, kState1, /*fp32_only=*/true);
  if (amsgrad) {
    add_list(u.call, max_exp_avg_sqs, "max_exp_avg_sqs", buffers, kState2, /*fp32_only=*/true);
  } else {
    TORCH_CHECK(max_exp_avg_sqs.empty(), "max_exp_avg_sqs must be empty without amsgrad, got ",
                max_exp_avg_sqs.size(), " tensors");
  }
  const AdamScalars s{static_cast<float>(decay_factor), static_cast<float>(weight_decay), static_cast<float>(lerp_weight),
                      static_cast<float>(beta2), static_cast<float>(one_minus_beta2), static_cast<float>(bc2_sqrt),
                      static_cast<float>(eps), static_cast<float>(neg_step_size), weight_decay != 0.0, decoupled,
                      amsgrad};
  if (u.call.is_cuda()) {
#ifdef WITH_CUDA
    CudaCall cuda_call(u.call);
    const cuda::DeviceFold fold{u.fold.present, u.fold.grad_dtype, u.fold.accum, device_ptr(grad_scale)};
    check_launch(cuda::launch_adam(cuda_call.entries(), cuda_call.n(), cuda_call.total_chunks, u.param_dtype, fold,
                                   u.window, device_ptr(clip_coef), s, cuda_call.raw_stream()),
                 "adam_update");
#endif
  } else {
    u.fold.grad_scale = u.fold.present ? host_value(grad_scale) : 1.0f;
    cpu::adam_update(u.call.entries, u.param_dtype, u.fold, u.window, host_value(clip_coef), s);
  }
  for (const TensorList* written : {&params, &exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs}) bump_versions(*written);
  if (rounding == kRoundKahan) bump_versions(compensations);
}

}  // namespace

std::optional<float> accumulate_one_cpu(const Tensor& grad, const Tensor& buffer, double weight, bool overwrite,
                                        std::optional<double> norm_weight_sum) {
  TensorEntry entry{};
  entry.numel = buffer.numel();
  entry.ptr[kBuffer] = buffer.data_ptr();
  entry.ptr[kGrad] = grad.data_ptr();
  float norm = 0.0f;
  cpu::accumulate_one(entry, to_dtype(grad, Name{"grad"}), AccumScalars{static_cast<float>(weight), overwrite},
                      /*grad_scale=*/1.0f, norm_weight_sum.has_value() ? static_cast<float>(*norm_weight_sum) : 1.0f,
                      norm_weight_sum.has_value() ? &norm : nullptr);
  if (!buffer.is_inference()) torch::autograd::impl::bump_version(buffer);  // (bump_versions, without its list)
  return norm_weight_sum.has_value() ? std::optional<float>(norm) : std::nullopt;
}

std::optional<Tensor> accumulate_op(const TensorList& grads, const TensorList& buffers, double weight, bool overwrite,
                                    const std::optional<Tensor>& grad_scale, std::optional<double> norm_weight_sum) {
  return accumulate(grads, buffers, weight, overwrite, grad_scale, norm_weight_sum);
}

Tensor window_norms_op(const TensorList& buffers, double weight_sum) { return window_norms(buffers, weight_sum); }

void sgd_update_op(const TensorList& params, const TensorList& buffers, const TensorList& momentum_buffers,
                   const std::vector<bool>& first_momentum, double weight_sum, const std::optional<Tensor>& clip_coef,
                   double neg_lr, double momentum, double one_minus_dampening, double weight_decay, bool nesterov,
                   bool maximize, const std::optional<TensorList>& grads, double weight, bool overwrite,
                   const std::optional<Tensor>& grad_scale) {
  sgd_update(params, buffers, momentum_buffers, first_momentum, weight_sum, clip_coef, neg_lr, momentum,
             one_minus_dampening, weight_decay, nesterov, maximize, grads, weight, overwrite, grad_scale);
}

void adam_update_op(const TensorList& params, const TensorList& buffers, const TensorList& exp_avgs,
                    const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, double weight_sum,
                    const std::optional<Tensor>& clip_coef, double decay_factor, double weight_decay,
                    double lerp_weight, double beta2, double one_minus_beta2, double bc2_sqrt, double eps,
                    double neg_step_size, bool decoupled, bool amsgrad, bool maximize,
                    const std::optional<TensorList>& grads, double weight, bool overwrite,
                    const std::optional<Tensor>& grad_scale) {
  adam_update(params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, weight_sum, clip_coef, decay_factor,
              weight_decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, decoupled, amsgrad,
              maximize, grads, weight, overwrite, grad_scale);
}

bool same_memory_layout(const Tensor& t, const Tensor& buffer) { return same_layout(t, buffer); }

bool plain_memory(const Tensor& t) { return !t._is_zerotensor() && !t.is_neg() && !t.is_conj(); }

bool kernel_dtype(at::ScalarType d) { return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf; }

bool kernel_grad(const Tensor& g) {
  return g.layout() == at::kStrided && kernel_dtype(g.scalar_type()) && plain_memory(g);
}

at::ScalarType state_dtype(at::ScalarType param) {
  if (kernel_dtype(param)) return at::kFloat;
  return param == at::kDouble ? at::kDouble : at::ScalarType::Undefined;
}

bool fits(const Tensor& t, const Tensor& param) {
  return t.scalar_type() == state_dtype(param.scalar_type()) && t.device() == param.device() &&
         t.sizes() == param.sizes();
}

bool adoptable(const Tensor& grad, const Tensor& param) {
  return grad.scalar_type() == state_dtype(param.scalar_type()) && grad.device() == param.device() &&
         !grad.is_view() && grad.is_contiguous() && param.is_contiguous();
}

}  // namespace accum_fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace accum_fused;
  m.doc() = "accum_fused compiled kernels (see accum_fused/backends/cpp_backend.py for the Python API)";
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // The torch whose headers this build was compiled against, and which of the fast paths that
  // reach into torch internals it holds (torch_compat.h): `python -m accum_fused info` prints them.
  m.attr("torch_headers") = TORCH_VERSION;
  py::dict fast_paths;
  fast_paths["adopt_preserved_gradients"] = static_cast<bool>(ACCUM_FUSED_PRESERVED_PYOBJECTS_TELL);
  m.attr("fast_paths") = fast_paths;
  m.def("cpu_kernel_variant", &cpu::kernel_variant, "The CPU kernel build in use: AVX2 or DEFAULT");
  m.def("layout_mismatches", &layout_mismatches, py::arg("tensors"), py::arg("buffers"));
  m.def("state_fits", &state_fits, py::arg("params"), py::arg("lists"));
  // (the per-tensor rules of ops.h, for the tests that compare them with accum_fused/layout.py's)
  m.def("kernel_grad", &accum_fused::kernel_grad, py::arg("grad"));
  m.def("fits", &accum_fused::fits, py::arg("t"), py::arg("param"));
  m.def("adoptable", &accum_fused::adoptable, py::arg("grad"), py::arg("param"));
  m.def("equal_scalars", &equal_scalars, py::arg("tensors"));
  m.def("accumulate", &accumulate, py::arg("grads"), py::arg("buffers"), py::arg("weight"), py::arg("overwrite"),
        py::arg("grad_scale"), py::arg("norm_weight_sum"), py::call_guard<py::gil_scoped_release>());
  m.def("window_norms", &window_norms, py::arg("buffers"), py::arg("weight_sum"),
        py::call_guard<py::gil_scoped_release>());
  m.def("sgd_update", &sgd_update, py::arg("params"), py::arg("buffers"), py::arg("momentum_buffers"),
        py::arg("first_momentum"), py::arg("weight_sum"), py::arg("clip_coef"), py::arg("neg_lr"),
        py::arg("momentum"), py::arg("one_minus_dampening"), py::arg("weight_decay"), py::arg("nesterov"),
        py::arg("maximize"), py::arg("grads"), py::arg("weight"), py::arg("overwrite"), py::arg("grad_scale"),
        py::arg("rounding") = 0, py::arg("rounding_keys") = std::vector<int64_t>{},
        py::arg("compensations") = TensorList{}, py::call_guard<py::gil_scoped_release>());
  m.def("adam_update", &adam_update, py::arg("params"), py::arg("buffers"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("weight_sum"), py::arg("clip_coef"),
        py::arg("decay_factor"), py::arg("weight_decay"), py::arg("lerp_weight"), py::arg("beta2"),
        py::arg("one_minus_beta2"), py::arg("bc2_sqrt"), py::arg("eps"), py::arg("neg_step_size"),
        py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"), py::arg("grads"), py::arg("weight"),
        py::arg("overwrite"), py::arg("grad_scale"), py::arg("rounding") = 0,
        py::arg("rounding_keys") = std::vector<int64_t>{}, py::arg("compensations") = TensorList{},
        py::call_guard<py::gil_scoped_release>());
  register_hooks(m);
  register_step_table(m);
}
