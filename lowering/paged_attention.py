"""The Inductor lowering of `torch.ops.b12x.paged_attention` (and `paged_attention_out`).

While Inductor compiles the graph, this reads the static sizes, asks `select_plan` for the plan, allocates
out, lse and the plan's scratch as Inductor buffers, and emits one call of the plan's entry op with the
plan's constants as literal arguments:

    buf0 = empty_strided_cuda((8, 1, 32, 128), ...)   # out
    buf1 = ...                                         # lse
    buf2 = empty_strided_cuda((1081344,), ..., torch.uint8)   # split-KV scratch
    torch.ops.b12x.paged_attention_decode.default(q, k, v, ..., buf0, buf1, buf2, kv_layout='NHD', ...,
        family='triton', num_splits=8, block_m=16, block_n=64, num_warps=4, num_stages=2, v_from_k=False)

Under CUDA graphs those buffers come from the graph's pool, so a replay allocates nothing. Sizes are
static: a symbolic size (torch.compile(dynamic=True), or automatic dynamic after a second shape) is guarded
to its current value, so each shape bucket compiles once. Packed q [T, Hq, D] is already a capacity bucket:
T is static, the live token counts stay on the device in cu_seqlens_q.
"""

from __future__ import annotations

import torch

from b12x_inductor.plan import Problem, device_facts
from b12x_inductor.validate import cache_dims
from b12x_inductor.kernels import precompile
from b12x_inductor.kernels import Options
from b12x_inductor.ops import plan_for

from . import _inductor


def _sizes(node) -> list[int]:
    return [_inductor.static_int(s) for s in node.get_size()]


def _problem(q, k_cache, v_cache, page_table, kv_layout: str, key_mask: bool = False,
             window_left: int = -1, q_pe=None) -> Problem:
    q_size, kv_size, pt_size = _sizes(q), _sizes(k_cache), _sizes(page_table)
    head_dim = q_size[-1] + (0 if q_pe is None else _sizes(q_pe)[-1])  # the query is cat(q, q_pe)
    v_head_dim = _sizes(v_cache)[-1]
    page_size, hkv = cache_dims(kv_size, kv_layout)
    device = q.get_device()
    sm_count, capability = device_facts(device)
    return Problem(
        batch=pt_size[0], q_len=q_size[1] if len(q_size) == 4 else q_size[0], packed=len(q_size) == 3,
        num_q_heads=q_size[-2], num_kv_heads=hkv, head_dim=head_dim, v_head_dim=v_head_dim, page_size=page_size,
        max_pages=pt_size[1], q_dtype=q.get_dtype(), kv_dtype=k_cache.get_dtype(), kv_layout=kv_layout,
        device_type=device.type, sm_count=sm_count, capability=capability, key_mask=key_mask,
        window_left=window_left, v_in_k=_inductor.is_prefix_view(k_cache, v_cache))


def _lower(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, *, kv_layout="NHD", causal=True,
           scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None, v_descale=None,
           key_mask=None, q_pe=None, out=None):
    problem = _problem(q, k_cache, v_cache, page_table, kv_layout, key_mask is not None, window_left, q_pe)
    plan = plan_for(problem)
    q_size = _sizes(q)
    device = q.get_device()
    if out is None:  # q's shape with the value head dim
        out = _inductor.empty(q_size[:-1] + [problem.v_head_dim], q.get_dtype(), device)
    lse = _inductor.empty(q_size[:-1], torch.float32, device)
    scratch = _inductor.empty([plan.scratch_bytes], torch.uint8, device)
    options = Options.of(problem.head_dim, kv_layout=kv_layout, causal=causal, scale=scale,
                         window_left=window_left, softcap=softcap)
    precompile(problem, plan, options)  # no JIT compile later, inside a CUDA-graph capture
    _inductor.call_fallback(
        plan.entry_op, q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start, sinks, k_descale,
        v_descale, key_mask, q_pe, out, lse, scratch, **options.as_kwargs(), **plan.constants())
    return out, lse


def _lower_out(*args, out, **kwargs):
    return _lower(*args, out=out, **kwargs)[1]


def register() -> None:
    _inductor.register_lowering(torch.ops.b12x.paged_attention.default, _lower)
    _inductor.register_lowering(torch.ops.b12x.paged_attention_out.default, _lower_out)
