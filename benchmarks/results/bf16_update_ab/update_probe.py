"""Update kernel time per call: cpp_backend adam_update / sgd_update over 16M elements in 8 tensors,
fp32 and bf16 params, nearest (and, where the code has it, stochastic/kahan)."""
import sys, time, json, torch
from accum_fused.backends import cpp_backend as cb
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["nearest"]
n, numel = 8, 2 << 20
out = {}
for dtype in (torch.float32, torch.bfloat16):
    for mode in modes:
        if mode != "nearest" and dtype != torch.bfloat16:
            continue
        g = torch.Generator().manual_seed(0)
        P = [torch.randn(numel, generator=g).to(dtype) for _ in range(n)]
        B = [torch.randn(numel, generator=g) for _ in range(n)]
        M = [torch.zeros(numel) for _ in range(n)]; V = [torch.zeros(numel) for _ in range(n)]
        extra = {}
        if mode == "stochastic": extra = dict(bf16_update=mode, rounding_keys=list(range(n)))
        if mode == "kahan": extra = dict(bf16_update=mode, compensations=[torch.zeros(numel, dtype=torch.bfloat16) for _ in range(n)])
        kw = dict(step=3, weight_sum=4.0, clip_coef=None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  amsgrad=False, maximize=False, decoupled_weight_decay=True, **extra)
        ts = []
        for r in range(40):
            t = time.perf_counter()
            cb.adam_update(params=P, buffers=B, exp_avgs=M, exp_avg_sqs=V, max_exp_avg_sqs=[], **kw)
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[f"adam {str(dtype)[6:]} {mode}"] = (round(ts[0] * 1e3, 2), round(ts[len(ts)//2] * 1e3, 2))
print(json.dumps(out))
