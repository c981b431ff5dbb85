"""Checkpoints of an open window: state_dict, load_state_dict, pickling, DCP frames.

Owns: the ``"accumulation"`` entry of ``state_dict()`` (the open window's buffers by parameter
index, counters, GradScaler flag) and its check and restore on load; the FSDP2 layout, where the
window rides inside "state" and "param_groups" because torch.distributed.checkpoint keeps only
those; loading a plain torch.optim state_dict (migration: the window starts empty, state is
widened to fp32); what ``copy.deepcopy`` / ``pickle`` refuse; recognising
torch.distributed.checkpoint's own calls (``called_from_torch_checkpoint``); a window listener's
entry (``LISTENER_ENTRIES``) loaded before that listener exists, kept until it claims it
(``Unclaimed``).

Must not: change what an update computes; every layout here round-trips bit-exactly, and a
checkpoint is checked against the optimizer before anything is loaded.
"""
from __future__ import annotations

import sys
import warnings
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from .framework_guard import user_stacklevel
from .layout import ELEMENTWISE_STATE, is_dtensor, state_dtype


def called_from_torch_checkpoint(function: str) -> bool:
    """Whether torch.distributed.checkpoint.state_dict's ``function`` is on the call stack (a
    few frames up). Its get/set_optimizer_state_dict call step() with zero gradients and lr 0
    to create state (``_init_optim_state``), which must not count as a micro-batch, and keep
    only "state" and "param_groups" of state_dict() (``_get_optim_state_dict``). step() asks
    every micro-batch: without that module imported, no stack is walked."""
    if "torch.distributed.checkpoint.state_dict" not in sys.modules:
        return False
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == function and code.co_filename.replace("\\", "/").endswith("checkpoint/state_dict.py"):
            return True
        frame = frame.f_back
    return False


# Entries of state_dict() that a window listener saves and loads with its own optimizer hooks, and
# the call that registers that listener.
LISTENER_ENTRIES = {"window_batchnorm": "accum_fused.nn.window_batchnorm(model, opt)"}


class Unclaimed:
    """A listener's entry loaded into an optimizer that has no such listener yet (load_state_dict
    before window_batchnorm dropped it silently: running_var 1.1% off the uninterrupted run in
    issue 29, 5.1% in tests/test_nn_batchnorm.py's checkpoint run). It waits, as a listener of the
    loaded window, for the listener registered later to claim it; state_dict() saves it meanwhile;
    a window that ends unclaimed warns."""

    def __init__(self, key: str, entry: Any, listeners: list) -> None:
        self.key, self.entry, self.listeners = key, entry, listeners

    def window_closed(self, opt, applied: bool) -> None:
        self._dropped(opt)

    def window_discarded(self, opt) -> None:
        self._dropped(opt)

    def _dropped(self, opt) -> None:
        self.listeners.remove(self)
        warnings.warn(
            f"the checkpoint loaded into this {type(opt).__name__} holds {self.key!r} (its open window's statistics), "
            f"which nothing claimed before that window ended: they were dropped. Call {LISTENER_ENTRIES[self.key]} "
            "before the window ends, before or after opt.load_state_dict()", RuntimeWarning, stacklevel=user_stacklevel())


def _keep_unclaimed(win, entries: dict[str, Any]) -> None:
    """The loaded window replaces the open one, and so do the entries waiting for a listener; an
    entry whose listener is registered was loaded by that listener's hooks."""
    listeners = win.listeners
    listeners[:] = [listener for listener in listeners if not isinstance(listener, Unclaimed)]
    claimed = {getattr(listener, "state_key", None) for listener in listeners}
    listeners.extend(Unclaimed(key, entry, listeners) for key, entry in entries.items() if key not in claimed)


# ------------------------------------------------------------------------- copy / pickle
def refuse_copy(opt, win) -> None:
    """deepcopy / pickle keep the open window, but not hooks on a model or a live process group."""
    if getattr(opt, "in_backward", False):
        raise TypeError(
            f"{type(opt).__name__} with in_backward=True cannot be pickled or deep-copied (its hooks live on "
            "the model's parameters); save and load its state_dict() instead"
        )
    if win.sync is not None:
        raise TypeError(
            f"{type(opt).__name__} with a process_group cannot be pickled or deep-copied (a process "
            "group is a live connection); save and load its state_dict() instead"
        )


# ------------------------------------------------------------------------------ saving
def state_dict(opt, win, torch_state_dict: dict[str, Any], recovery=None) -> dict[str, Any]:
    """``torch_state_dict`` (torch's, or a wrapped optimizer's) plus the open window ``win``: as
    the ``"accumulation"`` entry, or, with FSDP2 parameters, inside "state" and "param_groups".
    ``recovery``: what out-of-memory recovery learnt (recovery.RecoveryState), if it ran."""
    unclaimed = {listener.key: listener.entry for listener in win.listeners if isinstance(listener, Unclaimed)}
    state_dict = {**torch_state_dict, **unclaimed, "accumulation": accumulation_entry(opt, win, recovery)}
    if win.shards is not None:
        return _window_inside_state(opt, win, state_dict)
    if win.micro_step > 0 and called_from_torch_checkpoint("_get_optim_state_dict"):
        raise RuntimeError(
            f"torch.distributed.checkpoint's get_optimizer_state_dict keeps only 'state' and 'param_groups' of "
            f"{type(opt).__name__}.state_dict(), so this open window ({win.micro_step} micro-batches) "
            "would be lost: save at a window boundary (after the update or flush()), or save opt.state_dict() "
            "itself (torch.save)"
        )
    return state_dict


def _process() -> tuple[int, int] | None:
    """(global rank, world size) in a job of several processes, else None."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def accumulation_entry(opt, win, recovery) -> dict[str, Any]:
    index = {p: i for i, p in enumerate(opt.update_spec.params(opt))}
    # An open window in a job of several processes holds this rank's micro-batches only: the
    # entry says whose ("save on rank 0, load everywhere" would resume every rank with rank 0's).
    # A boundary state_dict (nothing open) is the same on every rank and stays rank-free.
    open_window = win.micro_step > 0 or bool(win.live)
    owner = _process() if open_window else None
    return {
        **({} if owner is None else {"rank": owner[0], "world_size": owner[1]}),
        "accumulation_steps": opt.accumulation_steps,
        "micro_step": win.micro_step,
        "weight_sum": win.weight_sum,
        "weight_shift": win.weight_shift,
        "update_count": win.update_count,
        "updated": win.updated,
        "found_inf": win.found_inf,
        "last_grad_norm": win.last_grad_norm,
        "late_weights": list(win.late_weights),
        "grads_held": win.grads_held,
        "buffers": {index[p]: win.buffers[p] for p in win.live},
        # What out-of-memory recovery learnt (opt.run): a resumed run starts split as this one would go on.
        **({} if recovery is None else {"recovery": recovery.to_state()}),
    }


def _window_inside_state(opt, win, state_dict: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 users checkpoint with torch.distributed.checkpoint (get/set_optimizer_state_dict,
    dcp.save/load), which keeps only "state" and "param_groups". So the window rides there:
    each parameter's buffer as "accumulation_buffer" in its state (a DTensor, saved sharded;
    for every parameter, so that a fresh optimizer's state_dict is a load template for any
    checkpoint), whether it is live as "accumulation_live", and the counters as the first
    group's "accumulation". load_state_dict takes them back out."""
    if win.grads_held:
        raise RuntimeError(
            "FSDP2 holds gradients of this open window (set_requires_gradient_sync(False)), which no checkpoint "
            "saves: checkpoint at a window boundary (after the update or flush())"
        )
    entry = state_dict.pop("accumulation")
    # DCP saves a group's values once for every rank; the rank's own part rides in rank_weights
    # (a DTensor, one shard per rank) and in the sharded buffers.
    entry.pop("rank", None)
    entry.pop("world_size", None)
    state = dict(state_dict["state"])
    for index, p in enumerate(opt.update_spec.params(opt)):
        if p.requires_grad:
            state[index] = {**state.get(index, {}), "accumulation_buffer": win.buffer(p),
                            "accumulation_live": torch.tensor(float(index in entry["buffers"]))}
    # The counters every rank shares as plain numbers: DCP saves a group's values as bytes
    # (once, not per rank), and a load template (a fresh optimizer's, whose norm is None)
    # must have the same kind of entry as the checkpoint. The rank's own weights as a
    # DTensor with one shard per rank, [weight sum, then (given, weight) per micro-batch].
    local = [entry.pop("weight_sum")]
    for weight in entry.pop("late_weights") + [None] * (opt.accumulation_steps - len(win.late_weights)):
        local += [0.0, 0.0] if weight is None else [1.0, weight]
    del entry["grads_held"]  # False: refused above
    from torch.distributed.tensor import DTensor, Shard
    mesh = win.shards.mesh
    entry["rank_weights"] = DTensor.from_local(  # (one shard per rank also on HSDP's 2-D mesh)
        torch.tensor(local, dtype=torch.float64, device=mesh.device_type), mesh, [Shard(0)] * mesh.ndim,
        run_check=False)
    groups = [dict(group) for group in state_dict["param_groups"]]
    groups[0]["accumulation"] = {key: value.item() if isinstance(value, Tensor) and not is_dtensor(value) else value
                                 for key, value in entry.items() if key != "buffers"}
    return {**state_dict, "state": state, "param_groups": groups}


# ----------------------------------------------------------------------------- loading
def _window_out_of_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The inverse of _window_inside_state: (state_dict as torch.optim has it, the
    "accumulation" entry), or the state_dict unchanged and None when it carries no window."""
    groups = state_dict.get("param_groups") or [{}]
    if "accumulation" not in groups[0]:
        return state_dict, None
    groups = [dict(group) for group in groups]
    entry = {**groups[0].pop("accumulation"), "buffers": {}}
    for key in ("found_inf", "last_grad_norm"):
        if entry.get(key) is not None:
            entry[key] = torch.tensor(entry[key], dtype=torch.float32)
    local = entry.pop("rank_weights").to_local().tolist()
    entry["weight_sum"] = local[0]
    entry["late_weights"] = [weight if given else None for given, weight in zip(local[1::2], local[2::2])]
    del entry["late_weights"][entry["micro_step"]:]
    state = {}
    for index, saved in state_dict["state"].items():
        saved = dict(saved)
        buffer, live = saved.pop("accumulation_buffer", None), saved.pop("accumulation_live", None)
        if live is not None and float(live) > 0:
            entry["buffers"][index] = buffer
        if saved:
            state[index] = saved
    return {**state_dict, "state": state, "param_groups": groups}, entry


def split_accumulation_entry(opt, state_dict: dict[str, Any]):
    """(state_dict without "accumulation", that entry or None, {saved param id: param}),
    the entry checked against ``opt`` before anything is loaded."""
    state_dict = dict(state_dict)
    accumulation = state_dict.pop("accumulation", None)
    if accumulation is None:
        state_dict, accumulation = _window_out_of_state(state_dict)
    saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    params = opt.update_spec.params(opt)
    by_id = dict(zip(saved_ids, params)) if len(saved_ids) == len(params) else {}
    if accumulation is not None:
        _check_accumulation_entry(opt, accumulation, by_id)
        # (restore_window keeps them: an entry of a listener's belongs to the saved open window)
        entries = {key: state_dict[key] for key in LISTENER_ENTRIES if state_dict.get(key)}
        accumulation = {**accumulation, "listener_entries": entries}
    return state_dict, accumulation, by_id


def _check_accumulation_entry(opt, accumulation: dict[str, Any], by_id: dict) -> None:
    if "rank" in accumulation:
        saved, here = (accumulation["rank"], accumulation["world_size"]), _process()
        if saved != here:
            where = "a single process" if here is None else f"rank {here[0]} of {here[1]}"
            raise ValueError(
                f"this state_dict holds the open window of rank {saved[0]} of {saved[1]} (its micro-batches "
                f"{accumulation['micro_step']} so far), but it is loaded on {where}: each rank's open window holds "
                "its own micro-batches. Save and load every rank's own state_dict mid-window (e.g. "
                "torch.save(opt.state_dict(), f'opt_rank{rank}.pt')), or save at a window boundary (after the update "
                "or opt.flush()), which loads on any rank and any world size"
            )
    micro_step = accumulation["micro_step"]
    # in_backward mode A (accumulation_steps=1): the caller's loop owns the window, which holds
    # as many backward passes as that loop ran before step(); any count fits.
    mode_a = getattr(opt, "in_backward", False) and opt.accumulation_steps == 1
    if not (0 <= micro_step and (mode_a or micro_step < opt.accumulation_steps)):
        raise ValueError(
            f"checkpoint holds an open window of {micro_step} micro-batches, which does not fit "
            f"accumulation_steps={opt.accumulation_steps} of this optimizer"
        )
    for param_id, saved in accumulation["buffers"].items():
        p = by_id.get(param_id)
        if p is None or saved.shape != p.shape:
            raise ValueError(f"checkpoint's accumulation buffer {param_id} does not match this optimizer's parameters")


def load_state_dict(opt, win, state_dict: dict[str, Any], torch_load) -> None:
    """SGD/Adam/AdamW: load our own state_dict (resuming mid-window exactly) or a torch.optim
    one of the same class, through ``torch_load`` (torch.optim.Optimizer.load_state_dict).

    torch's load_state_dict runs as it is, so load_state_dict pre and post hooks see and
    change exactly what they do on torch.optim; torch casts floating state to the parameter
    dtype, so for reduced-precision parameters the wide state is put back from the loaded
    values (by a post hook that runs before the user's)."""
    torch_state_dict, accumulation, by_id = split_accumulation_entry(opt, state_dict)
    if "accumulation" in state_dict:
        torch_state_dict = state_dict  # torch ignores the entry; hooks see it as saved
    loaded = {}

    def capture(optimizer, final_state_dict):  # registered last: sees the user's pre hooks' result
        loaded["state_dict"] = final_state_dict

    # State that stays in state_dtype whatever the parameter dtype (torch would cast it).
    wide_keys = [key for key in opt.update_spec.kept_state_entries.values() if key in ELEMENTWISE_STATE]

    def keep_state_wide(optimizer):  # registered first: runs before the user's post hooks
        final = loaded["state_dict"]
        saved_ids = chain.from_iterable(g["params"] for g in final["param_groups"])
        for param_id, p in zip(saved_ids, opt.update_spec.params(opt)):
            entry, p_state = final["state"].get(param_id), opt.state.get(p)
            if not isinstance(entry, dict) or not isinstance(p_state, dict):
                continue
            for key in wide_keys:
                if isinstance(entry.get(key), Tensor) and key in p_state:
                    p_state[key] = entry[key].to(device=p.device, dtype=state_dtype(p))
            step = p_state.get("step")
            if isinstance(step, Tensor) and step.device.type != "cpu":
                p_state["step"] = step.cpu()  # read every update: keep it off the device

    pre = opt.register_load_state_dict_pre_hook(capture)
    post = opt.register_load_state_dict_post_hook(keep_state_wide, prepend=True)
    try:
        torch_load(torch_state_dict)  # validates groups first
    finally:
        pre.remove()
        post.remove()
    restore_window(opt, win, accumulation, by_id)


def restore_window(opt, win, accumulation: dict[str, Any] | None, by_id: dict) -> None:
    """Reopen the saved window (or start an empty one when the checkpoint has none)."""
    win.discard()
    win.caches.update_plan = None  # (its kept lists hold the state the load replaced)
    _keep_unclaimed(win, {} if accumulation is None else accumulation.get("listener_entries", {}))
    if accumulation is None:
        return
    win.micro_step = accumulation["micro_step"]
    win.weight_sum = accumulation["weight_sum"]
    win.weight_shift = accumulation.get("weight_shift", 0)  # saved before weight bands: 0
    win.update_count = accumulation["update_count"]
    win.updated = accumulation["updated"]
    win.late_weights[:] = accumulation.get("late_weights", [])
    if "recovery" in accumulation:
        opt.recovery.load_state(accumulation["recovery"], win.update_count)
    win.grads_held = accumulation.get("grads_held", False)
    # Saved on the device the checkpoint was taken on: bring them to this optimizer's.
    params = opt.update_spec.params(opt)
    device = params[0].device if params else torch.device("cpu")
    norm, found = accumulation["last_grad_norm"], accumulation["found_inf"]
    win.last_grad_norm = None if norm is None else norm.to(device)
    win.found_inf = None if found is None else found.to(device, copy=True)
    win.changed()  # (the step table does not follow what is loaded here)
    # Fresh buffers only this window holds: let go of when it ends, as adopted gradients are (a
    # kept buffer would stay between windows for good, and the next windows copy into it).
    own = win.sync is None and win.shards is None
    for param_id, saved in accumulation["buffers"].items():
        p = by_id[param_id]
        fresh = p not in win.buffers
        win.buffer(p).copy_(saved)
        win.live.add(p)
        if own and fresh:
            win.adopted.add(p)
