"""One rank of the multi-process framework tests (tests/test_multiprocess.py), started the way
users start these frameworks: ``torchrun`` or ``accelerate launch`` (HF Trainer, accelerate), or
Lightning's own ``strategy="ddp"`` launcher.

    <launcher> tests/_launch_worker.py JOB OUT_DIR

Each JOB trains the tiny GPT-2 of ``_framework_truth`` with a README recipe, unchanged, and
saves what the test compares, per rank, to ``OUT_DIR/<run>-rank<R>.pt``: the final parameters,
the learning rate of every update and the number of updates. The data is the single-process
tests' (72 sequences of length 3-48, micro-batches of 4); the frameworks deal micro-batches to
the ranks round-robin, so a window of k micro-batches per rank is the big batch's window of
2k consecutive micro-batches.
"""
from __future__ import annotations

import os
import sys

import torch

import _framework_truth as ft

SEQUENCES = ft.make_sequences(112, seed=0)  # 14 micro-batches per rank: windows of 4, 4, 4 and 2
MICRO_BATCH, K = 4, 4
LR, WEIGHT_DECAY, WARMUP, CLIP = 1e-3, 0.1, 2, 1.0


def _save(out_dir: str, run: str, model, lrs: list[float], updates: int) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    torch.save({"params": params, "lrs": lrs, "updates": updates}, os.path.join(out_dir, f"{run}-rank{rank}.pt"))


# ---------------------------------------------------------------------------- HF Trainer
def hf_trainer(out_dir: str) -> None:
    """The README's Trainer recipe (accum_fused.AdamW in_backward + AccumFusedCallback) and the
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
        if run == "accum_fused":  # the README recipe
            opt = accum_fused.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, in_backward=True)
            callbacks = [AccumFusedCallback(), record]
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            callbacks = [record]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(),
                                       data_collator=lambda f: ft.collate([x["input_ids"] for x in f]),
                                       optimizers=(opt, None), callbacks=callbacks)
        trainer.train()
        _save(out_dir, f"hf-{run}", model, record.lrs, trainer.state.global_step)


JOBS = {"hf_trainer": hf_trainer}


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
