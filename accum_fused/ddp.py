"""DistributedDataParallel models: an accumulating optimizer takes DDP's gradient sync over.

Owns: finding the DDP module(s) that wrap an optimizer's parameters (at construction, or at
the module's first forward when the model is wrapped later, as HF Trainer and accelerate do),
and taking one over: without a ``process_group`` the DDP module's group becomes the window's
(a ``distributed.WindowSync``: one weighted fp32 all-reduce of the window per update, in
plain mode, in_backward mode A and mode B alike), and DDP's own all-reduce after every backward
is turned off for as long as the optimizer lives. With equal micro-batch weights the update is
what DDP plus the hand-written loop gives; with token weights it is the global token mean.

Keeps its state in a ``Takeover`` (the watch, the releases of the modules taken over), which
the optimizer holds and its window tells, as one of its listeners, when a window closes.

Must not: reduce anything itself or know what a window holds beyond moving it into the flat
buffers (``Window.join_ranks``); DDP's flag, hooks and the watch of module forwards are
``distributed.py``'s.
"""
from __future__ import annotations

import weakref

from . import distributed
from .layout import state_dtype


class Takeover:
    """An optimizer's side of DDP: the watch for a DDP module wrapping its parameters
    (``watch``, a ``distributed.watch_for_ddp`` token), whether nothing could watch
    (``unwatched``), and what gives taken modules their own sync back (``releases``,
    weakref.finalize objects on the optimizer). A listener of the optimizer's window (told by
    window/close.py); neither is copied with the optimizer, which then owns no DDP module."""

    def __init__(self, opt, win, params) -> None:
        """At construction: take over the DDP modules already wrapping ``params``; if none, and
        a DDP module can appear in this process (``distributed.ddp_possible``), watch module
        forwards for one (until the first window closes, see ``window_closed``)."""
        # (held weakly: the window holds this listener, and the watch ends when they are collected)
        self.optimizer, self.window = weakref.ref(opt), weakref.ref(win)
        self.releases: list = []
        modules = distributed.ddp_modules_holding(params)
        for module in modules:
            self._take(opt, module)
        watch = not modules and distributed.ddp_possible()
        self.watch = distributed.watch_for_ddp(self, Takeover._found) if watch else None
        # Built before torch.distributed was initialized, and not by a launcher (mp.spawn with a
        # tcp:// init_method): checked when a window closes (window_closed).
        self.unwatched = not modules and not watch
        win.listeners.append(self)

    def window_closed(self, opt, applied: bool = False) -> None:
        """Stop watching once the first window has closed (the global forward hook costs every
        module call), except for an optimizer that reduces nothing in a job of several processes:
        a DDP module wrapped later would leave its ranks training apart (mode A/B) or weighting
        DDP's per-micro-batch average by local weights (plain mode), so it keeps watching and
        takes the module over at its first forward, whenever that comes."""
        if self.unwatched and distributed.several_processes():
            self._late_process_group(opt)
        if self.watch is not None and not (opt.process_group is None and distributed.several_processes()):
            self._unwatch()

    def window_discarded(self, opt) -> None:
        pass

    def close(self) -> None:
        """``opt.close()``: DDP's own sync back, and no more watching."""
        for release in self.releases:
            release()
        self.releases.clear()
        self._unwatch()

    def _unwatch(self) -> None:
        if self.watch is not None:
            distributed.unwatch_ddp(self.watch)
            self.watch = None

    def _late_process_group(self, opt) -> None:
        """torch.distributed was initialized after the optimizer was built, outside a launcher,
        so nothing watched for a DDP module: a DDP module already wrapping our parameters ran
        this window with its own per-backward all-reduce, which accum_fused cannot take back.
        Said loudly; with none, watch from now on."""
        self.unwatched = False
        if opt.process_group is not None:
            return
        if distributed.ddp_modules_holding(opt.update_spec.params(opt)):
            raise RuntimeError(
                f"{type(opt).__name__} was built before torch.distributed.init_process_group() in a process no "
                "launcher started, so it could not take over the DistributedDataParallel module that wraps its "
                "parameters: this window was reduced by DDP after every backward instead of once. Build the "
                "optimizer after init_process_group() (or launch with torchrun), or pass process_group= explicitly"
            )
        self.watch = distributed.watch_for_ddp(self, Takeover._found)

    def _found(self, module) -> bool:
        """A DDP module's forward (the watch): take it over if it wraps our parameters."""
        opt = self.optimizer()
        if opt is None or not distributed.wraps_any(module, {id(p) for p in opt.update_spec.params(opt)}):
            return False
        self._take(opt, module)
        self.watch = None
        return True

    def _take(self, opt, module) -> None:
        """DDP broadcast the parameters when it was built; the window's micro-batches so far
        (none, unless the model was wrapped mid-window) are local, and are reduced with the
        window."""
        name = type(opt).__name__
        if opt.process_group is None:
            sync = distributed.WindowSync(module.process_group, name)
            sync.add_params(opt.update_spec.params(opt), state_dtype, broadcast=False)
            self.window().join_ranks(sync)
            opt.process_group = module.process_group
        else:
            distributed.check_same_ranks(opt.process_group, module, name)
        this = weakref.ref(opt)
        params = opt.update_spec.params
        release = distributed.own_ddp_sync(module, lambda: None if this() is None else params(this()))
        self.releases.append(weakref.finalize(opt, release))
