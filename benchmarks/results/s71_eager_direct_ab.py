"""Session 71: the eager op's host time a call on a GPU, the Triton family's direct launches (_Step.launch, this
tree) against the JIT's launch (the launch before them, patched back in), alternating in one process, outputs
compared bitwise. Run from the project root on a GPU machine without CuTe installed (every row then runs the
Triton family): python3 benchmarks/results/s71_eager_direct_ab.py. Output: h100_eager_direct_ab_s71.log."""
import statistics, sys, time
import torch
sys.path.insert(0, ".")
import b12x_inductor as b12x
from b12x_inductor.kernels import triton as tk
from tests.test_triton_kernels import make_inputs

direct_launch = tk._Step.launch


def jit_launch(self, operands):
    self.kernel[self.grid](*self.pick(operands), *self.scalars, **self.kwargs)


ROWS = {
    "decode 8x8192 D128": dict(batch=8, hq=32, hkv=8, d=128, page_size=16, lens=[8192] * 8),
    "decode 32x4096 D256": dict(batch=32, hq=16, hkv=8, d=256, page_size=16, lens=[4096] * 32),
    "verify 8x8192": dict(batch=8, q_len=4, hq=32, hkv=8, d=128, page_size=16, lens=[8192] * 8),
    "extend 4x2048": dict(batch=4, q_len=2048, hq=32, hkv=8, d=128, page_size=16, lens=[2048] * 4),
    "decode fp8 8x8192": dict(batch=8, hq=32, hkv=8, d=128, page_size=16, lens=[8192] * 8, kv_dtype=torch.float8_e4m3fn, descale="bh"),
}


def call_of(t):
    out = torch.empty(t["q"].shape[:-1] + t["v_cache"].shape[-1:], dtype=t["q"].dtype, device="cuda")
    def call():
        return b12x.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                                    t["cu_seqlens_q"], k_descale=t["k_descale"], v_descale=t["v_descale"],
                                    return_lse=True, out=out)
    return call, out


def host_us(call, n=200, batches=9):
    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best * 1e6 / n


with torch.no_grad():
    for name, kw in ROWS.items():
        try:
            t = make_inputs(**kw, device="cuda", seed=3)
        except Exception as e:
            print(name, "inputs failed:", type(e).__name__, e); continue
        call, out = call_of(t)
        res = {}
        for launch in (jit_launch, direct_launch):
            tk._Step.launch = launch
            o, l = call(); torch.cuda.synchronize()
            res[launch.__name__] = (o.clone(), l.clone())
        same = all(torch.equal(a, b) for a, b in zip(res["jit_launch"], res["launch"]))
        times = {"jit": [], "direct": []}
        for r in range(4):
            for key, launch in (("jit", jit_launch), ("direct", direct_launch)):
                tk._Step.launch = launch
                times[key].append(host_us(call))
        tk._Step.launch = direct_launch
        print(f"[{name}] bitwise equal {same}; µs a call, least of 4 rounds (each the least of 9 batches of 200): "
              f"jit {min(times['jit']):.1f} direct {min(times['direct']):.1f}; all rounds jit "
              f"{[round(x,1) for x in times['jit']]} direct {[round(x,1) for x in times['direct']]}", flush=True)
