#!/usr/bin/env python
"""Data-parallel training with accum_fused: gradients are synchronised once per window.

    torchrun --nproc-per-node 2 examples/data_parallel.py          # CPU, gloo
    torchrun --nproc-per-node 8 examples/data_parallel.py --device cuda   # one GPU per rank, NCCL

No DistributedDataParallel wrapper: the optimizer broadcasts rank 0's parameters when it is
built and all-reduces the fp32 window sums once per window. Each rank reads its own shard; the
shards hold the same number of micro-batches (as DistributedSampler gives) of different sizes,
and that number is not a multiple of k: flush() closes the last, partial window on every rank.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import accum_fused


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")

    torch.manual_seed(1234 + rank)  # ranks start different on purpose: the optimizer broadcasts rank 0's
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                            accumulation_steps=args.accumulation_steps, max_grad_norm=1.0,
                            process_group=dist.group.WORLD)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)

    # this rank's shard: 13 micro-batches of uneven sizes (different on every rank)
    gen = torch.Generator().manual_seed(rank)
    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(0))
    shard = []
    for _ in range(13):
        x = torch.randn(int(torch.randint(4, 33, (1,), generator=gen)), 16, generator=gen)
        shard.append((x, x @ true_w + 0.1 * torch.randn(len(x), 1, generator=gen)))

    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in shard:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)  # a plain mean: no "/ k", no "/ world"
            loss.backward()
            opt.step(weight=len(x))  # collective on the window's last micro-batch
            opt.zero_grad()
            if opt.updated:
                scheduler.step()
            total, count = total + loss.item() * len(x), count + len(x)
        # 13 = 3 windows of 4 + 1: flush() averages the partial window over what it holds.
        # It is collective: every rank calls it, even one with nothing pending.
        opt.flush()
        if opt.updated:
            scheduler.step()
        stats = torch.tensor([total, count], dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: mean loss {stats[0] / stats[1]:.4f}, updates {opt.update_count}")

    # every rank applied the same updates: parameters are identical
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    in_sync = torch.equal(flat, reference)
    print(f"rank {rank}: {opt.update_count} updates, parameters identical to rank 0: {in_sync}")
    dist.destroy_process_group()
    if not in_sync:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
