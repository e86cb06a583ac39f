"""Session 72: the eager op's host time a call on a GPU, the CuTe family's launches from values marshalled once
(`kernels/cute/_runtime.py`: `launch`) and its Triton merge launched directly (`merge_step`), this tree, against
the DSL's own call (which marshals every argument again) and the JIT's merge launch (both patched back in),
alternating in one process, outputs compared bitwise. Run from the project root on a GPU machine with CuTe
installed: python3 benchmarks/results/s72_cute_eager_ab.py. Output: h100_cute_eager_ab_s72.log (or h200_...)."""
import sys
import time

import torch

sys.path.insert(0, ".")
import b12x_inductor as b12x  # noqa: E402
from b12x_inductor import validate  # noqa: E402
from b12x_inductor.kernels import triton as tk  # noqa: E402
from b12x_inductor.kernels.cute import _runtime  # noqa: E402
from tests.test_triton_kernels import make_inputs  # noqa: E402

F8 = torch.float8_e4m3fn
NEW = (_runtime.launch, tk.merge_step)


def dsl_launch(compiled, args):
    compiled(*(a.value for a in args))


class _JitMerge:
    def __init__(self, step):
        self.step = step

    def launch_tensors(self, tensors):
        s = self.step
        s.kernel[s.grid](*tensors, *s.scalars, **s.kwargs)


def jit_merge_step(*key):
    return _JitMerge(NEW[1](*key))


def use(which):
    _runtime.launch, tk.merge_step = NEW if which == "new" else (dsl_launch, jit_merge_step)


MLA = dict(d=576, dv=512, hkv=1, v_view=True, page_size=64)
ROWS = {
    "decode fp8 8x8192 D128": dict(batch=8, hq=32, hkv=8, d=128, page_size=16, lens=[8192] * 8, kv_dtype=F8,
                                   descale="bh"),
    "decode fp8 1x32768 D128": dict(batch=1, hq=32, hkv=8, d=128, page_size=16, lens=[32768], kv_dtype=F8,
                                    descale="bh"),
    "extend 4x2048 D128": dict(batch=4, q_len=2048, hq=32, hkv=8, d=128, page_size=16, lens=[2048] * 4),
    "mla fp8 H16 32x4096": dict(MLA, batch=32, hq=16, lens=[4096] * 32, kv_dtype=F8, descale="b"),
    "mla bf16 H128 32x4096": dict(MLA, batch=32, hq=128, lens=[4096] * 32),
    "mla bf16 H16 1x32768": dict(MLA, batch=1, hq=16, lens=[32768]),
}


def call_of(t):
    out = torch.empty(t["q"].shape[:-1] + t["v_cache"].shape[-1:], dtype=t["q"].dtype, device="cuda")

    def call():
        return b12x.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                                    t["cu_seqlens_q"], k_descale=t["k_descale"], v_descale=t["v_descale"],
                                    return_lse=True, out=out)
    return call


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


print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch.cuda.get_device_name(), torch.__version__, flush=True)
with torch.no_grad():
    for name, kw in ROWS.items():
        t = make_inputs(**kw, device="cuda", seed=3)
        problem = validate.check_paged_attention(
            t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
            kv_layout="NHD", causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0,
            k_descale=t["k_descale"], v_descale=t["v_descale"])
        plan = b12x.select_plan(problem)
        call = call_of(t)
        res = {}
        for which in ("dsl", "new"):
            use(which)
            o, lse = call()
            torch.cuda.synchronize()
            res[which] = (o.clone(), lse.clone())
        same = all(torch.equal(a, b) for a, b in zip(res["dsl"], res["new"]))
        times = {"dsl": [], "new": []}
        for r in range(4):
            for which in ("dsl", "new"):
                use(which)
                times[which].append(host_us(call))
        use("new")
        print(f"[{name}] {plan.family} {plan.num_splits} splits; bitwise equal {same}; µs a call, least of 4 rounds "
              f"(each the least of 9 batches of 200): DSL call + JIT merge {min(times['dsl']):.1f}, marshalled once "
              f"+ direct merge {min(times['new']):.1f}; all rounds {[round(x, 1) for x in times['dsl']]} "
              f"{[round(x, 1) for x in times['new']]}", flush=True)
