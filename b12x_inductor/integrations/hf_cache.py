"""`B12xCache`: a transformers `Cache` whose layers hold paged KV pools read by the "b12x" attention.

State, all at static addresses (`torch._dynamo.mark_static_address`), allocated at construction:
- `page_table`: int32 [max_batch_size, pages_per_request], shared by the layers; request b's j-th page.
  By default request b owns pages [b * pages_per_request, (b + 1) * pages_per_request).
- per layer: `keys` / `values` page pools [num_pages, page_size, Hkv, D] (kv_layout "NHD") of `kv_dtype`
  (the model dtype, or float8_e4m3fn with `k_scale` / `v_scale`, float32 scalars), and `cache_seqlens`,
  int32 [max_batch_size]: the tokens cached for each request (left padding included).

`update` writes the new tokens at positions cache_seqlens[b] + i with `b12x_inductor.write_kv`, advances
cache_seqlens in place, and routes the layer to the attention function (see `route` / `routed_layer`).
Left padding: kv_start comes from the padding mask through the metadata mask, as for StaticCache.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import b12x_inductor as b12x

# layer_idx -> the B12xLayer whose update ran last: the channel for transformers versions that do not pass
# the kwargs of `cache.update` on to attention (< 5.24). Written by `update`, popped by the attention call
# that follows it.
_ROUTES: dict[int, "B12xLayer"] = {}
ROUTE_KEY = "b12x_layer"


def route(layer: "B12xLayer", update_kwargs: dict) -> None:
    """Hands `layer` to the attention call that follows its update: in the kwargs dict that transformers
    >= 5.24 passes both to `cache.update(..., kwargs=kwargs)` and to attention, and in
    `_ROUTES[layer.layer_idx]` (always: a version that copied the dict would otherwise lose the layer)."""
    shared = update_kwargs.get("kwargs")
    if isinstance(shared, dict):
        shared[ROUTE_KEY] = layer
    _ROUTES[layer.layer_idx] = layer


def routed_layer(module: torch.nn.Module, key: torch.Tensor, attn_kwargs: dict) -> "B12xLayer | None":
    """The B12xLayer whose pools `key` is, or None (transformers' own caches). Consumes the table entry."""
    tabled = _ROUTES.pop(getattr(module, "layer_idx", -1), None)
    layer = attn_kwargs.get(ROUTE_KEY)
    layer = tabled if layer is None else layer
    if layer is not None and key.shape != layer.keys.shape:
        raise ValueError(f"b12x attention: layer {layer.layer_idx} was routed a B12xCache layer but got other keys "
                         f"(shape {tuple(key.shape)}); mixing caches in one forward is not supported")
    return layer


class B12xLayer(CacheLayerMixin):
    """One decoder layer of a B12xCache (see the module docstring for the tensors)."""

    is_compileable = True
    is_sliding = False
    is_croppable = True

    def __init__(self, *, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, page_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.keys, self.values = keys, values
        self.page_table, self.cache_seqlens = page_table, cache_seqlens
        self.k_scale, self.v_scale = k_scale, v_scale
        self.page_size = keys.shape[1]
        self.max_cache_len = page_table.shape[1] * self.page_size
        self.device, self.dtype = keys.device, keys.dtype
        self.max_batch_size = page_table.shape[0]
        self.is_initialized = True

    # -- transformers' CacheLayerMixin API --
    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # allocated at construction

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes key/value_states [B, Hkv, S, D] at positions cache_seqlens[:B] + arange(S), advances
        cache_seqlens[:B] by S, and returns the pools. Eager calls check (layer 0, one host sync) that the
        tokens fit max_cache_len; under compile, positions past the capacity are dropped (B12X_DEBUG=1
        makes the attention check its lengths against the page table)."""
        b, h, s, d = key_states.shape
        if b > self.max_batch_size:
            raise ValueError(f"B12xCache: a batch of {b} requests exceeds max_batch_size {self.max_batch_size}")
        seqlens = self.cache_seqlens[:b]
        if self.layer_idx == 0 and not torch.compiler.is_compiling():
            longest = int(seqlens.max()) + s
            if longest > self.max_cache_len:
                raise ValueError(f"B12xCache: {longest} tokens exceed max_cache_len {self.max_cache_len}; build "
                                 "the cache with a larger max_cache_len")
        pos = seqlens[:, None].long() + torch.arange(s, device=self.device)  # [B, S]
        page_idx = torch.div(pos, self.page_size, rounding_mode="floor")
        pages_per_req = self.page_table.shape[1]
        pages = self.page_table[:b].long().gather(1, page_idx.clamp(max=pages_per_req - 1))
        slots = torch.where(page_idx < pages_per_req, pages * self.page_size + pos % self.page_size, -1)
        b12x.write_kv(key_states.transpose(1, 2).reshape(b * s, h, d),
                      value_states.transpose(1, 2).reshape(b * s, h, d), self.keys, self.values,
                      slots.reshape(-1), kv_layout="NHD", k_scale=self.k_scale, v_scale=self.v_scale)
        seqlens.add_(s)
        route(self, kwargs)
        return self.keys, self.values

    def attend(self, q: torch.Tensor, **opts) -> torch.Tensor:
        """q [B, S, Hq, D] of the tokens just written -> out [B, S, Hq, D]."""
        b = q.shape[0]
        return b12x.paged_attention(q, self.keys, self.values, self.page_table[:b], self.cache_seqlens[:b],
                                    kv_layout="NHD", k_descale=self.k_scale, v_descale=self.v_scale, **opts)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.cache_seqlens.max()

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.cache_seqlens.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many tokens from every request; >= 0: keep at most that many."""
        if tokens_to_remove < 0:
            self.cache_seqlens.sub_(-tokens_to_remove).clamp_(min=0)
        else:
            self.cache_seqlens.clamp_(max=tokens_to_remove)

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
        config: the model's (text) config; num_hidden_layers, num_key_value_heads and head_dim are read.
        max_batch_size: rows of the page table (a generate batch may be smaller).
        max_cache_len: tokens per request (prompt, padding and new tokens).
        device, dtype: of the pools (dtype the model's).
        kv_dtype: the pools' dtype: `dtype` (default) or torch.float8_e4m3fn.
        page_size: tokens per page (default 64).
        num_pages: pages per layer (default max_batch_size * ceil(max_cache_len / page_size)).
        k_scale, v_scale: float8 pools only: the pools hold k / k_scale (default 1.0).
    """

    def __init__(self, config, *, max_batch_size: int, max_cache_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None, page_size: int = 64,
                 num_pages: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        device = torch.device(device)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if max_batch_size < 1 or max_cache_len < 1 or page_size < 1:
            raise ValueError("B12xCache: max_batch_size, max_cache_len and page_size must be >= 1; got "
                             f"{max_batch_size}, {max_cache_len}, {page_size}")
        pages_per_req = math.ceil(max_cache_len / page_size)
        num_pages = max_batch_size * pages_per_req if num_pages is None else num_pages
        hkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        fp8 = kv_dtype == torch.float8_e4m3fn
        if kv_dtype not in (dtype, torch.float8_e4m3fn):
            raise TypeError(f"B12xCache: kv_dtype must be dtype ({dtype}) or torch.float8_e4m3fn; got {kv_dtype}")
        page_table = torch.arange(max_batch_size * pages_per_req, dtype=torch.int32, device=device)
        self.page_table = page_table.view(max_batch_size, pages_per_req) % max(num_pages, 1)
        self.page_size, self.num_pages = page_size, num_pages
        statics = [self.page_table]
        layers = []
        for i in range(config.num_hidden_layers):
            shape = (num_pages, page_size, hkv, head_dim)
            keys = torch.zeros(shape, dtype=kv_dtype, device=device)
            values = torch.zeros(shape, dtype=kv_dtype, device=device)
            seqlens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
            ks = torch.tensor(k_scale, dtype=torch.float32, device=device) if fp8 else None
            vs = torch.tensor(v_scale, dtype=torch.float32, device=device) if fp8 else None
            statics += [t for t in (keys, values, seqlens, ks, vs) if t is not None]
            layers.append(B12xLayer(layer_idx=i, keys=keys, values=values, page_table=self.page_table,
                                    cache_seqlens=seqlens, k_scale=ks, v_scale=vs))
        for t in statics:
            torch._dynamo.mark_static_address(t)
        super().__init__(layers=layers)

    def set_seqlens(self, cache_seqlens: torch.Tensor) -> None:
        """Copies int32 [max_batch_size] lengths into every layer, in place (for serving loops)."""
        for layer in self.layers:
            layer.cache_seqlens.copy_(cache_seqlens)

    @property
    def max_batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_cache_len(self) -> int:
        return self.layers[0].max_cache_len

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]
