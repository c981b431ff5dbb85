"""accum_fused under the real Hugging Face Trainer (issue 13): the recipe of
accum_fused/integrations/transformers.py against the big-batch ground truth, and every misuse.

Setting (tests/_framework_truth.py): a tiny GPT-2, 72 sequences of length 3-48 right-padded per
micro-batch, micro-batch 4, gradient_accumulation_steps=4: windows of 4, 4, 4, 4 and 2
micro-batches (5 updates, the last one partial), AdamW, clipping at 1.0, linear warmup (2
updates) and decay. The Trainer reads the data in order (train_sampling_strategy="sequential").
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import accum_fused  # noqa: E402
import _framework_truth as ft  # noqa: E402
from accum_fused.integrations import transformers as af_hf  # noqa: E402

SEQUENCES = ft.make_sequences(72, seed=0)
MICRO_BATCH, K = 4, 4
LR, WEIGHT_DECAY, WARMUP, CLIP = 1e-3, 0.1, 2, 1.0
UPDATES = 5  # 18 micro-batches: 4 full windows and one of 2


class _Sequences(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(SEQUENCES)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": SEQUENCES[i]}


def _collator(features):
    return ft.collate([f["input_ids"] for f in features])


class _RecordLR(transformers.TrainerCallback):
    """The learning rate each update uses (read just before optimizer.step())."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def _model():
    model = ft.tiny_gpt2(0)
    # transformers 5.23 does not map GPT2LMHeadModel to ForCausalLM, so its Trainer would count
    # every sequence's first label as a predicted token (AccumFusedCallback refuses that).
    model.loss_type = "ForCausalLM"
    return model


def _recipe_optimizer(model, **kwargs):
    return accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, in_backward=True, **kwargs)


def _trainer(output_dir, model, optimizer, callbacks=(), **overrides):
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=K,
                    num_train_epochs=1, max_grad_norm=CLIP, learning_rate=LR, weight_decay=WEIGHT_DECAY,
                    warmup_steps=WARMUP, lr_scheduler_type="linear", logging_steps=1, save_strategy="no",
                    report_to=[], use_cpu=True, dataloader_drop_last=False, train_sampling_strategy="sequential",
                    disable_tqdm=True, seed=0)
    settings.update(overrides)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**settings),
                                train_dataset=_Sequences(), data_collator=_collator,
                                optimizers=(optimizer, None), callbacks=list(callbacks))


def _max_diff(model, reference) -> float:
    return max((p.detach() - q.detach()).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def _relative_change_error(model, reference) -> float:
    """||Δ - Δ_ref|| / ||Δ_ref||, Δ a model's change from the common initialisation."""
    init = ft.tiny_gpt2(0)
    delta = torch.cat([(p - q).detach().flatten() for p, q in zip(model.parameters(), init.parameters())])
    delta_ref = torch.cat([(p - q).detach().flatten() for p, q in zip(reference.parameters(), init.parameters())])
    return ((delta - delta_ref).norm() / delta_ref.norm()).item()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The model is tiny: one intra-op thread is as fast, and far faster on a busy CI machine,
    # where two spinning OpenMP threads per op wait for each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def truth():
    return ft.ground_truth(SEQUENCES, MICRO_BATCH, K, lr=LR, weight_decay=WEIGHT_DECAY, warmup=WARMUP, clip=CLIP)


# ------------------------------------------------------------------------------ the recipe
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_recipe_matches_big_batch(tmp_path, truth, backend):
    """in_backward mode A under the Trainer's own accumulation: every parameter within 1e-5 of
    the big batch, the same learning rate at every update, the clip moved into the optimizer."""
    truth_model, truth_lrs = truth
    model = _model()
    opt = _recipe_optimizer(model, backend=backend)
    record = _RecordLR()
    trainer = _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback(), record])
    trainer.train()

    assert _max_diff(model, truth_model) < 1e-5
    assert record.lrs == pytest.approx(truth_lrs, rel=1e-12, abs=0)
    assert opt.update_count == trainer.state.global_step == UPDATES
    # The Trainer's clip of .grad (freed by in_backward) became the window clip.
    assert opt.max_grad_norm == CLIP and trainer.args.max_grad_norm == 0
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["update_count"] for entry in logged] == list(range(1, UPDATES + 1))
    # The Trainer would log the norm of the empty .grad (0.0); the window's norm replaces it.
    assert all(entry["grad_norm"] > 0.1 for entry in logged)
    assert logged[-1]["grad_norm"] == pytest.approx(float(opt.last_grad_norm))


def test_plain_optimizer_without_accumulation_matches_big_batch(tmp_path, truth):
    """accumulation_steps=1 without in_backward is a plain optimizer: the Trainer clips .grad
    itself and the result is the big batch's too."""
    truth_model, _ = truth
    model = _model()
    opt = accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    trainer = _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback()])
    trainer.train()
    assert _max_diff(model, truth_model) < 1e-5
    assert opt.max_grad_norm is None and trainer.args.max_grad_norm == CLIP


def test_bf16_autocast(tmp_path, truth, monkeypatch):
    """bf16=True (CPU autocast): compared with the big batch under the same autocast. Micro-batches
    and the window's batch have other shapes, so bf16 rounds differently: measured 1.9% relative
    error of the parameter change (the Trainer with torch.optim.AdamW: 1.9% too; 3.0% against the
    fp32 big batch), against 0 for fp32. Bound: 5%."""
    model = _model()
    opt = _recipe_optimizer(model)
    record = _RecordLR()
    _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback(), record], bf16=True).train()

    token_loss_sum = ft.token_loss_sum

    def autocast_loss(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return token_loss_sum(m, batch)

    monkeypatch.setattr(ft, "token_loss_sum", autocast_loss)
    bf16_truth, truth_lrs = ft.ground_truth(SEQUENCES, MICRO_BATCH, K, lr=LR, weight_decay=WEIGHT_DECAY,
                                            warmup=WARMUP, clip=CLIP)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _relative_change_error(model, bf16_truth) < 0.05
    assert _relative_change_error(model, truth[0]) < 0.06
    assert record.lrs == pytest.approx(truth_lrs, rel=1e-12, abs=0)
    assert opt.update_count == UPDATES


def test_interrupted_window_is_discarded_on_the_next_train(tmp_path, truth):
    """Training stopped inside a window leaves in_backward sums in the optimizer, where the
    Trainer's model.zero_grad() does not reach; the next train() starts without them, as it
    would without in_backward, and trains the big batch."""
    class StopAfterTwoMicroBatches(transformers.TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            control.should_training_stop = True if kwargs["optimizer"].optimizer.micro_step == 2 else None

    model = _model()
    opt = _recipe_optimizer(model)
    stopper = StopAfterTwoMicroBatches()
    trainer = _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback(), stopper])
    trainer.train()
    assert opt.micro_step == 2 and opt.update_count == 0
    trainer.remove_callback(stopper)
    trainer.train()
    assert _max_diff(model, truth[0]) < 1e-5 and opt.update_count == UPDATES


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """The Trainer saves only after an update (save_steps count updates), so there is no
    mid-window checkpoint to take: resuming from the one after update 2 with a fresh model and
    optimizer equals the uninterrupted run bit for bit."""
    model = _model()
    _trainer(tmp_path / "a", model, _recipe_optimizer(model), [af_hf.AccumFusedCallback()],
             save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved["accumulation"]["micro_step"] == 0 and saved["accumulation"]["update_count"] == 2

    resumed = _model()
    opt = _recipe_optimizer(resumed)
    record = _RecordLR()
    _trainer(tmp_path / "b", resumed, opt, [af_hf.AccumFusedCallback(), record]).train(
        resume_from_checkpoint=str(checkpoint))
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), model.parameters(), strict=True))
    assert opt.update_count == UPDATES and len(record.lrs) == UPDATES - 2


# ------------------------------------------------------------------------------- misuse
@pytest.mark.parametrize("accumulation", [
    dict(gradient_accumulation_steps=4, accumulation_steps=4, in_backward=False),  # 16 micro-batches per update
    dict(gradient_accumulation_steps=1, accumulation_steps=4, in_backward=False),  # scheduler per micro-batch
    dict(gradient_accumulation_steps=4, accumulation_steps=4, in_backward=True),   # mode B: a second window
])
def test_double_accumulation_raises(tmp_path, accumulation):
    model = _model()
    ga = accumulation.pop("gradient_accumulation_steps")
    opt = accum_fused.AdamW(model.parameters(), lr=LR, **accumulation)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback()], gradient_accumulation_steps=ga)
    with pytest.raises(ValueError, match=r"already owns the window.*TrainingArguments\(gradient_accumulation_steps="
                                         r"<micro-batches per update>, e\.g\. 4\).*accumulation_steps=1, in_backward=True"):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_disagreeing_clips_raise_and_agreeing_ones_train(tmp_path):
    model = _model()
    refused = _recipe_optimizer(model, max_grad_norm=0.5)
    trainer = _trainer(tmp_path, model, refused, [af_hf.AccumFusedCallback()])
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0\) and AdamW\(max_grad_norm=0.5\) disagree"):
        trainer.train()
    refused.close()  # the trainer keeps it alive; its hooks must go before another takes the parameters
    opt = _recipe_optimizer(model, max_grad_norm=CLIP)
    trainer = _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback()], max_steps=1)
    trainer.train()
    assert opt.update_count == 1 and opt.max_grad_norm == CLIP and opt.last_grad_norm is not None


def test_fp16_grad_scaler_with_in_backward_raises(tmp_path):
    """fp16=True gives the Trainer a GradScaler on CUDA only (on CPU accelerate has none), so the
    optimizer the Trainer would hold there is built directly: accelerate's AcceleratedOptimizer
    with a GradScaler."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = _model()
    trainer = _trainer(tmp_path, model, _recipe_optimizer(model), [af_hf.AccumFusedCallback()])
    # device_placement=False: built by hand, outside the Trainer, whose prepare accum_fused allows
    # (a bare AcceleratedOptimizer reading the state_dict of an accumulating optimizer is refused).
    wrapped = AcceleratedOptimizer(trainer.optimizer, device_placement=False, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="GradScaler.*bf16=True"):
        af_hf.AccumFusedCallback().on_train_begin(trainer.args, trainer.state, trainer.control, optimizer=wrapped,
                                                  model=model)


def test_unshifted_token_count_raises(tmp_path):
    """GPT2LMHeadModel as built (loss_type None): the Trainer's num_items_in_batch would count
    each sequence's first label; the callback names the one-line fix."""
    model = ft.tiny_gpt2(0)
    trainer = _trainer(tmp_path, model, _recipe_optimizer(model), [af_hf.AccumFusedCallback()])
    with pytest.raises(ValueError, match='model.loss_type = "ForCausalLM"'):
        trainer.train()


def test_callback_without_accum_fused_optimizer_raises(tmp_path):
    model = _model()
    trainer = _trainer(tmp_path, model, None, [af_hf.AccumFusedCallback()])
    with pytest.raises(TypeError, match="found no accum_fused optimizer"):
        trainer.train()


def test_module_imports_the_real_transformers():
    # accum_fused.integrations.transformers must not shadow the framework it integrates.
    assert af_hf.transformers is transformers and os.path.basename(os.path.dirname(transformers.__file__)) == "transformers"


@pytest.mark.parametrize("kwargs", [dict(in_backward=True), dict(accumulation_steps=4)])
def test_accumulating_optimizer_without_the_callback_raises(tmp_path, kwargs):
    """Without AccumFusedCallback the Trainer's max_grad_norm would clip nothing (in_backward) or
    the window would be accumulated twice: the optimizer's first step() raises, naming the
    callback, before any update."""
    model = _model()
    opt = accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, model, opt)
    with pytest.raises(RuntimeError, match="AccumFusedCallback"):
        trainer.train()
    assert opt.update_count == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_deepspeed_or_fsdp_is_refused_at_train_begin(tmp_path):
    model = _model()
    opt = _recipe_optimizer(model)
    trainer = _trainer(tmp_path, model, opt, [af_hf.AccumFusedCallback()])
    trainer.args.fsdp = "full_shard"  # set after construction: building FSDP needs several processes
    with pytest.raises(NotImplementedError, match="FSDP"):
        af_hf.AccumFusedCallback().on_train_begin(trainer.args, trainer.state, trainer.control, optimizer=opt,
                                                  model=model)
