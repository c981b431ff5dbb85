#!/usr/bin/env python
"""FSDP2 (fully_shard) + gradient accumulation: bytes communicated, peak memory and time per
window for torch's own loop and accum_fused's three patterns, on R ranks (gloo on CPU, NCCL
with --device cuda).

A GPT-style model (bench_memory's GPT: embeddings, pre-LN blocks, LM head tied to wte) sharded
with fully_shard per block and at the root (fp32 parameters; --bf16 adds
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). A window is k micro-batches of
uneven sizes, different on every rank (1..4 sequences of --seq tokens), weighted by tokens;
AdamW lr 1e-3, weight decay 0.01, clip 1.0. Meshes: 1-D (default); FSDP2's replicate()
(--replicate: replicate_with_fsdp.replicate instead of fully_shard on a 1-D mesh of all ranks,
whole parameters on every rank, gradients all-reduced); HSDP (--replicas R: R replicas of
ranks / R shards); tensor parallel + FSDP2 (--tp N: a (dp, "tp") mesh of ranks / N x N, each
block's MLP fc column-wise and fc_proj row-wise parallel on "tp", fully_shard over "dp"; a "tp"
group's ranks read the same micro-batches, chosen by the data-parallel coordinate); both
(--replicas R --tp N: a 3-D (replicate R, shard ranks / (R N), "tp" N) mesh, fully_shard over
("replicate", "shard")). Patterns:

  native  torch.optim.AdamW (foreach on CPU, fused on CUDA); set_requires_gradient_sync(j == k-1);
          (loss * tokens_j * R / window tokens of all ranks).backward() (FSDP2 averages over R);
          clip_grad_norm_ on the DTensor gradients (--tp: per mesh, combined); step(); zero_grad()
  a       accum_fused.AdamW(accumulation_steps=k, max_grad_norm=1.0):
          opt.backward(loss, weight=tokens); opt.step(); opt.zero_grad() - FSDP2 reduce-scatters
          after every backward
  b       as a, with set_requires_gradient_sync(j == k-1): one reduce-scatter per window
  c       accum_fused.AdamW(..., in_backward=True): opt.backward(loss, weight=tokens) only

Each pattern runs in its own set of R processes (fresh memory). Per pattern: window 1 warms up
(optimizer state allocated), window 2 is measured for memory and bytes, then --windows timed
windows. Reported per rank per window:

  bytes    by collective kind, counted in Python around torch.distributed's functions (the ones
           FSDP2 and accum_fused call: all_gather_single / all_gather_into_tensor, reduce_scatter_single
           / reduce_scatter_tensor, all_reduce, broadcast, ...; nested calls counted once) and around
           the functional collectives DTensor uses (clip_grad_norm_'s all-reduce). The size counted
           is the full (unsharded) message, as nccl-tests' "size": all-gather the output tensor,
           reduce-scatter the input tensor, all-reduce / broadcast the tensor. A ring moves about
           (R-1)/R of it per rank (all-reduce twice that). The measured window also runs under a
           dispatch mode that logs every c10d / _c10d_functional op: any collective the Python
           wrappers missed shows up as "unwrapped" in the output.
  peak     CPU: peak bytes of live tensor storages over the measured window, from bench_memory's
           dispatch-mode tracker (every op's outputs, each storage once, freed by weakref
           finalizer), extended to see FSDP2's storage resize_() (unsharded parameters are freed
           and re-allocated that way) and to unwrap DTensor outputs. It starts before the model is
           built: the peak holds this rank's shards, optimizer state and buffers, gradients,
           unsharded parameters, activations and collective buffers; not scratch inside one op
           (nor inside one DTensor op) nor the process group's own buffers.
           CUDA: torch.cuda.max_memory_allocated() over the measured window.
           B/param = this rank's peak / the model's (global) parameter count.
  ms       median over the timed windows of the slowest rank's window time.

Usage (from the repository root):
  python benchmarks/bench_fsdp.py                          # 2 gloo ranks, 4.3M params, k=8
  python benchmarks/bench_fsdp.py --device cuda --ranks 1 --layers 2 --windows 3
  python benchmarks/bench_fsdp.py --ranks 4 --replicas 2 --windows 3   # HSDP, 2 x 2
  python benchmarks/bench_fsdp.py --ranks 4 --tp 2 --windows 3         # tensor parallel 2 x FSDP2 over 2
  python benchmarks/bench_fsdp.py --ranks 2 --replicate --windows 3    # FSDP2's replicate(): all-reduced gradients
  python benchmarks/bench_fsdp.py --ranks 8 --replicas 2 --tp 2 --windows 2   # HSDP x tensor parallel, 3-D mesh
  torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py     # ranks started by torchrun
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import weakref
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import accum_fused
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(HERE.parent))
    import accum_fused
from accum_fused.bench import cpu_model  # noqa: E402
from bench_memory import GPT, LiveTensorTracker  # noqa: E402

PATTERNS = ("native", "a", "b", "c")
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 1e-2, 1.0

# ------------------------------------------------------------------------- byte counting
KINDS = {  # torch.distributed function -> (kind, which argument is the full message)
    "all_gather_single": ("all_gather", 0), "all_gather_into_tensor": ("all_gather", 0),
    "_all_gather_base": ("all_gather", 0), "all_gather": ("all_gather", 0),
    "all_gather_coalesced": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0), "all_to_all_single": ("all_to_all", 0), "reduce": ("reduce", 0),
    "barrier": ("barrier", None),
}
FUNCOL = {  # torch.distributed._functional_collectives (DTensor's redistribute)
    "all_reduce": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_tensor": ("all_gather", None), "reduce_scatter_tensor": ("reduce_scatter", 0),
    "broadcast": ("broadcast", 0), "all_to_all_single": ("all_to_all", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        local = getattr(x, "_local_tensor", x)
        return local.numel() * local.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter:
    """Bytes and calls per collective kind, counted around torch.distributed's Python functions."""

    def __init__(self):
        self.bytes, self.calls, self.names = defaultdict(int), defaultdict(int), defaultdict(int)
        self.name_bytes = defaultdict(int)
        self.on = True
        self._depth = threading.local()

    def _wrap(self, fn, name, kind, arg, funcol):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._depth, "n", 0)
            if depth == 0 and counter.on:
                n = 0
                if arg is not None and len(args) > arg:
                    n = _nbytes(args[arg])
                elif arg is None and funcol and args:  # all_gather_tensor(input, gather_dim, group)
                    group = args[2] if len(args) > 2 else kwargs.get("group")
                    n = _nbytes(args[0]) * _group_size(group)
                elif arg is not None:
                    key = {0: ("tensor", "output_tensor", "output", "tensor_list", "self"),
                           1: ("input", "input_tensor", "input_list")}[arg]
                    n = next((_nbytes(kwargs[k]) for k in key if k in kwargs), 0)
                counter.bytes[kind] += n
                counter.calls[kind] += 1
                counter.names[("funcol." if funcol else "dist.") + name] += 1
                counter.name_bytes[("funcol." if funcol else "dist.") + name] += n
            counter._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.n = depth

        wrapper.__wrapped__ = fn
        return wrapper

    def install(self) -> None:
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        for name, (kind, arg) in KINDS.items():
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            w = self._wrap(fn, name, kind, arg, False)
            setattr(c10d, name, w)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, w)
        for name, (kind, arg) in FUNCOL.items():
            fn = getattr(funcol, name, None)
            if fn is not None:
                setattr(funcol, name, self._wrap(fn, name, kind, arg, True))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.names.clear()
        self.name_bytes.clear()


_COUNTER: CommCounter | None = None


def _group_size(group) -> int:
    try:
        if isinstance(group, tuple):  # (mesh, dim)
            return group[0].size(group[1])
        if hasattr(group, "size") and not isinstance(group, (list, torch.Tensor)):
            return group.size() if callable(group.size) else int(group.size)
        return dist.get_world_size(group)
    except Exception:
        return dist.get_world_size()


# ------------------------------------------------------------------------- memory tracker
class FsdpTracker(LiveTensorTracker):
    """bench_memory's tracker, plus: DTensor outputs counted by their local tensor, storages
    resized in place (FSDP2 frees and re-allocates unsharded parameters with
    UntypedStorage.resize_) followed, and c10d ops logged (names and counts)."""

    def __init__(self):
        super().__init__()
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self
        self.collective_ops: dict[str, int] = defaultdict(int)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ns = func.namespace
                if ns in ("c10d", "_c10d_functional"):
                    tracker.collective_ops[f"{ns}.{func._opname}"] += 1
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        for plain in _plain_tensors(t):
                            tracker._add(plain)
                if tracker.current > tracker.peak:
                    tracker.peak = tracker.current
                    tracker.peak_op = str(func)
                return out

        self.peak_op = None
        self.mode = _Mode()
        global _RESIZE_TRACKER
        _RESIZE_TRACKER = self
        if not hasattr(torch.UntypedStorage.resize_, "__wrapped__"):
            torch.UntypedStorage.resize_ = _tracked_resize(torch.UntypedStorage.resize_)

    def resized(self, storage, old_ptr: int, entry) -> None:
        if entry is not None:
            self._free(old_ptr, entry)
        ptr = storage.data_ptr()
        if storage.nbytes() > 0 and ptr != 0 and ptr not in self.live:
            new = [storage.nbytes()]
            self.live[ptr] = new
            self.current += new[0]
            weakref.finalize(storage, self._free, ptr, new)
            if self.current > self.peak:
                self.peak, self.peak_op = self.current, None


_RESIZE_TRACKER: FsdpTracker | None = None


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor subclass's storage: a DTensor's local tensor, the
    AsyncCollectiveTensor that tensor parallel's functional collectives return, ..."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in attrs)
    return [plain for x in inner if isinstance(x, torch.Tensor) for plain in _plain_tensors(x)]


def _tracked_resize(original):
    def resize_(storage, size):
        tracker = _RESIZE_TRACKER
        old_ptr = storage.data_ptr()
        entry = tracker.live.get(old_ptr) if tracker is not None else None
        out = original(storage, size)
        if tracker is not None:
            tracker.resized(storage, old_ptr, entry)
        return out

    resize_.__wrapped__ = original
    return resize_


# ----------------------------------------------------------------------------- one rank
def micro_batch_sizes(rank: int, k: int) -> list[int]:
    gen = torch.Generator().manual_seed(10 + rank)
    return [int(torch.randint(1, 5, (1,), generator=gen)) for _ in range(k)]


def run_rank(rank: int, world: int, args, port: int | None, pattern: str, result_path: str | None) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if port is not None:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    elif not dist.is_initialized():  # torchrun: one process group for every pattern
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
    global _COUNTER
    if _COUNTER is None:  # once per process (torchrun runs every pattern in the same processes)
        _COUNTER = CommCounter()
        _COUNTER.install()
    counter = _COUNTER
    counter.reset()
    tracker = None if cuda else FsdpTracker()
    if tracker is not None:
        tracker.mode.__enter__()

    k = args.k
    torch.manual_seed(0)
    model = GPT(args.vocab, args.ctx, args.d_model, args.layers, args.heads).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    root_params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    data_ranks, data_rank = world, rank  # data-parallel ranks, each with micro-batches of its own
    shard = fully_shard
    if args.tp > 1:  # tensor parallel on "tp" (each block's MLP), FSDP2 over "dp" (or HSDP's two dimensions)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        dp = ("replicate", "shard") if args.replicas > 1 else ("dp",)
        shape = (args.replicas, world // args.replicas // args.tp) if args.replicas > 1 else (world // args.tp,)
        tp_mesh = init_device_mesh(device.type, (*shape, args.tp), mesh_dim_names=(*dp, "tp"))
        for block in model.blocks:
            parallelize_module(block, tp_mesh["tp"], {"fc": ColwiseParallel(), "fc_proj": RowwiseParallel()})
        mesh = tp_mesh[dp]
        # a "tp" group shares its micro-batches, chosen by its data-parallel coordinate (row-major over dp)
        data_ranks, data_rank = mesh.size(), 0
        for name in dp:
            data_rank = data_rank * tp_mesh.size(tp_mesh.mesh_dim_names.index(name)) + tp_mesh.get_local_rank(name)
    elif args.replicate:  # FSDP2's replicate(): whole parameters everywhere, gradients all-reduced
        from torch.distributed._composable.replicate_with_fsdp import replicate as shard
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("replicate",))
    elif args.replicas > 1:  # HSDP: reduce-scatter within a replica, all-reduce across replicas
        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    # the parameters one data-parallel rank holds before fully_shard (with --tp its tensor-parallel part)
    local_params = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16
                 else MixedPrecisionPolicy())
    for block in model.blocks:
        shard(block, mesh=mesh, mp_policy=mp_policy)
    shard(model, mesh=mesh, mp_policy=mp_policy)
    params = list(model.parameters())
    if pattern == "native":
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **({"fused": True} if cuda else {"foreach": True}))
    else:
        opt = accum_fused.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=k,
                                max_grad_norm=MAX_GRAD_NORM, in_backward=pattern == "c")

    # this rank's k micro-batches (reused every window) and the window's token total over all ranks
    gen = torch.Generator().manual_seed(100 + data_rank)
    batches = []
    for b in micro_batch_sizes(data_rank, k):
        idx = torch.randint(0, args.vocab, (b, args.seq + 1), generator=gen)
        batches.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    window_tokens = sum(b * args.seq for r in range(data_ranks) for b in micro_batch_sizes(r, k))

    def window() -> None:
        for j, (x, y) in enumerate(batches):
            if pattern in ("native", "b"):
                model.set_requires_gradient_sync(j == k - 1)
            loss = model(x, y)
            tokens = x.numel()
            if pattern == "native":
                (loss * (tokens * data_ranks / window_tokens)).backward()  # FSDP2 divides by data_ranks
            else:
                opt.backward(loss, weight=tokens)
                if pattern != "c":
                    opt.step()
                    opt.zero_grad()
        if pattern == "native":
            clip_native(params, MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # window 1: warm-up; window 2: memory and bytes
    counter.on = False
    window()
    dist.barrier()
    sync()
    counter.on = True
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    else:
        tracker.collective_ops.clear()
        tracker.reset_peak()
        tracker.peak_op = "(window start)"
        resident = tracker.current
    window()
    sync()
    peak = torch.cuda.max_memory_allocated() if cuda else tracker.peak
    peak_op = None if cuda else tracker.peak_op  # the op whose output set the peak (None: a resize_)
    comm = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "functions": dict(counter.names),
            "function_bytes": dict(counter.name_bytes)}
    dispatch_ops = dict(tracker.collective_ops) if tracker is not None else {}
    if tracker is not None:
        tracker.mode.__exit__(None, None, None)
    counter.on = False

    times = []
    for _ in range(args.windows):
        dist.barrier()
        sync()
        start = time.perf_counter()
        window()
        sync()
        slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(slowest.item())
    if pattern != "native":
        assert opt.update_count == 2 + args.windows, opt.update_count

    # a fingerprint of the trained model: every pattern should end at (nearly) the same parameters
    fingerprint = torch.zeros(2, dtype=torch.float64, device=device)
    for p in params:
        local = p.to_local().double()
        fingerprint += torch.stack([local.sum(), local.square().sum()])
    dist.all_reduce(fingerprint)

    peaks = [None] * world
    dist.all_gather_object(peaks, {"rank": rank, "peak": peak, "peak_op": peak_op, "resident": resident, "comm": comm,
                                   "dispatch_ops": dispatch_ops})
    if rank == 0 and result_path is not None:
        Path(result_path).write_text(json.dumps({
            "pattern": pattern, "ranks": world, "replicas": args.replicas, "tp": args.tp,
            "replicate": args.replicate, "params": n_params,
            "root_params": root_params, "local_params": local_params,
            "window_tokens": window_tokens, "ms_per_window": statistics.median(times) * 1e3,
            "all_ms": [t * 1e3 for t in times], "per_rank": peaks,
            "fingerprint": fingerprint.tolist(), "dist_backend": dist.get_backend(),
            "device": torch.cuda.get_device_name() if cuda else cpu_model(),
        }))
    if tracker is not None:
        global _RESIZE_TRACKER
        _RESIZE_TRACKER = None
    dist.barrier()
    if port is not None:
        dist.destroy_process_group()


def clip_native(params: list, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_; with tensor parallel, whose parameters are on two meshes
    (dp x "tp" and dp alone) that clip_grad_norm_ cannot stack together, the norm of each mesh's
    gradients (DTensor's all-reduce) combined here, as torchtitan does."""
    by_mesh = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh].append(p.grad)
    if len(by_mesh) <= 1:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    norms = [torch.nn.utils.get_total_norm(grads).full_tensor() for grads in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    torch._foreach_mul_([g for grads in by_mesh.values() for g in grads], coef)


# ------------------------------------------------------------------------------- report
def expected_bytes(rec: dict, args, world: int) -> dict[str, float]:
    """The model of bytes per rank per window (full-message sizes, see the docstring).
    reduce-scatter: the gradient in the reduce dtype (fp32 here) once per reduce: k times for a
    and c, once for native and b. all-gather: fp32 or bf16 parameters (param_dtype), the whole
    model in every forward and every unit but the root again in backward (the root is not
    resharded after forward), k micro-batches. all-reduce: accum_fused's (3 + 3k) fp64 values;
    native: clip_grad_norm_'s norm (not modelled). HSDP (--replicas R): the collectives above run
    within a replica (S = world / R ranks); each reduce adds an all-reduce of the fp32 gradient
    shard (P / S) across the replicas, and accum_fused's values are all-reduced twice (over the
    shards, then the replicas). Tensor parallel (--tp N): FSDP2's collectives run over "dp"
    (S = world / N ranks) on each rank's tensor-parallel part of the model (P_local: the MLPs'
    fc weight and bias and fc_proj weight 1/N each, the rest whole) instead of P; accum_fused's
    values get one more (the weight total of every rank, for the "tp" check) and are all-reduced
    once per mesh dimension (twice); tensor parallel itself all-reduces each block's activations
    (b, seq, d) twice per micro-batch: fc_proj's output in forward, fc's input gradient in
    backward (activation dtype: param_dtype). HSDP x tensor parallel (--replicas R --tp N, the
    3-D mesh): both at once: FSDP2's collectives over "shard" (S = world / (R N)) on P_local, each
    reduce's fp32 shard (P_local / S) all-reduced across the replicas, accum_fused's 4 + 3k values
    all-reduced once per mesh dimension (three times), tensor parallel's activations as above
    (measured to the byte, results/fsdp_hsdp_tp_cpu_20261129.txt: a and c 27 dist.all_reduce =
    3 units x k + accum_fused's 3; native's clip adds 3 funcol all-reduces, 144 B, not modelled).
    replicate() (--replicate): FSDP2 with a DDP mesh (DDPMeshInfo): no all-gather (every rank
    holds whole parameters) and no reduce-scatter (foreach_reduce skips it for a group of one and
    copies the gradient), one all-reduce of the whole fp32 gradient (P x 4 bytes) per reduce (k for
    a and c, 1 for native and b), plus accum_fused's values once (a 1-D mesh); native's
    clip_grad_norm_ on Replicate() gradients is computed locally (no collective), so its bytes are
    modelled too. Measured to the byte (results/fsdp_replicate_cpu_20261129.txt: only
    dist.all_reduce, one per FSDP2 unit (5) and reduce, plus accum_fused's one: a and c 41 calls,
    b 6, native 5). Padding of shards to a multiple of S is not modelled. One rank: FSDP2 and
    DTensor skip their collectives (accum_fused's all-reduce runs; replicate()'s gradient
    all-reduce is still called)."""
    P, root, k = rec["params"], rec["root_params"], args.k
    replicas, tp, replicate = rec.get("replicas", 1), rec.get("tp", 1), rec.get("replicate", False)
    shards = 1 if replicate else world // replicas // tp
    p_bytes = 2 if args.bf16 else 4
    reduces = k if rec["pattern"] in ("a", "c") else 1
    sharded = 1 if shards > 1 else 0
    P_local = rec.get("local_params", P)
    # FSDP2's all-reduce of the fp32 gradient (shard) per reduce: across HSDP's replicas, or replicate()'s ranks
    grad_all_reduce = reduces * P_local / shards * 4 if replicas > 1 or replicate else 0
    mesh_dims = (2 if replicas > 1 else 1) + (1 if tp > 1 else 0)
    ours = 8 * (3 + 3 * k + (1 if tp > 1 else 0)) * mesh_dims
    # rank 0 (whose bytes are counted) reads data-parallel rank 0's micro-batches
    tp_activations = (2 * args.layers * sum(micro_batch_sizes(0, k)) * args.seq * args.d_model * p_bytes
                      if tp > 1 else 0)
    if rec["pattern"] != "native":
        all_reduce = ours + grad_all_reduce + tp_activations
    else:  # clip_grad_norm_'s all-reduce is not modelled, but replicate()'s norm needs none
        all_reduce = grad_all_reduce if replicate else float("nan")
    return {"reduce_scatter": sharded * reduces * P_local * 4, "all_gather": sharded * k * (2 * P_local - root) * p_bytes,
            "all_reduce": all_reduce, "all_reduce_grads": grad_all_reduce,
            "all_reduce_tp_activations": tp_activations, "all_reduce_accum_fused": ours}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="HSDP: a 2-D mesh of this many replicas, each sharding over ranks / replicas")
    parser.add_argument("--tp", type=int, default=1,
                        help='tensor parallel + FSDP2: a (dp, "tp") mesh with this many ranks per "tp" group; '
                             'with --replicas R a 3-D (replicate, shard, "tp") mesh')
    parser.add_argument("--replicate", action="store_true",
                        help="FSDP2's replicate() (replicate_with_fsdp) instead of fully_shard, on a 1-D mesh of all ranks")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("-k", type=int, default=8, help="micro-batches per window")
    parser.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (after 2 untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    parser.add_argument("--json", default=None, help="write results here (default: benchmarks/results/fsdp_<device>_<time>.json)")
    args = parser.parse_args()
    patterns = [p for p in args.patterns.split(",") if p]
    if set(patterns) - set(PATTERNS):
        parser.error(f"--patterns: choose from {','.join(PATTERNS)}")
    if args.replicate and (args.tp > 1 or args.replicas > 1):
        parser.error("--replicate takes a 1-D mesh of all ranks: not with --tp or --replicas")
    ranks = int(os.environ.get("WORLD_SIZE", args.ranks))
    if args.tp < 1 or args.replicas < 1 or ranks % (args.tp * args.replicas):
        parser.error(f"--replicas {args.replicas} x --tp {args.tp} must divide the number of ranks ({ranks})")
    if args.json is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.json = str(HERE / "results" / f"fsdp_{args.device}_{stamp}.json")

    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    records = []
    scratch = Path(args.json).with_suffix(".tmp")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    for pattern in patterns:
        if torchrun:  # one process group after another in the same processes
            run_rank(0, 0, args, None, pattern, str(scratch))
            dist_rank = int(os.environ["RANK"])
            if dist_rank != 0:
                continue
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(run_rank, args=(args.ranks, args, port, pattern, str(scratch)),
                               nprocs=args.ranks, start_method="spawn")
        records.append(json.loads(scratch.read_text()))
        scratch.unlink()
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0

    world = records[0]["ranks"]
    base_fp = next((r["fingerprint"] for r in records if r["pattern"] == "native"), records[0]["fingerprint"])
    rows = []
    for rec in records:
        r0 = rec["per_rank"][0]
        model = expected_bytes(rec, args, world)
        peak = max(r["peak"] for r in rec["per_rank"])
        rows.append({
            "pattern": rec["pattern"], "ms_per_window": rec["ms_per_window"],
            "peak_bytes_max_rank": peak, "peak_B_per_param": peak / rec["params"],
            "resident_B_per_param": max(r["resident"] for r in rec["per_rank"]) / rec["params"],
            "bytes_rank0": r0["comm"]["bytes"], "calls_rank0": r0["comm"]["calls"],
            "functions_rank0": r0["comm"]["functions"], "function_bytes_rank0": r0["comm"].get("function_bytes", {}),
            "dispatch_collective_ops_rank0": r0["dispatch_ops"],
            "expected_bytes": model,
            "fingerprint_rel_diff_vs_native": abs(rec["fingerprint"][1] - base_fp[1]) / base_fp[1],
            "all_ms": rec["all_ms"], "per_rank": rec["per_rank"],
        })

    P = records[0]["params"]
    tp_params = f"{records[0]['local_params'] / 1e6:.2f}M params per tp rank before sharding"
    layout = (f" (HSDP x tensor parallel: {args.replicas} replicas of {world // args.replicas // args.tp} shards x "
              f"\"tp\" {args.tp}, a 3-D mesh; {tp_params})" if args.replicas > 1 and args.tp > 1 else
              f" (HSDP: {args.replicas} replicas of {world // args.replicas} shards)" if args.replicas > 1 else
              f" (tensor parallel {args.tp} x FSDP2 over {world // args.tp}: dp x \"tp\"; {tp_params})" if args.tp > 1 else
              " (FSDP2's replicate(): whole parameters on every rank, gradients all-reduced)" if args.replicate else "")
    print(f"{world} rank(s){layout}, {records[0]['dist_backend']} on {records[0]['device']}; GPT {P / 1e6:.2f}M params "
          f"(root unit {records[0]['root_params'] / 1e6:.2f}M), k={args.k}, {args.seq}-token sequences, 1-4 per "
          f"micro-batch, {records[0]['window_tokens']} tokens per window (all ranks), "
          f"{'bf16 params / fp32 reduce' if args.bf16 else 'fp32'}; {args.windows} timed windows")
    print("MB per rank per window: measured (model). Full message sizes: all-gather output, reduce-scatter input, all-reduce tensor.")
    print()
    print("| pattern | ms/window | peak B/param | all-gather MB | reduce-scatter MB | all-reduce bytes | fingerprint vs native |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        b, m, c = row["bytes_rank0"], row["expected_bytes"], row["calls_rank0"]
        ar_model = "?" if m["all_reduce"] != m["all_reduce"] else f"{m['all_reduce']:.0f}"
        print(f"| {row['pattern']} | {row['ms_per_window']:.1f} | {row['peak_B_per_param']:.1f} | "
              f"{b.get('all_gather', 0) / 1e6:.2f} ({m['all_gather'] / 1e6:.2f}) | "
              f"{b.get('reduce_scatter', 0) / 1e6:.2f} ({m['reduce_scatter'] / 1e6:.2f}) | "
              f"{b.get('all_reduce', 0)} ({ar_model}), {c.get('all_reduce', 0)} call(s) | {row['fingerprint_rel_diff_vs_native']:.1e} |")
    print()
    for row in rows:
        print(f"{row['pattern']}: resident {row['resident_B_per_param']:.1f} B/param at the window start; peak "
              f"reached by {row['per_rank'][0]['peak_op'] or 'a storage resize_ (FSDP2 allocating unsharded parameters)'} "
              "on rank 0")
    for row in rows:
        print(f"{row['pattern']}: calls {row['functions_rank0']}; bytes {row['function_bytes_rank0']}; "
              f"dispatcher c10d ops {row['dispatch_collective_ops_rank0']}")
    if args.tp > 1 or args.replicas > 1 or args.replicate:
        m = rows[0]["expected_bytes"]
        grads = ("replicate()'s" if args.replicate else "HSDP's across replicas") if args.replicate or args.replicas > 1 else None
        print("all-reduce model: accum_fused's agreement "
              f"{m['all_reduce_accum_fused']:.0f} B (dist.all_reduce)"
              + (f"; FSDP2's gradient all-reduce ({grads}) "
                 + ", ".join(f"{r['pattern']} {r['expected_bytes']['all_reduce_grads']:.0f} B" for r in rows)
                 + " (dist.all_reduce)" if grads else "")
              + (f"; tensor parallel's activations {m['all_reduce_tp_activations']:.0f} B (funcol.all_reduce)"
                 if args.tp > 1 else ""))
    record = {
        "benchmark": "bench_fsdp", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "args": vars(args), "ranks": world, "params": P,
        "root_params": records[0]["root_params"], "local_params": records[0].get("local_params"),
        "dist_backend": records[0]["dist_backend"],
        "device": records[0]["device"], "cpu_count": os.cpu_count(),
        "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__, "accum_fused": accum_fused.__version__, "python": platform.python_version(),
        "bytes_counted_as": "per rank per window, full message size: all-gather output tensor, reduce-scatter input "
                            "tensor, all-reduce/broadcast tensor; counted around torch.distributed's Python functions "
                            "and DTensor's functional collectives, nested calls once",
        "memory_counted_as": ("CUDA: torch.cuda.max_memory_allocated over the measured window" if args.device == "cuda" else
                              "CPU: peak live tensor storage bytes over the measured window (dispatch-mode tracker from "
                              "before the model is built, FSDP2 storage resize_ followed)") + "; B/param over global params",
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
