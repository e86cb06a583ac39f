"""The Triton kernel family (CUDA): decode/verify (split-KV with GQA packing, decode.py) and extend (extend.py).

`run` launches the plan's kernels on torch's current stream and writes only `out`, `lse` and the plan's
`scratch`: no allocation, no host sync, lengths read on the device, so it is CUDA-graph safe. `precompile`
compiles the same kernels ahead from the static Problem (Triton's `warmup`), so that no JIT compile happens
inside a capture. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests use this); the
interpreter's bf16/fp16 `tl.dot` is wrong on CPU, so there the products run in fp32.
"""

from __future__ import annotations

import os

import torch

from b12x_inductor.plan import HEAD_DIMS
from b12x_inductor.validate import cache_dims

FP8 = torch.float8_e4m3fn
_Q_DTYPES = (torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Compute capabilities the GPU tests (tests/test_triton_kernels.py -m gpu) have run and passed on: the H200.
VERIFIED_CAPABILITIES = frozenset({(9, 0)})
# The kernels are plain Triton, so they run on every CUDA GPU Triton generates code for from sm80 on: sm80/86/87
# (A100, A10, RTX 30), sm89 (L40, RTX 40), sm90 (H100/H200), sm100/103 (B200/B300), sm110, sm120/121 (RTX 50,
# DGX Spark). CI compiles every tile configuration the plans emit for sm80, sm89, sm90, sm100 and sm120
# (tests/test_triton_compile_targets.py) without a GPU; only sm90 has run them.
MIN_CAPABILITY = (8, 0)
MAX_MAJOR = 12
# float8_e4m3fn caches need a native e4m3 conversion (sm89+; Triton rejects float8e4nv for sm80-87). There the
# torch family runs instead (select_plan: correct, slower), not an error.
FP8_MIN_CAPABILITY = (8, 9)


def supports(problem) -> bool:
    """Whether the Triton kernels express this problem: CUDA from sm80 on (float8 caches from sm89 on), bf16/fp16
    q, the cache in q's dtype or float8_e4m3fn, head dims 64-256, NHD or HND, any page size. Elsewhere the torch
    family runs (fail closed)."""
    cap = tuple(problem.capability)
    if problem.device_type != "cuda" or not MIN_CAPABILITY <= cap or cap[0] > MAX_MAJOR:
        return False
    if problem.q_dtype not in _Q_DTYPES or problem.kv_dtype not in (problem.q_dtype, FP8):
        return False
    if problem.kv_dtype == FP8 and cap < FP8_MIN_CAPABILITY:
        return False
    return problem.head_dim in HEAD_DIMS and problem.kv_layout in ("NHD", "HND") and problem.page_size >= 1


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dot_dtype(q_dtype, kv_dtype):
    """The operand dtype of both products: q's dtype; fp16 for float8 caches (e4m3 -> fp16 is one native
    conversion on sm89+, e4m3 -> bf16 is not; q and the probabilities fit fp16's range and gain precision);
    fp32 under the interpreter, whose bf16/fp16 `tl.dot` is wrong on CPU."""
    import triton.language as tl

    if _interpreting() or q_dtype == torch.float32:
        return tl.float32
    if kv_dtype == FP8:
        return tl.float16
    return tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16


def _cache_strides(stride: tuple, kv_layout: str) -> tuple[int, int, int]:
    """(page, slot, head) strides of a cache [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv,
    page_size, D] (HND)."""
    return (stride[0], stride[1], stride[2]) if kv_layout == "NHD" else (stride[0], stride[2], stride[1])


def _descale_args(ds, dummy):
    """(pointer, stride over B, stride over Hkv, flag) of a descale that is None, a scalar, [B] or [B, Hkv]."""
    if ds is None:
        return dummy, 0, 0, 0
    if ds.dim() == 0:
        return ds, 0, 0, 1
    if ds.dim() == 1:
        return ds, ds.stride(0), 0, 1
    return ds, ds.stride(0), ds.stride(1), 1


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _launch(mode, shapes, t, *, plan, options, warmup=False, compile_with=None):
    """Launches (or, with warmup, compiles) the kernels of one plan. `compile_with(kernel, args, consts, tune)`
    replaces `kernel.warmup` (kernels/triton/_compile_only.py: compiles for another GPU).

    shapes: dict of static sizes (batch, q_len, packed, hq, hkv, d, page_size, max_pages: the page table's
    columns, num_pages: the pages both caches hold) and strides (q, k, v, pt);
    t: dict of tensors (or, for warmup, their dtypes) q, k, v, pt, seqlens, cu, kv_start, sinks, kds, vds,
    out, lse, part_o, part_l with descale strides and flags.
    """
    from . import decode, extend

    batch, s, hq, hkv, d = shapes["batch"], shapes["q_len"], shapes["hq"], shapes["hkv"], shapes["d"]
    g = hq // hkv
    kp, ko, kh = _cache_strides(shapes["k_stride"], options["kv_layout"])
    vp, vo, vh = _cache_strides(shapes["v_stride"], options["kv_layout"])
    qs = shapes["q_stride"]
    q_strides = (0, qs[0], qs[1]) if shapes["packed"] else (qs[0], qs[1], qs[2])
    window = int(options["window_left"])
    softcap = float(options["softcap"])
    common = (
        *q_strides, kp, ko, kh, vp, vo, vh, shapes["pt_stride"],
        t["kds_b"], t["kds_h"], t["vds_b"], t["vds_h"],
        t["has_kv_start"], t["has_sinks"], t["has_kds"], t["has_vds"],
        max(window, 0), float(options["scale"]), softcap if softcap > 0 else 1.0,
        shapes["max_pages"], shapes["num_pages"],
    )
    flags = dict(CAUSAL=bool(options["causal"]), USE_WINDOW=window >= 0, USE_SOFTCAP=softcap > 0,
                 DOT=_dot_dtype(shapes["q_dtype"], shapes["kv_dtype"]), D=d, BLOCK_D=_pow2(d),
                 PAGE=shapes["page_size"])
    tune = dict(num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    if mode == "extend":
        block_m = plan["block_m"]
        tiles = -(-s // block_m) + batch if shapes["packed"] else batch * -(-s // block_m)
        grid = (hq, tiles)
        args = (t["q"], t["k"], t["v"], t["pt"], t["seqlens"], t["cu"], t["kv_start"], t["sinks"], t["kds"],
                t["vds"], t["out"], t["lse"], *common)
        consts = dict(B=batch, S=s, B_P2=_pow2(batch + 1), G=g, HQ=hq, BLOCK_M=block_m, BLOCK_N=plan["block_n"],
                      PACKED=bool(shapes["packed"]), **flags)
        if warmup:
            return [compile_with(extend.extend_kernel, args, consts, tune) if compile_with else
                    extend.extend_kernel.warmup(*args, grid=grid, **consts, **tune)]
        extend.extend_kernel[grid](*args, **consts, **tune)
        return None

    splits = plan["num_splits"]
    block_m = plan["block_m"]
    m_tiles = -(-(s * g) // block_m)
    grid = (batch * hkv * m_tiles, splits)
    args = (t["q"], t["k"], t["v"], t["pt"], t["seqlens"], t["kv_start"], t["sinks"], t["kds"], t["vds"],
            t["out"], t["lse"], t["part_o"], t["part_l"], *common)
    consts = dict(S=s, G=g, HKV=hkv, M_TILES=m_tiles, BLOCK_M=block_m, BLOCK_N=plan["block_n"],
                  NUM_SPLITS=splits, **flags)
    merge_grid = (batch * s * hq,)
    merge_args = (t["part_o"], t["part_l"], t["sinks"], t["out"], t["lse"], t["has_sinks"])
    merge_consts = dict(HQ=hq, D=d, BLOCK_D=_pow2(d), NUM_SPLITS=splits, SPLITS_P2=_pow2(splits))
    if warmup:
        merge_tune = dict(num_warps=4, num_stages=1)
        if compile_with:
            kernels = [compile_with(decode.split_kernel, args, consts, tune)]
            if splits > 1:
                kernels.append(compile_with(decode.merge_kernel, merge_args, merge_consts, merge_tune))
            return kernels
        kernels = [decode.split_kernel.warmup(*args, grid=grid, **consts, **tune)]
        if splits > 1:
            kernels.append(decode.merge_kernel.warmup(*merge_args, grid=merge_grid, **merge_consts, **merge_tune))
        return kernels
    decode.split_kernel[grid](*args, **consts, **tune)
    if splits > 1:
        decode.merge_kernel[merge_grid](*merge_args, **merge_consts, num_warps=4, num_stages=1)
    return None


def run(mode: str, tensors: dict, *, out, lse, scratch, options: dict, plan: dict) -> None:
    """Runs one plan's kernels: writes out, lse and scratch only."""
    q, k_cache, v_cache = tensors["q"], tensors["k_cache"], tensors["v_cache"]
    packed = q.dim() == 3
    page_size, hkv = cache_dims(k_cache.shape, options["kv_layout"])
    shapes = dict(
        batch=tensors["page_table"].shape[0], q_len=q.shape[0] if packed else q.shape[1], packed=packed,
        hq=q.shape[-2], hkv=hkv, d=q.shape[-1], page_size=page_size, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
        q_stride=q.stride(), k_stride=k_cache.stride(), v_stride=v_cache.stride(),
        pt_stride=tensors["page_table"].stride(0), max_pages=tensors["page_table"].shape[1],
        num_pages=min(k_cache.shape[0], v_cache.shape[0]),
    )
    t = dict(q=q, k=k_cache, v=v_cache, pt=tensors["page_table"], seqlens=tensors["cache_seqlens"], out=out,
             lse=lse)
    int_dummy, float_dummy = tensors["cache_seqlens"], lse
    t["cu"] = tensors["cu_seqlens_q"] if packed else int_dummy
    t["kv_start"] = int_dummy if tensors["kv_start"] is None else tensors["kv_start"]
    t["has_kv_start"] = int(tensors["kv_start"] is not None)
    t["sinks"] = float_dummy if tensors["sinks"] is None else tensors["sinks"]
    t["has_sinks"] = int(tensors["sinks"] is not None)
    t["kds"], t["kds_b"], t["kds_h"], t["has_kds"] = _descale_args(tensors["k_descale"], float_dummy)
    t["vds"], t["vds_b"], t["vds_h"], t["has_vds"] = _descale_args(tensors["v_descale"], float_dummy)
    if mode != "extend":
        part = scratch.view(torch.float32) if plan["num_splits"] > 1 else lse
        rows = shapes["batch"] * shapes["q_len"] * shapes["hq"] * plan["num_splits"]
        t["part_o"] = part[: rows * shapes["d"]] if plan["num_splits"] > 1 else lse
        t["part_l"] = part[rows * shapes["d"]: rows * (shapes["d"] + 1)] if plan["num_splits"] > 1 else lse
    with torch.cuda.device(q.device) if q.is_cuda else _null():
        _launch(mode, shapes, t, plan=plan, options=options)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def precompile(problem, plan, options: dict) -> None:
    """Compiles the kernels of one plan ahead of any launch, for the standard (contiguous) strides of the
    problem's tensors; kv_start, sinks and descales are runtime flags, so one compile serves them all."""
    if plan.family != "triton" or _interpreting() or problem.device_type != "cuda":
        return
    _precompiled(problem, _plan_key(plan), tuple(sorted(options.items())))


def _plan_key(plan) -> tuple:
    return (plan.mode, plan.num_splits, plan.block_m, plan.block_n, plan.num_warps, plan.num_stages)


_DONE: dict = {}


def _warmup_inputs(problem, plan_key, options_items):
    """(mode, shapes, t, plan, options) of `_launch(..., warmup=True)` for one plan: the standard (contiguous)
    strides of the problem's tensors, pointers given as dtypes, runtime flags off."""
    mode, splits, block_m, block_n, num_warps, num_stages = plan_key
    plan = dict(num_splits=splits, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    options = dict(options_items)
    b, s, hq, hkv, d, ps = (problem.batch, problem.q_len, problem.num_q_heads, problem.num_kv_heads,
                            problem.head_dim, problem.page_size)
    cache_shape = (1, ps, hkv, d) if problem.kv_layout == "NHD" else (1, hkv, ps, d)
    q_shape = (s, hq, d) if problem.packed else (b, s, hq, d)
    shapes = dict(batch=b, q_len=s, packed=problem.packed, hq=hq, hkv=hkv, d=d, page_size=ps,
                  q_dtype=problem.q_dtype, kv_dtype=problem.kv_dtype, q_stride=_contiguous_strides(q_shape),
                  k_stride=_contiguous_strides(cache_shape), v_stride=_contiguous_strides(cache_shape),
                  pt_stride=problem.max_pages, max_pages=problem.max_pages, num_pages=1)
    f32, i32 = torch.float32, torch.int32
    t = dict(q=problem.q_dtype, k=problem.kv_dtype, v=problem.kv_dtype, pt=i32, seqlens=i32, cu=i32,
             kv_start=i32, sinks=f32, kds=f32, vds=f32, out=problem.q_dtype, lse=f32, part_o=f32, part_l=f32,
             kds_b=0, kds_h=0, vds_b=0, vds_h=0, has_kv_start=0, has_sinks=0, has_kds=0, has_vds=0)
    return mode, shapes, t, plan, options


def _launch_inputs_compiled(problem, plan, options: dict, compile_with) -> list:
    """The kernels of one plan compiled by `compile_with` (kernels/triton/_compile_only.py), no GPU needed."""
    mode, shapes, t, plan_d, options_d = _warmup_inputs(problem, _plan_key(plan), tuple(sorted(options.items())))
    return _launch(mode, shapes, t, plan=plan_d, options=options_d, warmup=True, compile_with=compile_with)


def _precompiled(problem, plan_key, options_items):
    key = (problem, plan_key, options_items)
    if key in _DONE:
        return _DONE[key]
    mode, shapes, t, plan, options = _warmup_inputs(problem, plan_key, options_items)
    with torch.cuda.device(torch.cuda.current_device()):
        kernels = _launch(mode, shapes, t, plan=plan, options=options, warmup=True)
        for k in kernels or ():
            init = getattr(k, "_init_handles", None)
            if init is not None:
                init()  # loads the module now, not at the first launch (which may be inside a capture)
    _DONE[key] = kernels
    return kernels
