"""The "b12x" attention and mask functions for transformers (see hf.py for the overview).

Shapes (transformers' conventions): query [B, Hq, S, D]; key/value as returned by `cache.update`; the
attention function returns ([B, S, Hq, D], None).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

import b12x_inductor as b12x
from b12x_inductor.integrations import hf_cache
from b12x_inductor.plan import HEAD_DIMS

ATTN_NAME = "b12x"
_USE_SDPA = 'use attn_implementation="sdpa" for this model or call'


def register() -> None:
    """Registers "b12x" with transformers' AttentionInterface and AttentionMaskInterface (idempotent).
    Afterwards `from_pretrained(..., attn_implementation="b12x")` and
    `model.set_attn_implementation("b12x")` both work."""
    AttentionInterface.register(ATTN_NAME, b12x_attention)
    AttentionMaskInterface.register(ATTN_NAME, b12x_mask)


_ALIGN = 4  # int32 elements per 16 bytes: each row of the metadata mask starts 16-byte aligned


def metadata_mask(kv_start: torch.Tensor, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """Packs int32 kv_start [B] and cache_seqlens [B] into the int32 [1, 1, 3, Bp] metadata mask (Bp: B
    rounded up to a multiple of 4); its last row is the request index, the one-page-per-request page table
    of a StaticCache. Each row is contiguous and 16-byte aligned, as the kernels read these arrays (and
    transformers keeps the mask `.contiguous()`)."""
    b = kv_start.shape[0]
    rows = torch.arange(b, dtype=torch.int32, device=kv_start.device)
    meta = torch.stack([kv_start.to(torch.int32), cache_seqlens.to(torch.int32), rows])
    return torch.nn.functional.pad(meta, (0, -b % _ALIGN)).view(1, 1, 3, -1)


def is_metadata_mask(mask: object) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4
            and tuple(mask.shape[:3]) == (1, 1, 3) and mask.shape[3] % _ALIGN == 0 and mask.is_contiguous())


def unpack_metadata(mask: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int32 [1, 1, 3, Bp] metadata mask of `batch` requests -> contiguous int32 views kv_start [B],
    cache_seqlens [B] and the StaticCache page table [B, 1] (request b reads page b)."""
    return mask[0, 0, 0, :batch], mask[0, 0, 1, :batch], mask[0, 0, 2, :batch, None]


def _check_left_padding(padding_mask: torch.Tensor) -> None:
    """Eager-only check (a host sync) that every row of a 2D padding mask is zeros then ones."""
    m = padding_mask.to(torch.int8)
    ok = bool((m[:, 1:] >= m[:, :-1]).all()) and bool(m[:, -1].all())
    if not ok:
        raise ValueError(
            "b12x attention: attention_mask must be a left-padding mask (each row zeros, then ones up to the "
            "last token); got a mask with holes or right padding. Left-pad the batch, or use "
            'attn_implementation="sdpa".')


def b12x_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
              mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
              device=None, **kwargs) -> torch.Tensor:
    """Mask function of "b12x": returns the int32 [1, 1, 3, Bp] metadata mask (see hf.py).

    attention_mask is transformers' 2D padding mask, bool [B, >= q_offset + q_length] (or None); q_offset
    (int or 0-dim tensor) is the number of tokens cached before this forward.
    """
    if mask_function is not causal_mask_function:
        raise ValueError(
            "b12x attention: expresses causal attention with left padding only; this model asked for another "
            f"mask ({getattr(mask_function, '__name__', mask_function)}: sliding window, bidirectional, packed or "
            f"custom). {_USE_SDPA} b12x_inductor.paged_attention directly.")
    if kv_offset != 0:
        raise ValueError(f"b12x attention: kv_offset must be 0 (no sliding-window cache); got {kv_offset}. "
                         f"{_USE_SDPA} b12x_inductor.paged_attention directly.")
    if attention_mask is None:
        kv_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise ValueError(f"b12x attention: attention_mask must be a 2D padding mask [{batch_size}, L]; got "
                             f"shape {tuple(attention_mask.shape)}")
        if q_length > 1 and not torch.compiler.is_compiling():
            _check_left_padding(attention_mask)
        kv_start = torch.argmax(attention_mask.to(torch.int32), dim=-1).to(torch.int32)  # first non-pad
    if isinstance(q_offset, torch.Tensor):
        lengths = (q_offset.to(device=device, dtype=torch.int32) + q_length).expand(batch_size)
    else:
        lengths = torch.full((batch_size,), int(q_offset) + q_length, dtype=torch.int32, device=device)
    return metadata_mask(kv_start.to(device), lengths)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"b12x attention: {what}. {_USE_SDPA} b12x_inductor.paged_attention directly.")


def b12x_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   sliding_window: int | None = None, softcap: float | None = None, s_aux=None, **kwargs):
    """Attention function of "b12x".

    query [B, Hq, S, D] (bf16/fp16; fp32 on CPU); key/value either transformers' StaticCache buffers
    [B, Hkv, max_cache_len, D] (or the fresh [B, Hkv, S, D] without a cache), or a `B12xCache` layer's page
    pools; attention_mask the metadata mask of `b12x_mask`. Returns (out [B, S, Hq, D], None).
    """
    if dropout and module.training:
        raise _unsupported(f"dropout must be 0 (inference only); got {dropout} in training mode")
    if sliding_window is not None:
        raise _unsupported(f"sliding-window layers are not supported (sliding_window={sliding_window})")
    if kwargs.get("is_causal", True) is False:
        raise _unsupported("non-causal attention is not supported")
    head_dim = query.shape[-1]
    if head_dim not in HEAD_DIMS:
        raise _unsupported(f"head_dim must be one of {HEAD_DIMS}; got {head_dim}")
    if attention_mask is None:
        raise ValueError("b12x attention: got no attention mask; the mask function of 'b12x' was not called "
                         "(call b12x_inductor.integrations.hf.register() before building the model)")
    if not is_metadata_mask(attention_mask):
        what = getattr(attention_mask, "dtype", type(attention_mask).__name__)
        raise _unsupported(
            f"got a custom attention mask (shape {tuple(attention_mask.shape)}, {what}); b12x takes a 2D "
            "left-padding mask only, not a 4D mask")
    batch = query.shape[0]
    if attention_mask.shape[-1] != batch + (-batch % _ALIGN):
        raise ValueError(f"b12x attention: the metadata mask (shape {tuple(attention_mask.shape)}) is not for a "
                         f"batch of {batch}")
    q = query.transpose(1, 2)  # [B, S, Hq, D], D contiguous
    kv_start, seqlens, page_table = unpack_metadata(attention_mask, batch)
    sinks = None if s_aux is None else s_aux.float()
    opts = dict(scale=scaling, kv_start=kv_start, softcap=float(softcap or 0.0), sinks=sinks)
    layer = hf_cache.routed_layer(module, key, kwargs)
    if layer is not None:
        out = layer.attend(q, **opts)
    else:
        if key.dim() != 4 or key.shape[0] != batch:
            raise _unsupported(f"key must be a [B={batch}, Hkv, L, D] static-cache buffer; got shape "
                               f"{tuple(key.shape)} (B12xCache or transformers' StaticCache expected)")
        out = b12x.paged_attention(q, key, value, page_table, seqlens, kv_layout="HND", **opts)
    return out, None
