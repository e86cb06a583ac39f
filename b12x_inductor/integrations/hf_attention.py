"""The "b12x" attention and mask functions for transformers (see hf.py for the overview).

Shapes (transformers' conventions): query [B, Hq, S, D]; key/value as returned by `cache.update`; the
attention function returns ([B, S, Hq, D], None).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import b12x_inductor as b12x
from b12x_inductor.integrations import hf_cache
from b12x_inductor.plan import HEAD_DIMS

ATTN_NAME = "b12x"
_USE_SDPA = 'use attn_implementation="sdpa" (or "eager") for this model or call'


def register() -> None:
    """Registers "b12x" with transformers' AttentionInterface and AttentionMaskInterface (idempotent).
    Afterwards `from_pretrained(..., attn_implementation="b12x")` and
    `model.set_attn_implementation("b12x")` both work."""
    AttentionInterface.register(ATTN_NAME, b12x_attention)
    AttentionMaskInterface.register(ATTN_NAME, b12x_mask)


_ALIGN = 4  # int32 elements per 16 bytes: each row of the metadata mask starts 16-byte aligned


def metadata_mask(kv_start: torch.Tensor, cache_seqlens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Packs int32 kv_start [B] and cache_seqlens [B] into the int32 metadata mask [1, G, 3, Bp] (Bp: B
    rounded up to a multiple of 4); its last row is the request index, the one-page-per-request page table
    of a StaticCache. Each row is contiguous and 16-byte aligned, as the kernels read these arrays (and
    transformers passes 4D masks on untouched). G is 1 for causal attention and window + 1 for a sliding
    window of `window` keys (a query sees itself and the window - 1 keys before it), so the window travels
    with the mask as a static size: dim 1 is an expansion (generate makes it contiguous: 12 * Bp bytes per
    key of the window)."""
    b = kv_start.shape[0]
    rows = torch.arange(b, dtype=torch.int32, device=kv_start.device)
    meta = torch.stack([kv_start.to(torch.int32), cache_seqlens.to(torch.int32), rows])
    meta = torch.nn.functional.pad(meta, (0, -b % _ALIGN)).view(1, 1, 3, -1)
    return meta if window is None else meta.expand(1, window + 1, 3, meta.shape[-1])


def is_metadata_mask(mask: object) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4
            and mask.shape[0] == 1 and mask.shape[2] == 3 and mask.shape[3] % _ALIGN == 0
            and mask[0, 0].is_contiguous())


def mask_window(mask: torch.Tensor) -> int | None:
    """The sliding window (keys a query sees, itself included) of a metadata mask, or None (causal)."""
    return None if mask.shape[1] == 1 else mask.shape[1] - 1


def unpack_metadata(mask: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int32 metadata mask of `batch` requests -> contiguous int32 views kv_start [B], cache_seqlens [B]
    and the StaticCache page table [B, 1] (request b reads page b)."""
    return mask[0, 0, 0, :batch], mask[0, 0, 1, :batch], mask[0, 0, 2, :batch, None]


def _check_left_padding(padding_mask: torch.Tensor) -> None:
    """Eager-only check (a host sync) that every row of a 2D padding mask is zeros then ones."""
    m = padding_mask.to(torch.int8)
    ok = bool((m[:, 1:] >= m[:, :-1]).all()) and bool(m[:, -1].all())
    if not ok:
        raise ValueError(
            "b12x attention: attention_mask must be a left-padding mask (each row zeros, then ones up to the "
            f"last token); got a mask with holes or right padding. Left-pad the batch, or {_USE_SDPA}.")


# -- recognising the mask pattern a model asks for --------------------------------------------------------------
# transformers hands the mask function the pattern as a Python callable of (batch, head, q, kv) indices
# (`causal_mask_function`, `sliding_window_causal_mask_function(w)`, or compositions with and_masks / or_masks).
# b12x expresses causal attention and causal sliding windows only, so the callable is evaluated at probe points
# on index objects that compute with Python ints: exact for the patterns transformers builds from index
# arithmetic, traceable by Dynamo (no tensors, no host sync), and anything that reads a tensor (padding,
# chunks, image-token groups) or does not give a plain truth value is refused.
class _Truth:
    __slots__ = ("value",)
    device = "cpu"

    def __init__(self, value: bool):
        self.value = value

    def __and__(self, other):
        return _Truth(self.value and _truth(other))

    def __or__(self, other):
        return _Truth(self.value or _truth(other))

    def __invert__(self):
        return _Truth(not self.value)

    def to(self, *args, **kwargs):
        return self


def _truth(x) -> bool:
    if isinstance(x, _Truth):
        return x.value
    if isinstance(x, bool):
        return x
    raise TypeError(f"not a truth value: {type(x).__name__}")


class _Index:
    __slots__ = ("value",)
    device = "cpu"

    def __init__(self, value: int):
        self.value = value

    @staticmethod
    def _int(other) -> int:
        if isinstance(other, _Index):
            return other.value
        if isinstance(other, int) and not isinstance(other, bool):
            return other
        raise TypeError(f"not an index: {type(other).__name__}")

    def __add__(self, other):
        return _Index(self.value + self._int(other))

    __radd__ = __add__

    def __sub__(self, other):
        return _Index(self.value - self._int(other))

    def __rsub__(self, other):
        return _Index(self._int(other) - self.value)

    def __le__(self, other):
        return _Truth(self.value <= self._int(other))

    def __lt__(self, other):
        return _Truth(self.value < self._int(other))

    def __ge__(self, other):
        return _Truth(self.value >= self._int(other))

    def __gt__(self, other):
        return _Truth(self.value > self._int(other))

    def new_ones(self, *args, **kwargs):
        return _Truth(True)

    def new_zeros(self, *args, **kwargs):
        return _Truth(False)


_FAR = 1 << 20  # probe queries sit far from position 0, so that no probe key is negative


def _visible(mask_function, distance: int) -> bool | None:
    """Whether the pattern lets a query see the key `distance` positions before it (None: not evaluable)."""
    try:
        return _truth(mask_function(_Index(0), _Index(0), _Index(_FAR), _Index(_FAR - distance)))
    except Exception:  # noqa: BLE001 - any pattern that does not evaluate on indices alone is refused
        return None


def pattern_window(mask_function, local_size: int | None) -> int | None:
    """None if `mask_function` is causal, w if it is the causal sliding window of w keys (`local_size`, the
    window transformers passes beside the pattern); raises ValueError for any other pattern."""
    distances = [-(1 << 19), -3, -1, 0, 1, 2, 3, 64, 1 << 19]
    if local_size is not None:
        distances += [local_size - 2, local_size - 1, local_size, local_size + 1, 2 * local_size]
    seen = [_visible(mask_function, d) for d in distances]
    window = local_size if local_size is not None and local_size >= 1 else None
    if seen == [d >= 0 and (window is None or d < window) for d in distances]:
        return window
    name = getattr(mask_function, "__name__", type(mask_function).__name__)
    raise ValueError(
        f"b12x attention: expresses causal attention, optionally within a sliding window, with left padding; "
        f"this model asked for another mask pattern ({name}, local_size={local_size}: bidirectional, chunked, "
        f"packed, image-token or custom). {_USE_SDPA}, or b12x_inductor.paged_attention directly.")


_MASK_HINTS = ("allow_is_causal_skip", "allow_is_bidirectional_skip", "dtype", "config", "use_vmap")


def b12x_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
              mask_function=None, attention_mask: torch.Tensor | None = None, device=None,
              local_size: int | None = None, **kwargs) -> torch.Tensor:
    """Mask function of "b12x": returns the int32 metadata mask [1, G, 3, Bp] (see `metadata_mask`).

    attention_mask is transformers' 2D padding mask, bool [B, >= q_offset + q_length] over absolute positions
    (or None); q_offset (int, SymInt or 0-dim tensor) is the number of tokens cached before this forward;
    kv_offset the absolute position of index 0 of the keys attention will get (nonzero for transformers'
    sliding-window static cache layers once full). The mask's lengths and kv_start count from kv_offset.
    mask_function must be causal or causal sliding-window (`pattern_window`); `allow_is_causal_skip`,
    `use_vmap`, `dtype` and `config` are hints for other mask builders and change nothing here.
    """
    from transformers.masking_utils import causal_mask_function

    unknown = {k: v for k, v in kwargs.items() if k not in _MASK_HINTS and v is not None}
    if unknown:
        raise ValueError(f"b12x attention: the mask function got arguments it cannot honor: {sorted(unknown)}. "
                         f"{_USE_SDPA}.")
    window = pattern_window(causal_mask_function if mask_function is None else mask_function, local_size)
    if attention_mask is None:
        kv_start = torch.zeros(batch_size, dtype=torch.int32, device=device)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise ValueError(f"b12x attention: attention_mask must be a 2D padding mask [{batch_size}, L]; got "
                             f"shape {tuple(attention_mask.shape)}")
        if q_length > 1 and not torch.compiler.is_compiling():
            _check_left_padding(attention_mask)
        kv_start = torch.argmax(attention_mask.to(torch.int32), dim=-1).to(torch.int32)  # first non-pad
        kv_start = (kv_start - kv_offset).clamp(min=0).to(device)
    if isinstance(q_offset, torch.Tensor):
        lengths = (q_offset.to(device=device, dtype=torch.int32) + (q_length - kv_offset)).expand(batch_size)
    else:
        lengths = torch.full((batch_size,), q_offset + q_length - kv_offset, dtype=torch.int32, device=device)
    return metadata_mask(kv_start, lengths, window)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"b12x attention: {what}. {_USE_SDPA}, or b12x_inductor.paged_attention directly.")


# Keyword arguments transformers' models pass to attention that change nothing in its result, and why.
HARMLESS_KWARGS = {
    "position_ids": "positions were applied to query and key by the rotary embedding",
    "cache_position": "the positions of the new tokens come from the metadata mask",
    "use_cache": "whether a cache is used shows in the key/value and mask arguments",
    "output_router_logits": "mixture-of-experts bookkeeping, outside attention",
    "output_hidden_states": "a model output flag, outside attention",
    "return_dict": "a model output flag, outside attention",
    hf_cache.ROUTE_KEY: "the B12xCache layer handed over by its update",
}


def b12x_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   sliding_window: int | None = None, softcap: float | None = None, s_aux=None,
                   is_causal: bool | None = None, output_attentions: bool | None = None, **kwargs):
    """Attention function of "b12x".

    query [B, Hq, S, D] (bf16/fp16; fp32 on CPU); key/value either transformers' StaticCache buffers
    [B, Hkv, L, D] (or the fresh [B, Hkv, S, D] without a cache), or what a `B12xCache` layer's update
    returned; attention_mask the metadata mask of `b12x_mask`. scaling: the logit scale (Gemma's
    query_pre_attn_scalar ** -0.5); sliding_window: the layer's window in keys (equal to the mask's);
    softcap: logit softcap (Gemma 2); s_aux: attention-sink logits [Hq] (gpt-oss). Every other argument is
    refused unless it is in HARMLESS_KWARGS or None. Returns (out [B, S, Hq, D], None).
    """
    if dropout and module.training:
        raise _unsupported(f"dropout must be 0 (inference only); got {dropout} in training mode")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise _unsupported("non-causal attention is not supported (is_causal=False: bidirectional layers)")
    if output_attentions:
        raise _unsupported("attention weights cannot be returned (output_attentions=True)")
    unknown = sorted(k for k, v in kwargs.items() if k not in HARMLESS_KWARGS and v is not None)
    if unknown:
        raise _unsupported(f"got attention arguments it cannot honor: {unknown}")
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
    window = mask_window(attention_mask)
    if window != sliding_window:
        raise _unsupported(f"layer {getattr(module, 'layer_idx', '?')} has sliding_window={sliding_window} but its "
                           f"mask is for {'causal attention' if window is None else f'a window of {window}'}")
    if s_aux is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise _unsupported(f"layer {getattr(module, 'layer_idx', '?')} has attention sinks (module.sinks) but "
                           "passed no s_aux")
    q = query.transpose(1, 2)  # [B, S, Hq, D], D contiguous
    kv_start, seqlens, page_table = unpack_metadata(attention_mask, batch)
    sinks = None if s_aux is None else s_aux.float()
    opts = dict(scale=scaling, kv_start=kv_start, softcap=float(softcap or 0.0), sinks=sinks,
                window_left=-1 if window is None else window - 1)
    layer = hf_cache.routed_layer(module, key, kwargs)
    if layer is not None:
        out = layer.attend(q, key, value, **opts)
    else:
        if key.dim() != 4 or key.shape[0] != batch:
            raise _unsupported(f"key must be a [B={batch}, Hkv, L, D] static-cache buffer; got shape "
                               f"{tuple(key.shape)} (B12xCache or transformers' StaticCache expected)")
        out = b12x.paged_attention(q, key, value, page_table, seqlens, kv_layout="HND", **opts)
    return out, None
