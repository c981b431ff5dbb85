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
// Window.accumulate would; `take` then does. Anything the table does not know how to take -- a
// gradient on a parameter without a buffer, a gradient whose dtype, device, shape or layout does
// not fit its buffer, a sparse one, a parameter whose dtype, device or shape changed, no
// gradient at all -- makes `check` answer -1 or 0 and changes nothing: the micro-batch goes
// through Python (which raises, conforms or warns as specified), and window.py keeps the table
// true afterwards (`mark_live`, `reset_live`) or drops it. (The optimizer's parameters are the
// ones the table was built on: base.py's one check of that, _wiring_stands, makes it stale.)
//
// A window's first gradient of a parameter whose buffer the last window let go of (an adopted
// one, below) or that never had one gets a buffer here: autograd's own gradient tensor where
// nothing else holds it (zero-copy, as the in-backward hooks adopt: the native loop's first
// micro-batch costs no bytes either, and between windows the parameter holds no buffer, 12 B
// per fp32 AdamW parameter instead of 16), else a fresh one, kept between windows.
//
//   StepTable(params, takes, may_adopt, torch_ops, buffers, live, adopted, frozen)
//                                          params: the optimizer's that require grad, in order;
//                                          then their rows (ops.h's Row; window.table.row_lists);
//                                          frozen: the others, whose gradient (a .grad set by
//                                          hand, or one unfrozen since) makes check answer -1
//     check() -> n                         gradients present; -1: not the table's to take
//     take(weight, grad_scale, clear, norm_weight_sum=None)
//         -> (newly live indices, norms or None, indices given a buffer, those buffers, how many
//             of them (the first) are adopted gradients)       (right after a check > 0)
//     new_window()                         the window ended: no buffer is live, adopted ones go
//     buffers(), missing_buffers()         every buffer in order (none missing); how many are
//     present_grads(), release(clear)      the checked gradients, and taking them without adding
//                                          (the closing micro-batch folded into the update)
//     drop_checked()                       not taking them after all
//     mark_live(params), live_count
//     conforms()                           every buffer still fits its parameter (Window.conform's check)
//     rows()                               the rows, as window.table.row_lists gives them (tests)
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ops.h"
#include "torch_compat.h"

namespace accum_fused {
namespace {

namespace py = pybind11;
using at::Tensor;

struct StepTable {
  std::vector<Tensor> params;
  // Each parameter's row (every route takes: window.table.StepTable.build builds no table
  // otherwise). A parameter changed since its row was built is Window.conform's and
  // conform_state's to refuse or follow; the table hands it back (fits, conforms).
  std::vector<Row> rows;
  std::vector<Tensor> frozen;  // the optimizer's other parameters: any gradient there is Python's
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of;
  std::vector<int64_t> present;  // filled by check: indices with a gradient
  std::vector<Tensor> grads;     // and those gradients
  int64_t live_count = 0;

  StepTable(const std::vector<Tensor>& ps, const std::vector<bool>& takes, const std::vector<bool>& may_adopt,
            const std::vector<bool>& torch_ops, const std::vector<std::optional<Tensor>>& buffers,
            const std::vector<bool>& live, const std::vector<bool>& adopted, const std::vector<Tensor>& frozen_params)
      : params(ps), rows(make_rows(ps, takes, may_adopt, torch_ops, buffers, live, adopted)), frozen(frozen_params) {
    for (size_t i = 0; i < params.size(); ++i) {
      index_of[params[i].unsafeGetTensorImpl()] = static_cast<int64_t>(i);
      live_count += rows[i].live;
    }
  }

  bool fits(size_t i, const Tensor& g) const {
    const Tensor& p = params[i];
    const Tensor& b = rows[i].buffer;
    if (!kernel_grad(g)) return false;
    if (!rows[i].built_for.stands(p)) return false;  // the parameter changed: Window.conform's work
    if (!b.defined()) {
      // take gives it one: the gradient itself or a contiguous fp32 buffer (Window.buffer's, for
      // a contiguous parameter of a kernel dtype); anything else is Window.buffer's to allocate.
      return !rows[i].live && kernel_dtype(p.scalar_type()) && p.is_contiguous() && g.is_contiguous() &&
             g.device() == p.device() && g.sizes() == p.sizes();
    }
    if (!accum_fused::fits(b, p)) return false;
    return g.device() == b.device() && g.sizes() == b.sizes() && same_memory_layout(g, b);
  }

  // Whether the gradient at position k of the last check can become its parameter's buffer, as
  // in_backward._can_adopt takes one: where its route says it may, any weight (take scales a
  // weighted one in place), no scale to undo,
  // plain-mode micro-batches (clear: .grad is freed, so only the buffer holds it), and nothing
  // else holding the tensor or its memory -- the parameter's .grad and this table's check are
  // its only references, it is no view and no other tensor shares its storage -- so that adding
  // into it later changes no tensor anyone else can see. Nor a gradient with a graph
  // (backward(create_graph=True)).
  bool can_adopt(size_t k, bool scaled, bool clear) const {
    const Tensor& g = grads[k];
    const Tensor& p = params[present[k]];
    return rows[present[k]].may_adopt && clear && !scaled && adoptable(g, p) &&
           !g.requires_grad() && only_held_here(g) && memory_held_only_by(g);
  }

  // Whether the parameter's .grad slot and this table's check hold the gradient's only
  // references: AccumulateGrad's own test for stealing a gradient. A Python wrapper made for it
  // once (`p.grad` read in Python) stays with the tensor and holds a reference too; it counts
  // only where nothing in Python holds the wrapper (torch >= 2.13 tells; before, such a
  // gradient is copied).
  static bool only_held_here(const Tensor& g) {
#if ACCUM_FUSED_PRESERVED_PYOBJECTS_TELL
    return torch::autograd::impl::is_tensor_stealable(g, /*num_expected_refs=*/2);
#else
    return g.use_count() <= 2;
#endif
  }

  // And no other tensor shares its memory: its storage's one owner is the tensor (a Python
  // storage object counts as above, where only the storage keeps it: a weakref to it, say).
  static bool memory_held_only_by(const Tensor& g) {
    const c10::Storage& storage = g.storage();
    const size_t owners = storage.use_count();
#if ACCUM_FUSED_PRESERVED_PYOBJECTS_TELL
    return owners == 1 || (owners == 2 && storage.unsafeGetStorageImpl()->pyobj_slot()->has_unique_reference());
#else
    return owners == 1;
#endif
  }

  int64_t check() {
    present.clear();
    grads.clear();
    for (const Tensor& p : frozen) {
      if (p.grad().defined()) return -1;
    }
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
  using Taken = std::tuple<std::vector<int64_t>, std::optional<Tensor>, std::vector<int64_t>, std::vector<Tensor>,
                           int64_t>;
  Taken take(double weight, const std::optional<Tensor>& grad_scale, bool clear,
             std::optional<double> norm_weight_sum) {
    TORCH_CHECK(present.size() == grads.size(), "StepTable.take: check() first");
    // Buffers for those without one: adopted gradients (no accumulate for them at weight 1;
    // scaled in place after the others otherwise), then fresh ones. The table keeps them only once the kernels ran: an
    // allocation or a kernel that raises (out of memory) leaves the table as it was, for
    // Python's path to take the micro-batch (out-of-memory recovery retries it in parts).
    std::vector<int64_t> given, fresh;
    std::vector<Tensor> given_buffers, fresh_buffers;
    std::vector<Tensor> buffer_at(present.size());  // position k's buffer in this take
    std::vector<char> skip(present.size(), 0);
    std::vector<Tensor> scaled_in_place;  // adopted with a weight other than 1: g <- g * w
    for (size_t k = 0; k < present.size(); ++k) {
      const int64_t i = present[k];
      if (rows[i].buffer.defined()) {
        buffer_at[k] = rows[i].buffer;
      } else if (!norm_weight_sum.has_value() && can_adopt(k, grad_scale.has_value(), clear)) {
        skip[k] = 1;
        given.push_back(i);
        given_buffers.push_back(grads[k]);
        if (weight != 1.0) scaled_in_place.push_back(grads[k]);
      } else {
        buffer_at[k] = at::empty(params[i].sizes(), params[i].options().dtype(at::kFloat));
        fresh.push_back(i);
        fresh_buffers.push_back(buffer_at[k]);
      }
    }
    const auto adopted_now = static_cast<int64_t>(given.size());
    given.insert(given.end(), fresh.begin(), fresh.end());
    given_buffers.insert(given_buffers.end(), fresh_buffers.begin(), fresh_buffers.end());
    struct Group {
      at::ScalarType dtype;
      bool overwrite;
      std::vector<int64_t> order;  // positions in present
      std::vector<Tensor> grads, buffers;
    };
    std::vector<Group> groups;
    for (size_t k = 0; k < present.size(); ++k) {
      if (skip[k]) continue;
      const int64_t i = present[k];
      const bool overwrite = !rows[i].live;
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
      group->buffers.push_back(buffer_at[k]);
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
      // Last, once nothing else can fail (a failed take leaves .grad for Python's path as it
      // was): an adopted gradient of a weighted micro-batch is scaled in place, the overwrite
      // pass with the gradient as its own buffer (acc <- g * w, elementwise; the same float
      // product as the copying overwrite, so bit for bit the spec's).
      if (!scaled_in_place.empty()) accumulate_op(scaled_in_place, scaled_in_place, weight, true, std::nullopt, std::nullopt);
    }
    for (size_t j = 0; j < given.size(); ++j) {
      rows[given[j]].buffer = given_buffers[j];
      rows[given[j]].adopted = static_cast<int64_t>(j) < adopted_now;
    }
    std::vector<int64_t> newly_live = release(clear);
    return {std::move(newly_live), std::move(norms), std::move(given), std::move(given_buffers), adopted_now};
  }

  // The window ended: no buffer is live, and those that were its adopted gradients go
  // (Window.discard drops them from window.buffers); the next window's first gradients get new ones.
  void new_window() {
    for (Row& row : rows) row.end_window();
    live_count = 0;
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
      if (!rows[i].live) {
        rows[i].live = true;
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
      Row& row = rows[it->second];
      TORCH_CHECK(row.buffer.defined(), "StepTable.mark_live: a parameter without a buffer");
      if (!row.live) {
        row.live = true;
        ++live_count;
      }
    }
  }

  // Whether every parameter is as when the table was built and every buffer still fits it
  // (Window.conform and conform_state would change nothing).
  bool conforms() const {
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& b = rows[i].buffer;
      if (!rows[i].built_for.stands(params[i]) || (b.defined() && !accum_fused::fits(b, params[i]))) {
        return false;
      }
    }
    return true;
  }

  // Every parameter's buffer, in order (window.StepTable.close's update reads them: a window's
  // adopted ones are new each window); none may be missing.
  std::vector<Tensor> all_buffers() const {
    std::vector<Tensor> buffers;
    buffers.reserve(rows.size());
    for (const Row& row : rows) {
      TORCH_CHECK(row.buffer.defined(), "StepTable.buffers: a parameter without a buffer");
      buffers.push_back(row.buffer);
    }
    return buffers;
  }

  int64_t missing_buffers() const {
    return std::count_if(rows.begin(), rows.end(), [](const Row& row) { return !row.buffer.defined(); });
  }
};

// Whether the lists in `lists` (the optimizer's param groups' "params") hold exactly `objects`,
// in order, by identity: base.py's _wiring_stands, the one check of "the same parameters",
// without a Python loop (~5 us at 5,000 parameters, ~80 us in Python).
bool same_objects(const py::list& lists, const py::tuple& objects) {
  const Py_ssize_t n = PyTuple_GET_SIZE(objects.ptr());
  Py_ssize_t i = 0;
  for (const py::handle& group : lists) {
    // (a list, or a tuple a user put there: as is, no copy; another iterable is read into one)
    const auto items = py::reinterpret_steal<py::object>(PySequence_Fast(group.ptr(), "a param group's params"));
    if (!items) throw py::error_already_set();
    const Py_ssize_t m = PySequence_Fast_GET_SIZE(items.ptr());
    PyObject** item = PySequence_Fast_ITEMS(items.ptr());
    for (Py_ssize_t j = 0; j < m; ++j, ++i) {
      if (i >= n || item[j] != PyTuple_GET_ITEM(objects.ptr(), i)) return false;
    }
  }
  return i == n;
}

}  // namespace

std::vector<Row> make_rows(const std::vector<Tensor>& params, const std::vector<bool>& takes,
                           const std::vector<bool>& may_adopt, const std::vector<bool>& torch_ops,
                           const std::vector<std::optional<Tensor>>& buffers, const std::vector<bool>& live,
                           const std::vector<bool>& adopted) {
  const size_t n = params.size();
  TORCH_CHECK(takes.size() == n && may_adopt.size() == n && torch_ops.size() == n && buffers.size() == n &&
                  live.size() == n && adopted.size() == n,
              "the table's rows: lists differ in length");
  std::vector<Row> rows(n);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(!live[i] || buffers[i].has_value(), "the table's rows: a live parameter without a buffer");
    rows[i].takes = takes[i];
    rows[i].may_adopt = may_adopt[i];
    rows[i].torch_ops = torch_ops[i];
    rows[i].built_for = BuiltFor(params[i]);
    rows[i].hold(buffers[i], live[i], adopted[i]);
  }
  return rows;
}

void register_step_table(py::module& m) {
  m.def("same_objects", &same_objects, py::arg("lists"), py::arg("objects"));
  py::class_<StepTable>(m, "StepTable")
      .def(py::init<const std::vector<Tensor>&, const std::vector<bool>&, const std::vector<bool>&,
                    const std::vector<bool>&, const std::vector<std::optional<Tensor>>&, const std::vector<bool>&,
                    const std::vector<bool>&, const std::vector<Tensor>&>(),
           py::arg("params"), py::arg("takes"), py::arg("may_adopt"), py::arg("torch_ops"), py::arg("buffers"),
           py::arg("live"), py::arg("adopted"), py::arg("frozen"))
      .def("check", &StepTable::check)
      .def("take", &StepTable::take, py::arg("weight"), py::arg("grad_scale"), py::arg("clear"),
           py::arg("norm_weight_sum") = py::none())
      .def("present_grads", &StepTable::present_grads)
      .def("release", &StepTable::release, py::arg("clear"))
      .def("drop_checked", &StepTable::drop_checked)
      .def("mark_live", &StepTable::mark_live, py::arg("params"))
      .def("new_window", &StepTable::new_window)
      .def("buffers", &StepTable::all_buffers)
      .def("missing_buffers", &StepTable::missing_buffers)
      .def("conforms", &StepTable::conforms)
      .def("rows", [](const StepTable& t) { return row_lists_of(t.rows); })
      .def_readonly("live_count", &StepTable::live_count);
}

}  // namespace accum_fused
