"""accum_fused under Lightning (the real package, CPU, one device): the recipe of
accum_fused.integrations.lightning against the big-batch ground truth, bf16-mixed, a mid-window
checkpoint resume, the in_backward mode-A route, and every misuse loud (issue 13)."""
from __future__ import annotations

import logging

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import accum_fused  # noqa: E402
from accum_fused.integrations import lightning as af_pl  # noqa: E402
from tests._framework_truth import (  # noqa: E402
    collate, ground_truth, linear_warmup_decay, make_sequences, micro_batches, predicted_tokens, tiny_gpt2,
    token_loss_sum,
)

MB, K = 4, 4  # micro-batch size, micro-batches per window
# 70 sequences: 18 micro-batches (the last holds 2 sequences), 4 full windows and one of 2.
SEQUENCES = make_sequences(70, seed=1)
BATCHES = 18
UPDATES = 5
HP = dict(lr=1e-3, weight_decay=0.1, warmup=2, clip=1.0)
SAVE_AT = 6  # global_step (micro-batches) of the mid-window checkpoint: window 2 holds 2 of 4

logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "GPU available: False" etc.


# ------------------------------------------------------------------------------------ helpers
class ResumableLoader(DataLoader):
    """A DataLoader that Lightning can resume mid-epoch (it saves loaders with state_dict /
    load_state_dict): it restarts after the batches it had handed out. The resume test checks
    that the resumed run sees exactly the batches the uninterrupted one saw after the save."""

    def __init__(self, sequences=SEQUENCES):
        super().__init__(sequences, batch_size=MB, shuffle=False, collate_fn=collate)
        self.handed_out = 0
        self.skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        self.handed_out = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.handed_out += 1
                yield batch

    def state_dict(self):
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state):
        self.skip = state["handed_out"]


def adamw(backend="auto", **kwargs):
    def make(params):
        kw = dict(lr=HP["lr"], weight_decay=HP["weight_decay"], accumulation_steps=K, backend=backend)
        return accum_fused.AdamW(params, **{**kw, **kwargs})
    return make


class TokenLM(L.LightningModule):
    """The tiny GPT-2 with the token-mean loss; ``weight``: tell the optimizer each
    micro-batch's token count (the recipe). ``schedule``: how the warmup+decay scheduler is
    attached ("per_update": the recipe; "plain": bare, interval "step"; None: no scheduler)."""

    def __init__(self, make_optimizer=None, *, schedule="per_update", interval="step", frequency=1, weight=True):
        super().__init__()
        self.model = tiny_gpt2(0)
        self.make_optimizer = make_optimizer or adamw()
        self.schedule, self.interval, self.frequency, self.weight = schedule, interval, frequency, weight

    def training_step(self, batch, batch_idx):
        tokens = predicted_tokens(batch)
        if self.weight:
            self.optimizers().set_micro_batch_weight(tokens)
        return token_loss_sum(self.model, batch) / tokens

    def configure_optimizers(self):
        opt = self.make_optimizer(self.model.parameters())
        if self.schedule is None:
            return opt
        scheduler = linear_warmup_decay(opt, HP["warmup"], UPDATES)
        if self.schedule == "per_update":
            scheduler = af_pl.PerUpdateScheduler(scheduler)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": scheduler, "interval": self.interval, "frequency": self.frequency}}


class AccumulatorLM(TokenLM):
    """The recipe with accum_fused.GradientAccumulator around torch.optim.AdamW: the scheduler
    is built on the inner optimizer and counts the accumulator's updates (``optimizer=``)."""

    def __init__(self, *, adapter=True):
        super().__init__()
        self.adapter = adapter

    def configure_optimizers(self):
        inner = torch.optim.AdamW(self.model.parameters(), lr=HP["lr"], weight_decay=HP["weight_decay"])
        accumulator = accum_fused.GradientAccumulator(inner, accumulation_steps=K)
        scheduler = linear_warmup_decay(inner, HP["warmup"], UPDATES)
        if self.adapter:
            scheduler = af_pl.PerUpdateScheduler(scheduler, optimizer=accumulator)
        return {"optimizer": accumulator, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Recorder(L.Callback):
    """The learning rate each update used, and the batches seen (index, first token). Put it
    before AccumFusedCallback: at epoch end it sees the LR the final flush will use."""

    def __init__(self):
        self.lrs, self.seen, self.flush_lr = [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.seen.append((batch_idx, int(batch["input_ids"][0, 0])))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.optimizers[0].updated:
            self.lrs.append(self.lr)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.optimizers[0].micro_step:
            self.flush_lr = trainer.optimizers[0].param_groups[0]["lr"]

    def update_lrs(self):
        return self.lrs + ([] if self.flush_lr is None else [self.flush_lr])


def make_trainer(callbacks=(), *, accum_callback=True, **kwargs):
    settings = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    callbacks = list(callbacks) + ([af_pl.AccumFusedCallback()] if accum_callback else [])
    return L.Trainer(**{**settings, **kwargs}, callbacks=callbacks)


def max_diff(model, reference) -> float:
    ref = dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref), "the models' parameters differ"
    return max((p.detach().float() - ref[n].detach().float()).abs().max().item() for n, p in model.named_parameters())


def relative_update_error(model, reference) -> float:
    """||model - reference|| / ||reference - initial||: how far off the training moved it, as a
    fraction of how far the reference moved (a max |diff| is dominated, under Adam, by elements
    whose tiny gradients flip sign under any rounding change)."""
    initial = tiny_gpt2(0)
    off = sum(((p.detach().double() - q.detach().double()) ** 2).sum()
              for p, q in zip(model.parameters(), reference.parameters()))
    moved = sum(((q.detach().double() - p0.double()) ** 2).sum()
                for q, p0 in zip(reference.parameters(), initial.parameters()))
    return float((off / moved).sqrt())


def loader():
    return DataLoader(SEQUENCES, batch_size=MB, collate_fn=collate, shuffle=False)


@pytest.fixture(scope="module")
def truth():
    model, lrs = ground_truth(SEQUENCES, MB, K, **HP)
    assert len(lrs) == UPDATES
    return model, lrs


def run_recipe(backend, callbacks=(), train_loader=None, **trainer_kwargs):
    module = AccumulatorLM() if backend == "accumulator" else TokenLM(adamw(backend))
    recorder = Recorder()
    trainer = make_trainer([recorder, *callbacks], gradient_clip_val=HP["clip"], **trainer_kwargs)
    trainer.fit(module, train_loader or loader())
    return module, trainer, recorder


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """The recipe, uninterrupted, with a checkpoint taken in the middle of a window."""
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_AT, save_top_k=-1,
                                 filename="{step}")
    module, trainer, recorder = run_recipe("auto", [checkpoint], ResumableLoader(), enable_checkpointing=True)
    return module, trainer, recorder, ckpt_dir / f"step={SAVE_AT}.ckpt"


# ------------------------------------------------------------------------------------- recipe
@pytest.mark.parametrize("backend", ["auto", "torch", "accumulator"])
def test_recipe_matches_big_batch(truth, recipe_run, backend):
    """Uneven sequences with padding, token weights, a partial last window (flushed by the
    callback), clipping at 1.0 (Lightning's gradient_clip_val moved into max_grad_norm) and
    warmup+decay per update: every parameter within 1e-5 of the big-batch run, every LR equal."""
    module, trainer, recorder = recipe_run[:3] if backend == "auto" else run_recipe(backend)
    ref, ref_lrs = truth
    opt = trainer.optimizers[0]
    # gradient_clip_val was moved into max_grad_norm for the fit, and put back afterwards
    assert opt.max_grad_norm == HP["clip"] and trainer.gradient_clip_val == HP["clip"]
    assert opt.update_count == UPDATES and opt.micro_step == 0
    assert recorder.update_lrs() == pytest.approx(ref_lrs, rel=1e-12, abs=0)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.updates_counted == UPDATES and scheduler.last_epoch == UPDATES  # the flush stepped it too
    assert max_diff(module.model, ref) < 1e-5
    assert trainer.global_step == BATCHES  # Lightning counts micro-batches (documented)
    metrics = trainer.callback_metrics
    assert metrics["accum_fused/update_count"] == UPDATES - 1  # logged at the last batch, before the flush
    assert metrics["accum_fused/last_grad_norm"] > 0


def test_resume_mid_window_is_bit_exact(recipe_run):
    """ModelCheckpoint every 6 micro-batches: the checkpoint at step 6 holds 2 micro-batches
    of the open window; resuming from it with ckpt_path ends bit-identical to the
    uninterrupted run (parameters, optimizer state, LRs, scheduler count)."""
    module, trainer, recorder, ckpt = recipe_run
    saved = torch.load(ckpt, weights_only=False)
    assert saved["optimizer_states"][0]["accumulation"]["micro_step"] == SAVE_AT % K
    resumed, resumed_recorder = TokenLM(adamw()), Recorder()
    resumed_trainer = make_trainer([resumed_recorder], gradient_clip_val=HP["clip"])
    resumed_trainer.fit(resumed, ResumableLoader(), ckpt_path=ckpt)
    assert resumed_recorder.seen == recorder.seen[SAVE_AT:]
    for a, b in zip(resumed.model.parameters(), module.model.parameters()):
        assert torch.equal(a, b)
    opt, ref_opt = resumed_trainer.optimizers[0], trainer.optimizers[0]
    assert opt.update_count == UPDATES
    for p, q in zip(resumed.model.parameters(), module.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key])
    assert resumed_recorder.update_lrs() == recorder.update_lrs()[-len(resumed_recorder.update_lrs()):]
    assert (resumed_trainer.lr_scheduler_configs[0].scheduler.state_dict()
            == trainer.lr_scheduler_configs[0].scheduler.state_dict())


def hand_loop_bf16():
    """The same recipe written by hand: accum_fused under bf16 autocast, no Lightning."""
    model = tiny_gpt2(0)
    opt = adamw(max_grad_norm=HP["clip"])(model.parameters())
    scheduler = linear_warmup_decay(opt, HP["warmup"], UPDATES)
    for batch in micro_batches(SEQUENCES, MB):
        tokens = predicted_tokens(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = token_loss_sum(model, batch) / tokens
        loss.backward()
        opt.step(weight=tokens)
        opt.zero_grad()
        if opt.updated:
            scheduler.step()
    assert opt.flush()
    return model


def test_bf16_mixed(truth):
    """precision="bf16-mixed": the recipe equals the same loop written by hand under bf16
    autocast (bound 1e-6; measured 0: the same operations), and is as close to the fp32 big
    batch as bf16 autocast allows: relative update error measured 2.8% (the big batch itself
    under bf16 autocast, plain torch.optim: 2.9%); bound 6%."""
    module, trainer, recorder = run_recipe("auto", precision="bf16-mixed")
    assert trainer.optimizers[0].update_count == UPDATES
    assert max_diff(module.model, hand_loop_bf16()) < 1e-6
    assert 0 < relative_update_error(module.model, truth[0]) < 0.06


def test_in_backward_mode_a_is_lightnings_own_accumulation(truth):
    """The other route: in_backward=True, accumulation_steps=1 and Lightning's
    accumulate_grad_batches=K. Lightning keeps its loop (loss / K, scheduler per update,
    update on the epoch's last batch) and the callback moves gradient_clip_val into
    max_grad_norm (.grad is gone when Lightning would clip): the result is Lightning's own
    accumulation with torch.optim.AdamW. That is a mean of micro-batch means, and the partial
    last window is divided by K: not the token-mean big batch (relative update error measured
    47%; the recipe's: 2e-5), which is why the recipe is the per-micro-batch one."""
    def run(make_optimizer, callbacks):
        module = TokenLM(make_optimizer, schedule="plain", weight=False)
        trainer = make_trainer(callbacks, accum_callback=False, accumulate_grad_batches=K,
                               gradient_clip_val=HP["clip"])
        trainer.fit(module, loader())
        return module, trainer

    mode_a, trainer = run(adamw(accumulation_steps=1, in_backward=True), [af_pl.AccumFusedCallback()])
    opt = trainer.optimizers[0]
    assert opt.max_grad_norm == HP["clip"] and trainer.gradient_clip_val == HP["clip"] and opt.update_count == UPDATES
    native, _ = run(lambda params: torch.optim.AdamW(params, lr=HP["lr"], weight_decay=HP["weight_decay"]), [])
    assert max_diff(mode_a.model, native.model) < 1e-5
    assert relative_update_error(mode_a.model, truth[0]) > 0.1


def test_lightning_optimizer_reaches_the_window():
    """self.optimizers() is Lightning's wrapper (another class, its own __dict__): micro_step,
    update_count and flush() through it act on the optimizer's one window, so a flush through
    the wrapper is not applied a second time by the optimizer."""
    checks = {}

    class FlushMidWindow(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx != 5:
                return
            wrapper, opt = pl_module.optimizers(), trainer.optimizers[0]
            checks["wrapper"] = isinstance(wrapper, LightningOptimizer) and type(wrapper) is not type(opt)
            checks["before"] = (wrapper.micro_step, opt.micro_step, wrapper.update_count, opt.update_count)
            checks["flushed"] = wrapper.flush()
            checks["after"] = (wrapper.micro_step, opt.micro_step, wrapper.update_count, opt.update_count)
            checks["again"] = opt.flush()
            checks["own_state"] = sorted(k for k in ("_window", "micro_step", "update_count") if k in vars(wrapper))

    module = TokenLM(adamw())
    trainer = make_trainer([FlushMidWindow()], limit_train_batches=8)
    trainer.fit(module, loader())
    assert checks == dict(wrapper=True, before=(2, 2, 1, 1), flushed=True, after=(0, 0, 2, 2), again=False,
                          own_state=[])
    # 4 + 2 (flushed through the wrapper) + 2 (flushed at epoch end): 3 updates, 3 scheduler steps.
    assert trainer.optimizers[0].update_count == 3
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3


# ------------------------------------------------------------------------------------- misuse
class ClipsItself(TokenLM):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, 1.0)


MISUSE = {
    "double accumulation": (lambda: TokenLM(), dict(accumulate_grad_batches=2), ValueError, "accumulate twice"),
    "bare step scheduler": (lambda: TokenLM(schedule="plain"), {}, ValueError, "PerUpdateScheduler"),
    "per-update scheduler per epoch": (lambda: TokenLM(interval="epoch"), {}, ValueError, "'interval': 'step'"),
    "per-update scheduler frequency": (lambda: TokenLM(frequency=2), {}, ValueError, "'frequency': 1"),
    "clip disagrees": (lambda: TokenLM(adamw(max_grad_norm=0.5)), dict(gradient_clip_val=1.0), ValueError,
                       "disagree"),
    "clip by value": (lambda: TokenLM(), dict(gradient_clip_val=1.0, gradient_clip_algorithm="value"), ValueError,
                      "clips only by norm"),
    "own clipping hook": (lambda: ClipsItself(), {}, ValueError, "configure_gradient_clipping"),
    "in_backward mode B": (lambda: TokenLM(adamw(in_backward=True)), {}, ValueError, "in_backward=True"),
    "forgotten weight": (lambda: TokenLM(weight=False), {}, RuntimeError, "set_micro_batch_weight"),
    "torch optimizer": (lambda: TokenLM(lambda params: torch.optim.AdamW(params), schedule=None), {}, TypeError,
                        "no accum_fused optimizer"),
    # Lightning's own check: a scheduler must be attached to the optimizer it was given.
    "scheduler on the inner optimizer": (lambda: AccumulatorLM(adapter=False), {}, MisconfigurationException,
                                         "attached with an optimizer"),
    "accumulation scheduler": (lambda: TokenLM(), dict(callbacks=[GradientAccumulationScheduler({0: 2})]),
                               ValueError, "accumulate twice"),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_loud(case):
    make_module, trainer_kwargs, error, match = MISUSE[case]
    trainer = make_trainer(trainer_kwargs.pop("callbacks", []), limit_train_batches=2, **trainer_kwargs)
    module = make_module()
    with pytest.raises(error, match=match):
        trainer.fit(module, loader())
    opt = trainer.optimizers[0] if trainer.optimizers else None
    if isinstance(opt, (accum_fused.AdamW, accum_fused.GradientAccumulator)):
        assert opt.update_count == 0  # refused before any update


def test_scheduler_adapter_misuse():
    """Without the callback the partial window would be dropped and nothing checked: the
    adapter refuses to step. It needs an accum_fused optimizer to count updates on."""
    trainer = make_trainer(accum_callback=False, limit_train_batches=2)
    with pytest.raises(RuntimeError, match="AccumFusedCallback"):
        trainer.fit(TokenLM(), loader())
    with pytest.raises(TypeError, match="accum_fused optimizer"):
        af_pl.PerUpdateScheduler(linear_warmup_decay(torch.optim.AdamW(tiny_gpt2().parameters()), 1, 2))


def test_equal_weights_on_purpose():
    """require_weight=False: micro-batches without a weight count equally, as documented."""
    module = TokenLM(weight=False)
    trainer = make_trainer([af_pl.AccumFusedCallback(require_weight=False)], accum_callback=False,
                           limit_train_batches=6)
    trainer.fit(module, loader())
    assert trainer.optimizers[0].update_count == 2


def test_multi_process_strategies_other_than_ddp_are_refused(monkeypatch):
    """DeepSpeed (a DDPStrategy subclass in Lightning) and FSDP own the gradients or the step:
    refused at fit start, naming what is supported. (Two processes are not started here: the
    check reads the Trainer's strategy and world size.)"""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    monkeypatch.setattr(type(trainer), "world_size", property(lambda self: 2))
    monkeypatch.setattr(type(trainer), "strategy", property(lambda self: DeepSpeedStrategy.__new__(DeepSpeedStrategy)))
    module = TokenLM()
    opt = adamw()(module.model.parameters())
    with pytest.raises(NotImplementedError, match="DeepSpeedStrategy"):
        af_pl.AccumFusedCallback()._check(trainer, module, opt)
