"""One rank of the multi-process framework tests (tests/test_multiprocess.py), started the way
users start these frameworks: ``torchrun`` or ``accelerate launch`` (HF Trainer, accelerate), or
Lightning's own ``strategy="ddp"`` launcher.

    <launcher> tests/_launch_worker.py JOB OUT_DIR

Each JOB trains the tiny GPT-2 of ``_framework_truth`` with a recipe of the docs' guides
(docs/guides/hf-trainer.md, accelerate.md, lightning.md), unchanged, and
saves what the test compares, per rank, to ``OUT_DIR/<run>-rank<R>.pt``: the final parameters,
the learning rate of every update and the number of updates. The data: 112 sequences of length
3-48 (``_framework_truth``), micro-batches of 4, k=4 per rank. accelerate (under the Trainer
too) deals micro-batches to the ranks round-robin, so a window of k micro-batches per rank is
the big batch's window of 2k consecutive micro-batches; Lightning's shuffling DistributedSampler
deals sequences (``lightning_order``).
"""
from __future__ import annotations

import os
import sys

import torch

import _framework_truth as ft

SEQUENCES = ft.make_sequences(112, seed=0)  # 14 micro-batches per rank: windows of 4, 4, 4 and 2
MICRO_BATCH, K = 4, 4
LR, WEIGHT_DECAY, WARMUP, CLIP = 1e-3, 0.1, 2, 1.0


def save(out_dir: str, run: str, model, lrs: list[float], updates: int) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    torch.save({"params": params, "lrs": lrs, "updates": updates}, os.path.join(out_dir, f"{run}-rank{rank}.pt"))


# ---------------------------------------------------------------------------- HF Trainer
def hf_trainer(out_dir: str) -> None:
    """The Trainer recipe of docs/guides/hf-trainer.md (accum_fused.AdamW in_backward +
    AccumFusedCallback) and the
    control, the Trainer with torch.optim.AdamW, under the same launch."""
    import transformers

    import accum_fused
    from accum_fused.integrations.transformers import AccumFusedCallback

    class Sequences(torch.utils.data.Dataset):
        def __len__(self):
            return len(SEQUENCES)

        def __getitem__(self, i):
            return {"input_ids": SEQUENCES[i]}

    class RecordLR(transformers.TrainerCallback):
        def __init__(self):
            self.lrs = []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.lrs.append(optimizer.param_groups[0]["lr"])

    for run in ("accum_fused", "torch"):
        model = ft.tiny_gpt2(0)
        model.loss_type = "ForCausalLM"
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out_dir, "hf"), per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=K, num_train_epochs=1, max_grad_norm=CLIP, learning_rate=LR,
            weight_decay=WEIGHT_DECAY, warmup_steps=WARMUP, lr_scheduler_type="linear", logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_drop_last=False,
            train_sampling_strategy="sequential", disable_tqdm=True, seed=0)
        record = RecordLR()
        if run == "accum_fused":  # the recipe of docs/guides/hf-trainer.md
            opt = accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, in_backward=True)
            callbacks = [AccumFusedCallback(), record]
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            callbacks = [record]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(),
                                       data_collator=lambda f: ft.collate([x["input_ids"] for x in f]),
                                       optimizers=(opt, None), callbacks=callbacks)
        trainer.train()
        save(out_dir, f"hf-{run}", model, record.lrs, trainer.state.global_step)


# ---------------------------------------------------------------------------- accelerate
def schedule_total() -> int:
    """The recipes' ``total_updates``, counted as on one process from the unprepared loader:
    accelerate steps a prepared scheduler once per process per update, so it stays right."""
    return -(-len(_loader()) // K)


def _loader():
    return torch.utils.data.DataLoader(SEQUENCES, batch_size=MICRO_BATCH, collate_fn=ft.collate, shuffle=False)


def global_window_tokens(num_processes: int, sequences=SEQUENCES) -> list[int]:
    """Predicted tokens per window over every process: window w is micro-batches
    [w*k*N, (w+1)*k*N) of ``sequences`` (accelerate deals micro-batches to the processes
    round-robin; Lightning's DistributedSampler deals sequences, see ``lightning_order``)."""
    counts = [ft.predicted_tokens(b) for b in ft.micro_batches(sequences, MICRO_BATCH)]
    size = K * num_processes
    return [sum(counts[i : i + size]) for i in range(0, len(counts), size)]


def lightning_order() -> list[torch.Tensor]:
    """The sequences in the order Lightning's DDP reads them: it always gives a training loader
    a shuffling DistributedSampler (seed 0, epoch 0), whose rank r takes permutation[r::N]; so
    the N processes' window w is permutation[w*k*b*N : (w+1)*k*b*N], b the micro-batch size."""
    permutation = torch.randperm(len(SEQUENCES), generator=torch.Generator().manual_seed(0)).tolist()
    return [SEQUENCES[i] for i in permutation]


def accelerate_recipe(out_dir: str) -> None:
    """The accelerate recipe of docs/guides/accelerate.md: the optimizer holds the window
    (step(weight=tokens))."""
    import accum_fused
    from accum_fused.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = ft.tiny_gpt2(0)
    opt = accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=K,
                            max_grad_norm=CLIP)
    scheduler = ft.linear_warmup_decay(opt, WARMUP, schedule_total())
    model, opt, loader, scheduler = accelerator.prepare(model, opt, _loader(), scheduler)
    lrs = []
    for batch in loader:
        loss = ft.token_loss_sum(model, batch) / ft.predicted_tokens(batch)  # the micro-batch's token mean
        accelerator.backward(loss)
        lr = opt.param_groups[0]["lr"]
        opt.step(weight=ft.predicted_tokens(batch))
        scheduler.step()
        opt.zero_grad()
        if opt.updated:
            lrs.append(lr)
    save(out_dir, "accelerate-recipe", model, lrs, opt.update_count)


def _accelerate_mode_a(out_dir: str, run: str) -> None:
    """in_backward mode A (or, for the control, torch.optim.AdamW) under accelerate's own
    accumulation: the loss is the window's token sum over every process' window tokens, times
    k (accelerator.backward divides by k) and times the number of processes (DDP, or the
    optimizer's window reduce, averages over them)."""
    import accum_fused
    from accum_fused.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model = ft.tiny_gpt2(0)
    if run == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        opt = accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, in_backward=True)
    scheduler = ft.linear_warmup_decay(opt, WARMUP, schedule_total())
    model, opt, loader, scheduler = accelerator.prepare(model, opt, _loader(), scheduler)
    window_tokens = global_window_tokens(accelerator.num_processes)
    lrs, updates = [], 0
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = ft.token_loss_sum(model, batch) / window_tokens[i // K] * K * accelerator.num_processes
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
                lrs.append(opt.param_groups[0]["lr"])
                updates += 1
            opt.step()
            scheduler.step()
            opt.zero_grad()
    save(out_dir, f"accelerate-{run}", model, lrs, updates)


def accelerate_jobs(out_dir: str) -> None:
    from accelerate.state import GradientState

    accelerate_recipe(out_dir)
    for run in ("mode_a", "torch"):
        GradientState._reset_state()  # a process-wide singleton: each run's Accelerator sets it
        _accelerate_mode_a(out_dir, run)


# ----------------------------------------------------------------------------- Lightning
def lightning_jobs(out_dir: str, strategy: str = "ddp") -> None:
    import logging

    import lightning as L
    from _lightning_lm import TokenLM  # its own module: ddp_spawn pickles it by name

    from accum_fused.integrations import lightning as af_pl

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for mode in ("recipe", "mode_a"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, gradient_clip_val=CLIP,
                            accumulate_grad_batches=K if mode == "mode_a" else 1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[af_pl.AccumFusedCallback(log=False)])
        trainer.fit(TokenLM(mode, out_dir, f"lightning-{strategy}-{mode}"), _loader())


JOBS = {"hf_trainer": hf_trainer, "accelerate": accelerate_jobs, "lightning": lightning_jobs,
        "lightning_spawn": lambda out_dir: lightning_jobs(out_dir, "ddp_spawn")}


def main(job: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # a tiny model, two ranks on a small machine
    JOBS[job](out_dir)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal interpreter exit: torch 2.13's gloo sometimes aborts in its exit-time
    # teardown after autograd and collectives ran in one process ("terminate called without an
    # active exception"; reproduced without accum_fused). Everything this rank had to do is done
    # and saved; the test checks the saved files.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
