// In-backward hooks without Python (accum_fused/in_backward.py's FastPath).
//
// A backward pass of an in_backward optimizer hands one gradient per parameter to the window.
// In Python each post-accumulate-grad hook cost 5-10 us (issue 22's profile: ~4 ms of a 120 ms
// window of 60 tensors, k=8); here the common cases are one C++ call per parameter. in_backward.py
// stays the spec. Each slot is the table's row of one hooked parameter (Slot): its route, decided
// once per layout epoch in Python (may the hooks take it; may a first gradient become its buffer;
// kernel or torch's ops), and the window's state of it (buffer, live, adopted), which every writer
// keeps true. At a pass's first gradient (which it takes itself) in_backward.py begins the pass
// with its scalars; each slot's gradient then does what its row says (mode_of):
//   ADD        add into its live buffer (with weight; with the window-norm output on a clipped
//              window's last micro-batch)
//   ADOPT      become its buffer (no ranks, fp32: the zero-copy first micro-batch; scaled in place
//              by a weight other than 1) if the gradient allows it, else OVERWRITE a stale buffer
//   OVERWRITE  overwrite its stale buffer (its first gradient of the window)
// A pass that folds (the last micro-batch, no clipping, no ranks) is armed with explicit modes
// instead: FOLD updates the parameter with its window, with the update op and the scalars
// in_backward.py computed for its group.
// Anything else -- a parameter without a row that allows it, a second gradient in one pass,
// another autograd graph task (a reentrant checkpoint's, a foreign backward), a gradient whose
// dtype, device, shape or layout does not fit -- goes to the Python hook given as `fallback`,
// which writes what it did back into the row (python_took). in_backward.py reads what was done
// here (`drain`) before it reads or changes the pass's records.
//
//   HookState  one per optimizer; slot i = the i-th hooked parameter
//     set_rows(...)  every row: route and window state (in_backward.FastPath.build_rows); rows()
//                reads them back (tests)
//     epoch      the window's layout epoch the rows are true to (Python's to read and set)
//     begin_pass(weight, norm_weight_sum, weight_sum, seen)  modes from the rows; `seen` slots
//                are Python's in this pass; the current graph task becomes the armed one
//     arm(...)   a pass that folds: explicit modes (ROW: the row's), see HookState::arm
//     new_window()  the window ended: no row is live, adopted buffers are let go of, and the
//                accumulator nodes kept for TakeBeforeAccumulate
//     python_took(slot, buffer, live, adopted)  in_backward.py took the slot's gradient of this
//                pass itself: the row becomes the window's, and the slot takes nothing more in
//                this pass (another gradient of it goes to Python, which knows it is the second)
//     write_linear(slot, param, grad_out, input) -> bool  a fused Linear's gradient of `param`
//                (accum_fused/nn/linear.py), computed straight into the slot's buffer by what
//                its mode: the GEMM grad_out^T @ input (input None: the bias, grad_out
//                summed over the rows) adds into the live buffer (ADD, with the norm on a clipped
//                window's last micro-batch), or overwrites the stale buffer or a fresh one at
//                the window's first micro-batch (ADOPT / OVERWRITE; recorded as adopted: the
//                window lets go of it as it ends, as Window.write_one's); false, with nothing
//                changed, where Python's take_written is to do it
//     drain() -> (slots of plain additions; slots of additions that measured a norm, and the
//                norms; slots that adopted their gradient, and those gradients; slots that
//                folded; slots that overwrote their stale buffer, and the norms measured there)
//                since the last drain: lists, so that in_backward.py records a pass in set and
//                dict updates, with no Python work per parameter
//     disarm()   the pass ended (or failed)
//     taken      gradients taken here, in all (tests count them); taken_before_accumulate: of
//                those, before AccumulateGrad
//     resized_slot() -> the first slot whose parameter changed shape since its node was kept
//                in this window (`p.data = ...`), or -1: opt.backward refuses it before its pass
//     take_dropped() -> slots whose hook left its parameter's slot other than by remove_hook
//                (something set param._post_accumulate_grad_hooks: torch's setter replaces the
//                slot), since the last call; in_backward.py hooks them again
//   install_hook(param, state, slot, fallback, python_hooks_dict)  the hook, in the parameter's
//              post-accumulate-grad slot (ExtensionHook); remove_hook(param) takes it out, and
//              the one below. At the slot's first gradient of a window, ExtensionHook puts a
//              pre-hook on the parameter's AccumulateGrad node (TakeBeforeAccumulate) that takes
//              what the slot would, before autograd makes the gradient .grad, where nothing else
//              can tell (most gradients of a pass); ExtensionHook takes the rest
//   FastHook(state, slot, fallback)  the same hook registered through Python, where the slot
//              already held Python hooks
#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"
#include "torch_compat.h"

namespace accum_fused {
namespace {

namespace py = pybind11;
using at::Tensor;

constexpr const char* kCompiledAutogradMessage =
    "an accum_fused optimizer with in_backward=True takes gradients in hooks that compiled autograd cannot "
    "trace: run this backward with torch._dynamo.config.compiled_autograd = False, or use in_backward=False";

// kRow: in an explicit arm, what the slot's row says (mode_of).
enum Mode : int64_t { kNone = 0, kAdd = 1, kOverwrite = 2, kAdopt = 3, kFold = 4, kRow = 5 };

// A parameter's gradient accumulator node (a std::shared_ptr before torch 2.13, a
// c10::intrusive_ptr since).
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const Tensor&>()));

// The update of one parameter group at one step count: the arguments cpp_backend.py computes
// for bindings.cpp's sgd_update / adam_update, read once per pass.
struct FoldSpec {
  bool adam = true;
  double decay_factor = 1, weight_decay = 0, lerp_weight = 0, beta2 = 0, one_minus_beta2 = 0, bc2_sqrt = 1,
         eps = 0, neg_step_size = 0;
  bool decoupled = false, amsgrad = false, maximize = false;
  double neg_lr = 0, momentum = 0, one_minus_dampening = 1;
  bool nesterov = false;

  static FoldSpec from(const py::dict& d) {
    FoldSpec s;
    s.adam = d["kind"].cast<std::string>() == "adam";
    s.weight_decay = d["weight_decay"].cast<double>();
    s.maximize = d["maximize"].cast<bool>();
    if (s.adam) {
      s.decay_factor = d["decay_factor"].cast<double>();
      s.lerp_weight = d["lerp_weight"].cast<double>();
      s.beta2 = d["beta2"].cast<double>();
      s.one_minus_beta2 = d["one_minus_beta2"].cast<double>();
      s.bc2_sqrt = d["bc2_sqrt"].cast<double>();
      s.eps = d["eps"].cast<double>();
      s.neg_step_size = d["neg_step_size"].cast<double>();
      s.decoupled = d["decoupled"].cast<bool>();
      s.amsgrad = d["amsgrad"].cast<bool>();
    } else {
      s.neg_lr = d["neg_lr"].cast<double>();
      s.momentum = d["momentum"].cast<double>();
      s.one_minus_dampening = d["one_minus_dampening"].cast<double>();
      s.nesterov = d["nesterov"].cast<bool>();
    }
    return s;
  }
};

// A slot is the table's row of one hooked parameter (ops.h's Row: its route, from
// in_backward.FastPath.build_rows, and the window's state of it, kept true by every writer: this
// file's takes; in_backward.py writes its own through, python_took; new_window ends a window;
// a parameter changed since the row was built makes the rows stale: route_stands), with what
// the armed pass gives it. A pass that folds nothing derives each slot's mode from its row
// (mode_of); one that folds arms explicit modes (arm).
struct Slot : Row {
  // An explicit arm's (a pass that folds): its mode and buffer, and for FOLD the parameter's
  // group update, whether the buffer is stale, its state and step count.
  int64_t mode = kNone;
  Tensor pass_buffer;
  int64_t spec = -1;
  bool overwrite = false;
  Tensor state0, state1, state2, step;  // exp_avg / momentum_buffer, exp_avg_sq, max_exp_avg_sq
  int64_t seen_task = -1;  // the armed graph task this slot was last taken in
  // The parameter's AccumulateGrad node with this slot's TakeBeforeAccumulate, kept from the
  // slot's first gradient in a window (ExtensionHook) to the window's end (new_window), and the
  // parameter's shape then, which autograd checks every gradient reaching that node against.
  NodePtr accumulator;
  std::vector<int64_t> kept_shape;

  void disarm() {
    mode = kNone;
    pass_buffer = Tensor();
    spec = -1;
    overwrite = false;
    state0 = state1 = state2 = step = Tensor();
  }
};

struct Taken {
  std::vector<int64_t> added;  // ADD without a norm: the common record, only its slot
  std::vector<int64_t> normed;  // ADD with a norm (a clipped window's last micro-batch), and the norms
  std::vector<Tensor> norms;
  std::vector<int64_t> adopted;  // ADOPT done (the window's first micro-batch), and the gradients
  std::vector<Tensor> grads;
  std::vector<int64_t> folded;  // FOLD done
  std::vector<int64_t> written;  // OVERWRITE done, with a norm or none
  std::vector<std::optional<Tensor>> written_norms;
};

struct HookState : std::enable_shared_from_this<HookState> {
  // Taken by every method: the extension's hooks run without the GIL (ExtensionHook), on the
  // autograd thread of their parameter's device, while Python may arm or drain from another.
  // Recursive: arm calls begin_pass, which calls disarm.
  using Lock = std::lock_guard<std::recursive_mutex>;
  mutable std::recursive_mutex mu;
  int64_t armed_task = -1;  // the autograd graph task whose pass may be taken here; -1: none
  double weight = 1.0, weight_sum = 1.0;
  std::optional<double> norm_weight_sum;
  std::vector<Slot> slots;
  std::vector<int64_t> armed;
  std::vector<FoldSpec> specs;
  Taken taken_now;  // since the last drain
  int64_t taken = 0;
  int64_t taken_before_accumulate = 0;  // of those, by TakeBeforeAccumulate
  bool explicit_modes = false;  // the armed pass folds: each slot does its armed mode, not its row's
  int64_t epoch = -1;  // the window's layout epoch the rows are true to (in_backward.FastPath's; -1: none)
  std::vector<int64_t> dropped;  // take_dropped

  void note_dropped(int64_t slot) {
    const Lock lock(mu);
    dropped.push_back(slot);
  }

  std::vector<int64_t> take_dropped() {
    const Lock lock(mu);
    return std::exchange(dropped, {});
  }

  void add_slot() {
    const Lock lock(mu);
    slots.emplace_back();
  }

  // The table's rows, all of them (aligned with the slots): the route and the window's state of
  // each hooked parameter (in_backward.FastPath.build_rows, once per layout epoch).
  void set_rows(const std::vector<Tensor>& params, const std::vector<bool>& takes,
                const std::vector<bool>& may_adopt, const std::vector<bool>& torch_ops,
                const std::vector<std::optional<Tensor>>& buffers, const std::vector<bool>& live,
                const std::vector<bool>& adopted) {
    std::vector<Row> rows = make_rows(params, takes, may_adopt, torch_ops, buffers, live, adopted);
    const Lock lock(mu);
    TORCH_CHECK(rows.size() == slots.size(), "set_rows: one row per slot");
    for (size_t i = 0; i < rows.size(); ++i) static_cast<Row&>(slots[i]) = std::move(rows[i]);
  }

  // What a slot does with its gradient in the armed pass: the explicit arm's mode, or the one
  // its row gives (as in_backward._add would: add into a live buffer; a window's first gradient
  // becomes the buffer where it may, else overwrites a stale one; without a buffer, Python's).
  bool by_row(const Slot& s) const { return !explicit_modes || s.mode == kRow; }

  int64_t mode_of(const Slot& s) const {
    if (!by_row(s)) return s.mode;
    if (!s.takes) return kNone;
    if (s.live) return kAdd;
    if (s.may_adopt) return kAdopt;
    return s.buffer.defined() ? kOverwrite : kNone;
  }

  const Tensor& buffer_of(const Slot& s) const { return by_row(s) ? s.buffer : s.pass_buffer; }

  // Whether `param` is still what its row's route was decided for; if not, nothing is taken by
  // the row and the rows are stale (epoch -1: in_backward.FastPath builds them anew at the next
  // pass), as a layout change the window saw would have made them.
  bool route_stands(Slot& s, const Tensor& param) {
    if (s.built_for.stands(param)) return true;
    epoch = -1;
    return false;
  }

  // A pass that folds nothing: each slot's mode comes from its row; `seen` (the gradient Python
  // takes first, parameters whose gradient of this micro-batch is in already) are Python's.
  void begin_pass(double w, std::optional<double> nws, double wsum, const std::vector<int64_t>& seen) {
    const Lock lock(mu);
    disarm();
    armed_task = torch::autograd::get_current_graph_task_id();
    if (armed_task < 0) return;  // not inside a backward pass: nothing to take
    weight = w;
    norm_weight_sum = nws;
    weight_sum = wsum;
    specs.clear();
    for (int64_t i : seen) {
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(slots.size()), "begin_pass: no slot ", i);
      slots[i].seen_task = armed_task;
    }
  }

  // A pass that folds: slots[i] does modes[i] with buffers[i] (kRow: what its row says); for
  // FOLD, also spec_of[i] into specs and the parameter's state tensors and step count (lists
  // aligned with slots); every other slot is Python's.
  void arm(double w, std::optional<double> nws, double wsum, const std::vector<int64_t>& slot_ids,
           const std::vector<int64_t>& modes, const std::vector<std::optional<Tensor>>& buffers,
           const std::vector<py::dict>& fold_specs, const std::vector<int64_t>& spec_of,
           const std::vector<bool>& overwrite, const std::vector<std::optional<Tensor>>& state0,
           const std::vector<std::optional<Tensor>>& state1, const std::vector<std::optional<Tensor>>& state2,
           const std::vector<std::optional<Tensor>>& steps) {
    const Lock lock(mu);
    const size_t n = slot_ids.size();
    TORCH_CHECK(modes.size() == n && buffers.size() == n && spec_of.size() == n && overwrite.size() == n &&
                    state0.size() == n && state1.size() == n && state2.size() == n && steps.size() == n,
                "arm: lists differ in length");
    begin_pass(w, nws, wsum, {});
    if (armed_task < 0) return;
    explicit_modes = true;
    for (const py::dict& d : fold_specs) specs.push_back(FoldSpec::from(d));
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(slot_ids[i] >= 0 && slot_ids[i] < static_cast<int64_t>(slots.size()), "arm: no slot ", slot_ids[i]);
      Slot& s = slots[slot_ids[i]];
      s.mode = modes[i];
      s.pass_buffer = buffers[i].value_or(Tensor());
      if (s.mode == kFold) {
        TORCH_CHECK(spec_of[i] >= 0 && spec_of[i] < static_cast<int64_t>(specs.size()), "arm: no spec");
        s.spec = spec_of[i];
        s.overwrite = overwrite[i];
        s.state0 = state0[i].value_or(Tensor());
        s.state1 = state1[i].value_or(Tensor());
        s.state2 = state2[i].value_or(Tensor());
        s.step = steps[i].value_or(Tensor());
      }
    }
    armed = slot_ids;
  }

  // The window ended: no buffer is live, the adopted ones are let go of (the window drops them),
  // and so are the accumulator nodes kept for TakeBeforeAccumulate.
  void new_window() {
    std::vector<NodePtr> kept;  // (declared before the lock: the nodes go after it is let go)
    const Lock lock(mu);
    for (Slot& s : slots) {
      s.end_window();
      if (s.accumulator) kept.push_back(std::move(s.accumulator));
    }
  }

  void disarm() {
    const Lock lock(mu);
    for (int64_t i : armed) slots[i].disarm();
    armed.clear();
    armed_task = -1;
    explicit_modes = false;
  }

  bool write_linear(int64_t slot_id, const Tensor& param, const Tensor& grad_out, const std::optional<Tensor>& input) {
    const Lock lock(mu);
    if (armed_task < 0 || slot_id < 0 || slot_id >= static_cast<int64_t>(slots.size())) return false;
    Slot& s = slots[slot_id];
    const int64_t mode = mode_of(s);
    if ((mode != kAdd && mode != kOverwrite && mode != kAdopt) || s.seen_task == armed_task) return false;
    if (torch::autograd::get_current_graph_task_id() != armed_task || !route_stands(s, param)) return false;
    const bool starts = mode != kAdd;  // (the window's first gradient of it: no sum yet)
    if (starts && norm_weight_sum.has_value()) return false;  // (no norm record for a start: Python's)
    // fp32 throughout (Python's path widens other operands and runs autocast's dtype)
    const auto fp32_here = [&](const Tensor& t) {
      return t.layout() == at::kStrided && t.scalar_type() == at::kFloat && t.device() == param.device() &&
             plain_memory(t);
    };
    if (!fp32_here(param) || !param.is_contiguous() || !fp32_here(grad_out) || grad_out.dim() != 2 ||
        grad_out.size(1) != param.size(0)) {
      return false;
    }
    if (input.has_value()) {
      const Tensor& x = *input;
      if (!fp32_here(x) || x.dim() != 2 || param.dim() != 2 || x.size(0) != grad_out.size(0) || x.size(1) != param.size(1)) {
        return false;
      }
    } else if (param.dim() != 1) {
      return false;
    }
    Tensor buf = buffer_of(s);
    if (buf.defined()) {
      if (!fits(buf, param) || !buf.is_contiguous()) return false;
    } else if (mode == kAdopt) {
      buf = at::empty(param.sizes(), param.options().dtype(at::kFloat));
    } else {
      return false;
    }
    std::optional<Tensor> norm;
    {
      // (the same ops as linear.py's _gemm_into and _BiasGradient.write: the same sums)
      at::NoGradGuard no_grad;
      if (input.has_value()) {
        buf.addmm_(grad_out.t(), *input, /*beta=*/starts ? 0.0 : 1.0, /*alpha=*/weight);
      } else {
        const Tensor total = grad_out.sum(0, /*keepdim=*/false, at::kFloat);
        if (starts) {
          at::mul_out(buf, total, at::Scalar(weight));
        } else {
          buf.add_(total, weight);
        }
      }
      if (norm_weight_sum.has_value()) norm = norm_of(s, buf, *norm_weight_sum);
    }
    // (a start is recorded as an adoption of the buffer it wrote: the window lets go of it)
    record_take(slot_id, starts ? kAdopt : kAdd, starts ? std::optional<Tensor>(buf) : std::nullopt, std::move(norm));
    return true;
  }

  // in_backward.py took the slot's gradient of this pass itself (the pass's first, one handed
  // back, a fused Linear's GEMM output): its row becomes the window's (`buffer`, live or not,
  // adopted or not), and the slot takes nothing more in this pass (a second gradient is
  // Python's, which knows it is the pass's second).
  void python_took(int64_t slot_id, const std::optional<Tensor>& buffer, bool live, bool adopted) {
    const Lock lock(mu);
    TORCH_CHECK(slot_id >= 0 && slot_id < static_cast<int64_t>(slots.size()), "python_took: no slot ", slot_id);
    Slot& s = slots[slot_id];
    if (armed_task >= 0) {
      s.seen_task = armed_task;
      s.mode = kNone;
    }
    s.hold(buffer, live, adopted);
  }

  py::tuple drain() {
    const Lock lock(mu);
    Taken out = std::move(taken_now);
    taken_now = Taken{};
    return py::make_tuple(std::move(out.added), std::move(out.normed), std::move(out.norms), std::move(out.adopted),
                          std::move(out.grads), std::move(out.folded), std::move(out.written),
                          std::move(out.written_norms));
  }

  // Does what `param`'s slot was armed for with the gradient autograd left in its .grad (the
  // post-accumulate-grad slot's hook), when it fits, and sets .grad to None; false leaves
  // everything as it was, for the Python hook. `before_accumulate`: the slot's hook is
  // ExtensionHook, and its first gradient of a window puts TakeBeforeAccumulate on the node.
  bool take(int64_t slot_id, const Tensor& param, bool before_accumulate = false) {
    const Lock lock(mu);
    if (before_accumulate && slot_id < static_cast<int64_t>(slots.size()) && !slots[slot_id].accumulator) {
      keep_accumulator(slot_id, param);
    }
    Tensor& grad_slot = param.mutable_grad();
    if (!grad_slot.defined()) return false;
    const Tensor grad = grad_slot;  // keeps the gradient alive through the kernel
    if (!take_grad(slot_id, param, grad, /*before_accumulate=*/false)) return false;
    grad_slot.reset();  // .grad = None, as the Python hook leaves it
    return true;
  }

  // The same with the gradient autograd is about to hand AccumulateGrad (TakeBeforeAccumulate),
  // where .grad is None: taken, it never becomes .grad. Not the window's first gradient of a
  // parameter that may adopt it (adopting needs autograd's steal: its own fresh tensor).
  bool take_before_accumulate(int64_t slot_id, const Tensor& param, const Tensor& grad) {
    const Lock lock(mu);
    if (param.grad().defined() || !param.requires_grad()) return false;  // (AccumulateGrad's own cases)
    if (!take_grad(slot_id, param, grad, /*before_accumulate=*/true)) return false;
    ++taken_before_accumulate;
    return true;
  }

  // Whether TakeBeforeAccumulate took this pass's gradient for the slot: autograd calls the
  // post-accumulate-grad slot all the same, with .grad None (ExtensionHook asks only then).
  bool took_before_accumulate(int64_t slot_id) const {
    const Lock lock(mu);
    return slot_id < static_cast<int64_t>(slots.size()) && slots[slot_id].seen_task >= 0 &&
           slots[slot_id].seen_task == torch::autograd::get_current_graph_task_id();
  }

  // Under the lock: this slot's TakeBeforeAccumulate, the last pre-hook of `param`'s current
  // AccumulateGrad node (put there unless it is already), and the node kept until the window
  // ends. Defined after TakeBeforeAccumulate.
  void keep_accumulator(int64_t slot_id, const Tensor& param);

  // How many slots keep their parameter's node now (tests: none between windows).
  int64_t kept_nodes() {
    const Lock lock(mu);
    return std::count_if(slots.begin(), slots.end(), [](const Slot& s) { return static_cast<bool>(s.accumulator); });
  }

  // The first slot whose parameter no longer has its kept node's shape (`p.data = ...` of
  // another shape in the middle of a window), or -1: the next forward would still route its
  // gradient to that node, and autograd refuse it with its own error, before any hook could give
  // the spec's (in_backward.check_resized, before opt.backward's pass begins). One comparison per
  // slot, no Python.
  int64_t resized_slot() {
    const Lock lock(mu);
    for (size_t i = 0; i < slots.size(); ++i) {
      const Slot& s = slots[i];
      if (!s.accumulator) continue;
      const auto& param = static_cast<const torch::autograd::AccumulateGrad*>(s.accumulator.get())->variable;
      if (param.sizes() != c10::IntArrayRef(s.kept_shape)) return static_cast<int64_t>(i);
    }
    return -1;
  }

  // The slot's kept node, no longer kept (its hook left the parameter), for the caller to let go
  // of outside the lock.
  NodePtr let_go(int64_t slot_id) {
    const Lock lock(mu);
    if (slot_id < 0 || slot_id >= static_cast<int64_t>(slots.size())) return NodePtr();
    return std::move(slots[slot_id].accumulator);
  }

  bool take_grad(int64_t slot_id, const Tensor& param, const Tensor& grad, bool before_accumulate) {
    if (armed_task < 0 || slot_id >= static_cast<int64_t>(slots.size())) return false;
    Slot& s = slots[slot_id];
    const int64_t mode = mode_of(s);
    if (mode == kNone || s.seen_task == armed_task || (before_accumulate && mode == kAdopt)) return false;
    if (torch::autograd::get_current_graph_task_id() != armed_task || !route_stands(s, param)) return false;
    if (!kernel_grad(grad) || grad.device() != param.device()) return false;
    int64_t done = mode;
    std::optional<Tensor> norm, adopted;
    if (mode == kAdopt && adoptable(grad, param)) {
      adopted = grad;  // (as in_backward._can_adopt: the gradient is autograd's fresh, unshared tensor)
      // A weighted micro-batch's: scaled in place, the copying overwrite's product.
      if (weight != 1.0) accumulate_into(s, grad, grad, /*overwrite=*/true, std::nullopt);
    } else {
      if (mode == kAdopt) done = kOverwrite;
      const Tensor& buf = buffer_of(s);
      if (!buf.defined() || !fits(buf, param) || buf.sizes() != grad.sizes() || !same_memory_layout(grad, buf) ||
          (done == kFold && !fold_fits(s, param))) {
        return false;
      }
      if (done == kFold) {
        fold(s, param, grad);
      } else {
        norm = accumulate_into(s, grad, buf, /*overwrite=*/done == kOverwrite, norm_weight_sum);
      }
    }
    record_take(slot_id, done, std::move(adopted), std::move(norm));
    return true;
  }

  // One gradient into its buffer with the armed weight (the buffer may be the gradient itself:
  // elementwise, in place), on the gradient's device; ||buf / norm_weight_sum|| as a 0-dim
  // tensor when asked for. The slot's route says how (in_backward.by_torch_ops, decided once):
  // the extension's kernel (CPU: one call, no allocation), or torch's own ops, what autograd's
  // AccumulateGrad does with a gradient on a GPU (`grad +=`): launched on the current stream,
  // the gradient's, with no table built and uploaded and nothing that waits for the device,
  // whether or not the extension was built with CUDA. They are the reference backend's ops
  // (reference.accumulate, window_norms), so what they write is the spec's bit for bit; the
  // window's close is the backend's one multi-tensor update per group (in_backward.FastPath.arm
  // folds nothing there).
  std::optional<Tensor> accumulate_into(const Slot& s, const Tensor& grad, const Tensor& buf, bool overwrite,
                                        std::optional<double> norm_weight_sum) const {
    if (!s.torch_ops) {
      const auto n = accumulate_one_cpu(grad, buf, weight, overwrite, norm_weight_sum);
      return n.has_value() ? std::optional<Tensor>(at::scalar_tensor(*n, at::kFloat)) : std::nullopt;
    }
    if (weight == 1.0) {  // (g * 1 is g: the contribution is the gradient itself, widened)
      if (overwrite) {
        if (!buf.is_same(grad)) buf.copy_(grad);
      } else {
        buf.add_(grad);
      }
    } else if (overwrite && grad.scalar_type() == buf.scalar_type()) {
      Tensor out = buf;  // (in place when buf is grad: an adopted gradient, scaled)
      at::mul_out(out, grad, weight);
    } else {
      // The spec's contribution, g * w in the buffer's dtype: a bf16 gradient is widened first
      // (g * w in bf16 would round the product to bf16).
      const Tensor contribution = grad.scalar_type() == buf.scalar_type() ? grad * weight : grad.to(buf.scalar_type()).mul_(weight);
      if (overwrite) {
        buf.copy_(contribution);
      } else {
        buf.add_(contribution);
      }
    }
    if (!norm_weight_sum.has_value()) return std::nullopt;
    return norm_of(s, buf, *norm_weight_sum);
  }

  // ||buf / norm_weight_sum|| as a 0-dim tensor on the buffer's device, by the slot's route as
  // accumulate_into adds.
  Tensor norm_of(const Slot& s, const Tensor& buf, double norm_weight_sum) const {
    if (!s.torch_ops) return window_norms_op({buf}, norm_weight_sum).select(0, 0);
    return at::linalg_vector_norm(buf / norm_weight_sum);
  }

  // What a slot did with its gradient of the armed pass (`done`; `adopted`: the tensor that
  // became its buffer), in its row (the buffer is live; an adopted one is its buffer now) and
  // for drain. Under the lock.
  void record_take(int64_t slot_id, int64_t done, std::optional<Tensor> adopted, std::optional<Tensor> norm) {
    Slot& s = slots[slot_id];
    s.seen_task = armed_task;
    if (done != kFold) {
      if (adopted.has_value()) {
        s.buffer = *adopted;
        s.adopted = true;
      } else if (!by_row(s)) {
        s.buffer = s.pass_buffer;
      }
      s.live = true;
    }
    ++taken;
    if (done == kAdd && !norm.has_value()) {
      taken_now.added.push_back(slot_id);
    } else if (done == kAdd) {
      taken_now.normed.push_back(slot_id);
      taken_now.norms.push_back(std::move(*norm));
    } else if (done == kFold) {
      taken_now.folded.push_back(slot_id);
    } else if (adopted.has_value()) {
      taken_now.adopted.push_back(slot_id);
      taken_now.grads.push_back(std::move(*adopted));
    } else {
      taken_now.written.push_back(slot_id);
      taken_now.written_norms.push_back(std::move(norm));
    }
  }

  // The update op's own checks, so that it cannot raise inside backward: the parameter and its
  // state in the buffer's layout (cpp_backend.py re-lays out the rare others; Python does here).
  static bool fold_fits(const Slot& s, const Tensor& param) {
    if (!kernel_dtype(param.scalar_type()) || !same_memory_layout(param, s.pass_buffer)) return false;
    for (const Tensor* t : {&s.state0, &s.state1, &s.state2}) {
      if (t->defined() && (!fits(*t, param) || !same_memory_layout(*t, s.pass_buffer))) return false;
    }
    return true;
  }

  // step += 1, as Adam._update counts an update: a CPU count in place (a dispatched add_ cost
  // ~2 us per parameter), with its version counter bumped as add_ bumps it.
  static void count_step(const Tensor& step) {
    if (step.device().is_cpu() && step.numel() == 1 && !step.is_inference()) {
      if (step.scalar_type() == at::kFloat) {
        *step.mutable_data_ptr<float>() += 1.0f;
        torch::autograd::impl::bump_version(step);
        return;
      }
      if (step.scalar_type() == at::kDouble) {
        *step.mutable_data_ptr<double>() += 1.0;
        torch::autograd::impl::bump_version(step);
        return;
      }
    }
    step.add_(1);
  }

  // The optimizer's update of one parameter with the window's last gradient folded in, as
  // in_backward.take_grad's Python path runs it (the step count first, as Adam._update).
  void fold(const Slot& s, const Tensor& param, const Tensor& grad) {
    const FoldSpec& f = specs[s.spec];
    const std::vector<Tensor> grads{grad};
    if (f.adam) {
      count_step(s.step);
      std::vector<Tensor> max_sqs;
      if (f.amsgrad) max_sqs.push_back(s.state2);
      adam_update_op({param}, {s.pass_buffer}, {s.state0}, {s.state1}, max_sqs, weight_sum, std::nullopt, f.decay_factor,
                     f.weight_decay, f.lerp_weight, f.beta2, f.one_minus_beta2, f.bc2_sqrt, f.eps, f.neg_step_size,
                     f.decoupled, f.amsgrad, f.maximize, grads, weight, s.overwrite, std::nullopt);
    } else {
      std::vector<Tensor> momentum;
      std::vector<bool> first;
      if (f.momentum != 0.0) {
        momentum.push_back(s.state0);
        first.push_back(false);
      }
      sgd_update_op({param}, {s.pass_buffer}, momentum, first, weight_sum, std::nullopt, f.neg_lr, f.momentum,
                    f.one_minus_dampening, f.weight_decay, f.nesterov, f.maximize, grads, weight, s.overwrite,
                    std::nullopt);
    }
  }
};

// The hook registered through Python (torch's dict of Python post-accumulate-grad hooks), where
// ExtensionHook cannot stand (see install_hook): one Python call per gradient into C++.
struct FastHook {
  std::shared_ptr<HookState> state;
  int64_t slot;
  py::object fallback;

  void operator()(py::handle param) {
    const Tensor tensor = py::cast<Tensor>(param);
    bool took;
    {
      py::gil_scoped_release no_gil;  // (the kernel runs without it, as the Python path's _C calls do)
      took = state->take(slot, tensor);
    }
    if (!took) fallback(param);  // (the very Parameter object)
  }
};

// The hook in the parameter's own post-accumulate-grad slot, in C++: autograd calls it without
// the GIL and it takes what its slot was armed for without running Python (~2-3 us a gradient
// less than FastHook: the GIL, the argument tuple, the dict of hooks, pybind's dispatch). The
// rest goes to `fallback` (in_backward.py's Python hook, the spec), then to `python_hooks`:
// torch's dict of Python hooks on the parameter, which install_hook set before taking the
// slot, so that hooks registered later with register_post_accumulate_grad_hook run after
// this one, as they would after a hook registered in that dict first.
struct ExtensionHook : torch::autograd::PostAccumulateGradHook {
  std::shared_ptr<HookState> state;
  int64_t slot;
  PyObject* fallback;  // owned
  PyObject* python_hooks_dict;  // owned; the dict python_hooks calls
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> python_hooks;
  bool removed = false;  // by remove_hook; destroyed otherwise, it was dropped (take_dropped)

  ExtensionHook(std::shared_ptr<HookState> s, int64_t i, py::object fb, py::object dict,
                std::unique_ptr<torch::autograd::PostAccumulateGradHook> hooks)
      : state(std::move(s)), slot(i), fallback(fb.release().ptr()), python_hooks_dict(dict.release().ptr()),
        python_hooks(std::move(hooks)) {}

  ~ExtensionHook() override {
    NodePtr kept;  // (dropped: the node and its hook need not wait for the window's end)
    if (!removed) {
      state->note_dropped(slot);
      kept = state->let_go(slot);
    }
    if (Py_IsInitialized()) {  // (as torch's own Python hooks let go: the last reference may be C++'s)
      py::gil_scoped_acquire gil;
      Py_DECREF(fallback);
      Py_DECREF(python_hooks_dict);
      python_hooks.reset();
    } else {
      (void)python_hooks.release();  // (its destructor would take the GIL of a finalized interpreter)
    }
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) ACCUM_FUSED_COMPILED_ARGS_CONST override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kCompiledAutogradMessage);
  }

  void operator()(const torch::autograd::Variable& param) override {
    // (.grad set: autograd accumulated, the common case of the slot path, without a second lock)
    if (!param.grad().defined() && state->took_before_accumulate(slot)) return;
    if (!state->take(slot, param, /*before_accumulate=*/true)) {
      py::gil_scoped_acquire gil;
      THPObjectPtr arg(THPVariable_Wrap(param));  // (the very Parameter object)
      if (!arg) throw python_error();
      THPObjectPtr result(PyObject_CallOneArg(fallback, arg.get()));
      if (!result) throw python_error();
    }
    // Reading the dict's size without the GIL: hooks are registered between passes, and a
    // stale size can only make this pass call an empty dict (or miss a hook registered by
    // another thread during it). It saves taking the GIL for the common empty dict.
    if (PyDict_GET_SIZE(python_hooks_dict) > 0) (*python_hooks)(param);
  }
};

// The hook before AccumulateGrad: a pre-hook of the parameter's gradient accumulator node (its
// life: HookState::keep_accumulator). It takes the gradient autograd is about to hand the node,
// which then gets none: autograd does not steal it into .grad (a detach, a new TensorImpl per
// gradient) for ExtensionHook to take and set to None again (autograd still calls the slot, and
// ExtensionHook returns at once). That was ~1 us a gradient on this VM, what made a pass dearer
// than autograd's own in-place `.grad +=` (benchmarks/bench_hook_cost.py;
// benchmarks/results/host_overhead_20261127b). It takes only where nothing else could tell the
// difference: this slot's ExtensionHook still in the parameter's slot with no Python hooks behind
// it, no post-hooks on the node (DDP's reducer, a user's), and this hook the node's last pre-hook
// (so it runs after every other hook that may change the gradient). Everything else, and whatever
// take_before_accumulate declines, goes on to AccumulateGrad and ExtensionHook as before.
struct TakeBeforeAccumulate : torch::autograd::FunctionPreHook {
  std::shared_ptr<HookState> state;
  int64_t slot;
  torch::autograd::AccumulateGrad* node;  // the node that owns this hook

  TakeBeforeAccumulate(std::shared_ptr<HookState> s, int64_t i, torch::autograd::AccumulateGrad* n)
      : state(std::move(s)), slot(i), node(n) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    const auto& param = node->variable;
    if (grads.size() != 1 || !grads[0].defined() || !param.defined() || !node->post_hooks().empty() ||
        node->pre_hooks().back().get() != this) {
      return grads;
    }
    const auto* hook = dynamic_cast<ExtensionHook*>(torch::autograd::impl::post_acc_grad_hooks(param).get());
    if (hook == nullptr || hook->state != state || hook->slot != slot || PyDict_GET_SIZE(hook->python_hooks_dict) > 0 ||
        !state->take_before_accumulate(slot, param, grads[0])) {
      return grads;
    }
    return {Tensor()};  // (AccumulateGrad returns at once on an undefined gradient)
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) ACCUM_FUSED_COMPILED_ARGS_CONST override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kCompiledAutogradMessage);
  }
};

bool is_take_before(const std::unique_ptr<torch::autograd::FunctionPreHook>& hook) {
  return dynamic_cast<TakeBeforeAccumulate*>(hook.get()) != nullptr;
}

void erase_take_before(torch::autograd::Node& node) {
  auto& hooks = node.pre_hooks();
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(), is_take_before), hooks.end());
}

// How many TakeBeforeAccumulate hooks `param`'s accumulator node holds, 0 without a node (tests:
// one from the parameter's first gradient of a window, none after remove_hook).
int64_t count_take_before(const Tensor& param) {
  auto node = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!node) return 0;
  const auto& hooks = node->pre_hooks();
  return std::count_if(hooks.begin(), hooks.end(), is_take_before);
}

// The node's life. The parameter holds its accumulator node only weakly: autograd makes a new
// one, without this hook, once no graph holds the old. So it is kept, but only within a window:
// torch gives a parameter a new node when `.data =` changes its dtype or device, not its shape,
// and a node kept across windows met the next forward with the old shape, where autograd refused
// the gradient of a parameter resized between windows with its own error, before any hook could
// give the spec's (issue 44 row 5; none is kept before the first gradient either, so a parameter
// resized after construction trains as with the spec). new_window lets go of the nodes, and each
// slot's first gradient of the next window comes here through AccumulateGrad and ExtensionHook:
// one slower gradient per parameter per window, not per pass, and mostly one TakeBeforeAccumulate
// declines anyway (a window's first, adopted). Measured on this VM (bench_hook_cost.py, 5,000
// tensors of 64, --window 4): ~0.5 us more per parameter in a window's first pass (the node made
// again, this hook put on it; for bf16 autograd's steal too) and about as much at its end (the
// node freed), what autograd's own loop pays on every pass. A graph of the user's that holds the
// old node still gives it to the next forward, as without accum_fused (torch's refusal is then
// the spec's too).
// The hook stays on a node let go of: a window can end inside a backward (mode B's last pass; a
// failed pass settled at the next one's first gradient), where another device's autograd thread
// may be running a node's pre-hooks; and on a node that outlives the window it takes only as it
// does on a kept one. Adding the hook here is safe: ExtensionHook runs inside the node's apply,
// after the engine ran its pre-hooks (engine.cpp's call_function), on its device's one thread.
void HookState::keep_accumulator(int64_t slot_id, const Tensor& param) {
  auto node = torch::autograd::impl::grad_accumulator(param);
  auto* accumulator = dynamic_cast<torch::autograd::AccumulateGrad*>(node.get());
  if (accumulator == nullptr) return;  // (the parameter does not require grad)
  const auto& hooks = accumulator->pre_hooks();
  const auto* last = hooks.empty() ? nullptr : dynamic_cast<const TakeBeforeAccumulate*>(hooks.back().get());
  if (last == nullptr || last->state.get() != this || last->slot != slot_id) {
    // (ours, behind a pre-hook added since: put last again; or one of a hook dropped and installed again)
    erase_take_before(*accumulator);
    accumulator->add_pre_hook(std::make_unique<TakeBeforeAccumulate>(shared_from_this(), slot_id, accumulator));
  }
  slots[slot_id].accumulator = std::move(node);
  slots[slot_id].kept_shape = param.sizes().vec();
}

// Put an ExtensionHook in `param`'s post-accumulate-grad slot, which holds torch's hooks for
// `python_hooks_dict` (param._post_accumulate_grad_hooks, empty: torch's setter put them there);
// they are kept and called after. False, changing nothing, when the slot holds something else.
bool install_hook(const Tensor& param, std::shared_ptr<HookState> state, int64_t slot, py::object fallback,
                  py::dict python_hooks_dict) {
  auto& current = torch::autograd::impl::post_acc_grad_hooks(param);
  if (current == nullptr || dynamic_cast<ExtensionHook*>(current.get()) != nullptr) return false;
  auto python_hooks = std::move(current);
  torch::autograd::impl::set_post_acc_grad_hooks(
      param, std::make_unique<ExtensionHook>(std::move(state), slot, std::move(fallback),
                                             std::move(python_hooks_dict), std::move(python_hooks)));
  return true;
}

// Undo install_hook: torch's Python hooks back in the slot. False when the slot no longer holds
// an ExtensionHook (something set param._post_accumulate_grad_hooks since).
bool remove_hook(const Tensor& param) {
  // (One in_backward optimizer at a time takes a parameter's gradients: in_backward.claim.)
  if (auto node = torch::autograd::impl::try_get_grad_accumulator(param)) erase_take_before(*node);
  auto& current = torch::autograd::impl::post_acc_grad_hooks(param);
  auto* hook = dynamic_cast<ExtensionHook*>(current.get());
  if (hook == nullptr) return false;
  // (the kept node is another than the parameter's now only after a `.data =` of a new dtype or device)
  if (auto kept = hook->state->let_go(hook->slot)) erase_take_before(*kept);
  hook->removed = true;
  auto python_hooks = std::move(hook->python_hooks);
  torch::autograd::impl::set_post_acc_grad_hooks(param, std::move(python_hooks));
  return true;
}

}  // namespace

void register_hooks(py::module& m) {
  py::class_<HookState, std::shared_ptr<HookState>>(m, "HookState")
      .def(py::init<>())
      .def("add_slot", &HookState::add_slot)
      .def("set_rows", &HookState::set_rows, py::arg("params"), py::arg("takes"), py::arg("may_adopt"),
           py::arg("torch_ops"), py::arg("buffers"), py::arg("live"), py::arg("adopted"))
      .def("begin_pass", &HookState::begin_pass, py::arg("weight"), py::arg("norm_weight_sum"), py::arg("weight_sum"),
           py::arg("seen"))
      .def("arm", &HookState::arm, py::arg("weight"), py::arg("norm_weight_sum"), py::arg("weight_sum"),
           py::arg("slots"), py::arg("modes"), py::arg("buffers"), py::arg("fold_specs"), py::arg("spec_of"),
           py::arg("overwrite"), py::arg("state0"), py::arg("state1"), py::arg("state2"), py::arg("steps"))
      .def("disarm", &HookState::disarm)
      .def("new_window", &HookState::new_window)
      .def("write_linear", &HookState::write_linear, py::arg("slot"), py::arg("param"), py::arg("grad_out"),
           py::arg("input"))
      .def("python_took", &HookState::python_took, py::arg("slot"), py::arg("buffer"), py::arg("live"),
           py::arg("adopted"))
      .def("drain", &HookState::drain)
      .def("take_dropped", &HookState::take_dropped)
      .def("kept_nodes", &HookState::kept_nodes)
      .def("resized_slot", &HookState::resized_slot)
      .def("rows",
           [](const HookState& s) {
             const HookState::Lock lock(s.mu);
             return row_lists_of(s.slots);
           })
      .def_property_readonly("armed",
                             [](const HookState& s) {
                               const HookState::Lock lock(s.mu);
                               return s.armed_task >= 0;
                             })
      .def_readwrite("epoch", &HookState::epoch)
      .def_readonly("taken", &HookState::taken)
      .def_readonly("taken_before_accumulate", &HookState::taken_before_accumulate);
  py::class_<FastHook>(m, "FastHook")
      .def(py::init([](std::shared_ptr<HookState> state, int64_t slot, py::object fallback) {
             return FastHook{std::move(state), slot, std::move(fallback)};
           }),
           py::arg("state"), py::arg("slot"), py::arg("fallback"))
      .def("__call__", &FastHook::operator(), py::arg("param"));
  m.def("install_hook", &install_hook, py::arg("param"), py::arg("state"), py::arg("slot"), py::arg("fallback"),
        py::arg("python_hooks_dict"));
  m.def("remove_hook", &remove_hook, py::arg("param"));
  m.def("count_take_before", &count_take_before, py::arg("param"));
}

}  // namespace accum_fused
