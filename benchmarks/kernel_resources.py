"""Registers, stack (spills) and shared memory of Triton plans and tile variants, compiled for sm90 as the GPU's
JIT compiles them (kernels/triton/_compile_only.py), on this machine: no GPU needed. A tile that spills or
that leaves room for fewer programs per SM shows here before any device time is spent on it.

    python benchmarks/kernel_resources.py            # the rows below, with the installed Triton
    PYTHONPATH=/tmp/t36 python benchmarks/kernel_resources.py   # another Triton (pip install --target)

Rows: (label, Problem fields, Options fields, [tile variants]); a variant replaces plan fields (family_plan).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

H200 = dict(device_type="cuda", sm_count=132, capability=(9, 0))
GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
MLA = dict(num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512, page_size=64, v_in_k=True)
VK = dict(v_from_k=True)  # V's tile from K's (plan.v_from_k; the MLA decode plans take it)
OWN_V = dict(v_from_k=False)  # V loaded on its own
OPT = dict(kv_layout="NHD", causal=True, scale=0.1, window_left=-1, softcap=0.0)
F8 = torch.float8_e4m3fn
ROWS = [
    ("decode 8x8192", dict(GQA, batch=8, q_len=1, max_pages=512), OPT,
     [{}, dict(block_n=64, num_stages=2), dict(num_warps=8)]),
    ("verify S=4 8x8192", dict(GQA, batch=8, q_len=4, max_pages=512), OPT, [{}, dict(block_n=64, num_stages=2)]),
    ("decode 32x4096", dict(GQA, batch=32, q_len=1, max_pages=256), OPT, [{}, dict(num_splits=2, block_n=32)]),
    ("verify S=4 32x4096 G=8", dict(GQA, num_q_heads=64, batch=32, q_len=4, max_pages=256), OPT,
     [{}, dict(num_stages=2, num_splits=2), dict(block_n=32)]),
    ("decode fp8 32x4096", dict(GQA, batch=32, q_len=1, max_pages=256, kv_dtype=F8), OPT,
     [{}, dict(num_stages=2, num_splits=2), dict(block_n=64), dict(num_warps=8)]),
    # one_wave_tile above three programs an SM: one or two K / V buffers, 2 splits or unsplit (16 rows a KV head);
    # each row's other buffer count as a variant
    ("decode 56x4096", dict(GQA, batch=56, q_len=1, max_pages=256), OPT, [{}, dict(num_splits=1, num_stages=3)]),
    ("decode 72x4096", dict(GQA, batch=72, q_len=1, max_pages=256), OPT, [{}, dict(num_stages=2)]),
    ("decode G=8 72x4096", dict(GQA, num_q_heads=64, batch=72, q_len=1, max_pages=256), OPT,
     [{}, dict(num_stages=2)]),
    ("decode G=7 144x4096", dict(GQA, num_q_heads=28, num_kv_heads=4, batch=144, q_len=1, max_pages=256), OPT,
     [{}, dict(num_stages=2), dict(num_splits=2, num_stages=2)]),
    ("verify S=4 72x4096", dict(GQA, batch=72, q_len=4, max_pages=256), OPT, [{}, dict(num_stages=2)]),
    ("extend 4x4096", dict(GQA, batch=4, q_len=4096, max_pages=256), OPT, [{}]),
    ("gpt-oss swa128 decode 32x4096", dict(GQA, num_q_heads=64, head_dim=64, batch=32, q_len=1, max_pages=256),
     dict(OPT, window_left=127), [{}]),
    ("gemma D256 decode 32x4096", dict(GQA, num_q_heads=16, head_dim=256, batch=32, q_len=1, max_pages=256), OPT,
     [{}, dict(block_n=32, num_stages=2)]),
    ("mla H16 decode 32x4096", dict(MLA, batch=32, q_len=1, max_pages=64), OPT,
     [{}, OWN_V, dict(num_stages=2), dict(block_n=64)]),
    ("mla H128 decode 32x4096", dict(MLA, num_q_heads=128, batch=32, q_len=1, max_pages=64), OPT,
     [{}, dict(OWN_V, block_n=32), dict(num_stages=3)]),
    ("mla H16 extend 1x2048", dict(MLA, batch=1, q_len=2048, max_pages=32), OPT,
     [{}, VK, dict(VK, block_n=32)]),
]


def main() -> None:
    import triton

    from b12x_inductor.kernels import Options
    from b12x_inductor.kernels.triton import _compile_only
    from b12x_inductor.plan import Problem, family_plan

    print(f"Triton {triton.__version__}, sm90; per kernel: registers / stack bytes a thread, shared bytes a block")
    print("| row | plan | kernel | registers | stack | shared |")
    print("|---|---|---|---|---|---|")
    for label, fields, options, variants in ROWS:
        problem = Problem(**{**dict(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD", packed=False),
                             **fields, **H200})
        for tiles in variants:
            plan = family_plan(problem, "triton", **tiles)
            what = (f"m{plan.block_m} n{plan.block_n} w{plan.num_warps} st{plan.num_stages} "
                    f"splits {plan.num_splits}" + (" vk" if plan.v_from_k else "") + (" (plan)" if not tiles else ""))
            for kernel in _compile_only.precompile_for(problem, plan, Options(**options), 90):
                use = _compile_only.resource_usage(kernel)
                print(f"| {label} | {what} | {kernel.name} | {use['registers']} | {use['stack']} | {use['shared']} |",
                      flush=True)


if __name__ == "__main__":
    main()
