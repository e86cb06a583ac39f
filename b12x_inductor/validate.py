"""Fail-closed argument checks shared by the eager ops and their fake (meta) implementations.

Every message names the argument, what was expected and what came. Only static facts (shapes, dtypes,
devices, strides, options) are checked here, so the same checks run while tracing under torch.compile.
What only the device knows (page ids, lengths) is checked by `check_device_values` when B12X_DEBUG=1;
without it the kernels clamp such values on the device (kernels/reference.py, `clamp_to_contract`).
"""

from __future__ import annotations

import os

import torch

from b12x_inductor.plan import (  # noqa: F401
    FP8, HEAD_DIMS, MLA_HEAD_DIMS, Q_DTYPES_CPU, Q_DTYPES_CUDA, V_HEAD_DIMS, Problem, device_facts,
)


REFUSALS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError)}


def refuse(exc: str, message: str) -> None:
    """Raises the exception named `exc` (a key of REFUSALS) with `message`. While Dynamo traces (the public
    functions' Python checks run then), through the op b12x::refuse, whose fake raises it: Dynamo reports an
    exception raised by traced Python code under fullgraph only as "Observed exception", without the message,
    but an error of an op's fake comes out as its TorchRuntimeError with the original in the chain, as the
    other checks' errors do. The name is a str, not the class: Dynamo (torch 2.11) cannot pass a class's
    attributes to an op."""
    if torch.compiler.is_compiling():
        torch.ops.b12x.refuse(exc, message)
    raise REFUSALS[exc](message)


def _fail(op: str, arg: str, expected: str, got: object, exc: str = "ValueError") -> None:
    refuse(exc, f"{op}: {arg} must be {expected}; got {got}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_tensor(op: str, name: str, t: object, *, dtype=None, dim=None, shape=None, device=None,
                  contiguous=False, device_of: str = "q") -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, name, "a torch.Tensor", type(t).__name__, "TypeError")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            _fail(op, name, "of dtype " + " or ".join(str(d) for d in allowed), t.dtype, "TypeError")
    if dim is not None and t.dim() != dim:
        _fail(op, name, f"{dim}-dimensional", f"shape {_shape(t)}")
    if shape is not None and _shape(t) != tuple(shape):
        _fail(op, name, f"of shape {tuple(shape)}", f"shape {_shape(t)}")
    if device is not None and t.device != device:
        _fail(op, name, f"on {device} ({device_of}'s device)", t.device)
    if contiguous and not t.is_contiguous():  # kernels read these vectors with unit stride
        _fail(op, name, "contiguous", f"strides {tuple(t.stride())}")


def _check_fp8_scale(op, name, s, cache_dtype, device, rows_name: str | None = None, rows: int = 0,
                     hkv: int = 0) -> None:
    """An optional float32 scale of a float8 cache (descale of paged_attention, scale of write_kv): None for
    other caches, else a scalar, [rows] or [rows, Hkv] (a scalar only without rows_name: write_latent's)."""
    if s is None:
        return
    if cache_dtype != FP8:
        _fail(op, name, "None for a cache that is not float8_e4m3fn", "a tensor")
    _check_tensor(op, name, s, dtype=torch.float32, device=device)
    if rows_name is None:
        if s.dim() != 0:
            _fail(op, name, "a float32 scalar tensor (shape ())", f"shape {_shape(s)}")
        return
    if _shape(s) not in ((), (rows,), (rows, hkv)):
        _fail(op, name, f"a scalar, [{rows_name}] = ({rows},) or [{rows_name}, Hkv] = ({rows}, {hkv})",
              f"shape {_shape(s)}")


_INT = (int, torch.SymInt)
_REAL = (int, float, torch.SymInt, torch.SymFloat)


def _type_name(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return "Tensor"
    return f"{type(x).__name__} {x!r}" if isinstance(x, (bool, int, float, str)) else type(x).__name__


def check_kv_layout(op: str, kv_layout: object) -> None:
    if not isinstance(kv_layout, str):
        _fail(op, "kv_layout", "'NHD' or 'HND' (a str)", _type_name(kv_layout), "TypeError")
    if kv_layout not in ("NHD", "HND"):
        _fail(op, "kv_layout", "'NHD' or 'HND'", repr(kv_layout))


def check_options(op: str, *, kv_layout, causal, scale, window_left, softcap) -> None:
    """The non-tensor options of paged_attention: exact Python types (a bool is not taken for a number, a
    tensor is not taken for a float), then their ranges. The public functions run this before the op's
    schema (which would coerce causal=1 to True, take a one-element tensor as a float and reject 2.5 for an
    int with a schema error); the op's eager and fake implementations run it again."""
    check_kv_layout(op, kv_layout)
    if not isinstance(causal, bool):
        _fail(op, "causal", "a bool", _type_name(causal), "TypeError")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, _REAL):
            _fail(op, "scale", "a Python float or int, or None (a tensor scale is not taken: pass float(scale))",
                  _type_name(scale), "TypeError")
        if not 0.0 < float(scale) < float("inf"):
            _fail(op, "scale", "a positive finite float or None", scale)
    if isinstance(window_left, bool) or not isinstance(window_left, _INT):
        _fail(op, "window_left", "an int >= -1 (-1: no window)", _type_name(window_left), "TypeError")
    if window_left < -1:
        _fail(op, "window_left", "an int >= -1 (-1: no window)", window_left)
    if isinstance(softcap, bool) or not isinstance(softcap, _REAL):
        _fail(op, "softcap", "a Python float or int (0: no softcap)", _type_name(softcap), "TypeError")
    if not 0.0 <= float(softcap) < float("inf"):
        _fail(op, "softcap", "a finite float >= 0 (0: no softcap)", softcap)


def _check_tensor_types(op: str, required: dict, optional: dict) -> None:
    for name, t in required.items():
        if not isinstance(t, torch.Tensor):
            _fail(op, name, "a torch.Tensor", _type_name(t), "TypeError")
    for name, t in optional.items():
        if t is not None and not isinstance(t, torch.Tensor):
            _fail(op, name, "a torch.Tensor or None", _type_name(t), "TypeError")


def check_paged_attention_types(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, *, kv_layout,
                                causal, scale, window_left, kv_start, sinks, softcap, k_descale, v_descale,
                                key_mask=None, q_pe=None, return_lse, out) -> None:
    """What `b12x_inductor.paged_attention` checks before it calls the op (Python types only: it runs the
    same eagerly and while Dynamo traces)."""
    op = "paged_attention"
    _check_tensor_types(op, dict(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                                 cache_seqlens=cache_seqlens),
                        dict(cu_seqlens_q=cu_seqlens_q, kv_start=kv_start, sinks=sinks, k_descale=k_descale,
                             v_descale=v_descale, key_mask=key_mask, q_pe=q_pe, out=out))
    check_options(op, kv_layout=kv_layout, causal=causal, scale=scale, window_left=window_left, softcap=softcap)
    if not isinstance(return_lse, bool):
        _fail(op, "return_lse", "a bool", _type_name(return_lse), "TypeError")


def check_write_kv_types(k, v, k_cache, v_cache, slot_mapping, *, kv_layout, k_scale, v_scale) -> None:
    """What `b12x_inductor.write_kv` checks before it calls the op."""
    op = "write_kv"
    _check_tensor_types(op, dict(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping),
                        dict(k_scale=k_scale, v_scale=v_scale))
    check_kv_layout(op, kv_layout)


def check_no_grad(op: str, tensors: dict) -> None:
    """The ops have no backward: with grad mode on, an input that requires grad is refused (rather than an
    output whose gradient would silently be missing). Inference (torch.no_grad, torch.inference_mode, inputs
    that do not require grad) is untouched."""
    if not torch.is_grad_enabled():
        return
    needs = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if needs:
        raise RuntimeError(
            f"{op}: {', '.join(needs)} {'requires' if len(needs) == 1 else 'require'} grad with grad mode on, "
            f"but {op} has no backward (it supports inference only); call it under torch.no_grad() or "
            f"torch.inference_mode(), or pass detached tensors")


def cache_dims(shape, kv_layout: str) -> tuple:
    """(page_size, Hkv) of a cache of shape [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv,
    page_size, D] (HND); `shape` may hold symbolic sizes."""
    return (shape[1], shape[2]) if kv_layout == "NHD" else (shape[2], shape[1])


def cache_geometry(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kv_layout: str) -> tuple[int, int, int, int, int]:
    """(num_pages, page_size, Hkv, D, Dv) of a paged cache pair, after checking the pair agrees: v_cache matches
    k_cache in every dim but the last (the value head dim Dv may differ from the key head dim D)."""
    check_kv_layout(op, kv_layout)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(op, name, c, dim=4)
        if c.stride(-1) != 1:
            _fail(op, name, "contiguous in its last (head) dim", f"strides {tuple(c.stride())}")
    if _shape(k_cache)[:-1] != _shape(v_cache)[:-1]:
        _fail(op, "v_cache", f"of k_cache's shape {_shape(k_cache)[:-1]} in every dim but the last (the value head "
              f"dim)", f"shape {_shape(v_cache)}")
    if k_cache.dtype != v_cache.dtype:
        _fail(op, "v_cache", f"of k_cache's dtype {k_cache.dtype}", v_cache.dtype, "TypeError")
    if k_cache.device != v_cache.device:
        _fail(op, "v_cache", f"on k_cache's device {k_cache.device}", v_cache.device)
    n, _, _, d = _shape(k_cache)
    dv = _shape(v_cache)[-1]
    page_size, hkv = cache_dims(_shape(k_cache), kv_layout)
    if n < 1:
        _fail(op, "k_cache", "a cache with at least one page (num_pages >= 1)", f"shape {_shape(k_cache)}")
    if page_size < 1:
        _fail(op, "k_cache", "a cache with page_size >= 1", f"shape {_shape(k_cache)} ({kv_layout})")
    if hkv < 1:
        _fail(op, "k_cache", "a cache with Hkv >= 1 KV heads", f"shape {_shape(k_cache)} ({kv_layout})")
    return n, page_size, hkv, d, dv


def check_head_dims(op: str, d, dv) -> None:
    """The (D, Dv) pair against plan.py's head-dim table (sizes may be symbolic: compared, never hashed)."""
    if d not in HEAD_DIMS and d not in tuple(MLA_HEAD_DIMS):
        _fail(op, "q", "of head dim " + ", ".join(map(str, HEAD_DIMS)) + " (or "
              + ", ".join(f"{k} with a value head dim of {v}" for k, v in MLA_HEAD_DIMS.items()) + ")",
              f"head dim {d}")
    for mla_d, mla_dv in MLA_HEAD_DIMS.items():
        if d == mla_d and dv != mla_dv:
            _fail(op, "v_cache", f"of value head dim {mla_dv} with q/k head dim {mla_d}", f"value head dim {dv}")
    if dv not in V_HEAD_DIMS:
        _fail(op, "v_cache", "of value head dim " + ", ".join(map(str, V_HEAD_DIMS)), f"value head dim {dv}")


def check_paged_attention(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, *, kv_layout, causal, scale, window_left,
    kv_start, sinks, softcap, k_descale, v_descale, key_mask=None, q_pe=None, out=None, want_problem=True,
) -> Problem | None:
    """Checks one call and returns its static Problem (None with want_problem=False, as while tracing
    with symbolic sizes, which building a Problem would specialize). With q_pe (absorbed MLA's rope part
    apart) the query is cat(q, q_pe, dim=-1) and the Problem's head dim is that of the concatenation."""
    op = "paged_attention"
    _check_tensor(op, "q", q)
    if q.dim() == 4:
        if cu_seqlens_q is not None:
            _fail(op, "cu_seqlens_q", "None for a 4-dimensional q [B, S, Hq, D]", "a tensor")
    elif q.dim() == 3:
        if cu_seqlens_q is None:
            _fail(op, "cu_seqlens_q", "an int32 [B + 1] tensor for a packed q [T, Hq, D]", None)
    else:
        _fail(op, "q", "[B, S, Hq, D] or packed [T, Hq, D]", f"shape {_shape(q)}")
    device = q.device
    q_dtypes = Q_DTYPES_CPU if device.type == "cpu" else Q_DTYPES_CUDA
    _check_tensor(op, "q", q, dtype=q_dtypes)
    if q.stride(-1) != 1:
        _fail(op, "q", "contiguous in its last (head) dim", f"strides {tuple(q.stride())}")
    if q.shape[0] == 0 or (q.dim() == 4 and q.shape[1] == 0):
        _fail(op, "q", "at least one token", f"shape {_shape(q)}")
    if q.shape[-2] == 0:
        _fail(op, "q", "at least one head (Hq >= 1)", f"shape {_shape(q)}")
    num_pages, page_size, hkv, d, dv = cache_geometry(op, k_cache, v_cache, kv_layout)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(op, name, c, device=device)
    if k_cache.dtype != q.dtype and not (k_cache.dtype == FP8 and q.dtype in Q_DTYPES_CUDA):
        _fail(op, "k_cache", f"of q's dtype {q.dtype} or torch.float8_e4m3fn (with bf16/fp16 q)", k_cache.dtype,
              "TypeError")
    hq, qd = q.shape[-2], q.shape[-1]
    if q_pe is not None:  # the caches' head dims first: q_pe's shape follows from them
        check_head_dims(op, d, dv)
        qd = qd + _check_q_pe(op, q, q_pe, d)
    if qd != d:
        _fail(op, "k_cache", f"of q's head dim {qd}" + (" (q's and q_pe's last dims)" if q_pe is not None else ""),
              f"head dim {d}")
    check_head_dims(op, d, dv)
    if hq % hkv != 0:
        _fail(op, "q", f"a number of heads divisible by the cache's {hkv} KV heads", f"{hq} heads")

    _check_tensor(op, "page_table", page_table, dtype=torch.int32, dim=2, device=device)
    if page_table.stride(-1) != 1:
        _fail(op, "page_table", "contiguous in its last dim", f"strides {tuple(page_table.stride())}")
    batch, max_pages = page_table.shape
    if q.dim() == 4 and q.shape[0] != batch:
        _fail(op, "q", f"of batch {batch} (page_table's rows)", f"shape {_shape(q)}")
    _check_tensor(op, "cache_seqlens", cache_seqlens, dtype=torch.int32, shape=(batch,), device=device, contiguous=True)
    if cu_seqlens_q is not None:
        _check_tensor(op, "cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(batch + 1,), device=device, contiguous=True)
    if kv_start is not None:
        _check_tensor(op, "kv_start", kv_start, dtype=torch.int32, shape=(batch,), device=device, contiguous=True)
    if sinks is not None:
        _check_tensor(op, "sinks", sinks, dtype=torch.float32, shape=(hq,), device=device, contiguous=True)
    for name, ds in (("k_descale", k_descale), ("v_descale", v_descale)):
        _check_fp8_scale(op, name, ds, k_cache.dtype, device, "B", batch, hkv)
    if key_mask is not None:
        if q.dim() != 4:
            _fail(op, "key_mask", "None for a packed q [T, Hq, D] (a key mask needs q [B, S, Hq, D])", "a tensor")
        capacity = max_pages * page_size
        _check_tensor(op, "key_mask", key_mask, dtype=torch.bool, dim=3, device=device)
        if _shape(key_mask) not in ((batch, q.shape[1], capacity), (batch, 1, capacity)):
            _fail(op, "key_mask", f"of shape [B, S, max_pages * page_size] = ({batch}, {q.shape[1]}, {capacity}) "
                  f"or [B, 1, max_pages * page_size] = ({batch}, 1, {capacity})", f"shape {_shape(key_mask)}")
    check_options(op, kv_layout=kv_layout, causal=causal, scale=scale, window_left=window_left, softcap=softcap)
    if out is not None:  # q's shape with the value head dim: [B, S, Hq, Dv] or [T, Hq, Dv]
        _check_tensor(op, "out", out, dtype=q.dtype, shape=_shape(q)[:-1] + (dv,), device=device)
        if not out.is_contiguous():
            _fail(op, "out", "contiguous", f"strides {tuple(out.stride())}")

    if not want_problem:
        return None
    sm_count, capability = device_facts(device)
    return Problem(
        batch=int(batch), q_len=int(q.shape[1] if q.dim() == 4 else q.shape[0]), packed=q.dim() == 3,
        num_q_heads=int(hq), num_kv_heads=int(hkv), head_dim=int(d), v_head_dim=int(dv), page_size=int(page_size),
        max_pages=int(max_pages), q_dtype=q.dtype, kv_dtype=k_cache.dtype, kv_layout=kv_layout,
        device_type=device.type, sm_count=sm_count, capability=capability, key_mask=key_mask is not None,
        window_left=int(window_left), v_in_k=v_is_prefix_of_k(k_cache, v_cache),
    )


def _check_q_pe(op: str, q, q_pe, d) -> int:
    """q_pe, absorbed MLA's rope part of the query apart from q (the query is cat(q, q_pe, dim=-1)): only for
    plan.py's MLA head dims (D = 576: q [.., Hq, 512], q_pe [.., Hq, 64]), of q's leading dims, dtype and
    device, last dim contiguous (any other strides). Returns its width. (Sizes may be symbolic: compared,
    never hashed.)"""
    _check_tensor(op, "q_pe", q_pe, dim=q.dim(), dtype=q.dtype, device=q.device)
    rank = MLA_HEAD_DIMS.get(d)
    if rank is None:
        _fail(op, "q_pe", "None unless k_cache's head dim is absorbed MLA's ("
              + ", ".join(f"{k} = {v} + {k - v}" for k, v in MLA_HEAD_DIMS.items()) + ": q holds the query's "
              "first columns, as many as the value head dim, and q_pe the rest)", f"a tensor with head dim {d}")
    want = _shape(q)[:-1] + (d - rank,)
    if q.shape[-1] != rank or _shape(q_pe) != want:
        _fail(op, "q_pe", f"of shape {want} with q of last dim {rank} (the query is cat(q, q_pe): q its first "
              f"{rank} columns, q_pe the last {d - rank})", f"q of shape {_shape(q)}, q_pe of shape {_shape(q_pe)}")
    if q_pe.stride(-1) != 1:
        _fail(op, "q_pe", "contiguous in its last dim", f"strides {tuple(q_pe.stride())}")
    return q_pe.shape[-1]


def v_is_prefix_of_k(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether v_cache is k_cache's first Dv columns (Problem.v_in_k): the same storage, storage offset,
    strides and dtype, the sizes but the last. Read from tensor metadata only (no device access)."""
    return (v_cache.dtype == k_cache.dtype and v_cache.dim() == k_cache.dim()
            and v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
            and v_cache.storage_offset() == k_cache.storage_offset() and v_cache.stride() == k_cache.stride()
            and v_cache.shape[:-1] == k_cache.shape[:-1] and v_cache.shape[-1] <= k_cache.shape[-1])


def check_write_kv(k, v, k_cache, v_cache, slot_mapping, *, kv_layout, k_scale, v_scale) -> None:
    op = "write_kv"
    _check_tensor(op, "k", k, dim=3)
    device = k.device
    if k.dtype not in Q_DTYPES_CPU:
        _fail(op, "k", "of dtype torch.bfloat16, torch.float16 or torch.float32", k.dtype, "TypeError")
    _, _, hkv, d, dv = cache_geometry(op, k_cache, v_cache, kv_layout)
    _check_tensor(op, "v", v, dtype=k.dtype, shape=_shape(k)[:-1] + (dv,), device=device, device_of="k")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(op, name, c, device=device, device_of="k")
    if k_cache.dtype != k.dtype and k_cache.dtype != FP8:
        _fail(op, "k_cache", f"of k's dtype {k.dtype} or torch.float8_e4m3fn", k_cache.dtype, "TypeError")
    n = k.shape[0]
    if tuple(k.shape[1:]) != (hkv, d):
        _fail(op, "k", f"of shape [N, Hkv, D] = [N, {hkv}, {d}] (the cache's heads and head dim)", f"shape {_shape(k)}")
    _check_tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, shape=(n,), device=device, device_of="k")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_fp8_scale(op, name, s, k_cache.dtype, device, "N", n, hkv)


def check_write_latent_types(ckv, kpe, kv_cache, slot_mapping, *, scale) -> None:
    """What `b12x_inductor.mla_write_kv` checks before it calls the op."""
    _check_tensor_types("write_latent", dict(ckv=ckv, kpe=kpe, kv_cache=kv_cache, slot_mapping=slot_mapping),
                        dict(scale=scale))


def check_write_latent(ckv, kpe, kv_cache, slot_mapping, *, scale) -> None:
    """write_latent: ckv [T, kv_lora_rank] and kpe [T, rope_dim] (one dtype, bf16/fp16/fp32) into the latent cache
    [num_pages, page_size, kv_lora_rank + rope_dim] (last dim contiguous) of their dtype, or float8_e4m3fn under
    bf16/fp16 with a float32 scalar scale; slot_mapping int64 or int32 [T] (slots as write_kv's)."""
    op = "write_latent"
    _check_tensor(op, "ckv", ckv, dim=2)
    device = ckv.device
    if ckv.dtype not in Q_DTYPES_CPU:
        _fail(op, "ckv", "of dtype torch.bfloat16, torch.float16 or torch.float32", ckv.dtype, "TypeError")
    _check_tensor(op, "kv_cache", kv_cache, dim=3, device=device, device_of="ckv")
    if kv_cache.stride(-1) != 1:
        _fail(op, "kv_cache", "contiguous in its last dim", f"strides {tuple(kv_cache.stride())}")
    num_pages, page_size, width = _shape(kv_cache)
    if num_pages < 1 or page_size < 1:
        _fail(op, "kv_cache", "a cache with at least one page (num_pages >= 1) and page_size >= 1",
              f"shape {_shape(kv_cache)}")
    t, rank = _shape(ckv)
    if not 0 < rank < width:
        _fail(op, "ckv", f"of shape [T, kv_lora_rank] with 0 < kv_lora_rank < {width} (kv_cache's last dim: the "
              f"rope key follows the latent)", f"shape {_shape(ckv)}")
    _check_tensor(op, "kpe", kpe, device=device, device_of="ckv")
    if kpe.dtype != ckv.dtype:
        _fail(op, "kpe", f"of ckv's dtype {ckv.dtype}", kpe.dtype, "TypeError")
    if _shape(kpe) != (t, width - rank):
        _fail(op, "kpe", f"of shape [T, rope_dim] = ({t}, {width - rank}) (ckv's T; rope_dim = kv_cache's last dim "
              f"{width} - ckv's kv_lora_rank {rank})", f"shape {_shape(kpe)}")
    if kv_cache.dtype != ckv.dtype and not (kv_cache.dtype == FP8 and ckv.dtype in Q_DTYPES_CUDA):
        _fail(op, "kv_cache", f"of ckv's dtype {ckv.dtype} or torch.float8_e4m3fn (with bf16/fp16 ckv)",
              kv_cache.dtype, "TypeError")
    _check_tensor(op, "slot_mapping", slot_mapping, dtype=(torch.int64, torch.int32), shape=(t,), device=device,
                  device_of="ckv")
    if kv_cache.dtype == FP8 and scale is None:
        _fail(op, "scale", "a float32 scalar tensor for a float8_e4m3fn kv_cache (it stores value / scale)", None)
    _check_fp8_scale(op, "scale", scale, kv_cache.dtype, device)


def debug_enabled() -> bool:
    return os.environ.get("B12X_DEBUG", "0") not in ("", "0")


def check_device_values(q, k_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start, kv_layout) -> None:
    """B12X_DEBUG=1: checks what only the device knows. Syncs with the host; for debugging only."""
    op = "paged_attention"
    num_pages = k_cache.shape[0]
    page_size, _ = cache_dims(k_cache.shape, kv_layout)
    cap = page_table.shape[1] * page_size
    lens = cache_seqlens.cpu().long()
    if bool((lens < 0).any()) or bool((lens > cap).any()):
        _fail(op, "cache_seqlens", f"in [0, {cap}] (max_pages * page_size)", lens.tolist())
    pt = page_table.cpu().long()
    for b, length in enumerate(lens.tolist()):
        live = pt[b, : -(-length // page_size)]
        if bool(((live < 0) | (live >= num_pages)).any()):
            _fail(op, f"page_table[{b}]", f"page ids in [0, {num_pages}) for its {length} live keys", live.tolist())
    if kv_start is not None:
        ks = kv_start.cpu().long()
        if bool((ks < 0).any()) or bool((ks > lens).any()):
            _fail(op, "kv_start", "in [0, cache_seqlens[b]]", ks.tolist())
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.cpu().long()
        new = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or bool((new < 0).any()) or int(cu[-1]) > q.shape[0]:
            _fail(op, "cu_seqlens_q", f"non-decreasing from 0 to at most T = {q.shape[0]}", cu.tolist())
    else:
        new = torch.full_like(lens, q.shape[1])
    if bool((new > lens).any()):
        _fail(op, "cache_seqlens", "at least each request's new-token count (new tokens are written first)",
              f"lengths {lens.tolist()} for {new.tolist()} new tokens")


def check_slots(k_cache, slot_mapping, page_size: int, op: str = "write_kv") -> None:
    """B12X_DEBUG=1: every slot of write_kv (or write_latent) inside the cache."""
    slots = slot_mapping.cpu()
    total = k_cache.shape[0] * page_size
    if bool((slots >= total).any()):
        _fail(op, "slot_mapping", f"slots < num_pages * page_size = {total} (or < 0 to skip)", slots.tolist())
