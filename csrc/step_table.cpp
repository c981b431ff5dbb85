// Plain mode's micro-batches without a Python loop over the parameters (window.py's StepTable).
//
// In plain mode step() reads every parameter's .grad, adds it into the parameter's window buffer
// and frees .grad. Done in Python that cost ~15-35 us per tensor per micro-batch (issue 31's
// profile: set and dict lookups keyed by tensors, whose __hash__ is Python, grouping keys, the
// layout checks), which on models of many small tensors (LoRA adapters; 5,000 x 4,096) was the
// whole gap to the native loop, whose micro-batches do no Python work per tensor at all.
// window.py stays the spec: it builds this table (every parameter of the optimizer in order,
// its buffer or none, whether the buffer is live in the open window) and asks, per micro-batch
// that does not close the window, `check` whether the table can take it exactly as
// Window.accumulate would; `take` then does. Anything the table does not know how to take --
// the optimizer's parameter lists changed, a gradient on a parameter without a buffer, a
// gradient whose dtype, device, shape or layout does not fit its buffer, a sparse one, a
// parameter whose dtype, device or shape changed, no gradient at all -- makes `check` answer
// -1 or 0 and changes nothing: the micro-batch goes through Python (which raises, conforms or
// warns as specified), and window.py keeps the table true afterwards (`mark_live`,
// `reset_live`) or drops it.
//
//   StepTable(params, buffers, live)       params: the optimizer's, in order
//     check(param_lists) -> n              gradients present; -1: not the table's to take
//     take(weight, grad_scale, clear, norm_weight_sum=None) -> (newly live indices, norms or None)
//                                          (right after a check > 0)
//     present_grads(), release(clear)      the checked gradients, and taking them without adding
//                                          (the closing micro-batch folded into the update)
//     drop_checked()                       not taking them after all
//     mark_live(params), reset_live(), live_count
//     conforms()                           every buffer still fits its parameter (Window.conform's check)
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace accum_fused {
namespace {

namespace py = pybind11;
using at::Tensor;

bool kernel_dtype(at::ScalarType d) { return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf; }

struct StepTable {
  std::vector<py::object> objects;  // the parameters as Python objects (identity checks)
  std::vector<Tensor> params;
  std::vector<Tensor> buffers;  // undefined: none yet
  std::vector<at::ScalarType> param_dtypes;
  std::vector<char> live;
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of;
  std::vector<int64_t> present;  // filled by check: indices with a gradient
  std::vector<Tensor> grads;     // and those gradients
  int64_t live_count = 0;

  StepTable(const py::list& param_objects, const std::vector<std::optional<Tensor>>& bufs,
            const std::vector<bool>& live_now) {
    const size_t n = param_objects.size();
    TORCH_CHECK(bufs.size() == n && live_now.size() == n, "StepTable: lists differ in length");
    objects.reserve(n);
    params.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      py::object obj = param_objects[i];
      Tensor p = obj.cast<Tensor>();
      objects.push_back(obj);
      index_of[p.unsafeGetTensorImpl()] = static_cast<int64_t>(i);
      param_dtypes.push_back(p.scalar_type());
      params.push_back(std::move(p));
      buffers.push_back(bufs[i].value_or(Tensor()));
      TORCH_CHECK(!live_now[i] || buffers.back().defined(), "StepTable: a live parameter without a buffer");
      live.push_back(live_now[i] ? 1 : 0);
      live_count += live_now[i];
    }
  }

  // Whether `param_lists` (the optimizer's param groups' lists) hold exactly the table's
  // parameters in order.
  bool same_params(const py::list& param_lists) const {
    size_t i = 0;
    for (const py::handle& group : param_lists) {
      PyObject* list = group.ptr();
      if (!PyList_Check(list)) return false;
      const Py_ssize_t m = PyList_GET_SIZE(list);
      for (Py_ssize_t j = 0; j < m; ++j, ++i) {
        if (i >= objects.size() || PyList_GET_ITEM(list, j) != objects[i].ptr()) return false;
      }
    }
    return i == objects.size();
  }

  bool fits(size_t i, const Tensor& g) const {
    const Tensor& p = params[i];
    const Tensor& b = buffers[i];
    if (!b.defined() || p.scalar_type() != param_dtypes[i] || p.device() != b.device() || p.sizes() != b.sizes()) {
      return false;  // no buffer yet, or the parameter changed: Window.conform's work
    }
    return g.layout() == at::kStrided && kernel_dtype(g.scalar_type()) && g.device() == b.device() &&
           g.sizes() == b.sizes() && same_memory_layout(g, b) && plain_memory(g);
  }

  int64_t check(const py::list& param_lists) {
    present.clear();
    grads.clear();
    if (!same_params(param_lists)) return -1;
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& g = params[i].grad();
      if (!g.defined()) continue;
      if (!fits(i, g)) {
        present.clear();
        grads.clear();
        return -1;
      }
      present.push_back(static_cast<int64_t>(i));
      grads.push_back(g);
    }
    return static_cast<int64_t>(present.size());
  }

  // Adds the gradients found by the last check into their buffers: one accumulate call per
  // (gradient dtype, overwrite) -- stale buffers are overwritten, live ones added to, as
  // Window.accumulate groups them -- then frees .grad (clear) and returns the indices whose
  // buffers became live. With norm_weight_sum (a window's closing micro-batch, clipped), also
  // ||buffer / norm_weight_sum|| of each taken gradient's buffer, in the order of the check.
  std::tuple<std::vector<int64_t>, std::optional<Tensor>> take(double weight, const std::optional<Tensor>& grad_scale,
                                                               bool clear, std::optional<double> norm_weight_sum) {
    TORCH_CHECK(present.size() == grads.size(), "StepTable.take: check() first");
    struct Group {
      at::ScalarType dtype;
      bool overwrite;
      std::vector<int64_t> order;  // positions in present
      std::vector<Tensor> grads, buffers;
    };
    std::vector<Group> groups;
    for (size_t k = 0; k < present.size(); ++k) {
      const int64_t i = present[k];
      const bool overwrite = !live[i];
      const at::ScalarType d = grads[k].scalar_type();
      Group* group = nullptr;
      for (Group& g : groups) {
        if (g.dtype == d && g.overwrite == overwrite) group = &g;
      }
      if (group == nullptr) {
        groups.push_back(Group{d, overwrite, {}, {}, {}});
        group = &groups.back();
      }
      group->order.push_back(static_cast<int64_t>(k));
      group->grads.push_back(grads[k]);
      group->buffers.push_back(buffers[i]);
    }
    std::optional<Tensor> norms;
    {
      py::gil_scoped_release no_gil;
      for (const Group& g : groups) {
        std::optional<Tensor> group_norms =
            accumulate_op(g.grads, g.buffers, weight, g.overwrite, grad_scale, norm_weight_sum);
        if (!norm_weight_sum.has_value()) continue;
        if (groups.size() == 1) {
          norms = group_norms;
          continue;
        }
        if (!norms.has_value()) norms = at::empty({static_cast<int64_t>(present.size())}, group_norms->options());
        norms->index_copy_(0, at::tensor(g.order, at::kLong).to(group_norms->device()), *group_norms);
      }
    }
    std::vector<int64_t> newly_live = release(clear);
    return {std::move(newly_live), std::move(norms)};
  }

  // The gradients found by the last check, in its order (a closing micro-batch folded into the
  // update: window.ClosingPlan passes them to the update pass, then calls release).
  std::vector<Tensor> present_grads() const { return grads; }

  // The gradients found by the last check are in the window: frees .grad (clear), marks their
  // buffers live and returns the indices that became so.
  std::vector<int64_t> release(bool clear) {
    std::vector<int64_t> newly_live;
    for (const int64_t i : present) {
      if (clear) params[i].mutable_grad().reset();
      if (!live[i]) {
        live[i] = 1;
        ++live_count;
        newly_live.push_back(i);
      }
    }
    present.clear();
    grads.clear();
    return newly_live;
  }

  // The gradients found by the last check are not the table's to take after all (a closing
  // micro-batch window.ClosingPlan refuses): let go of them, so that freeing .grad frees them.
  void drop_checked() {
    present.clear();
    grads.clear();
  }

  // Window.accumulate (Python) made these live: the table follows.
  void mark_live(const std::vector<Tensor>& made_live) {
    for (const Tensor& p : made_live) {
      auto it = index_of.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != index_of.end(), "StepTable.mark_live: not a parameter of the table");
      TORCH_CHECK(buffers[it->second].defined(), "StepTable.mark_live: a parameter without a buffer");
      if (!live[it->second]) {
        live[it->second] = 1;
        ++live_count;
      }
    }
  }

  // Whether every buffer still fits its parameter as when the table was built (Window.conform
  // would change nothing): same parameter dtype, device and shape.
  bool conforms() const {
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& b = buffers[i];
      if (b.defined() && (params[i].scalar_type() != param_dtypes[i] || params[i].device() != b.device() ||
                          params[i].sizes() != b.sizes())) {
        return false;
      }
    }
    return true;
  }

  void reset_live() {
    std::fill(live.begin(), live.end(), 0);
    live_count = 0;
  }
};

}  // namespace

void register_step_table(py::module& m) {
  py::class_<StepTable>(m, "StepTable")
      .def(py::init<const py::list&, const std::vector<std::optional<Tensor>>&, const std::vector<bool>&>(),
           py::arg("params"), py::arg("buffers"), py::arg("live"))
      .def("check", &StepTable::check, py::arg("param_lists"))
      .def("take", &StepTable::take, py::arg("weight"), py::arg("grad_scale"), py::arg("clear"),
           py::arg("norm_weight_sum") = py::none())
      .def("present_grads", &StepTable::present_grads)
      .def("release", &StepTable::release, py::arg("clear"))
      .def("drop_checked", &StepTable::drop_checked)
      .def("mark_live", &StepTable::mark_live, py::arg("params"))
      .def("reset_live", &StepTable::reset_live)
      .def("conforms", &StepTable::conforms)
      .def_readonly("live_count", &StepTable::live_count);
}

}  // namespace accum_fused
