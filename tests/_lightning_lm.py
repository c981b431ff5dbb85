"""The Lightning recipes of docs/guides/lightning.md as a LightningModule, for
tests/_launch_worker.py (a module of its own so that ``strategy="ddp_spawn"`` can pickle it by
name)."""
from __future__ import annotations

import atexit
import multiprocessing
import os

import lightning as L

import _framework_truth as ft
import accum_fused
from _launch_worker import K, LR, WARMUP, WEIGHT_DECAY, global_window_tokens, lightning_order, save
from accum_fused.integrations import lightning as af_pl


class TokenLM(L.LightningModule):
    """``mode``: "recipe" (the optimizer holds the window, each micro-batch weighted by its
    tokens) or "mode_a" (in_backward under Lightning's accumulate_grad_batches, the loss scaled
    to the global window's token mean). Saves the result per rank at the end of training."""

    exit_registered = False  # per process

    def __init__(self, mode: str, out_dir: str, run: str):
        super().__init__()
        self.model = ft.tiny_gpt2(0)
        self.mode, self.out_dir, self.run = mode, out_dir, run
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.mode == "recipe":
            tokens = ft.predicted_tokens(batch)
            self.optimizers().set_micro_batch_weight(tokens)
            return ft.token_loss_sum(self.model, batch) / tokens
        # Lightning divides the loss by k, and DDP (here: the window's reduce) averages over
        # the processes: the token sum over the window's tokens on all processes, times k * N.
        window_tokens = global_window_tokens(self.trainer.world_size, lightning_order())[batch_idx // K]
        return ft.token_loss_sum(self.model, batch) / window_tokens * K * self.trainer.world_size

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        # Updates per process (Lightning's DistributedSampler gives each its share of the data):
        # estimated_stepping_batches counts step() calls, one per micro-batch in the recipe.
        steps = self.trainer.estimated_stepping_batches
        if self.mode == "recipe":
            opt = accum_fused.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=K)
            sched = af_pl.PerUpdateScheduler(ft.linear_warmup_decay(opt, WARMUP, -(-steps // K)))
        else:
            opt = accum_fused.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, in_backward=True)
            sched = ft.linear_warmup_decay(opt, WARMUP, steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_end(self):
        opt = self.optimizers().optimizer
        # The recipe's step() runs every micro-batch: the LR of each full window's update is at
        # its k-th call (the partial last window is flushed at the epoch's end, unrecorded).
        lrs = self.lrs if self.mode == "mode_a" else self.lrs[K - 1 :: K]
        save(self.out_dir, self.run, self.model, lrs, opt.update_count)
        if multiprocessing.parent_process() is not None and not self.exit_registered:
            # A ddp_spawn worker: end it without the interpreter's teardown, where torch 2.13's gloo
            # sometimes aborts ("terminate called without an active exception"; reproduced
            # without accum_fused) after all work is done. atexit runs before that teardown; the
            # test checks the saved results, so a worker that failed later cannot pass.
            atexit.register(os._exit, 0)
            TokenLM.exit_registered = True
