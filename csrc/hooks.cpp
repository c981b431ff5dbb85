// In-backward hooks without Python (accum_fused/in_backward.py's fast path).
//
// A backward pass of an in_backward optimizer adds one gradient per parameter into the window.
// In Python each post-accumulate-grad hook cost 5-10 us (issue 22's profile: ~4 ms of a 120 ms
// window of 60 tensors, k=8); here the common case is one C++ call per parameter per
// micro-batch. in_backward.py stays the spec: it decides, once per backward pass, which
// parameters this path may take (the "armed" ones: live buffers on the cpp backend, in a pass
// that neither updates inside its hooks nor hands buckets to other ranks) and with which
// weight; everything else -- the pass's first gradient, a parameter not live yet (adopted or
// overwriting its buffer), a second gradient in one pass, a nested or foreign backward (another
// autograd graph task), an unusual gradient -- goes to the Python hook given as `fallback`.
// in_backward.py takes what this path did (`drain`) before it reads the pass's records.
//
//   HookState  one per optimizer; slot i = the i-th hooked parameter
//     arm(slots, buffers, weight, norm_weight_sum)  from the pass's first (Python) hook:
//        the current graph task becomes the armed one; buffers[j] is slot j's live buffer
//     drain() -> (slots taken since the last drain, their norms or [])
//     disarm()   the pass ended (or failed)
//     taken      gradients taken by this path, in all (tests count it)
//   FastHook(state, slot, fallback)  the hook registered on a parameter
#include <torch/extension.h>
#include <torch/csrc/autograd/graph_task.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"

namespace accum_fused {
namespace {

namespace py = pybind11;
using at::Tensor;

struct HookState {
  int64_t armed_task = -1;  // the autograd graph task whose pass may be taken here; -1: none
  double weight = 1.0;
  std::optional<double> norm_weight_sum;
  std::vector<Tensor> buffers;     // per slot: its live buffer while armed, else undefined
  std::vector<int64_t> seen_task;  // per slot: the armed task it was last taken in
  std::vector<int64_t> armed_slots;
  std::vector<int64_t> taken_slots;  // since the last drain
  std::vector<Tensor> taken_norms;
  int64_t taken = 0;

  void add_slot() {
    buffers.emplace_back();
    seen_task.push_back(-1);
  }

  void arm(const std::vector<int64_t>& slots, const std::vector<Tensor>& live_buffers, double w,
           std::optional<double> nws) {
    TORCH_CHECK(slots.size() == live_buffers.size(), "arm: slots and buffers differ in length");
    disarm();
    armed_task = torch::autograd::get_current_graph_task_id();
    if (armed_task < 0) return;  // not inside a backward pass: nothing to take
    weight = w;
    norm_weight_sum = nws;
    for (size_t i = 0; i < slots.size(); ++i) {
      TORCH_CHECK(slots[i] >= 0 && slots[i] < static_cast<int64_t>(buffers.size()), "arm: no slot ", slots[i]);
      buffers[slots[i]] = live_buffers[i];
    }
    armed_slots = slots;
  }

  void disarm() {
    for (int64_t s : armed_slots) buffers[s] = Tensor();
    armed_slots.clear();
    armed_task = -1;
  }

  std::pair<std::vector<int64_t>, std::vector<Tensor>> drain() {
    std::pair<std::vector<int64_t>, std::vector<Tensor>> out{std::move(taken_slots), std::move(taken_norms)};
    taken_slots.clear();
    taken_norms.clear();
    return out;
  }

  // Takes `param`'s gradient into its buffer when this path may; false leaves everything as
  // it was, for the Python hook.
  bool take(int64_t slot, const Tensor& param) {
    if (armed_task < 0 || slot >= static_cast<int64_t>(buffers.size())) return false;
    const Tensor& buffer = buffers[slot];
    if (!buffer.defined() || buffer.scalar_type() != at::kFloat || seen_task[slot] == armed_task) return false;
    if (torch::autograd::get_current_graph_task_id() != armed_task) return false;
    Tensor& grad_slot = param.mutable_grad();
    if (!grad_slot.defined()) return false;
    const Tensor grad = grad_slot;  // keeps the gradient alive through the kernel
    const auto dtype = grad.scalar_type();
    if (grad.layout() != at::kStrided || (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) ||
        grad.device() != buffer.device() || grad.sizes() != buffer.sizes() || !same_memory_layout(grad, buffer)) {
      return false;
    }
    std::optional<Tensor> norms;
    {
      py::gil_scoped_release no_gil;  // as the Python path's _C.accumulate call does
      norms = accumulate_op({grad}, {buffer}, weight, /*overwrite=*/false, std::nullopt, norm_weight_sum);
    }
    seen_task[slot] = armed_task;
    taken_slots.push_back(slot);
    if (norms.has_value()) taken_norms.push_back(norms->reshape({}));
    grad_slot.reset();  // .grad = None, as the Python hook leaves it
    ++taken;
    return true;
  }
};

struct FastHook {
  std::shared_ptr<HookState> state;
  int64_t slot;
  py::object fallback;

  void operator()(py::handle param) {
    if (!state->take(slot, py::cast<Tensor>(param))) fallback(param);  // (the very Parameter object)
  }
};

}  // namespace

void register_hooks(py::module& m) {
  py::class_<HookState, std::shared_ptr<HookState>>(m, "HookState")
      .def(py::init<>())
      .def("add_slot", &HookState::add_slot)
      .def("arm", &HookState::arm, py::arg("slots"), py::arg("buffers"), py::arg("weight"),
           py::arg("norm_weight_sum"))
      .def("disarm", &HookState::disarm)
      .def("drain", &HookState::drain)
      .def_property_readonly("armed", [](const HookState& s) { return s.armed_task >= 0; })
      .def_readonly("taken", &HookState::taken);
  py::class_<FastHook>(m, "FastHook")
      .def(py::init([](std::shared_ptr<HookState> state, int64_t slot, py::object fallback) {
             return FastHook{std::move(state), slot, std::move(fallback)};
           }),
           py::arg("state"), py::arg("slot"), py::arg("fallback"))
      .def("__call__", &FastHook::operator(), py::arg("param"));
}

}  // namespace accum_fused
