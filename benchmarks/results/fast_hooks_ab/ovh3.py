import torch, time, accum_fused, sys
torch.set_num_threads(1)
N = 400
x = torch.randn(256)
def setup(kind):
    ps = [torch.nn.Parameter(torch.randn(256)) for _ in range(N)]
    if kind == "mode_b":
        opt = accum_fused.AdamW(ps, lr=1e-3, accumulation_steps=1000000, in_backward=True, backend="cpp")
    elif kind == "pyhook":
        def drop(p): p.grad = None
        for p in ps: p.register_post_accumulate_grad_hook(drop)
        opt = None
    elif kind == "native":
        opt = None
    loss = torch.stack([(p * x).sum() for p in ps]).sum()
    return ps, opt, loss
def run(kind, ps, opt, loss):
    if kind == "mode_b": opt.backward(loss, retain_graph=True)
    else:
        loss.backward(retain_graph=True)
res = {}
objs = {k: setup(k) for k in ("native", "pyhook", "mode_b")}
for k in objs: [run(k, *objs[k]) for _ in range(5)]
for r in range(7):
    for k in objs:
        t = time.perf_counter(); [run(k, *objs[k]) for _ in range(20)]; res.setdefault(k, []).append((time.perf_counter() - t) / 20 / N * 1e6)
for k, v in res.items(): print(f"{k:8s} {sorted(v)[3]:.2f} us per param per backward")
if objs["mode_b"][1]._fast_path: print("taken", objs["mode_b"][1]._fast_path.state.taken)
