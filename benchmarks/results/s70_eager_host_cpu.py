"""Session 70: the eager op's host time a call on a machine without a GPU, its kernels stubbed out. Run from
the project root (PYTHONPATH=.), once per version of the tree, alternating (the CPU machine is shared and noisy:
take the least of several runs). Prints:
- op: torch.ops.b12x.paged_attention called eagerly (decode 8x8192, bf16, D 128, GQA 4) with `kernels.run`
  stubbed, under torch.no_grad() (HF generate) and torch.inference_mode(), least of 9 batches of 1000 calls;
- triton: the Triton family's `run` (the Launch, the arguments, the launches) with its two kernels stubbed;
- cute: the CuTe family's `run` with the compiled kernels and the CUDA stream stubbed (the launch arguments of
  decode_mma.py (float8), decode.py (bf16, 4 splits, with the Triton merge stubbed), the extend kernel, MLA).
Output of session 70 (this script at 9d5cbcd and at bdacb9d, alternating, three rounds): cpu_eager_host_ab_s70.log."""
import contextlib
import dataclasses
import time
import timeit
from unittest import mock

import torch

import b12x_inductor  # noqa: F401
from b12x_inductor import kernels, validate
from b12x_inductor.plan import Plan, family_plan, partials_bytes


def best_of(f, n=2000, repeat=7):
    return min(timeit.repeat(f, number=n, repeat=repeat)) / n * 1e6


def op_host():
    B, L, Hq, Hkv, D, P = 8, 8192, 32, 8, 128, 16
    pages = B * L // P
    kc = torch.randn(pages, P, Hkv, D, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.arange(pages, dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, 1, Hq, D, dtype=torch.bfloat16)
    op = torch.ops.b12x.paged_attention
    real = kernels.run
    kernels.run = lambda call: None
    try:
        for name, ctx in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
            with ctx():
                print(f"op {name}: {best_of(lambda: op(q, kc, vc, pt, sl), 1000, 9):.1f} us")
    finally:
        kernels.run = real


def triton_host():
    from b12x_inductor.kernels import triton as T
    from b12x_inductor.kernels.triton import decode

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    saved = decode.split_kernel, decode.merge_kernel
    decode.split_kernel = decode.merge_kernel = Stub()
    try:
        B, L, Hq, Hkv, D, P, S = 8, 8192, 32, 8, 128, 16, 4
        pages = B * L // P
        kc = torch.randn(pages, P, Hkv, D, dtype=torch.bfloat16)
        plan = Plan(mode="decode", family="triton", num_splits=S, block_m=16, block_n=64, num_warps=4, num_stages=2,
                    scratch_bytes=partials_bytes(B * Hq * S, D, torch.bfloat16))
        call = kernels.Call(
            q=torch.randn(B, 1, Hq, D, dtype=torch.bfloat16), k_cache=kc, v_cache=torch.randn_like(kc),
            page_table=torch.arange(pages, dtype=torch.int32).view(B, -1),
            cache_seqlens=torch.full((B,), L, dtype=torch.int32), cu_seqlens_q=None, kv_start=None, sinks=None,
            k_descale=None, v_descale=None, key_mask=None, q_pe=None,
            out=torch.empty(B, 1, Hq, D, dtype=torch.bfloat16), lse=torch.empty(B, 1, Hq),
            scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8),
            options=kernels.Options.of(D, kv_layout="NHD", causal=True, scale=None, window_left=-1, softcap=0.0),
            plan=plan)
        print(f"triton run (decode 8x8192, 4 splits): {best_of(lambda: T.run(call), 5000):.1f} us")
    finally:
        decode.split_kernel, decode.merge_kernel = saved


def cute_host():
    from b12x_inductor.kernels import cute
    from b12x_inductor.kernels.triton import decode as triton_decode
    from tests.test_triton_kernels import make_inputs

    noop = lambda *a, **k: None  # noqa: E731

    class Merge:
        def __getitem__(self, grid):
            return noop

    stream = mock.MagicMock(cuda_stream=0)
    with mock.patch.object(cute, "_compiled", lambda key: noop), \
            mock.patch.object(cute, "_compiled_extend", lambda key: noop), \
            mock.patch.object(cute, "_compiled_mla", lambda key: noop), \
            mock.patch.object(cute, "_check_aligned", lambda *a: None), \
            mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext()), \
            mock.patch.object(torch.cuda, "current_stream", lambda d=None: stream), \
            mock.patch.object(triton_decode, "merge_kernel", Merge()):
        f8 = torch.float8_e4m3fn
        mla = dict(d=576, dv=512, hq=16, hkv=1, v_view=True)
        for name, kw, tiles in (("decode float8", dict(q_len=1, kv_dtype=f8, descale="bh"), {}),
                                ("decode bf16 4 splits", dict(q_len=1), dict(num_splits=4)),
                                ("extend", dict(q_len=40), {}),
                                ("mla 16 splits", dict(mla, q_len=1, lens=[3000, 70]), dict(num_splits=16))):
            t = make_inputs(**{**dict(d=128, hq=8, hkv=2, page_size=16, lens=[100, 70]), **kw})
            problem = validate.check_paged_attention(
                t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
                kv_layout="NHD", causal=True, scale=None, window_left=-1, kv_start=t["kv_start"], sinks=t["sinks"],
                softcap=0.0, k_descale=t["k_descale"], v_descale=t["v_descale"], q_pe=t["q_pe"], out=None)
            problem = dataclasses.replace(problem, device_type="cuda", capability=(9, 0), sm_count=132)
            plan = family_plan(problem, "cute", **tiles)
            q = t["q"]
            call = kernels.Call(
                **{k: t[k] for k in kernels.Call.INPUTS}, out=q.new_empty(q.shape[:-1] + t["v_cache"].shape[-1:]),
                lse=q.new_empty(q.shape[:-1], dtype=torch.float32),
                scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8),
                options=kernels.Options.of(problem.head_dim, kv_layout="NHD", causal=True, scale=None,
                                           window_left=-1, softcap=0.0), plan=plan)
            print(f"cute run ({name}): {best_of(lambda: kernels.run(call)):.1f} us")


if __name__ == "__main__":
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch.__version__)
    op_host()
    triton_host()
    cute_host()
