"""One rank of the FSDP2 tests (tests/test_fsdp2.py starts 2 or 4 of these).

    python tests/_fsdp_worker.py RANK WORLD_SIZE PORT OUT_DIR

With 2 ranks: every scenario of ``SCENARIOS`` on every backend that loads, the model sharded by
``fully_shard`` over a 1-D mesh. With 4: HSDP, a 2-D mesh of 2 replicas of 2 shards each
(``HSDP_SCENARIOS``, on the cpp backend or, without it, the reference: the agreement under test is
the same on every backend); with FSDP_MESH=tp, tensor parallel + FSDP2 on a (dp 2, "tp" 2) mesh
(``TP_SCENARIOS``), and with FSDP_MESH=hsdp_tp the same on HSDP's (replicate 2, shard 1) x "tp" 2,
a 3-D mesh (8 ranks: shard 2). With 2 ranks and FSDP_MESH=replicate: FSDP2's ``replicate()``
(``REPLICATE_SCENARIOS``). Each against the single-process big batch over every rank's
micro-batches (plain torch.optim, clip_grad_norm_), computed here from the same seeded data;
writes {"<scenario>-<name>[<backend>]": "ok" | failure text} to OUT_DIR/rank<RANK>.json.

The data is uneven on purpose: each rank's micro-batches have other sizes (token-weighted
mean), windows of K=3, two full windows and a partial one closed with flush().
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import accum_fused
from _helpers import cpu_skip_reason, run_worker_cases, worker_case_ids

K = 3
CLIP = 0.5
SEQ = 4
# SIZES[rank][i]: rows of rank's i-th micro-batch (7 each: windows of 3, 3 and a partial 1).
SIZES = ((3, 1, 5, 2, 4, 1, 2), (2, 4, 1, 1, 1, 3, 5), (1, 2, 2, 5, 1, 4, 3), (4, 3, 1, 2, 3, 2, 1))
RANKS = 2  # this run's data-parallel ranks (main)
MESH = None  # None: fully_shard's default 1-D mesh; with 4 ranks HSDP's (replicate 2, shard 2)
TP_MESH = None  # FSDP_MESH=tp: the (dp 2, tp 2) mesh; the model's MLP is tensor-parallel on "tp"
DP_DIMS = ("dp",)  # TP_MESH's data-parallel dimensions: ("replicate", "shard") under FSDP_MESH=hsdp_tp
REPLICATE = False  # FSDP_MESH=replicate: replicate() (FSDP2's, replicate_with_fsdp) on 2 ranks


class Block(nn.Module):
    """A pre-norm transformer block (self-attention and MLP, residual)."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No biases (as LLaMA-style models): the key bias's gradient is zero up to rounding,
        # which Adam's normalisation would turn into noise-driven updates no test can compare.
        self.attn = nn.MultiheadAttention(dim, num_heads=2, batch_first=True, bias=False)
        self.fc1, self.fc2 = nn.Linear(dim, 9), nn.Linear(9, dim)

    def forward(self, h):
        a = self.norm1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        return h + self.fc2(torch.tanh(self.fc1(self.norm2(h))))


class Net(nn.Module):
    """Two transformer blocks, a head and a 1-element scale (only rank 0's shard holds it, and
    with HSDP its replica's); each block and the root sharded by fully_shard."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x, y, poison: float = 0.0):
        for block in self.blocks:
            x = block(x)
        out = self.head(x) * self.scale
        # poison=inf makes only the scale's gradient non-finite (the loss value too).
        return (out - y).square().mean() + (self.scale * poison).sum()


class TPNet(nn.Module):
    """A pre-norm MLP block (fc1 column-wise and fc2 row-wise parallel under FSDP_MESH=tp), a
    head and the 1-element scale; the norm, head and scale are data-parallel only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(6)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 6)
        self.head = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x, y, poison: float = 0.0):
        h = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        out = self.head(h) * self.scale
        return (out - y).square().mean() + (self.scale * poison).sum()


MODEL = Net  # TPNet under FSDP_MESH=tp


def make_data():
    """(x, y) per micro-batch: n sequences of SEQ positions; the weight of a micro-batch is n
    (its loss is the mean over n * SEQ positions)."""
    gen = torch.Generator().manual_seed(7)
    return [[(torch.randn(n, SEQ, 6, generator=gen), torch.randn(n, SEQ, 3, generator=gen)) for n in sizes]
            for sizes in SIZES]


def windows(n: int):
    return [list(range(start, min(start + K, n))) for start in range(0, n, K)]


def sharded_net(mixed_precision: bool = False, model: nn.Module | None = None) -> Net:
    model = MODEL() if model is None else model
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if TP_MESH is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        parallelize_module(model, TP_MESH["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=TP_MESH[DP_DIMS], **kw)
        return model
    shard = fully_shard
    if REPLICATE:  # every rank holds whole parameters (Replicate), FSDP2 all-reduces the gradients
        from torch.distributed._composable.replicate_with_fsdp import replicate as shard
    if MESH is not None:
        kw["mesh"] = MESH
    for block in model.blocks:
        shard(block, **kw)
    shard(model, **kw)
    return model


OPTIMIZERS = {
    "AdamW": (lambda ps, **kw: accum_fused.AdamW(ps, lr=0.02, weight_decay=0.1, **kw),
              lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1)),
    "SGD": (lambda ps, **kw: accum_fused.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "RMSprop-wrapped": (lambda ps, in_backward=False, **kw: accum_fused.GradientAccumulator(
                            torch.optim.RMSprop(ps, lr=0.01), **kw),
                        lambda ps: torch.optim.RMSprop(ps, lr=0.01)),
}


def reference(name, data, skip_windows=()):
    """The single-process big batch: every rank's micro-batches of a window concatenated."""
    model = MODEL()
    opt = OPTIMIZERS[name][1](model.parameters())
    for w, window in enumerate(windows(len(SIZES[0]))):
        if w in skip_windows:
            continue
        x = torch.cat([data[r][i][0] for r in range(RANKS) for i in window])
        y = torch.cat([data[r][i][1] for r in range(RANKS) for i in window])
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return [p.detach() for p in model.parameters()]


def build(name, backend, mixed_precision=False, **kw):
    model = sharded_net(mixed_precision)
    kw.setdefault("max_grad_norm", CLIP)
    opt = OPTIMIZERS[name][0](list(model.parameters()), accumulation_steps=K, backend=backend, **kw)
    return model, opt


def micro_batch(pattern, model, opt, x, y, position, poison=0.0):
    """One micro-batch in pattern a (reduce-scatter every backward), b (FSDP2 holds the
    gradients until the window's last micro-batch), c (in_backward) or bc (both)."""
    if "b" in pattern:
        model.set_requires_gradient_sync(position == K - 1)
    opt.backward(model(x, y, poison), weight=len(x))
    if "c" not in pattern:
        opt.step()


def train(pattern, model, opt, data, rank, poison_at=None):
    for w, window in enumerate(windows(len(SIZES[rank]))):
        for position, i in enumerate(window):
            x, y = data[rank][i]
            poison = float("inf") if (rank, w, position) == poison_at else 0.0
            micro_batch(pattern, model, opt, x, y, position if len(window) == K else K - 1, poison)
    model.set_requires_gradient_sync(True)
    return opt.flush()


def full(model):
    return [p.full_tensor() for p in model.parameters()]


def check_close(got, expected, atol=1e-5, what=""):
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def expect_error(kind, match, fn):
    try:
        fn()
    except kind as exc:
        assert match in str(exc), f"{kind.__name__} without {match!r}: {exc}"
        return
    raise AssertionError(f"no {kind.__name__} ({match!r})")


# ----------------------------------------------------------------------------- scenarios
def big_batch(case, rank, backend, data):
    """Patterns a, b and c with uneven token weights, clipping and a flushed partial window."""
    pattern, name = case.split("-", 1)
    model, opt = build(name, backend, in_backward="c" in pattern)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train(pattern, model, opt, data, rank)
    # (pattern b's micro-batches whose gradients FSDP2 holds back are no "step() without a gradient")
    assert not [w for w in caught if "found no gradient" in str(w.message)], case
    assert opt.update_count == 3, opt.update_count
    check_close(full(model), reference(name, data), what=case)
    if opt.max_grad_norm is not None and name != "RMSprop-wrapped":
        assert opt.last_grad_norm is not None


def mixed_precision(pattern, rank, backend, data):
    """bf16 compute, fp32 reduce: within bf16's reach of the fp32 big batch. SGD, whose update
    is linear in the gradient (Adam's normalisation would magnify bf16 rounding in the
    near-zero gradient elements)."""
    model, opt = build("SGD", backend, mixed_precision=True, in_backward="c" in pattern)
    train(pattern, model, opt, data, rank)
    check_close(full(model), reference("SGD", data), atol=2e-3, what="bf16")


def in_backward_sums(name, rank, backend, data):
    """in_backward with accumulation_steps=1: the tutorial loop (loss / k, step every k-th)
    on equal micro-batches is the big batch, as with torch.optim under FSDP2."""
    model = sharded_net()
    opt = OPTIMIZERS[name][0](list(model.parameters()), backend=backend, max_grad_norm=CLIP, in_backward=True)
    gen = torch.Generator().manual_seed(3)
    batches = [[(torch.randn(2, SEQ, 6, generator=gen), torch.randn(2, SEQ, 3, generator=gen))
                for _ in range(RANKS)] for _ in range(2 * K)]
    ref = MODEL()
    ref_opt = OPTIMIZERS[name][1](ref.parameters())
    for w in range(2):
        window = batches[w * K:(w + 1) * K]
        for micro in window:
            (model(*micro[rank]) / K).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        ref(torch.cat([m[r][0] for m in window for r in range(RANKS)]),
            torch.cat([m[r][1] for m in window for r in range(RANKS)])).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
    check_close(full(model), [p.detach() for p in ref.parameters()], what="sums")


def late_weights(case, rank, backend, data):
    """Weights given after backward (step(weight=)) reach gradients FSDP2 already averaged:
    right when every rank gives the same weight per micro-batch, refused otherwise."""
    model, opt = build("AdamW", backend)
    before = full(model)
    if case == "equal":  # micro-batch j weighs j + 1 on both ranks
        for j in range(K):
            model(*data[rank][j]).backward()
            opt.step(weight=j + 1.0)
        assert opt.updated
        ref = MODEL()
        ref_opt = OPTIMIZERS["AdamW"][1](ref.parameters())
        total = sum(j + 1.0 for j in range(K)) * RANKS
        sum(ref(*data[r][j]) * (j + 1.0) / total for r in range(RANKS) for j in range(K)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        check_close(full(model), [p.detach() for p in ref.parameters()], what="equal late weights")
    elif case == "unequal":
        for i in range(K - 1):
            model(*data[rank][i]).backward()
            opt.step(weight=len(data[rank][i][0]))
        model(*data[rank][K - 1]).backward()
        expect_error(RuntimeError, "backward(loss, weight=w)", lambda: opt.step(weight=len(data[rank][K - 1][0])))
        check_close(full(model), before, atol=0, what="a refused window changes nothing")
    else:  # held: FSDP2 sums the window's gradients, one late weight cannot weight them all
        for i in range(K):
            model.set_requires_gradient_sync(i == K - 1)
            model(*data[0][i]).backward()
            if i < K - 1:
                opt.step(weight=i + 1.0)
            else:
                expect_error(RuntimeError, "held back", lambda: opt.step(weight=K))
        model.set_requires_gradient_sync(True)


def non_finite_skips_everywhere(pattern, rank, backend, data):
    """A non-finite gradient in rank 0's shard only (the scale lives there) skips the window
    on both ranks; the other windows train as the big batch without it."""
    model, opt = build("AdamW", backend, in_backward="c" in pattern)
    updates = []
    for w, window in enumerate(windows(len(SIZES[rank]))):
        for position, i in enumerate(window):
            poison = float("inf") if (w, position) == (1, 0) and rank == 0 else 0.0
            micro_batch(pattern, model, opt, *data[rank][i], position if len(window) == K else K - 1, poison)
        updates.append(opt.updated)
    model.set_requires_gradient_sync(True)
    updates[-1] = opt.flush()
    assert updates == [True, False, True], updates
    check_close(full(model), reference("AdamW", data, skip_windows=(1,)), what="skipped window")


def checkpoint_mid_window(case, rank, backend, data):
    """get_state_dict / dcp.save mid-window, a fresh model and optimizer, dcp.load /
    set_state_dict: training resumes bit for bit. DCP's init step on the fresh optimizer
    counts as nothing. Pattern b mid-window is refused (FSDP2 holds the gradients)."""
    pattern, name = case.split("-", 1)
    model, opt = build(name, backend, in_backward="c" in pattern)
    train(pattern, model, opt, data, rank)
    expected = full(model)

    model, opt = build(name, backend, in_backward="c" in pattern)
    get_state_dict(model, opt)
    assert (opt.micro_step, opt.update_count) == (0, 0)
    stop = K + 1  # one micro-batch into the second window
    for i in range(stop):
        micro_batch(pattern, model, opt, *data[rank][i], i % K)
    if "b" in pattern:  # FSDP2 holds the window's gradients: no checkpoint can save them
        expect_error(RuntimeError, "window boundary", lambda: get_state_dict(model, opt))
        return
    model_sd, optim_sd = get_state_dict(model, opt)
    path = os.path.join(os.environ["DCP_DIR"], f"dcp_{case}_{backend}")  # (the test's tmp_path: removed with it)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model, opt = build(name, backend, in_backward="c" in pattern)
    model_sd, optim_sd = get_state_dict(model, opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert (opt.micro_step, opt.update_count) == (1, 1), (opt.micro_step, opt.update_count)
    for i in range(stop, len(SIZES[rank])):
        position = i % K if i < 2 * K else K - 1
        micro_batch(pattern, model, opt, *data[rank][i], position)
    model.set_requires_gradient_sync(True)
    opt.flush()
    for a, b in zip(full(model), expected):
        assert torch.equal(a, b), (a - b).abs().max()


def refusals(case, rank, backend, data):
    model = sharded_net()
    params = list(model.parameters())
    if case == "grad_scaler":
        opt = accum_fused.AdamW(params, accumulation_steps=K, backend=backend)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(*data[rank][0])).backward()
        expect_error(RuntimeError, "GradScaler", lambda: scaler.step(opt))
    elif case == "process_group":
        expect_error(NotImplementedError, "process_group", lambda: accum_fused.AdamW(
            params, backend=backend, process_group=dist.group.WORLD))
    elif case == "mixed_params":
        expect_error(NotImplementedError, "mix of DTensor and plain", lambda: accum_fused.AdamW(
            params + [nn.Parameter(torch.ones(2))], backend=backend))
    elif case == "in_backward_weight":
        opt = accum_fused.AdamW(params, accumulation_steps=K, backend=backend, in_backward=True)
        expect_error(ValueError, "opt.backward(loss, weight=w)", lambda: opt.set_micro_batch_weight(2.0))
    elif case == "flush_mismatch":
        opt = accum_fused.AdamW(params, accumulation_steps=2, backend=backend)
        opt.backward(model(*data[rank][0]), weight=3)
        opt.step()
        opt.backward(model(*data[rank][1]), weight=3)
        close = opt.flush if rank == 0 else opt.step
        expect_error(RuntimeError, "flush()", close)
    elif case == "tp_weights_differ":  # a "tp" group's ranks with other weights: refused, nothing changed
        opt = accum_fused.SGD(params, lr=0.1, accumulation_steps=2, backend=backend)
        before, tp_rank = full(model), TP_MESH["tp"].get_local_rank()
        opt.backward(model(*data[rank][0]), weight=3 + tp_rank)
        opt.step()
        opt.backward(model(*data[rank][1]), weight=3 + tp_rank)
        expect_error(RuntimeError, "'tp' dimension gave this window different", opt.step)
        check_close(full(model), before, atol=0, what="a refused window changes nothing")


def accelerate_fsdp2(case, rank, backend, data):
    """accelerate's FSDP2 prepare (FullyShardedDataParallelPlugin(fsdp_version=2)), which runs
    on GPUs only (on CPU accelerate leaves the plugin unused), done here step for step with
    accelerate's own function: the optimizer is built on the unsharded model; accelerate puts
    placeholders in its param groups, shards the model, then gives each group a new list of the
    sharded DTensors (fsdp2_switch_optimizer_parameters). The optimizer follows the new
    parameters at its first window: the big batch."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters
    pattern, name = case.split("-", 1)
    model = MODEL()
    opt = OPTIMIZERS[name][0](list(model.parameters()), accumulation_steps=K, backend=backend, max_grad_norm=CLIP,
                              in_backward="c" in pattern)
    old = {n: p.data_ptr() for n, p in model.named_parameters()}
    for group in opt.param_groups:  # accelerate's placeholders, which keep the data pointer
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1)
            group["params"][i].data_ptr = p.data_ptr()
    sharded_net(model=model)
    fsdp2_switch_optimizer_parameters(opt, {old[n]: p for n, p in model.named_parameters()})
    assert train(pattern, model, opt, data, rank)
    assert opt.update_count == 3, opt.update_count
    check_close(full(model), reference(name, data), what=case)
    # Replaced again mid-window: refused, nothing changed.
    opt.backward(model(*data[rank][0]), weight=1.0)
    if "c" not in pattern:
        opt.step()
    opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
    expect_error(RuntimeError, "replaced (its \"params\" list or one in it) while", lambda: opt.backward(model(*data[rank][1])))


SCENARIOS = {
    "big_batch": (big_batch, [f"{p}-{n}" for p in ("a", "b", "c", "bc") for n in OPTIMIZERS
                              if not ("c" in p and "wrapped" in n)]),
    "mixed_precision": (mixed_precision, ["a", "b", "c"]),
    "in_backward_sums": (in_backward_sums, ["AdamW", "SGD"]),
    "late_weights": (late_weights, ["equal", "unequal", "held"]),
    "non_finite": (non_finite_skips_everywhere, ["a", "b", "c"]),
    "checkpoint": (checkpoint_mid_window, ["a-AdamW", "a-SGD", "b-SGD", "bc-AdamW", "c-AdamW", "a-RMSprop-wrapped"]),
    "refusals": (refusals, ["grad_scaler", "process_group", "mixed_params", "in_backward_weight", "flush_mismatch"]),
    "accelerate_fsdp2": (accelerate_fsdp2, ["a-AdamW", "b-SGD", "c-AdamW"]),
}


# HSDP's cases (4 ranks): what the 2-D mesh changes is the window's agreement (the weight
# total and the flush check over all 4 ranks, the norm over the shards counted once), the
# non-finite skip and the checkpoint's layout; each mode and both closes go through it.
HSDP_SCENARIOS = {
    "big_batch": (big_batch, ["a-AdamW", "a-SGD", "b-SGD", "c-AdamW", "c-SGD", "bc-AdamW", "a-RMSprop-wrapped"]),
    "in_backward_sums": (in_backward_sums, ["SGD"]),
    "late_weights": (late_weights, ["equal", "unequal"]),
    "non_finite": (non_finite_skips_everywhere, ["a", "c"]),
    "checkpoint": (checkpoint_mid_window, ["a-SGD", "c-AdamW"]),
    "refusals": (refusals, ["flush_mismatch"]),
}


# Tensor parallel + FSDP2 (4 ranks: dp 2 x tp 2): the weights and checks from one rank per
# data-parallel rank, the norm from every shard once (tensor-parallel shards summed, replicated
# parameters counted once), the divisor over the 2 data-parallel ranks.
TP_SCENARIOS = {
    "big_batch": (big_batch, ["a-AdamW", "a-SGD", "b-SGD", "c-AdamW", "c-SGD"]),
    "late_weights": (late_weights, ["equal"]),
    "non_finite": (non_finite_skips_everywhere, ["a"]),
    "checkpoint": (checkpoint_mid_window, ["a-SGD", "c-AdamW"]),
    "refusals": (refusals, ["flush_mismatch", "tp_weights_differ"]),
}


# replicate() (2 ranks, FSDP2's data parallel without sharding): the norm from one rank's copy,
# the weight total and the checks over both ranks.
REPLICATE_SCENARIOS = {
    "big_batch": (big_batch, ["a-AdamW", "a-SGD", "b-SGD", "c-AdamW", "bc-SGD", "a-RMSprop-wrapped"]),
    "late_weights": (late_weights, ["equal", "unequal"]),
    "non_finite": (non_finite_skips_everywhere, ["a", "c"]),
    "checkpoint": (checkpoint_mid_window, ["a-SGD", "c-AdamW"]),
    "refusals": (refusals, ["flush_mismatch"]),
}


def hsdp_backends() -> list[str]:
    return ["cpp" if cpu_skip_reason("cpp") is None else "torch"]


def case_ids(backends) -> list[str]:
    return worker_case_ids(SCENARIOS, backends)


def hsdp_case_ids() -> list[str]:
    return worker_case_ids(HSDP_SCENARIOS, hsdp_backends())


def tp_case_ids() -> list[str]:
    return worker_case_ids(TP_SCENARIOS, hsdp_backends())


def replicate_case_ids() -> list[str]:
    return worker_case_ids(REPLICATE_SCENARIOS, hsdp_backends())


def set_up_mesh(rank: int, world_size: int, layout: str | None) -> tuple[dict, list | None, int]:
    """The mesh and model of ``layout`` (FSDP_MESH: None, "tp", "hsdp_tp" or "replicate"; 4 ranks
    and None: HSDP) into this module's globals; returns (its scenarios, their backends, this
    rank's data-parallel rank)."""
    global RANKS, MESH, TP_MESH, MODEL, REPLICATE, DP_DIMS
    RANKS, data_rank = world_size, rank
    scenarios, backends = SCENARIOS, None
    if world_size == 4 and layout == "tp":
        TP_MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        MODEL, RANKS, data_rank = TPNet, 2, rank // 2  # (tp peers: the same micro-batches)
        scenarios, backends = TP_SCENARIOS, hsdp_backends()
    elif layout == "hsdp_tp":  # 3-D: 2 replicas of world/4 shards, x tp 2
        DP_DIMS = ("replicate", "shard")
        TP_MESH = init_device_mesh("cpu", (2, world_size // 4, 2), mesh_dim_names=(*DP_DIMS, "tp"))
        MODEL, RANKS, data_rank = TPNet, world_size // 2, rank // 2
        scenarios, backends = TP_SCENARIOS, hsdp_backends()
    elif layout == "replicate":
        REPLICATE, scenarios, backends = True, REPLICATE_SCENARIOS, hsdp_backends()
    elif world_size == 4:
        MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        scenarios, backends = HSDP_SCENARIOS, hsdp_backends()
    return scenarios, backends, data_rank


def main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    os.environ["DCP_DIR"] = out_dir  # checkpoints live in the run's own directory, shared by its ranks
    scenarios, backends, data_rank = set_up_mesh(rank, world_size, os.environ.get("FSDP_MESH"))
    data = make_data()[:RANKS]
    run_worker_cases(scenarios, rank, out_dir, lambda run, name, backend: run(name, data_rank, backend, data), backends)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
