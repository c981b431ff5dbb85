"""in_backward's host work per window (issue 31) against the spec it stands in for.

The extension's hooks keep their lists from pass to pass (advanced as each parameter takes its
gradient, and a new window's start lists), and the window keeps the update's per-group lists
between closes (window.UpdatePlan: the close, the conform check and the folding pass without
a Python loop over the parameters). Every case trains the same model twice from the same start:
once as it runs, once with Python's hooks alone and the kept lists switched off (the spec), and
requires bit-equal parameters, optimizer state and counters, with events between windows that
must make the kept lists be read anew: a state_dict loaded, a state entry replaced by hand, a
new param group, a parameter without a gradient for a whole window, a new learning rate, a
weight other than 1 (no adoption), mode A's zero_grad() in the middle of a window, the model
moved to float64. Each case also counts that the kept paths ran, so none passes without them.
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import accum_fused
from accum_fused import in_backward, window as window_module

from _helpers import built_without_extension, rows_compared_with_window

pytestmark = pytest.mark.skipif(built_without_extension(), reason="the extension's hooks")

K = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))
        self.side = nn.Linear(5, 3)
        self.extra = nn.Linear(5, 3)

    def forward(self, x, use_side=True, use_extra=False):
        out = self.body(x)
        if use_side:
            out = out + self.side(x)
        if use_extra:
            out = out + self.extra(x)
        return out


class Uses:
    """Counts what the kept paths did in a run (``spec``: switched off, Python's hooks alone)."""

    def __init__(self, monkeypatch, spec: bool) -> None:
        self.updates = self.folds = self.rows_compared = 0
        if spec:
            monkeypatch.setattr(in_backward.FastPath, "for_optimizer", staticmethod(lambda opt: None))
            monkeypatch.setattr(window_module.UpdatePlan, "for_window", staticmethod(lambda *args, **kw: None))
            return
        update, arm_folds = window_module.UpdatePlan.update, in_backward.FastPath._arm_folds_from_kept

        def counted_update(plan, *args):
            self.updates += 1
            return update(plan, *args)

        def counted_folds(fast_path, *args):
            done = arm_folds(fast_path, *args)
            self.folds += done
            return done
        monkeypatch.setattr(window_module.UpdatePlan, "update", counted_update)
        monkeypatch.setattr(in_backward.FastPath, "_arm_folds_from_kept", counted_folds)


def _optimizer(name, params, mode, clip):
    kw = dict(in_backward=True, max_grad_norm=clip, accumulation_steps=K if mode == "B" else 1, backend="cpp")
    if name == "SGD":
        return accum_fused.SGD(params, lr=0.05, momentum=0.9, nesterov=True, **kw)
    if name == "SGD-plain":  # (no momentum: no state at all)
        return accum_fused.SGD(params, lr=0.05, weight_decay=0.01, **kw)
    if name == "Adam-amsgrad":
        return accum_fused.Adam(params, lr=0.01, amsgrad=True, **kw)
    return accum_fused.AdamW(params, lr=0.01, weight_decay=0.1, **kw)


def _event(event, window, model, opt):
    """Between windows ``window`` - 1 and ``window``: what the kept lists must notice."""
    if window != 3:
        return
    p = model.body[0].weight
    if event == "load_state_dict":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif event == "state_replaced":
        for key in ("exp_avg", "momentum_buffer"):
            if key in opt.state[p]:
                opt.state[p][key] = opt.state[p][key].clone()
    elif event == "param_group":
        opt.add_param_group({"params": list(model.extra.parameters())})
    elif event == "lr":
        for group in opt.param_groups:
            group["lr"] *= 0.5
    elif event == "float64":
        model.double()


def _train(monkeypatch, spec, *, name, mode, clip, event, windows=6):
    monkeypatch.undo()
    uses = Uses(monkeypatch, spec)
    model = Net()
    if event == "frozen":  # (in the optimizer, never a gradient: its windows' live sets leave it out)
        model.side.bias.requires_grad_(False)
    opt = _optimizer(name, [p for n, p in model.named_parameters() if not n.startswith("extra")], mode, clip)
    gen = torch.Generator().manual_seed(1)
    for w in range(windows):
        _event(event, w, model, opt)
        dtype = next(model.parameters()).dtype
        for i in range(K):
            x = torch.randn(2 + i, 5, generator=gen).to(dtype)
            use_side = not (event == "no_grad_window" and w == 2)
            use_extra = event == "param_group" and w >= 3
            loss = model(x, use_side=use_side, use_extra=use_extra).square().mean()
            weight = 2.0 if event == "weights" and (w + i) % 4 == 1 else 1.0
            if mode == "B":
                opt.backward(loss, weight=weight)
            else:
                (loss * weight).backward()
                if event == "zero_grad_mid_window" and w == 2 and i == 1:
                    opt.zero_grad()
            uses.rows_compared += rows_compared_with_window(opt)  # (the hooks' rows are the window's)
        if mode == "A":
            opt.step()
            opt.zero_grad()
            uses.rows_compared += rows_compared_with_window(opt)
    built = None if opt._hooks.fast_path is None else opt._hooks.fast_path.built
    state = [t for p in opt._all_params() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    out = [p.detach().clone() for p in opt._all_params()] + [t.clone() for t in state]
    opt.close()
    return out, (opt.update_count, opt.micro_step), uses, built


EVENTS = ["steady", "load_state_dict", "state_replaced", "param_group", "no_grad_window", "lr", "weights",
          "zero_grad_mid_window", "float64", "frozen"]


@pytest.mark.parametrize("event", EVENTS)
@pytest.mark.parametrize("mode,clip", [("A", None), ("A", 1.0), ("B", None), ("B", 0.05)],
                         ids=["modeA", "modeA-clip", "modeB", "modeB-clip"])
@pytest.mark.parametrize("name", ["AdamW", "SGD", "SGD-plain", "Adam-amsgrad"])
def test_kept_lists_match_python(monkeypatch, name, mode, clip, event):
    if event == "zero_grad_mid_window" and mode == "B":
        pytest.skip("mode A's zero_grad()")
    fast, fast_counts, uses, built = _train(monkeypatch, False, name=name, mode=mode, clip=clip, event=event)
    spec, spec_counts, _, _ = _train(monkeypatch, True, name=name, mode=mode, clip=clip, event=event)
    assert fast_counts == spec_counts
    assert len(fast) == len(spec)
    for a, b in zip(fast, spec):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # The kept paths ran: every window but the first few closes through UpdatePlan (or, in
    # mode B without clipping, folds from it), and the Python loop that builds the hooks' lists
    # ran only where something changed.
    # (After a window without a gradient for some parameters, Adam's step counts differ inside
    # a group for good: one call cannot update them all, and Python's grouping does.)
    minimum = {"no_grad_window": 1, "frozen": 4}.get(event, 2)
    assert (uses.folds if mode == "B" and clip is None else uses.updates) >= minimum
    if event == "steady":
        assert built == 1  # (the rows, built once: every pass after keeps them true)
    # The extension's rows were the window's at every point where they said they were current:
    # all of them but one just after an event that makes them stale (read anew at the next pass).
    points = 6 * K + (6 if mode == "A" else 0)
    assert uses.rows_compared >= points - 1, uses.rows_compared


@pytest.mark.parametrize("mode,clip", [("A", None), ("A", 1.0), ("B", None), ("B", 1.0)],
                         ids=["modeA", "modeA-clip", "modeB", "modeB-clip"])
def test_window_lets_go_of_adopted_gradients(mode, clip):
    """The hooks' lists hold the window's adopted gradients while it is open (the next pass adds
    into them); when it closes they are let go of with the window's buffers: resident memory
    between windows is the native loop's (before, they lived on in the lists until the next
    window's first backward pass, through its forward)."""
    model = Net()
    opt = _optimizer("AdamW", [p for n, p in model.named_parameters() if not n.startswith("extra")], mode, clip)
    x = torch.randn(4, 5)

    def micro_batch(last):
        loss = model(x).square().mean()
        if mode == "B":
            opt.backward(loss)
        else:
            loss.backward()
            if last:
                opt.step()
                opt.zero_grad()
    for i in range(K):  # (the first window creates the state)
        micro_batch(i == K - 1)
    for _ in range(K - 1):
        micro_batch(False)
    adopted = [weakref.ref(opt._window.buffers[p]) for p in opt._window.adopted]
    assert len(adopted) >= 6
    micro_batch(True)  # closes the window
    gc.collect()
    assert opt.update_count == 2 and all(ref() is None for ref in adopted)


@pytest.mark.parametrize("mode", ["A", "B"])
def test_gradients_python_takes_in_some_passes(monkeypatch, mode):
    """A parameter whose gradient the extension cannot take in one pass (here: inside a
    reentrant checkpoint, another autograd graph task, on each window's first micro-batch only)
    is Python's there; the extension's lists, which did not see it, are built anew for the next
    pass instead of being armed again (where it would overwrite, or adopt over, the sum)."""
    from torch.utils.checkpoint import checkpoint

    def train(spec):
        monkeypatch.undo()
        Uses(monkeypatch, spec)
        model = Net()
        opt = _optimizer("AdamW", [p for n, p in model.named_parameters() if not n.startswith("extra")], mode, 1.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for i in range(K):
                x = torch.randn(3, 5, generator=gen)
                if i == 0:
                    h = checkpoint(model.body[:2], x.requires_grad_(), use_reentrant=True)
                    out = model.body[2:](h) + model.side(x)
                else:
                    out = model(x)
                loss = out.square().mean()
                opt.backward(loss) if mode == "B" else loss.backward()
            if mode == "A":
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in opt._all_params()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["A", "B"])
def test_a_param_group_added_gets_rows_in_the_extension(monkeypatch, mode):
    """The extension's rows (FastPath, true to the window's layout epoch) are built anew when a
    parameter is hooked after them: the next passes take the new group too, and its gradients
    are the extension's, not the Python hook's, from then on."""
    if built_without_extension():
        pytest.skip("the extension's hooks")
    model = Net()
    opt = _optimizer("AdamW", [p for n, p in model.named_parameters() if not n.startswith("extra")], mode, None)
    python_took = []
    take_grad = in_backward.take_grad

    def counted(opt_, p, *args, **kwargs):
        python_took.append(p)
        return take_grad(opt_, p, *args, **kwargs)
    monkeypatch.setattr(in_backward, "take_grad", counted)
    gen = torch.Generator().manual_seed(1)

    def window(use_extra):
        passes = []
        for _ in range(K):
            python_took.clear()
            loss = model(torch.randn(3, 5, generator=gen), use_extra=use_extra).square().mean()
            opt.backward(loss) if mode == "B" else loss.backward()
            passes.append(list(python_took))
        if mode == "A":
            opt.step()
            opt.zero_grad()
        return passes

    for _ in range(2):
        window(False)
    opt.add_param_group({"params": list(model.extra.parameters())})
    for w in range(3):
        passes = window(True)
    # Each pass's first gradient is Python's (it arms the others); no other one is.
    assert all(len(took) == 1 for took in passes), passes


@pytest.mark.parametrize("mode", ["A", "B"])
@pytest.mark.parametrize("change", ["every_parameter", "all_but_the_first"])
def test_the_plan_of_an_sgd_without_state_follows_its_parameters(monkeypatch, mode, change):
    """SGD without momentum keeps no state whose move would witness a parameter cast between
    windows: the kept update lists (one call per group, on the backend of the group's dtype)
    must see the parameters themselves change, the group's first one or any other (mixed
    dtypes: one call cannot take them)."""
    def run(spec):
        monkeypatch.undo()
        uses = Uses(monkeypatch, spec)
        gen = torch.Generator().manual_seed(3)
        params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (3, 5, 4)]
        opt = accum_fused.SGD(params, lr=0.1, weight_decay=0.01, in_backward=True, backend="cpp",
                              accumulation_steps=K if mode == "B" else 1)
        for i in range(6 * K):
            if i == 3 * K:
                for p in params[change == "all_but_the_first":]:
                    p.data = p.data.double()
            x = torch.randn(5, generator=gen)
            loss = sum((p.float() * x[:len(p)]).sin().sum() for p in params)
            opt.backward(loss) if mode == "B" else loss.backward()
            if mode == "A" and i % K == K - 1:
                opt.step()
                opt.zero_grad()
        return uses, [p.detach().clone() for p in params]

    uses, fast = run(False)
    _, spec = run(True)
    assert (uses.folds if mode == "B" else uses.updates) >= 2
    for a, b in zip(fast, spec):
        assert a.dtype == b.dtype and torch.equal(a, b)
