"""Lightning recipe: accum_fused owns the window, Lightning steps every micro-batch.

    opt = accum_fused.AdamW(self.parameters(), lr=..., accumulation_steps=4, max_grad_norm=1.0)
    sched = PerUpdateScheduler(get_linear_schedule_with_warmup(opt, warmup, total_updates))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    # training_step: self.optimizers().set_micro_batch_weight(n_tokens); return token_mean_loss
    trainer = L.Trainer(callbacks=[AccumFusedCallback()])   # accumulate_grad_batches=1 (default)

Lightning (``accumulate_grad_batches=1``) runs ``optimizer.step(closure)`` after every batch; the
optimizer accumulates and updates on every k-th call. What Lightning would get wrong around
that is fixed or refused here:

- ``PerUpdateScheduler`` advances the wrapped scheduler once per update the optimizer applied
  (Lightning's ``interval="step"`` calls it after every micro-batch), and saves that count.
- ``AccumFusedCallback`` flushes the partial last window at the end of each epoch (Lightning's
  own accumulation also updates on an epoch's last batch) and of training, steps the
  scheduler for it, logs ``update_count`` / ``last_grad_norm``, and at ``on_fit_start``
  refuses or repairs the settings that would train silently wrong (see ``_check``).

Lightning's ``LightningOptimizer`` (``self.optimizers()``) falls back to the optimizer's
attributes, and the window is one object (``opt._window``) the optimizer's properties read, so
``self.optimizers().flush()`` / ``.update_count`` / ``.set_micro_batch_weight`` act on the real
optimizer's window.

Under ``strategy="ddp"`` (``"ddp_spawn"``, ``"ddp_notebook"``) Lightning wraps the model in
DistributedDataParallel; the optimizer takes DDP's gradient sync over (accum_fused/ddp.py) and
all-reduces its window once per update. Other multi-process strategies are refused at fit start.

Lightning's own counters count micro-batches here: ``trainer.global_step``, ``max_steps``,
``every_n_train_steps``, ``log_every_n_steps``. Updates are ``opt.update_count``.

The other route, ``in_backward=True, accumulation_steps=1`` with
``Trainer(accumulate_grad_batches=k)``, keeps Lightning's loop and gives exactly Lightning's
own accumulation (the callback moves ``gradient_clip_val`` into ``max_grad_norm``, since .grad
is gone when Lightning clips), with fp32 sums and no ``.grad`` between micro-batches; but
Lightning divides each loss by k: micro-batches count equally and a partial last window is
divided by k, so it is not the token-mean big batch when micro-batches differ in size.
"""
from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import accum_fused

__all__ = ["AccumFusedCallback", "PerUpdateScheduler"]

_ACCUM_FUSED = (accum_fused.SGD, accum_fused.Adam, accum_fused.AdamW, accum_fused.GradientAccumulator)


def _unwrap(optimizer):
    """The optimizer inside Lightning's LightningOptimizer (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def _is_accum_fused(optimizer) -> bool:
    return isinstance(_unwrap(optimizer), _ACCUM_FUSED)


def _accumulates(optimizer) -> bool:
    """Whether micro-batch gradients never reach .grad whole at Lightning's clipping point:
    the optimizer owns a window (k > 1), or in_backward takes .grad inside backward."""
    return optimizer.accumulation_steps > 1 or getattr(optimizer, "in_backward", False)


class PerUpdateScheduler(torch.optim.lr_scheduler.LRScheduler):
    """Steps ``scheduler`` once per update its accum_fused optimizer applied.

    Attach it with ``"interval": "step"`` (frequency 1): Lightning calls ``step()`` after every
    micro-batch, and each call advances the wrapped scheduler by the updates applied since the
    last call (0 or 1; the callback's flush adds one). The count it has passed on is in its
    state_dict, next to the optimizer's ``update_count`` in the optimizer's, so a resumed run
    picks up where it stopped. It subclasses LRScheduler only so that Lightning accepts it; its
    own ``__init__`` does not touch the learning rate.
    """

    def __init__(self, scheduler, optimizer=None):
        if isinstance(scheduler, PerUpdateScheduler):
            raise TypeError("the scheduler is already a PerUpdateScheduler")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("ReduceLROnPlateau steps on a metric, not per update: attach it unwrapped with "
                            "'interval': 'epoch' and a 'monitor'")
        optimizer = scheduler.optimizer if optimizer is None else _unwrap(optimizer)
        if not _is_accum_fused(optimizer):
            raise TypeError(
                f"PerUpdateScheduler needs an accum_fused optimizer, got {type(optimizer).__name__}; for a "
                "GradientAccumulator whose inner optimizer the scheduler was built on, pass "
                "PerUpdateScheduler(scheduler, optimizer=accumulator)")
        # No super().__init__: it would step the wrapped scheduler's optimizer once more.
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.updates_counted = optimizer.update_count
        self.attached = False  # set by AccumFusedCallback once it has checked the trainer

    def step(self, metrics=None) -> None:
        if metrics is not None:
            raise TypeError("PerUpdateScheduler.step() takes no metric")
        if not self.attached:
            raise RuntimeError(
                "PerUpdateScheduler is stepped without AccumFusedCallback: add it, "
                "L.Trainer(callbacks=[accum_fused.integrations.lightning.AccumFusedCallback()]); without it the "
                "partial last window is dropped and the settings are not checked")
        count = self.optimizer.update_count
        if count < self.updates_counted:
            raise RuntimeError(
                f"the optimizer has applied {count} updates but this scheduler already counted "
                f"{self.updates_counted}: their state_dicts come from different runs")
        for _ in range(count - self.updates_counted):
            self.scheduler.step()
        self.updates_counted = count

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    @property
    def last_epoch(self) -> int:
        return self.scheduler.last_epoch

    @property
    def base_lrs(self):
        return self.scheduler.base_lrs

    def state_dict(self):
        return {"scheduler": self.scheduler.state_dict(), "updates_counted": self.updates_counted}

    def load_state_dict(self, state_dict) -> None:
        if set(state_dict) != {"scheduler", "updates_counted"}:
            raise ValueError("not a PerUpdateScheduler state_dict (keys 'scheduler', 'updates_counted'); a bare "
                             "scheduler's state_dict loads with per_update.scheduler.load_state_dict(...)")
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.updates_counted = int(state_dict["updates_counted"])


class AccumFusedCallback(pl.Callback):
    """Checks the Trainer against the accum_fused optimizer at fit start, flushes partial
    windows, steps PerUpdateSchedulers for them, and logs ``accum_fused/update_count`` and
    ``accum_fused/last_grad_norm`` (``log=False`` to turn off).

    ``require_weight=True``: in automatic optimization with ``accumulation_steps > 1``, every
    micro-batch must call ``self.optimizers().set_micro_batch_weight(w)`` in ``training_step``
    (its token count, or ``len(batch)``); a forgotten weight would silently give every
    micro-batch the same say. Pass ``False`` to weight micro-batches equally on purpose.
    """

    def __init__(self, *, require_weight: bool = True, log: bool = True):
        self.require_weight = require_weight
        self.log = log
        self._moved_clip = None  # the gradient_clip_val taken from the Trainer for this fit

    @staticmethod
    def _optimizers(trainer):
        return [opt for opt in trainer.optimizers if _is_accum_fused(opt)]

    def on_fit_start(self, trainer, pl_module) -> None:
        optimizers = self._optimizers(trainer)
        if not optimizers:
            raise TypeError("AccumFusedCallback found no accum_fused optimizer: return accum_fused.SGD/Adam/AdamW (or "
                            "a GradientAccumulator) from configure_optimizers")
        for opt in optimizers:
            self._check(trainer, pl_module, opt)

    def _check(self, trainer, pl_module, opt) -> None:
        name = type(opt).__name__
        k = opt.accumulation_steps
        self._check_accumulation(trainer, opt)
        ddp = isinstance(trainer.strategy, DDPStrategy) and not isinstance(trainer.strategy, DeepSpeedStrategy)
        if trainer.world_size > 1 and not ddp:
            # Under DDP the optimizer takes DDP's gradient sync over (one weighted all-reduce per
            # update, accum_fused/ddp.py); other strategies (DeepSpeed's is a DDPStrategy subclass)
            # own the gradients or the optimizer step themselves.
            raise NotImplementedError(
                f"{name} under Lightning's {type(trainer.strategy).__name__} on {trainer.world_size} processes: "
                "accum_fused supports one device and DDP (strategy=\"ddp\", \"ddp_spawn\", \"ddp_notebook\"). "
                "DeepSpeed owns the optimizer step, and Lightning's FSDP strategy is FSDP1; for FSDP2 call torch's "
                "fully_shard in configure_model with an accum_fused optimizer in your own loop")
        if getattr(opt, "in_backward", False) and k > 1 and pl_module.automatic_optimization:
            raise ValueError(
                f"{name}(in_backward=True, accumulation_steps={k}) updates inside backward and refuses step(), "
                "which Lightning's automatic optimization calls after every batch: use in_backward=False with accumulation_steps, or "
                "in_backward=True with accumulation_steps=1 and Trainer(accumulate_grad_batches=k)")
        if _accumulates(opt) and pl_module.automatic_optimization:
            self._route_clipping(trainer, pl_module, opt)
        for config in trainer.lr_scheduler_configs:
            if isinstance(config.scheduler, PerUpdateScheduler) and config.scheduler.optimizer is opt:
                if config.interval != "step" or config.frequency != 1:
                    raise ValueError(
                        "PerUpdateScheduler counts updates each time it is called: attach it with "
                        f"'interval': 'step', 'frequency': 1 (got {config.interval!r}, {config.frequency})")
                config.scheduler.attached = True
            elif (k > 1 and config.interval == "step" and _unwrap(config.scheduler.optimizer) is opt
                  and pl_module.automatic_optimization):
                raise ValueError(
                    f"the LR scheduler {type(config.scheduler).__name__} has 'interval': 'step', which Lightning "
                    f"steps after every micro-batch, while {name} updates every {k}: wrap it, "
                    "{'scheduler': PerUpdateScheduler(scheduler), 'interval': 'step'} "
                    "(from accum_fused.integrations.lightning)")

    @staticmethod
    def _check_accumulation(trainer, opt) -> None:
        k = opt.accumulation_steps
        if trainer.accumulate_grad_batches > 1 and k > 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and "
                f"{type(opt).__name__}(accumulation_steps={k}) would accumulate twice (one update per "
                f"{trainer.accumulate_grad_batches * k} batches, losses divided by "
                f"{trainer.accumulate_grad_batches}): keep accumulation_steps={k} and "
                "accumulate_grad_batches=1 (the default)")

    def _route_clipping(self, trainer, pl_module, opt) -> None:
        """Lightning clips .grad after each backward: with k > 1 that is one micro-batch's
        gradient, and with in_backward .grad is already gone. The window clip is max_grad_norm."""
        name = type(opt).__name__
        if is_overridden("configure_gradient_clipping", pl_module):
            raise ValueError(
                f"configure_gradient_clipping is overridden, but with {name} accumulating it would clip each "
                "micro-batch's .grad (or, with in_backward, nothing): remove it and pass max_grad_norm= to "
                f"{name} (the window's averaged gradient is clipped)")
        clip = trainer.gradient_clip_val
        if clip is None or clip <= 0:
            return
        algorithm = trainer.gradient_clip_algorithm
        if algorithm is not None and algorithm != GradClipAlgorithmType.NORM:  # None means "norm"
            raise ValueError(
                f"gradient_clip_algorithm={algorithm!r} would clip each micro-batch's .grad, "
                f"and {name} clips only by norm: remove gradient_clip_val or use max_grad_norm=")
        if opt.max_grad_norm is not None and not math.isclose(opt.max_grad_norm, clip):
            raise ValueError(
                f"Trainer(gradient_clip_val={clip}) and {name}(max_grad_norm={opt.max_grad_norm}) disagree: "
                "keep one (max_grad_norm clips the window's averaged gradient)")
        # Made correct: the window's averaged gradient is clipped at that norm instead, and
        # Lightning clips nothing.
        opt.max_grad_norm = float(clip)
        trainer.gradient_clip_val = None  # put back at teardown: a second fit() routes it again
        self._moved_clip = clip
        rank_zero_info(f"accum_fused: Trainer(gradient_clip_val={clip}) moved into {name}.max_grad_norm (the window's "
                       "averaged gradient is clipped, not each micro-batch)")

    def teardown(self, trainer, pl_module, stage) -> None:
        self._restore_clip(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_clip(trainer)  # teardown hooks are not called after an exception

    def _restore_clip(self, trainer) -> None:
        if self._moved_clip is not None:
            trainer.gradient_clip_val, self._moved_clip = self._moved_clip, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # GradientAccumulationScheduler changes accumulate_grad_batches at epoch starts.
        for opt in self._optimizers(trainer):
            self._check_accumulation(trainer, opt)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Runs inside the step's closure, after training_step and backward, before the
        # optimizer reads the micro-batch's weight.
        opt = _unwrap(optimizer)
        if (self.require_weight and pl_module.automatic_optimization and _is_accum_fused(opt)
                and opt.accumulation_steps > 1 and opt.micro_batch_weight is None):
            raise RuntimeError(
                f"{type(opt).__name__}(accumulation_steps={opt.accumulation_steps}) got no weight for this "
                "micro-batch: call self.optimizers().set_micro_batch_weight(n) in training_step with what its "
                "loss averaged over (token count, len(batch)), or AccumFusedCallback(require_weight=False) to "
                "weight micro-batches equally")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.log:
            self._log(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Lightning's own accumulation updates on an epoch's last batch; so does this.
        self._flush(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush(trainer, pl_module)  # training stopped mid-epoch (max_steps, max_time)

    def _flush(self, trainer, pl_module) -> None:
        for opt in self._optimizers(trainer):
            opt = _unwrap(opt)
            if opt.accumulation_steps > 1 and opt.flush():
                for config in trainer.lr_scheduler_configs:
                    if isinstance(config.scheduler, PerUpdateScheduler) and config.scheduler.optimizer is opt:
                        config.scheduler.step()

    def _log(self, trainer, pl_module) -> None:
        for i, opt in enumerate(self._optimizers(trainer)):
            suffix = "" if i == 0 else f"_{i}"
            pl_module.log(f"accum_fused/update_count{suffix}", float(opt.update_count), on_step=True,
                          on_epoch=False, batch_size=1)
            if opt.last_grad_norm is not None:
                pl_module.log(f"accum_fused/last_grad_norm{suffix}", opt.last_grad_norm.detach().float(),
                              on_step=True, on_epoch=False, batch_size=1)
