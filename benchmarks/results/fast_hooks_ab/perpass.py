import torch, time, accum_fused, statistics, cProfile, pstats, sys
torch.set_num_threads(1)
N = 60
x = torch.randn(16)
def setup(kind):
    ps = [torch.nn.Parameter(torch.randn(16)) for _ in range(N)]
    opt = accum_fused.AdamW(ps, lr=1e-3, accumulation_steps=1000000, in_backward=True, backend="cpp") if kind == "mode_b" else None
    loss = torch.stack([(p * x).sum() for p in ps]).sum()
    return ps, opt, loss
def run(kind, ps, opt, loss):
    if kind == "mode_b": opt.backward(loss, retain_graph=True)
    else: loss.backward(retain_graph=True)
objs = {k: setup(k) for k in ("native", "mode_b")}
for k in objs: [run(k, *objs[k]) for _ in range(5)]
res = {}
for r in range(9):
    for k in objs:
        t = time.perf_counter(); [run(k, *objs[k]) for _ in range(200)]; res.setdefault(k, []).append((time.perf_counter() - t) / 200 * 1e6)
for k, v in res.items(): print(f"{k:8s} {statistics.median(v):.1f} us per backward pass")
if "--prof" in sys.argv:
    cProfile.run("[run('mode_b', *objs['mode_b']) for _ in range(2000)]", "/tmp/dd/prof3")
    pstats.Stats("/tmp/dd/prof3").sort_stats("tottime").print_stats(20)
