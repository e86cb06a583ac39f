"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) over a paged latent cache, absorbed form.

    b12x.mla_write_kv(ckv, kpe, kv_cache, slot_mapping)      # the new tokens' latents, in place
    out = b12x.mla_attention(q_nope, q_pe, kv_cache, page_table, cache_seqlens, scale=softmax_scale)

A thin entry on top of `paged_attention`: the latent cache [num_pages, page_size, 576] (512 compressed KV
values + 64 rope key values per token, vLLM's layout) is one KV head whose keys are all 576 values and whose
values are the first 512 of them, so this is paged_attention with Hkv = 1, D = 576 and Dv = 512:
k_cache = kv_cache[:, :, None, :] (NHD), v_cache = k_cache[..., :512] (a view: the same memory), and the
query cat(q_nope, q_pe), which the kernels read from the two tensors in place (paged_attention's q and q_pe:
no copy of q). The kernels run as paged_attention's do: with a 16-bit cache,
decode and verify on the CuTe DSL family's MLA kernel where it is installed (sm90, pages that go by TMA:
kernels/cute/mla.py), else Triton on CUDA, the torch family elsewhere. Plain torch and the op: it traces
under torch.compile(fullgraph=True).

`mla_write_kv` is its write: the op b12x::write_latent stores each new token's cat(ckv, kpe) in its slot of
the one latent cache (write_kv's slot convention and contract), which write_kv cannot do (it mutates two
distinct caches).
"""

from __future__ import annotations

import torch

from b12x_inductor import validate
from b12x_inductor.plan import MLA_HEAD_DIMS

__all__ = ["mla_attention", "mla_write_kv", "latent_cache"]

_OP = "mla_attention"


def _fail(arg: str, expected: str, got: object, exc: str = "ValueError") -> None:
    validate.refuse(exc, f"{_OP}: {arg} must be {expected}; got {got}")


def _check_tensor(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__, "TypeError")


def latent_cache(ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
    """FlashInfer's two MLA caches as one latent cache view: ckv [num_pages, page_size, kv_lora_rank] and kpe
    [num_pages, page_size, rope_dim] that are adjacent views of one buffer (kpe starts kv_lora_rank elements
    after ckv, with ckv's strides: ckv = buf[..., :512], kpe = buf[..., 512:]) come back as that buffer's
    [num_pages, page_size, kv_lora_rank + rope_dim] view (as_strided, no copy). Anything else raises
    ValueError naming the argument: caches in separate buffers would need a copy, which this does not make.

    Eager only (Dynamo cannot read data pointers): under torch.compile, build the view outside the compiled
    region and pass it as mla_attention's kv_cache."""
    for name, t in (("kv_cache[0] (ckv)", ckv), ("kv_cache[1] (kpe)", kpe)):
        _check_tensor(name, t)
        if t.dim() != 3:
            _fail(name, "3-dimensional [num_pages, page_size, dim]", f"shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            _fail(name, "contiguous in its last dim", f"strides {tuple(t.stride())}")
    if tuple(kpe.shape[:2]) != tuple(ckv.shape[:2]):
        _fail("kv_cache[1] (kpe)", f"of ckv's [num_pages, page_size] = {tuple(ckv.shape[:2])}",
              f"shape {tuple(kpe.shape)}")
    if kpe.dtype != ckv.dtype or kpe.device != ckv.device:
        _fail("kv_cache[1] (kpe)", f"of ckv's dtype {ckv.dtype} on {ckv.device}", f"{kpe.dtype} on {kpe.device}",
              "TypeError")
    if torch.compiler.is_compiling():
        _fail("kv_cache", "one [num_pages, page_size, kv_lora_rank + rope_dim] tensor under torch.compile (whether "
              "the two caches (ckv, kpe) are adjacent views of one buffer cannot be checked in a compiled graph: "
              "build the view outside it with b12x_inductor.mla.latent_cache(ckv, kpe))", "a (ckv, kpe) pair")
    rank = ckv.shape[-1]
    adjacent = (tuple(kpe.stride()) == tuple(ckv.stride())
                and ckv.untyped_storage().data_ptr() == kpe.untyped_storage().data_ptr()
                and kpe.data_ptr() == ckv.data_ptr() + rank * ckv.element_size())
    if not adjacent:
        _fail("kv_cache", "(ckv, kpe) adjacent views of one buffer (kpe.data_ptr() == ckv.data_ptr() + "
              f"{rank} * element size, equal strides: ckv = buf[..., :{rank}], kpe = buf[..., {rank}:])",
              f"ckv strides {tuple(ckv.stride())}, kpe strides {tuple(kpe.stride())}, "
              f"kpe {kpe.data_ptr() - ckv.data_ptr()} bytes after ckv")
    shape = (ckv.shape[0], ckv.shape[1], rank + kpe.shape[-1])
    return ckv.as_strided(shape, ckv.stride(), ckv.storage_offset())  # checked against the storage's size


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor | None,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    kv_lora_rank: int = 512,
    causal: bool = True,
    scale: float,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
):
    """Absorbed multi-head latent attention over a paged latent cache (DeepSeek-V3: kv_lora_rank 512, rope 64).

    Args:
        q_nope: [B, S, H, kv_lora_rank] (S new tokens for each of B requests) or packed [T, H, kv_lora_rank]
            with cu_seqlens_q: the queries' no-rope part already absorbed through W_UK (q_nope @ W_UK per head);
            bf16 or fp16 (fp32 too on CPU). Or, with q_pe None, the whole query [.., H, kv_lora_rank + rope_dim]
            (last dim contiguous).
        q_pe: [.., H, rope_dim] (q_nope's leading dims, its dtype and device; rope_dim 64 for DeepSeek), the
            rope part; or None (q_nope is the whole query). With DeepSeek's 512 + 64 latent the kernels read
            q_nope and q_pe in place (other widths, as tiny test configs have, are concatenated first), any
            strides (views such as a transposed rope output too) with the last dim contiguous (else that one is
            copied first); the CuTe kernel also needs their rows on 16 bytes (ValueError naming them if not).
        kv_cache: the latent cache [num_pages, page_size, kv_lora_rank + rope_dim] (vLLM's layout: per token
            the compressed KV, then the rope key; last dim contiguous, any other strides), q's dtype or
            float8_e4m3fn (bf16/fp16 q). Or FlashInfer's two caches as a pair (ckv [num_pages, page_size,
            kv_lora_rank], kpe [num_pages, page_size, rope_dim]) when they are adjacent views of one buffer
            (eager only: see `latent_cache`).
        page_table: int32 [B, max_pages]; request b's j-th page is page_table[b, j].
        cache_seqlens: int32 [B]; latent tokens in the cache for request b, its new tokens included.
        cu_seqlens_q: int32 [B + 1], packed q only.
        kv_lora_rank: the latent (value) width, 512 for DeepSeek-V3 / Kimi K2: out's last dim.
        causal: as in paged_attention.
        scale: the logit scale, required (keyword). The absorbed product q.k over 576 columns equals the
            original q.k over the 192-dim (128 no-rope + 64 rope) qk head, so the scale is the model's
            softmax_scale of that head (192 ** -0.5 times its YaRN mscale ** 2 for DeepSeek-V3), not
            576 ** -0.5: no default would be right, so none is given.
        k_descale, v_descale: float32 scalar, [B] or [B, 1]; float8 caches only. The values are the keys'
            first kv_lora_rank columns, so v_descale defaults to k_descale.
        return_lse: also return lse, float32 [B, S, H] or [T, H] (natural log).
        out: optional contiguous output [.., H, kv_lora_rank] of q's dtype, written in place.

    Returns:
        out [B, S, H, kv_lora_rank] or [T, H, kv_lora_rank] (q's dtype): the attention-weighted latent values,
        still to be multiplied by W_UV per head; or (out, lse) with return_lse.

    Bad shapes, dtypes or options raise ValueError / TypeError naming the argument (those of the arguments
    passed through, as paged_attention's do).
    """
    _check_tensor("q_nope", q_nope)
    if q_pe is not None:
        _check_tensor("q_pe", q_pe)
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            _fail("kv_cache", "a tensor or a pair (ckv, kpe)", f"a sequence of {len(kv_cache)}")
        ckv = kv_cache[0]
        if isinstance(ckv, torch.Tensor) and ckv.shape[-1] != kv_lora_rank:
            _fail("kv_cache[0] (ckv)", f"of last dim kv_lora_rank = {kv_lora_rank}", f"shape {tuple(ckv.shape)}")
        kv_cache = latent_cache(*kv_cache)
    _check_tensor("kv_cache", kv_cache)
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int):
        _fail("kv_lora_rank", "a positive int", repr(kv_lora_rank), "TypeError")
    if kv_lora_rank < 1:
        _fail("kv_lora_rank", "a positive int", repr(kv_lora_rank))
    if scale is None:
        _fail("scale", "a Python float (the model's softmax_scale; no default: see the docstring)", None,
              "TypeError")
    if kv_cache.dim() != 3:
        _fail("kv_cache", "3-dimensional [num_pages, page_size, kv_lora_rank + rope_dim]",
              f"shape {tuple(kv_cache.shape)}")
    width = kv_cache.shape[-1]
    if width <= kv_lora_rank:
        _fail("kv_cache", f"wider than kv_lora_rank = {kv_lora_rank} (the rope key follows the latent)",
              f"shape {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        _fail("kv_cache", "contiguous in its last dim", f"strides {tuple(kv_cache.stride())}")
    if q_nope.dim() not in (3, 4):
        _fail("q_nope", "[B, S, H, kv_lora_rank] or packed [T, H, kv_lora_rank]", f"shape {tuple(q_nope.shape)}")
    if q_pe is None:
        if q_nope.shape[-1] != width:
            _fail("q_nope", f"of last dim kv_lora_rank + rope_dim = {width} (the whole query, with q_pe None)",
                  f"shape {tuple(q_nope.shape)}")
        if q_nope.stride(-1) != 1:
            _fail("q_nope", "contiguous in its last dim", f"strides {tuple(q_nope.stride())}")
        q = q_nope
    else:
        if q_nope.shape[-1] != kv_lora_rank:
            _fail("q_nope", f"of last dim kv_lora_rank = {kv_lora_rank}", f"shape {tuple(q_nope.shape)}")
        rope = width - kv_lora_rank
        if tuple(q_pe.shape) != tuple(q_nope.shape[:-1]) + (rope,):
            _fail("q_pe", f"of shape {tuple(q_nope.shape[:-1]) + (rope,)} (q_nope's leading dims, rope_dim = "
                  f"kv_cache's last dim {width} - kv_lora_rank {kv_lora_rank})", f"shape {tuple(q_pe.shape)}")
        if q_pe.dtype != q_nope.dtype:
            _fail("q_pe", f"of q_nope's dtype {q_nope.dtype}", q_pe.dtype, "TypeError")
        if q_pe.device != q_nope.device:
            _fail("q_pe", f"on q_nope's device {q_nope.device}", q_pe.device)
        if MLA_HEAD_DIMS.get(width) == kv_lora_rank:
            # the kernels read both in place, rows of unit stride (any other strides): a copy only where not so
            q = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
            q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
        else:  # other latent widths (small test configs) are plain head dims: one query tensor
            q, q_pe = torch.cat([q_nope, q_pe], dim=-1), None
    k_cache = kv_cache.unsqueeze(2)  # [num_pages, page_size, 1, kv_lora_rank + rope_dim]: one KV head, NHD
    v_cache = k_cache[..., :kv_lora_rank]  # the values: the latent, the keys' first kv_lora_rank columns
    if v_descale is None:
        v_descale = k_descale
    from b12x_inductor import paged_attention

    return paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_layout="NHD",
                           causal=causal, scale=scale, k_descale=k_descale, v_descale=v_descale, q_pe=q_pe,
                           return_lse=return_lse, out=out)


def mla_write_kv(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
) -> None:
    """Writes new tokens into a paged latent cache, in place: `mla_attention`'s write (vLLM's
    concat_and_cache_mla). Token t's slot row becomes cat(ckv[t], kpe[t]).

    Args:
        ckv: [T, kv_lora_rank] (512 for DeepSeek-V3 / Kimi K2), the new tokens' compressed KV (the latent
            c = W_DKV x after its norm); bf16, fp16 or fp32; any strides.
        kpe: [T, rope_dim] (64 for DeepSeek), their rope keys (after rotary embedding); ckv's dtype and device.
        kv_cache: the latent cache [num_pages, page_size, kv_lora_rank + rope_dim] that `mla_attention` reads
            (last dim contiguous, any other strides), ckv's dtype, or float8_e4m3fn for bf16/fp16 ckv.
        slot_mapping: int64 or int32 [T]; token t goes to slot = page * page_size + offset, i.e.
            kv_cache[slot // page_size, slot % page_size]. As in `write_kv`: slot < 0 skips the token
            (padding), and so does a slot past the cache (num_pages * page_size or more; B12X_DEBUG=1 raises
            for it); of duplicate slots the last kept token wins.
        scale: float32 scalar tensor, required for a float8_e4m3fn cache and None otherwise: the cache stores
            value / scale (saturated to the float8 range), so `mla_attention` reads it with
            k_descale=scale.

    Bad shapes, dtypes or types raise ValueError / TypeError naming the argument (messages begin
    "write_latent:", the op's name). There is no backward: with grad mode on, an input that requires grad
    raises RuntimeError (use torch.no_grad()). Under torch.compile the write is functionalized, so a later
    `mla_attention` of the same graph reads the written cache, and Inductor writes the cache in place.
    """
    validate.check_write_latent_types(ckv, kpe, kv_cache, slot_mapping, scale=scale)
    torch.ops.b12x.write_latent(ckv, kpe, kv_cache, slot_mapping, scale=scale)
