"""Session 72: host time on a machine without a GPU.
- op / entry: `torch.ops.b12x.paged_attention` under torch.no_grad() and the decode entry op (what a compiled graph
  calls) with the plan's literals, decode 8x8192 bf16 D 128 GQA 4, `kernels.run` stubbed;
- cute run: the CuTe family's `kernels.run` up to the launch (the Call's checks, the launch values and their
  marshalling), real kernels compiled for sm_90a, the compiled program's run (`run_compiled_program`, the step
  after the DSL marshals the arguments) and the Triton merge kernel replaced by no-ops. Run from the project root, once per version of the tree, alternating (the CPU machine
is shared and noisy: take the least of the runs). Output of session 72: cpu_cute_launch_host_s72.log."""
import contextlib
import types
import dataclasses
import sys
import time
import timeit
from unittest import mock

import torch

import cutlass.cute as cute_dsl
from b12x_inductor import kernels, validate
from b12x_inductor.kernels import cute
from b12x_inductor.kernels.cute.plan import mla_narrow_tile
from b12x_inductor.kernels.triton import decode as triton_decode
from b12x_inductor.plan import family_plan
from tests.test_triton_kernels import make_inputs

F8 = torch.float8_e4m3fn
STREAM = types.SimpleNamespace(cuda_stream=0)  # torch's current stream, as the launch reads it
CASES = {  # name: make_inputs arguments, plan tiles
    "decode float8 (decode_mma.py)": (dict(q_len=1, kv_dtype=F8, descale="bh"), {}),
    "decode bf16 4 splits (decode.py)": (dict(q_len=1, lens=[3000, 70]), dict(num_splits=4)),
    "extend": (dict(q_len=40), {}),
    "mla float8 H16 (mla_narrow.py)": (dict(d=576, dv=512, hq=16, hkv=1, v_view=True, kv_dtype=F8, descale="b",
                                            lens=[3000, 70]), "narrow"),
}


def op_host():
    import b12x_inductor.ops as ops

    B, L, Hq, Hkv, D, P = 8, 8192, 32, 8, 128, 16
    pages = B * L // P
    kc = torch.randn(pages, P, Hkv, D, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.arange(pages, dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, 1, Hq, D, dtype=torch.bfloat16)
    problem = validate.check_paged_attention(q, kc, vc, pt, sl, None, kv_layout="NHD", causal=True, scale=None,
                                             window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None,
                                             v_descale=None)
    plan = ops.plan_for(problem)
    out, lse = torch.empty_like(q), torch.empty(B, 1, Hq)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8)
    kw = dict(kernels.Options.of(D, kv_layout="NHD", causal=True, scale=None, window_left=-1,
                                 softcap=0.0).as_kwargs(), **plan.constants())
    real = kernels.run
    kernels.run = lambda call: None
    try:
        with torch.no_grad():
            op = torch.ops.b12x.paged_attention
            us = min(timeit.repeat(lambda: op(q, kc, vc, pt, sl), number=2000, repeat=7)) / 2000 * 1e6
            print(f"op under no_grad (kernels.run stubbed): {us:.1f} us")
            entry = plan.entry_op
            us = min(timeit.repeat(lambda: entry(q, kc, vc, pt, sl, None, None, None, None, None, None, None, out, lse,
                                                 scratch, **kw), number=2000, repeat=7)) / 2000 * 1e6
            print(f"decode entry op (kernels.run stubbed): {us:.1f} us")
    finally:
        kernels.run = real


def main():
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch.__version__, sys.argv[1:])
    op_host()
    compile_ = cute_dsl.compile
    noop = lambda *a, **k: None  # noqa: E731

    class Merge:
        def __getitem__(self, grid):
            return noop

    with mock.patch.object(cute_dsl, "compile", lambda *a, **k: compile_(*a, options="--gpu-arch sm_90a", **k)), \
            mock.patch.object(cute, "_check_aligned", lambda *a: None), \
            mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext()), \
            mock.patch.object(torch.cuda, "current_stream", lambda d=None: STREAM), \
            mock.patch.object(triton_decode, "merge_kernel", Merge()):
        for name, (kw, tiles) in CASES.items():
            t = make_inputs(**{**dict(d=128, hq=8, hkv=2, page_size=16, lens=[100, 70]), **kw})
            problem = validate.check_paged_attention(
                t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
                kv_layout="NHD", causal=True, scale=None, window_left=-1, kv_start=t["kv_start"], sinks=t["sinks"],
                softcap=0.0, k_descale=t["k_descale"], v_descale=t["v_descale"], q_pe=t["q_pe"], out=None)
            problem = dataclasses.replace(problem, device_type="cuda", capability=(9, 0), sm_count=132)
            plan = family_plan(problem, "cute", **(mla_narrow_tile(problem) if tiles == "narrow" else tiles))
            options = kernels.Options.of(problem.head_dim, kv_layout="NHD", causal=True, scale=None, window_left=-1,
                                         softcap=0.0)
            compiled = cute.compile_kernel(problem, plan, options)
            compiled.run_compiled_program = noop  # the program's run: what follows the marshalling
            q = t["q"]
            call = kernels.Call(
                **{k: t[k] for k in kernels.Call.INPUTS}, out=q.new_empty(q.shape[:-1] + t["v_cache"].shape[-1:]),
                lse=q.new_empty(q.shape[:-1], dtype=torch.float32),
                scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8), options=options, plan=plan)
            with mock.patch.object(cute, "_compiled", lambda key: compiled), \
                    mock.patch.object(cute, "_compiled_extend", lambda key: compiled), \
                    mock.patch.object(cute, "_compiled_mla", lambda key: compiled):
                us = min(timeit.repeat(lambda: kernels.run(call), number=2000, repeat=7)) / 2000 * 1e6
            print(f"cute run ({name}; {plan.num_splits} splits): {us:.1f} us")


if __name__ == "__main__":
    main()
