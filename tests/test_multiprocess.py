"""The framework recipes of docs/guides/ (hf-trainer.md, accelerate.md, lightning.md) on two
processes, launched as users launch them (issue 20): HF Trainer under ``torchrun`` and
``accelerate launch``, accelerate's two recipes under ``accelerate launch``, Lightning's recipes
under ``strategy="ddp"`` and ``"ddp_spawn"``.

Each launch runs ``_launch_worker.py`` (the recipe unchanged, gloo on 127.0.0.1, CPU), which
saves every rank's final parameters, the learning rate of each update and the update count. The
ground truth is the single-process big batch over both ranks' micro-batches (torch.optim.AdamW
on each window's concatenated batch, token-mean loss, clipping at 1.0, warmup + decay; 112
sequences of 3-48 tokens, micro-batches of 4, k=4 per rank: windows of 4, 4, 4 and 2 micro-batches
per rank, the last partial). Every rank must be bit-identical; every parameter within TOLERANCE
of the big batch. TOLERANCE: the frameworks' own torch.optim.AdamW under the same launch land
4.9e-7 (accelerate) and 7.8e-7 (Trainer) from it, accum_fused 4.7e-7 to 1.4e-6 (fp32 sums in
another order); 1e-5 is what the single-process framework tests use, and a rank that trained
on its own data alone lands ~3e-3 away.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _framework_truth as ft

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "_launch_worker.py"
TIMEOUT_S = 400
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


def _launch(argv: list[str], out_dir: Path) -> None:
    """Run a launcher command to the end (a new session, killed whole on timeout: a rank that
    hangs fails the test instead of the suite)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=out_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(argv[:6])} ... did not finish within {TIMEOUT_S} s (a rank hung?)")
    assert proc.returncode == 0, log[-6000:]


def _torchrun(job: str, out_dir: Path) -> None:
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(WORKER), job, str(out_dir)], out_dir)


def _accelerate_launch(job: str, out_dir: Path) -> None:
    # --multi_gpu is accelerate's DDP launcher (torchrun underneath); on CPU it runs CPU processes.
    _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
             str(WORKER), job, str(out_dir)], out_dir)


def _truth(sequences=None, **schedule):
    import _launch_worker as w

    model, lrs = ft.ground_truth(sequences or w.SEQUENCES, w.MICRO_BATCH, 2 * w.K, lr=w.LR,
                                 weight_decay=w.WEIGHT_DECAY, warmup=w.WARMUP, clip=w.CLIP, **schedule)
    return [p.detach() for p in model.parameters()], lrs


def _check(out_dir: Path, run: str, truth, *, lr_prefix: bool = False) -> float:
    """Both ranks bit-identical, on the big batch, with its learning rates. Returns the distance."""
    params, expected_lrs = truth
    ranks = [torch.load(out_dir / f"{run}-rank{r}.pt") for r in (0, 1)]
    for i, (a, b) in enumerate(zip(ranks[0]["params"], ranks[1]["params"], strict=True)):
        assert torch.equal(a, b), f"{run}: parameter {i} differs between the ranks by {(a - b).abs().max().item()}"
    distance = max((a - b).abs().max().item() for a, b in zip(ranks[0]["params"], params, strict=True))
    assert distance < TOLERANCE, f"{run}: {distance} from the big batch"
    lrs = ranks[0]["lrs"]
    assert lrs == pytest.approx(expected_lrs[: len(lrs)] if lr_prefix else expected_lrs, rel=1e-12, abs=0), run
    assert ranks[0]["updates"] == ranks[1]["updates"] == len(expected_lrs), run
    return distance


def _needs(*packages: str) -> None:
    for package in packages:
        pytest.importorskip(package)


@pytest.mark.parametrize("launcher", [_torchrun, _accelerate_launch], ids=["torchrun", "accelerate_launch"])
def test_hf_trainer_recipe(tmp_path, launcher):
    """The Trainer recipe of docs/guides/hf-trainer.md (AdamW in_backward + AccumFusedCallback),
    unchanged; the
    control is the Trainer with torch.optim.AdamW under the same launch."""
    _needs("transformers", *(["accelerate"] if launcher is _accelerate_launch else []))
    launcher("hf_trainer", tmp_path)
    truth = _truth()
    _check(tmp_path, "hf-accum_fused", truth)
    _check(tmp_path, "hf-torch", truth)


def test_accelerate_recipes(tmp_path):
    """The project's Accelerator recipe (step(weight=tokens)) and the mode-A recipe under
    accelerate's accumulation, and torch.optim.AdamW under accelerate's accumulation (control).
    accelerate steps a prepared scheduler once per process per update: the schedule is built for
    one process's loader (7 updates) and advances 2 per update, for torch.optim alike."""
    _needs("accelerate", "transformers")
    import _launch_worker as w

    _accelerate_launch("accelerate", tmp_path)
    truth = _truth(schedule_total=w.schedule_total(), schedule_stride=2)
    for run in ("accelerate-recipe", "accelerate-mode_a", "accelerate-torch"):
        _check(tmp_path, run, truth)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_recipes(tmp_path, strategy):
    """Lightning's own launcher: the recipe of docs/guides/lightning.md (PerUpdateScheduler,
    per-micro-batch weight)
    and mode A under accumulate_grad_batches with the loss scaled to the global window's token
    mean. Lightning's DistributedSampler shuffles (seed 0): the truth reads in that order."""
    _needs("lightning", "transformers")
    import _launch_worker as w

    _launch([sys.executable, str(WORKER), "lightning" if strategy == "ddp" else "lightning_spawn", str(tmp_path)],
            tmp_path)
    truth = _truth(w.lightning_order())
    # The recipe's flushed partial window is applied at the epoch's end, outside optimizer_step.
    _check(tmp_path, f"lightning-{strategy}-recipe", truth, lr_prefix=True)
    _check(tmp_path, f"lightning-{strategy}-mode_a", truth)
