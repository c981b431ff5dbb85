"""A rank killed mid-window resumes from DCP bit for bit (tests/test_fsdp2.py starts it):

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 tests/_fsdp_resume.py OUT LAYOUT PATTERN KILL

_fsdp_worker's model on LAYOUT's mesh ("hsdp": 2 replicas of 2 shards; "tp": dp 2 x "tp" 2),
AdamW with clipping, pattern a or c, uneven token weights. After every micro-batch each rank
saves a DCP checkpoint of the model and the optimizer (its open window with it), and rank 0
marks it complete (OUT/ckpt_<i>/done). In torchrun's first attempt, rank KILL SIGKILLs itself
after micro-batch KILL_AT (the second window's middle), before that checkpoint: torchrun restarts
every rank, and each loads the newest complete checkpoint (one micro-batch into the window) and
trains on. Rank 0 writes the trained parameters to OUT/final.pt. KILL -1: never killed, the
uninterrupted run the test compares with, bit for bit.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import _fsdp_worker as w
from _helpers import cpu_skip_reason

KILL_AT = w.K + 1  # micro-batch index: the second window's second micro-batch


def main(out: Path, layout: str, pattern: str, kill: int) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, _, data_rank = w.set_up_mesh(rank, world_size, None if layout == "hsdp" else layout)
    data = w.make_data()[:w.RANKS]
    backend = "cpp" if cpu_skip_reason("cpp") is None else "torch"
    model, opt = w.build("AdamW", backend, in_backward="c" in pattern)
    start = 0
    complete = sorted(int(path.name.split("_")[1]) for path in out.glob("ckpt_*") if (path / "done").exists())
    if complete:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(out / f"ckpt_{complete[-1]}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = complete[-1] + 1
        print(f"rank {rank} resumed at micro-batch {start}, micro_step {opt.micro_step}", flush=True)
    n = len(w.SIZES[data_rank])
    for i in range(start, n):
        position = i % w.K if i < n - n % w.K else w.K - 1
        w.micro_batch(pattern, model, opt, *data[data_rank][i], position)
        if rank == kill and i == KILL_AT and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / f"ckpt_{i}"))
        if rank == 0:
            (out / f"ckpt_{i}" / "done").touch()
    opt.flush()
    params = w.full(model)
    if rank == 0:
        torch.save([p.clone() for p in params], out / "final.pt")
    print(f"rank {rank} done, {opt.update_count} updates", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
