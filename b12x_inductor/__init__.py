"""b12x-inductor: paged GQA attention as a torch.library op, with an Inductor lowering that picks the
decode, verify or extend plan at compile time.

    import b12x_inductor as b12x
    out = b12x.paged_attention(q, k_cache, v_cache, page_table, cache_seqlens)

Follow one call: `paged_attention` (this file) -> `torch.ops.b12x.paged_attention` (ops.py: checks, then
`select_plan` in plan.py) -> one `kernels.Call` to `kernels.run` (what the plan's entry op runs, called directly)
-> its family. Under torch.compile, lowering/paged_attention.py replaces the middle: it selects the plan while
compiling and emits the entry op call with the plan's constants.
"""

from __future__ import annotations

import torch

from b12x_inductor import ops as _ops  # noqa: F401  (registers torch.ops.b12x.*)
from b12x_inductor import validate as _validate
from b12x_inductor.plan import Plan, Problem, select_plan

__all__ = ["paged_attention", "write_kv", "warmup", "select_plan", "Plan", "Problem"]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    kv_layout: str = "NHD",
    causal: bool = True,
    scale: float | None = None,
    window_left: int = -1,
    kv_start: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    q_pe: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
):
    """Paged GQA attention of new queries over a paged KV cache.

    Args:
        q: [B, S, Hq, D] (S new tokens for each of B requests) or packed [T, Hq, D] with cu_seqlens_q;
            bf16 or fp16 (fp32 too on CPU); D in 64, 96, 128, 192, 256 (or 576, MLA's, with Dv 512); last dim
            contiguous.
        k_cache, v_cache: kv_layout "NHD": [num_pages, page_size, Hkv, D]; "HND": [num_pages, Hkv,
            page_size, D]; q's dtype, or float8_e4m3fn under bf16/fp16 q; any strides with the head dim
            contiguous (views of a combined [num_pages, 2, ...] cache work). Hq must be divisible by Hkv.
            v_cache's last dim is the value head dim Dv, which may differ from D (every other dim as
            k_cache's): Dv in 64, 96, 128, 192, 256, 512 (plan.py's table; D = 576 takes Dv = 512 only).
            MLA: D = 192, Dv = 128 (DeepSeek-V3 non-absorbed), or D = 576, Dv = 512 with v_cache a view of
            k_cache's first 512 values (absorbed; `mla_attention` builds that call).
        page_table: int32 [B, max_pages]; request b's j-th page is page_table[b, j].
        cache_seqlens: int32 [B]; keys in the cache for request b, its new tokens included (written first,
            e.g. with `write_kv`). Its S_b new queries are the last S_b positions.
        cu_seqlens_q: int32 [B + 1], packed q only; rows past cu_seqlens_q[-1] are padding (zeros out).
        causal: query i of request b sees keys j <= L_b - S_b + i; without it all keys j < L_b.
        scale: logit scale, default D ** -0.5.
        window_left: >= 0 keeps keys j >= c - window_left (c the causal limit); -1 keeps all.
        kv_start: int32 [B], first visible key of each request (left padding).
        sinks: float32 [Hq], attention-sink logits counted in the softmax denominator only.
        softcap: > 0 applies softcap * tanh(logits / softcap).
        k_descale, v_descale: float32 scalar, [B] or [B, Hkv]; float8 caches only.
        key_mask: bool [B, S, max_pages * page_size] (one row per query) or [B, 1, max_pages * page_size]
            (one row per request), q [B, S, Hq, D] only; any strides. Key j is visible to query i only where
            key_mask[b, i, j] (or [b, 0, j]) is True, on top of the range, causal and window rules: an
            attention mask whose values only the device knows (a padding mask), read by the kernel.
        q_pe: absorbed MLA's query in two tensors (D = 576 only): q [.., Hq, 512] its first 512 columns and
            q_pe [.., Hq, 64] (q's leading dims, dtype and device; last dim contiguous, any other strides) the
            rope part; the query is cat(q, q_pe, dim=-1), which the kernels read from the two tensors in
            place (`mla_attention` passes its q_nope and q_pe so). The default scale is then 576 ** -0.5.
        return_lse: also return lse, float32 [B, S, Hq] or [T, Hq], natural log, sink included.
        out: optional contiguous output of q's shape with Dv as its last dim ([B, S, Hq, Dv] or [T, Hq, Dv])
            and q's dtype, written in place.

    Returns:
        out ([B, S, Hq, Dv] or [T, Hq, Dv], q's dtype), or (out, lse) with return_lse. A query with no
        visible key gets zeros and lse = -inf.

    Bad shapes, dtypes, devices, strides or options raise ValueError / TypeError naming the argument
    (options must be of their Python type: causal a bool, scale a float or int, not a tensor). There is no
    backward: with grad mode on, an input that requires grad raises RuntimeError (use torch.no_grad()).
    What only the device knows (page ids, lengths) is checked with B12X_DEBUG=1 (a host sync); without it,
    out-of-contract device values are clamped on the device (README, "Bad input"), never read past.
    """
    kwargs = dict(kv_layout=kv_layout, causal=causal, scale=scale, window_left=window_left, kv_start=kv_start,
                  sinks=sinks, softcap=softcap, k_descale=k_descale, v_descale=v_descale, key_mask=key_mask,
                  q_pe=q_pe)
    _validate.check_paged_attention_types(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                                          return_lse=return_lse, out=out, **kwargs)
    if out is None:
        out, lse = torch.ops.b12x.paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                                                  **kwargs)
    else:
        lse = torch.ops.b12x.paged_attention_out(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                                                 out=out, **kwargs)
    return (out, lse) if return_lse else out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes new keys and values into a paged cache, in place.

    Args:
        k, v: [N, Hkv, D], the cache's dtype (or bf16/fp16/fp32 for a float8_e4m3fn cache).
        k_cache, v_cache: as in `paged_attention`.
        slot_mapping: int64 [N]; token n goes to slot = page * page_size + offset; slot < 0 skips it.
        k_scale, v_scale: float32 scalar, [N] or [N, Hkv]; float8 caches store k / k_scale (clamped to
            the float8 range).
    """
    _validate.check_write_kv_types(k, v, k_cache, v_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale,
                                   v_scale=v_scale)
    torch.ops.b12x.write_kv(k, v, k_cache, v_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale,
                            v_scale=v_scale)


def warmup(problems, *, causal: bool = True, scale: float | None = None, window_left: int = -1,
           softcap: float = 0.0) -> None:
    """Compiles ahead the kernels of the given buckets, so that no JIT compile happens later (inside a
    CUDA-graph capture, say). `problems`: one `Problem` or an iterable of them (e.g. from
    `validate.check_paged_attention` or built by hand, with device_type "cuda" and its sm_count and
    capability); the options are those the calls will pass. Buckets that run the torch family need nothing.
    """
    from b12x_inductor.kernels import precompile
    from b12x_inductor.kernels import Options
    from b12x_inductor.ops import plan_for

    for p in [problems] if isinstance(problems, Problem) else problems:
        options = Options.of(p.head_dim, kv_layout=p.kv_layout, causal=causal, scale=scale,
                             window_left=window_left, softcap=softcap)
        precompile(p, plan_for(p), options)


from b12x_inductor import lowering as _lowering  # noqa: E402,F401  (registers the Inductor lowering)
from b12x_inductor.mla import mla_attention, mla_write_kv  # noqa: E402  (absorbed MLA on top of paged_attention)
from b12x_inductor.substitution import disable, enable, last_decisions, substituting  # noqa: E402

__all__ += ["enable", "disable", "substituting", "last_decisions", "mla_attention", "mla_write_kv"]
