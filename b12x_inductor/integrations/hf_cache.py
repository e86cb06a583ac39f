"""`B12xCache`: a transformers `Cache` whose layers hold paged KV pools read by the "b12x" attention.

State, all at static addresses (`torch._dynamo.mark_static_address`), allocated at construction:
- `page_table`: int32 [max_batch_size, pages_per_request], shared by the full-attention layers; request b's
  j-th page. By default request b owns pages [b * pages_per_request, (b + 1) * pages_per_request).
- `window_page_table`: the same for the sliding-window layers (transformers' `layer_types`), which keep
  only the pages their window can still see: request b cycles through its `window_pages` pages, column j
  being page b * window_pages + j % window_pages, so position p lives in the slot that position
  p - window_tokens held (window_tokens = window_pages * page_size >= window - 1 + window_slack).
- per layer: `keys` / `values` page pools [num_pages, page_size, Hkv, D] (kv_layout "NHD") of `kv_dtype`
  (the model dtype, or float8_e4m3fn with `k_scale` / `v_scale`, float32 scalars), and `cache_seqlens`,
  int32 [max_batch_size]: the tokens cached for each request (left padding included).

`update` writes the new tokens at positions cache_seqlens[b] + i with `b12x_inductor.write_kv`, advances
cache_seqlens in place, and routes the layer to the attention function (see `route` / `routed_layer`).
Left padding: kv_start comes from the padding mask through the metadata mask, as for StaticCache.

A cycling window layer reads its pool in place for forwards of up to MAX_VERIFY_LEN new tokens (decode,
verify: the window and the new tokens fit in window_tokens). A longer forward (a prefill) first gathers
the window - 1 keys before its first token into a dense [B, window - 1 + S, Hkv, D] block, attends to that
block and its own tokens, and writes only its last window_tokens tokens. `crop` (assisted generation) can
take back at most window_tokens - window + 1 tokens past the longest length ever written: further back, the
window's keys were overwritten, and crop raises.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

import b12x_inductor as b12x
from b12x_inductor.plan import MAX_VERIFY_LEN

# layer_idx -> the B12xLayer whose update ran last: the channel for transformers versions that do not pass
# the kwargs of `cache.update` on to attention (< 5.24). Written by `update`, popped by the attention call
# that follows it.
_ROUTES: dict[int, "B12xLayer"] = {}
ROUTE_KEY = "b12x_layer"
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def route(layer: "B12xLayer", update_kwargs: dict) -> None:
    """Hands `layer` to the attention call that follows its update: in the kwargs dict that transformers
    >= 5.24 passes both to `cache.update(..., kwargs=kwargs)` and to attention, and in
    `_ROUTES[layer.layer_idx]` (always: a version that copied the dict would otherwise lose the layer)."""
    shared = update_kwargs.get("kwargs")
    if isinstance(shared, dict):
        shared[ROUTE_KEY] = layer
    _ROUTES[layer.layer_idx] = layer


def routed_layer(module: torch.nn.Module, key: torch.Tensor, attn_kwargs: dict) -> "B12xLayer | None":
    """The B12xLayer whose update returned `key`, or None (transformers' own caches). Consumes the table
    entry; a table entry whose pools are not `key` is stale (a forward that failed between update and
    attention) and ignored."""
    tabled = _ROUTES.pop(getattr(module, "layer_idx", -1), None)
    layer = attn_kwargs.get(ROUTE_KEY)
    if layer is None and tabled is not None and (key is tabled.keys or tabled.gathers(key)):
        layer = tabled
    if layer is not None and key is not layer.keys and not layer.gathers(key):
        raise ValueError(f"b12x attention: layer {layer.layer_idx} was routed a B12xCache layer but got other keys "
                         f"(shape {tuple(key.shape)}); mixing caches in one forward is not supported")
    return layer


def layer_windows(config) -> tuple[list[str], list[int | None]]:
    """transformers' layer types of a (text) config, as its static cache reads them, and each layer's
    sliding window (None for other layers). transformers >= 5.24 gives per-layer kwargs, 5.17 one dict."""
    layer_types, kwargs = get_layer_types_and_kwargs(config)
    per_layer = kwargs if isinstance(kwargs, list) else [kwargs] * len(layer_types)
    return list(layer_types), [kw.get("sliding_window") if t == "sliding_attention" else None
                               for t, kw in zip(layer_types, per_layer)]


class B12xLayer(CacheLayerMixin):
    """One decoder layer of a B12xCache (see the module docstring for the tensors).

    sliding_window: keys a query sees, itself included (transformers' `sliding_window`), or None for a
    full-attention layer. window_tokens: the positions after which a cycling window layer reuses a slot, or
    None where every position has its own slot.
    """

    is_compileable = True
    is_croppable = True

    def __init__(self, *, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, page_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 sliding_window: int | None = None, window_tokens: int | None = None,
                 written: torch.Tensor | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.keys, self.values = keys, values
        self.page_table, self.cache_seqlens = page_table, cache_seqlens
        self.k_scale, self.v_scale = k_scale, v_scale
        self.sliding_window, self.window_tokens = sliding_window, window_tokens
        self.is_sliding = sliding_window is not None
        self.written = written  # int32 [max_batch_size]: the longest length written (cycling layers only)
        self.page_size = keys.shape[1]
        self.max_cache_len = page_table.shape[1] * self.page_size
        self.device, self.dtype = keys.device, keys.dtype
        self.max_batch_size = page_table.shape[0]
        self.is_initialized = True

    # -- transformers' CacheLayerMixin API --
    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # allocated at construction

    def _slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Slots of int64 positions [B, N] of requests 0..B-1; -1 past the page table."""
        page_idx = torch.div(pos, self.page_size, rounding_mode="floor")
        pages_per_req = self.page_table.shape[1]
        pages = self.page_table[:pos.shape[0]].long().gather(1, page_idx.clamp(0, pages_per_req - 1))
        return torch.where(page_idx < pages_per_req, pages * self.page_size + pos % self.page_size, -1)

    def _gathering(self, num_new: int) -> bool:
        """Whether a forward of `num_new` tokens attends to a gathered dense block (cycling window layers,
        forwards longer than MAX_VERIFY_LEN) instead of the pool."""
        return self.window_tokens is not None and num_new > MAX_VERIFY_LEN

    def gathers(self, key: torch.Tensor) -> bool:
        """Whether `key` is the dense block of `_window_block` (shape [B, window - 1 + S, Hkv, D])."""
        return (self.window_tokens is not None and key.dim() == 4 and key.shape[2:] == self.keys.shape[2:]
                and key.shape[1] > self.sliding_window - 1 + MAX_VERIFY_LEN)

    def _quantized(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x in the pool's dtype, as write_kv stores it (float8 pools: x / scale, saturated)."""
        if self.dtype != torch.float8_e4m3fn:
            return x.to(self.dtype)
        return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(self.dtype)

    def _window_block(self, seqlens: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor):
        """Dense [B, window - 1 + S, Hkv, D] keys and values: the window - 1 positions before each request's
        first new token, read from the pool (garbage before position 0, which kv_start hides), then the new
        tokens [B, S, Hkv, D] in the pool's dtype."""
        before = self.sliding_window - 1
        pos = seqlens[:, None].long() - before + torch.arange(before, device=self.device)
        slots = self._slots(pos.clamp(min=0)).clamp(min=0)
        flat_shape = (-1,) + tuple(self.keys.shape[2:])
        blocks = []
        for pool, new, scale in ((self.keys, k_new, self.k_scale), (self.values, v_new, self.v_scale)):
            blocks.append(torch.cat([pool.view(flat_shape)[slots], self._quantized(new, scale)], dim=1))
        return blocks[0], blocks[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes key/value_states [B, Hkv, S, D] at positions cache_seqlens[:B] + arange(S), advances
        cache_seqlens[:B] by S, and returns the pools (or, for a long forward on a cycling window layer, the
        dense blocks of `_window_block`). Eager calls check (layer 0, one host sync) that the tokens fit
        max_cache_len; under compile, positions past the capacity are dropped (B12X_DEBUG=1 makes the
        attention check its lengths against the page table)."""
        b, h, s, d = key_states.shape
        if b > self.max_batch_size:
            raise ValueError(f"B12xCache: a batch of {b} requests exceeds max_batch_size {self.max_batch_size}")
        seqlens = self.cache_seqlens[:b]
        if self.layer_idx == 0 and not torch.compiler.is_compiling():
            longest = int(seqlens.max()) + s
            if longest > self.max_cache_len:
                raise ValueError(f"B12xCache: {longest} tokens exceed max_cache_len {self.max_cache_len}; build "
                                 "the cache with a larger max_cache_len")
        k_new, v_new = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [B, S, Hkv, D]
        pos = seqlens[:, None].long() + torch.arange(s, device=self.device)  # [B, S]
        slots = self._slots(pos)
        returned = (self.keys, self.values)
        if self._gathering(s):  # read the window before overwriting; keep only the last window_tokens tokens
            returned = self._window_block(seqlens, k_new, v_new)
            slots = torch.where(pos >= seqlens[:, None].long() + (s - self.window_tokens), slots, -1)
        b12x.write_kv(k_new.reshape(b * s, h, d), v_new.reshape(b * s, h, d), self.keys, self.values,
                      slots.reshape(-1), kv_layout="NHD", k_scale=self.k_scale, v_scale=self.v_scale)
        seqlens.add_(s)
        if self.written is not None:
            self.written[:b].copy_(torch.maximum(self.written[:b], seqlens))
        route(self, kwargs)
        return returned

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window_left: int,
               kv_start: torch.Tensor, **opts) -> torch.Tensor:
        """q [B, S, Hq, D] of the tokens just written, key/value what `update` returned -> out [B, S, Hq, D].
        window_left (from the mask) must be this layer's window - 1, or -1 on a full-attention layer."""
        b, s = q.shape[:2]
        mine = -1 if self.sliding_window is None else self.sliding_window - 1
        if window_left != mine:
            raise ValueError(f"b12x attention: B12xCache layer {self.layer_idx} holds a window of "
                             f"{self.sliding_window} keys but its mask has window_left={window_left}")
        descales = dict(k_descale=self.k_scale, v_descale=self.v_scale)
        if not self._gathering(s):
            return b12x.paged_attention(q, self.keys, self.values, self.page_table[:b], self.cache_seqlens[:b],
                                        kv_layout="NHD", window_left=window_left, kv_start=kv_start, **descales,
                                        **opts)
        block = self.sliding_window - 1 + s
        if tuple(key.shape[:2]) != (b, block):
            raise ValueError(f"b12x attention: B12xCache layer {self.layer_idx} expected its [{b}, {block}, Hkv, D] "
                             f"window block; got keys of shape {tuple(key.shape)}")
        first = self.cache_seqlens[:b] - block  # the position of the block's index 0
        local_start = (kv_start - first).clamp(min=0).to(torch.int32)
        rows = torch.arange(b, dtype=torch.int32, device=q.device)[:, None]
        lengths = torch.full((b,), block, dtype=torch.int32, device=q.device)
        return b12x.paged_attention(q, key, value, rows, lengths, kv_layout="NHD", window_left=window_left,
                                    kv_start=local_start, **descales, **opts)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0  # positions are absolute: no kv_offset, whatever the window

    def get_seq_length(self) -> torch.Tensor:
        return self.cache_seqlens.max()

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.cache_seqlens.zero_()
        if self.written is not None:
            self.written.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many tokens from every request; 0: nothing (transformers >= 5.24 crops by
        -tokens, 0 when every draft was accepted); > 0: keep at most that many (older transformers). On a
        cycling window layer, raises ValueError (eagerly, one host sync) if the window of the new last token
        was already overwritten."""
        if tokens_to_remove == 0:
            return
        if tokens_to_remove < 0:
            new = (self.cache_seqlens + tokens_to_remove).clamp(min=0)
        else:
            new = self.cache_seqlens.clamp(max=tokens_to_remove)
        if self.written is not None and not torch.compiler.is_compiling():
            back, limit = int((self.written - new).max()), self.window_tokens - self.sliding_window + 1
            if back > limit:
                raise ValueError(f"B12xCache: cannot crop {back} tokens back on sliding-window layer "
                                 f"{self.layer_idx}: it keeps {self.window_tokens} positions for a window of "
                                 f"{self.sliding_window}, so at most {limit} can be taken back; build the cache "
                                 f"with a larger window_slack")
        self.cache_seqlens.copy_(new)

    def _no_beams(self, *args) -> None:
        raise NotImplementedError("B12xCache does not reorder or repeat requests (beam search); use "
                                  "num_beams=1, or transformers' StaticCache with attn_implementation='sdpa'")

    reorder_cache = batch_repeat_interleave = batch_select_indices = _no_beams

    def offload(self):
        raise NotImplementedError("B12xCache does not offload")

    prefetch = offload


class B12xCache(Cache):
    """Paged KV cache for "b12x" attention; works as `model.generate(..., past_key_values=B12xCache(...))`,
    eager or compiled (fullgraph; reduce-overhead on CUDA). Reuse it across generate calls after `reset()`.

    Args:
        config: the model's (text) config; num_hidden_layers, num_key_value_heads, head_dim and the layer
            types (`layer_types` / `sliding_window`, as transformers reads them) are read.
        max_batch_size: rows of the page tables (a generate batch may be smaller).
        max_cache_len: tokens per request (prompt, padding and new tokens).
        device, dtype: of the pools (dtype the model's).
        kv_dtype: the pools' dtype: `dtype` (default) or torch.float8_e4m3fn.
        page_size: tokens per page (default 64).
        num_pages: pages per full-attention layer (default max_batch_size * ceil(max_cache_len / page_size)).
        window_slack: sliding-window layers keep ceil((window - 1 + window_slack) / page_size) pages per
            request (when that is fewer than a full layer's): window_slack >= MAX_VERIFY_LEN (16) bounds how
            far `crop` may take tokens back (default 64).
        k_scale, v_scale: float8 pools only: the pools hold k / k_scale (default 1.0).
    """

    def __init__(self, config, *, max_batch_size: int, max_cache_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None, page_size: int = 64,
                 num_pages: int | None = None, window_slack: int = 64, k_scale: float = 1.0,
                 v_scale: float = 1.0):
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        device = torch.device(device)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if max_batch_size < 1 or max_cache_len < 1 or page_size < 1:
            raise ValueError("B12xCache: max_batch_size, max_cache_len and page_size must be >= 1; got "
                             f"{max_batch_size}, {max_cache_len}, {page_size}")
        if window_slack < MAX_VERIFY_LEN:
            raise ValueError(f"B12xCache: window_slack must be >= {MAX_VERIFY_LEN}; got {window_slack}")
        if kv_dtype not in (dtype, torch.float8_e4m3fn):
            raise TypeError(f"B12xCache: kv_dtype must be dtype ({dtype}) or torch.float8_e4m3fn; got {kv_dtype}")
        layer_types, windows = layer_windows(config)
        other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if other:
            raise ValueError(f"B12xCache: holds full_attention and sliding_attention layers; this model has "
                             f"{other} layers. Use transformers' own caches with attn_implementation='sdpa'")
        pages_per_req = math.ceil(max_cache_len / page_size)
        num_pages = max_batch_size * pages_per_req if num_pages is None else num_pages
        hkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        fp8 = kv_dtype == torch.float8_e4m3fn
        columns = torch.arange(pages_per_req, dtype=torch.int32, device=device)
        rows = torch.arange(max_batch_size, dtype=torch.int32, device=device)[:, None]
        self.page_table = (rows * pages_per_req + columns) % max(num_pages, 1)
        self.page_size, self.num_pages = page_size, num_pages
        windows = {w for w in windows if w is not None}
        window = max(windows) if windows else None  # transformers builds one sliding mask per model
        if len(windows) > 1:
            raise ValueError(f"B12xCache: one sliding window per model; this one has {sorted(windows)}")
        self.window_pages = None if window is None else min(math.ceil((window - 1 + window_slack) / page_size),
                                                            pages_per_req)
        cycling = self.window_pages is not None and self.window_pages < pages_per_req
        self.window_page_table = None if window is None else rows * self.window_pages + columns % self.window_pages
        statics = [t for t in (self.page_table, self.window_page_table) if t is not None]
        layers = []
        for i, kind in enumerate(layer_types):
            sliding = kind == "sliding_attention"
            shape = ((max_batch_size * self.window_pages) if sliding else num_pages, page_size, hkv, head_dim)
            keys = torch.zeros(shape, dtype=kv_dtype, device=device)
            values = torch.zeros(shape, dtype=kv_dtype, device=device)
            seqlens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
            written = torch.zeros_like(seqlens) if sliding and cycling else None
            ks = torch.tensor(k_scale, dtype=torch.float32, device=device) if fp8 else None
            vs = torch.tensor(v_scale, dtype=torch.float32, device=device) if fp8 else None
            statics += [t for t in (keys, values, seqlens, written, ks, vs) if t is not None]
            layers.append(B12xLayer(
                layer_idx=i, keys=keys, values=values, cache_seqlens=seqlens, k_scale=ks, v_scale=vs,
                page_table=self.window_page_table if sliding else self.page_table,
                sliding_window=window if sliding else None,
                window_tokens=self.window_pages * page_size if sliding and cycling else None, written=written))
        for t in statics:
            torch._dynamo.mark_static_address(t)
        super().__init__(layers=layers)

    def set_seqlens(self, cache_seqlens: torch.Tensor) -> None:
        """Copies int32 [max_batch_size] lengths into every layer, in place (for serving loops that wrote
        the pools themselves: a cycling window layer then takes them as the longest lengths written)."""
        for layer in self.layers:
            layer.cache_seqlens.copy_(cache_seqlens)
            if layer.written is not None:
                layer.written.copy_(cache_seqlens)

    @property
    def max_batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_cache_len(self) -> int:
        return self.layers[0].max_cache_len

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    def kv_bytes(self) -> int:
        """Bytes of the key and value pools of all layers."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))
