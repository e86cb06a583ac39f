"""The model runner: one forward pass per scheduler step, compiled once per static bucket.

The compile boundary is `ModelRunner._forward`: a transformers causal LM (its decoder and lm_head) with the
"b12x_serve" attention (below: `write_kv` of the new keys and values into the paged pool, then
`paged_attention`), and greedy argmax. It takes one int64 tensor of step metadata and returns the sampled
token ids. Shapes per step kind (B a decode bucket, S = 1 + num_draft, T an extend bucket, M = max_batch,
P = max_pages):

    kind     model input   metadata (concatenated, int64)                           returns
    decode   ids [B, 1]    ids, positions, slots [B]; page_table [B, P]; seqlens [B]  [B]
    verify   ids [B, S]    ids, positions, slots [B*S]; page_table [B, P]; seqlens [B] [B, S]
    extend   ids [1, T]    ids, positions, slots [T]; page_table [M, P]; seqlens [M];  [M] (one row per
                           cu_seqlens_q [M + 1]; logit_rows [M]                        request)

That is the layout with one pool (`ModelRunner.pools == ("full",)`: a model without window layers, or
recycle_window_pages off; or ("window",): every layer has a window and recycles its pages). A model with both
kinds of layers that recycles window pages has two pools, ("full", "window"), and two slot mappings and page
tables: ids, positions, slots, window_slots; page_table, window_table; then the rest as above. Window-table
columns that the request freed (before its window) hold page 0: no query of the step sees a key there
(paged_attention's window), and the pool holds finite values only (zero-initialized, written with the model's
keys and values), so a kernel that reads such a key anyway gives it probability 0.

An MLA model (DeepSeek-V3: `serve.mla.is_mla`, by its config) runs the same steps and metadata with its
attention modules' forwards replaced by the absorbed latent attention (`serve.mla.absorb_mla`: `mla_write_kv`
of each new token's compressed KV and rope key, then `mla_attention`), over a latent pool: per layer one
[num_pages, page_size, kv_lora_rank + qk_rope_head_dim] tensor (576 values a token for DeepSeek-V3, one KV
head) in place of the key and value tensors, in the one pool "full" (MLA layers have no windows).

Padding (rows of a bucket that no request uses) gets slot -1 (nothing written), seqlen 0 and page 0, and sits
past cu_seqlens_q[-1] in extend steps; its outputs are ignored. The host copies the metadata in once and
reads the sampled tokens once per step; nothing else syncs.
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import asdict, dataclass

import torch

import b12x_inductor as b12x
from b12x_inductor.lowering import _inductor
from b12x_inductor.plan import HEAD_DIMS
from b12x_inductor.serve import mla
from b12x_inductor.serve.config import ServeConfig
from b12x_inductor.serve.scheduler import Step

ATTN_NAME = "b12x_serve"
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")

# Attention keyword arguments that the engine takes and honors: each is turned into an argument of
# `paged_attention`, or accepted only with the one value the engine implements (refused otherwise).
HONORED_KWARGS = ("b12x_serve", "scaling", "sliding_window", "softcap", "s_aux", "dropout", "output_attentions",
                  "is_causal")
# Attention keyword arguments that cannot change the output of this engine's attention, whatever their value.
HARMLESS_KWARGS = {
    "position_ids": "RoPE has already been applied to query and key before the attention call; the engine's "
                    "positions reach attention through the slot mapping and the lengths",
    "use_cache": "the engine owns the KV cache (write_kv into its pool); the model's own cache is off",
    "output_router_logits": "a MoE flag read by the router and the model's output; attention never reads it",
}


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Where:
    """'attention "b12x_serve" (layer i)', read from the module only when formatted."""

    def __init__(self, module) -> None:
        self.module = module

    def __format__(self, spec: str) -> str:
        return f"attention {ATTN_NAME!r} (layer {getattr(self.module, 'layer_idx', '?')})"


def attention_arguments(module, query, key, value, attention_mask, kwargs: dict, window: int | None) -> dict:
    """The `paged_attention` keyword arguments (scale, window_left, softcap, sinks) of one transformers
    attention call, or ValueError naming the argument that the engine cannot honor.

    `window` is the layer's sliding window by its config (None: a full-attention layer); the call must pass
    the same. Every keyword is honored (HONORED_KWARGS), harmless (HARMLESS_KWARGS) or None; anything else is
    refused, so no argument is ever silently dropped."""
    where = _Where(module)  # formatted only in an error: a traced read of layer_idx would specialize on it
    if attention_mask is not None:
        raise ValueError(f"{where}: attention_mask must be None (the engine derives causal and sliding-window "
                         f"visibility from its page table and lengths); got {_describe(attention_mask)}. A model "
                         "that builds its own mask cannot be served by this engine: use transformers' generate")
    for name, val in kwargs.items():
        if name not in HONORED_KWARGS and name not in HARMLESS_KWARGS and val is not None:
            raise ValueError(f"{where}: attention argument {name!r} is not supported by the serving engine "
                             f"(supported: {sorted(HONORED_KWARGS + tuple(HARMLESS_KWARGS))}, others only when "
                             f"None); got {name}={_describe(val)}")
    dropout = kwargs.get("dropout")
    if dropout is not None and dropout != 0:
        raise ValueError(f"{where}: dropout must be 0 (the engine serves in eval mode: call model.eval()); got "
                         f"dropout={_describe(dropout)} with module.training={module.training}")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{where}: output_attentions must be False or None (the engine returns no attention "
                         f"weights); got {_describe(kwargs['output_attentions'])}")
    if kwargs.get("is_causal", True) is False:
        raise ValueError(f"{where}: is_causal must be True or None (the engine runs causal attention only); "
                         "got False")
    q_heads = query.shape[1]
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[2:] != query.shape[2:]:
        raise ValueError(f"{where}: key and value must be the step's new tokens, [B, Hkv, S, D] like query "
                         f"[B, Hq, S, D] = {list(query.shape)}; got key {list(key.shape)}, value "
                         f"{list(value.shape)}")
    scaling = kwargs.get("scaling")
    sliding = kwargs.get("sliding_window")
    if sliding != window:
        raise ValueError(f"{where}: sliding_window must be {window} (this layer's window by "
                         f"config.layer_types / config.sliding_window; None for a full-attention layer); got "
                         f"{_describe(sliding)}")
    if sliding is not None and (not isinstance(sliding, int) or sliding < 1):
        raise ValueError(f"{where}: sliding_window must be an int >= 1 or None; got {_describe(sliding)}")
    softcap = kwargs.get("softcap")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap >= 0):
        raise ValueError(f"{where}: softcap must be None or a number >= 0; got {_describe(softcap)}")
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise ValueError(f"{where}: s_aux must be the module's attention sinks (module.sinks, "
                         f"{_describe(module.sinks)}); got None")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (q_heads,):
            raise ValueError(f"{where}: s_aux (attention sinks) must be a tensor of shape [{q_heads}] (one logit "
                             f"per query head); got {_describe(sinks)}")
        sinks = sinks.float()
    return dict(scale=scaling, window_left=-1 if sliding is None else sliding - 1, softcap=float(softcap or 0.0),
                sinks=sinks)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention interface: query [B, Hq, S, D], key/value [B, Hkv, S, D] of the new tokens
    -> [B, S, Hq, D]. `b12x_serve` (from `ModelRunner._forward`) is the step's attention input of one layer
    (`layer_view`: its window, its pool's key and value tensors, that pool's slot mapping and page table, the
    step's lengths and cu_seqlens_q; extend steps: B == 1, tokens packed), or of all layers (lists indexed by
    module.layer_idx). Every other keyword is honored or refused (`attention_arguments`)."""
    info = kwargs.get("b12x_serve")
    if info is None:
        raise ValueError(f"attention {ATTN_NAME!r} runs only inside b12x_inductor.serve.ModelRunner")
    if "layer" not in info:
        info = layer_view(info, module.layer_idx)
    options = attention_arguments(module, query, key, value, attention_mask, kwargs, info["window"])
    k_cache, v_cache = info["kv"]
    b, hkv, s, d = key.shape
    b12x.write_kv(key.transpose(1, 2).reshape(b * s, hkv, d), value.transpose(1, 2).reshape(b * s, hkv, d),
                  k_cache, v_cache, info["slots"])
    q = query.transpose(1, 2)  # [B, S, Hq, D]
    cu = info["cu_seqlens_q"]
    if cu is not None:
        q = q.reshape(b * s, -1, d)  # packed [T, Hq, D]
    out = b12x.paged_attention(q, k_cache, v_cache, info["page_table"], info["seqlens"], cu, **options)
    return out.reshape(b, s, -1, d), None


def layer_view(info: dict, layer: int) -> dict:
    """Layer `layer`'s attention input from the all-layer info of a step: its key and value pool tensors
    (`kv`), window, slot mapping and page table, and the step's lengths and cu_seqlens_q."""
    return dict(layer=True, kv=info["kv"][layer], window=info["windows"][layer], slots=info["slots"][layer],
                page_table=info["page_table"][layer], seqlens=info["seqlens"], cu_seqlens_q=info["cu_seqlens_q"])


# -- regional compilation ---------------------------------------------------------------------------------------
# Regional compile (ServeConfig.regional_compile: the default where the decoder keeps a ModuleList `layers`;
# True requires it): each decoder layer's forward is `_served_layer`, which hands its own
# slice of the step's info (layer_view) and the layer module to one compiled function, `_layer_region`. Dynamo
# guards on what the layer's code reads (shapes, dtypes, the window and other constants), not on which layer
# it is (parameters are inputs), so all layers of one kind share one graph per bucket: a 16-layer model
# compiles 1 layer per bucket instead of 16 (2 for models with window and full layers). Embedding, rotary
# tables, final norm, lm_head and argmax run eagerly around the layers; on CUDA the runner captures the whole
# step, eager parts and compiled layers, in one CUDA graph per bucket (`ModelRunner._capture`), so a step is
# still one graph replay. torch.compiler.nested_compile_region would keep one Dynamo graph too, but torch
# 2.11-2.14 cannot functionalize a mutating custom op (write_kv) inside a region that mutates its inputs
# (pytorch#186807, fixed in main by pytorch#189543).
def _layer_region(layer, hidden_states, info: dict, args: tuple, kwargs: dict):
    return type(layer).forward(layer, hidden_states, *args, b12x_serve=info, **kwargs)


def _served_layer(region, layer, index: int, hidden_states, *args, **kwargs):
    info = layer_view(kwargs.pop("b12x_serve"), index)
    return region(layer, hidden_states, info, args, kwargs)


def layer_windows(model) -> list[int | None]:
    """Per decoder layer, its sliding window (None: full attention), from the model's config; ValueError for
    what the engine cannot serve, with what to use instead."""
    from b12x_inductor.integrations.hf_cache import layer_windows as config_layer_windows

    cfg = model.config.get_text_config(decoder=True)
    name = type(cfg).__name__
    instead = "serve this model with transformers' generate (attn_implementation='sdpa' or 'eager') instead"
    if cfg.__dict__.get("_heterogeneity_spec") is not None:
        raise ValueError(f"ModelRunner: {name} is a heterogeneous config (per-layer shapes); the engine's pool "
                         f"needs one head count and head_dim for all layers: {instead}")
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise ValueError(f"ModelRunner: {name}.attention_chunk_size must be None (the engine has no chunked "
                         f"attention); got {cfg.attention_chunk_size}: {instead}")
    if getattr(cfg, "is_causal", True) is False or getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"ModelRunner: {name} must be causal (is_causal True, use_bidirectional_attention "
                         f"False); got is_causal={getattr(cfg, 'is_causal', None)}, use_bidirectional_attention="
                         f"{getattr(cfg, 'use_bidirectional_attention', None)}: {instead}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim not in HEAD_DIMS and not mla.is_mla(cfg):  # MLA: the latent widths, checked by serve.mla
        raise ValueError(f"ModelRunner: {name} head_dim must be one of {HEAD_DIMS} (the kernels' head dims); "
                         f"got {head_dim}: {instead}")

    def check_types(types):
        if len(types) != cfg.num_hidden_layers:
            raise ValueError(f"ModelRunner: {name}.layer_types must name one type per layer "
                             f"({cfg.num_hidden_layers}); got {len(types)}")
        for i, kind in enumerate(types):
            if kind not in SERVED_LAYER_TYPES:
                raise ValueError(f"ModelRunner: layer {i} of {name} has attention type {kind!r} "
                                 f"(config.layer_types); the engine serves {SERVED_LAYER_TYPES} only: {instead}")

    if getattr(cfg, "layer_types", None) is not None:
        check_types(cfg.layer_types)  # first: transformers' own reading of some types fails on some configs
    types, windows = config_layer_windows(cfg)
    check_types(types)
    for i, (kind, window) in enumerate(zip(types, windows)):
        if kind == "sliding_attention" and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"ModelRunner: layer {i} of {name} is a sliding_attention layer; its sliding_window "
                             f"must be an int >= 1; got {window!r}")
    for module in model.get_decoder().modules():
        if hasattr(module, "layer_idx") and getattr(module, "is_causal", True) is False:
            raise ValueError(f"ModelRunner: {type(module).__name__} (layer {module.layer_idx}) has is_causal "
                             f"False; the engine runs causal attention only: {instead}")
    return windows


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


_WARMED_ENTRIES = [0]  # Dynamo cache entries the warm-ups of this process's runners have compiled


class ModelRunner:
    """Owns the paged KV pool of a transformers causal LM and runs scheduler steps through it.

    model: a transformers causal LM (decoder via get_decoder(), lm_head via get_output_embeddings()) whose
    layers are causal full-attention or sliding-window layers (`layer_windows`; windows, logit softcap, any
    scaling and attention sinks are honored), switched to the "b12x_serve" attention. The pools: per layer,
    keys and values [pages, page_size, Hkv, D] in the model's dtype, on its device, zero-initialized; the
    layer's pool is `pools[layer_pool[layer]]`: "full" (num_pages pages) or, for window layers that recycle
    their pages, "window" (window_num_pages pages; `window` is the layers' sliding window, the largest if they
    differ). An MLA model (`mla`: DeepSeek-V3) has instead one latent tensor per layer, [pages, page_size,
    kv_lora_rank + qk_rope_head_dim] (`kv[layer]` is that tensor), and its attention forwards absorbed
    (`serve.mla.absorb_mla`).
    """

    def __init__(self, model, config: ServeConfig) -> None:
        self.windows = layer_windows(model)  # refuses what the engine cannot serve, before touching the model
        cfg = model.config.get_text_config(decoder=True)
        self.mla = mla.is_mla(cfg)
        if self.mla:
            mla.check_model(model, self.windows, compile=config.compile)  # what absorb_mla refuses, also first
        register_attention()
        self.model, self.config = model, config
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        recycle = config.recycle_window_pages and any(w is not None for w in self.windows)
        self.window = max(w for w in self.windows if w is not None) if recycle else None
        self.layer_pool = ["window" if recycle and w is not None else "full" for w in self.windows]
        self.pools = tuple(p for p in ("full", "window") if p in self.layer_pool)
        self.pool_pages = {"full": config.num_pages}
        if recycle:
            self.pool_pages["window"] = config.window_pool_pages(self.window)
        self.kv = []
        for pool in self.layer_pool:
            if self.mla:  # the latent cache: [c | k_pe] per token, one KV head
                shape = (self.pool_pages[pool], config.page_size, mla.latent_width(cfg))
                self.kv.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                continue
            shape = (self.pool_pages[pool], config.page_size, hkv, head_dim)
            self.kv.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.dtype, device=self.device)))
        model.set_attn_implementation(ATTN_NAME)  # MLA too: no mask is built for it
        if self.mla:
            mla.absorb_mla(model, self.windows, compile=config.compile)
        model.eval()
        self.cuda_graphs = config.cuda_graphs and self.device.type == "cuda"
        if self.cuda_graphs:
            for tensors in self.kv:  # mutated in place by the graphs: their addresses must stay fixed
                for t in (tensors,) if self.mla else tensors:
                    torch._dynamo.mark_static_address(t)
        self.buckets = ([("decode", b, 1) for b in config.decode_sizes]
                        + [("verify", b, 1 + config.num_draft) for b in config.decode_sizes if config.num_draft]
                        + [("extend", config.max_batch, t) for t in config.extend_sizes])
        # per pool: request -> ((first live column, page count), its page-table row)
        self._rows = {pool: weakref.WeakKeyDictionary() for pool in self.pools}
        regional_ok = isinstance(getattr(self.decoder, "layers", None), torch.nn.ModuleList)
        self.regional = config.compile and (regional_ok if config.regional_compile is None else config.regional_compile)
        self.layer_kinds = len(set(self.windows))  # layers that can share a regional graph: one per window
        if self.mla:  # and DeepSeek-V3's dense layers (first_k_dense_replace) trace apart from its MoE layers
            self.layer_kinds = len({(w, type(getattr(layer, "mlp", None)))
                                    for w, layer in zip(self.windows, self.decoder.layers)})
        self._install_layers()
        self._graphs: dict[tuple[str, int, int], tuple] = {}  # regional on CUDA: bucket -> (graph, meta, out)
        self._pool = None
        self.forward = self._forward
        # Every runner's buckets are cache entries of the same code objects (ModelRunner._forward, or
        # _layer_region once per layer kind): warm-up raises Dynamo's limits by this runner's count while it
        # compiles (serving compiles nothing: fail_on_recompile), so several engines in one process never hit them.
        self._entries = len(self.buckets) * (self.layer_kinds if self.regional else 1)
        if config.compile:
            if not self.regional:
                self.forward = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                             mode="reduce-overhead" if self.cuda_graphs else None)

    def _install_layers(self) -> None:
        """Regional compile: every decoder layer's forward becomes `_served_layer` over this runner's compiled
        `_layer_region` (CUDA graphs are the runner's, around the whole step: no cudagraph trees inside).
        Otherwise a forward installed by an earlier runner is removed: the class's forward again."""
        layers = getattr(self.decoder, "layers", None)
        if self.regional and not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(f"ServeConfig.regional_compile: {type(self.decoder).__name__} keeps no ModuleList "
                             "`layers` of decoder layers to compile one by one; use regional_compile=False")
        region = torch.compile(_layer_region, fullgraph=True, dynamic=False) if self.regional else None
        for i, layer in enumerate(layers if layers is not None else ()):
            installed = layer.__dict__.get("forward")
            if isinstance(installed, functools.partial) and installed.func is _served_layer:
                del layer.forward
            if region is not None:
                layer.forward = functools.partial(_served_layer, region, layer, i)

    # -- the compiled region --------------------------------------------------------------------------------
    def _forward(self, meta: torch.Tensor, kind: str, rows: int, width: int) -> torch.Tensor:
        """meta: int64, the layout of the module docstring; (rows, width) = (B, S) or (M, T) for extend."""
        pages, g = self.config.max_pages, len(self.pools)
        n = width if kind == "extend" else rows * width
        sizes = [n] * (2 + g) + [rows * pages] * g + [rows] + ([rows + 1, rows] if kind == "extend" else [])
        parts = meta.split(sizes)
        ids, positions = parts[:2]
        slots = dict(zip(self.pools, parts[2:2 + g]))
        tables = {pool: t.view(rows, pages).int() for pool, t in zip(self.pools, parts[2 + g:2 + 2 * g])}
        seqlens, parts = parts[2 + 2 * g], parts[2 + 2 * g:]  # parts[1], parts[2]: cu_seqlens_q, logit_rows
        shape = (1, width) if kind == "extend" else (rows, width)
        info = dict(kv=self.kv, windows=self.windows, slots=[slots[p] for p in self.layer_pool],
                    page_table=[tables[p] for p in self.layer_pool], seqlens=seqlens.int(),
                    cu_seqlens_q=parts[1].int() if kind == "extend" else None)
        hidden = self.decoder(input_ids=ids.view(shape), position_ids=positions.view(shape), use_cache=False,
                              b12x_serve=info).last_hidden_state
        hidden = hidden.flatten(0, 1)  # [n, H]
        if kind == "extend":
            hidden = hidden[parts[2]]  # the last token of each request: [M, H]
        tokens = self.lm_head(hidden).argmax(-1)
        return tokens.view(rows, width) if kind == "verify" else tokens

    # -- host side ------------------------------------------------------------------------------------------
    def bucket(self, step: Step) -> tuple[str, int, int]:
        c = self.config
        if step.kind == "extend":
            return "extend", c.max_batch, next(t for t in c.extend_sizes if t >= step.num_tokens)
        b = next(b for b in c.decode_sizes if b >= len(step.work))
        return step.kind, b, (1 + c.num_draft if step.kind == "verify" else 1)

    def metadata(self, step: Step | None, kind: str, rows: int, width: int) -> torch.Tensor:
        """The int64 metadata of a step, on the host (all padding when step is None: warm-up)."""
        ps, pages = self.config.page_size, self.config.max_pages
        work = step.work if step is not None else ()
        ids, pos, seqlens, cu, logit_rows = [], [], [], [0], []
        slots = {pool: [] for pool in self.pools}
        tables = {pool: [] for pool in self.pools}
        for w in work:
            r, n = w.request, len(w.tokens)
            span = range(w.start, w.start + n)
            ids += w.tokens
            pos += span
            for pool in self.pools:
                r_pages, base = (r.pages, 0) if pool == "full" else (r.window_pages, r.window_base)
                slots[pool] += [r_pages[p // ps - base] * ps + p % ps for p in span]
                if kind == "verify":  # pad to S tokens; padding writes nothing
                    slots[pool] += [-1] * (width - n)
                tables[pool].append(self._table_row(r, pool))
            if kind == "verify":
                ids += [w.tokens[-1]] * (width - n)
                pos += range(w.start + n, w.start + width)
            seqlens.append(w.start + (width if kind == "verify" else n))
            cu.append(cu[-1] + n)
            logit_rows.append(cu[-1] - 1)
        pad = (width if kind == "extend" else rows * width) - len(ids)
        free_rows = rows - len(work)
        head = ids + [0] * pad + pos + [0] * pad
        for pool in self.pools:
            head += slots[pool] + [-1] * pad
        tail = seqlens + [0] * free_rows
        if kind == "extend":
            tail += cu + [cu[-1]] * free_rows + logit_rows + [0] * free_rows
        table = []
        for pool in self.pools:
            table += tables[pool] + [torch.zeros(free_rows * pages, dtype=torch.int64)]
        return torch.cat([torch.tensor(head, dtype=torch.int64), *table, torch.tensor(tail, dtype=torch.int64)])

    def _table_row(self, request, pool: str = "full") -> torch.Tensor:
        """A request's page-table row in a pool, padded with page 0 (and, in the window pool, page 0 in its
        freed columns), rebuilt only when its pages change: they grow at the end, free at the front, or are all
        freed by a preemption (and taken anew, maybe as many)."""
        pages, base = (request.pages, 0) if pool == "full" else (request.window_pages, request.window_base)
        key = (request.num_preempted, base, len(pages))
        cached = self._rows[pool].get(request)
        if cached is None or cached[0] != key:
            row = torch.zeros(self.config.max_pages, dtype=torch.int64)
            row[base:base + len(pages)] = torch.tensor(pages, dtype=torch.int64)
            cached = self._rows[pool][request] = (key, row)
        return cached[1]

    def run(self, step: Step) -> list[list[int]]:
        """Runs a step; per work item, the greedy token after each of its tokens (verify) or after its last."""
        kind, rows, width = self.bucket(step)
        tokens = self._call(self.metadata(step, kind, rows, width), kind, rows, width).tolist()  # the host read
        if kind == "verify":
            return [tokens[i] for i in range(len(step.work))]
        return [[tokens[i]] for i in range(len(step.work))]

    def _call(self, meta: torch.Tensor, kind: str, rows: int, width: int) -> torch.Tensor:
        graph = self._graphs.get((kind, rows, width))
        if graph is not None:  # regional on CUDA: the step's one CUDA graph, over its static metadata
            graph, static_meta, out = graph
            static_meta.copy_(meta.pin_memory(), non_blocking=True)
            graph.replay()
            return out
        if self.device.type == "cuda":
            meta = meta.pin_memory().to(self.device, non_blocking=True)
        if self.cuda_graphs and not self.regional:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return self.forward(meta, kind, rows, width)

    def _capture(self, kind: str, rows: int, width: int) -> None:
        """Regional compile on CUDA: records one CUDA graph of the whole step (eager embedding, rotary tables,
        norm, lm_head and argmax, and the compiled layers) over a static metadata buffer, after a warm run on
        a side stream. All buckets share one memory pool: their steps never overlap, and each step's tokens
        are read before the next replay."""
        static_meta = self.metadata(None, kind, rows, width).to(self.device)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.no_grad():
            self.forward(static_meta, kind, rows, width)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(static_meta, kind, rows, width)
        self._graphs[(kind, rows, width)] = (graph, static_meta, out)

    def warmup(self) -> list[BucketWarmup]:
        """Compiles (and on CUDA captures) every bucket with padding-only inputs: writes nothing. First runs
        the smallest bucket eagerly, so an attention argument the engine refuses raises its ValueError here
        (under torch.compile it would surface wrapped in a Dynamo error). Every call after a bucket's first
        runs under fail_on_recompile. Returns where each bucket's time went (`BucketWarmup`)."""
        _WARMED_ENTRIES[0] += self._entries  # with those earlier runners left on the same code objects
        with _inductor.more_recompiles(_WARMED_ENTRIES[0]):
            return self._warmup()

    def _warmup(self) -> list[BucketWarmup]:
        self._graphs.clear()
        kind, rows, width = self.buckets[0]
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            self._forward(self.metadata(None, kind, rows, width).to(self.device), kind, rows, width)
        out = []
        for kind, rows, width in self.buckets:
            meta = self.metadata(None, kind, rows, width)
            before, start = _inductor.compile_stats(), time.perf_counter()
            self._call(meta, kind, rows, width).tolist()  # compiles: Dynamo, then Inductor or its caches
            first = time.perf_counter()
            stats = _inductor.compile_stats()
            with torch.compiler.set_stance("fail_on_recompile"):
                if self.regional and self.cuda_graphs:
                    self._capture(kind, rows, width)
                    self._call(meta, kind, rows, width).tolist()  # one replay
                else:  # cudagraph trees record on the 2nd call and replay from the 3rd; CPU: a 2nd run
                    for _ in range(2 if self.cuda_graphs else 1):
                        self._call(meta, kind, rows, width).tolist()
            done = time.perf_counter()
            delta = {k: stats[k] - before[k] for k in stats}
            out.append(BucketWarmup(kind=kind, rows=rows, width=width, compiled=self.config.compile,
                                    compile_s=first - start,
                                    dynamo_s=delta["dynamo_s"], backend_s=delta["backend_s"], capture_s=done - first,
                                    graphs=int(delta["graphs"]), fx_hit=int(delta["fx_hit"]),
                                    fx_miss=int(delta["fx_miss"]), fx_bypass=int(delta["fx_bypass"]),
                                    aot_hit=int(delta["aot_hit"]), aot_miss=int(delta["aot_miss"])))
        return out


@dataclass(frozen=True, kw_only=True)
class BucketWarmup:
    """Where one bucket's warm-up time went, in seconds. compile_s: its first call (Dynamo's trace, of which
    dynamo_s, then the backend, backend_s: AOTAutograd and Inductor, or their caches; then the first run).
    capture_s: the calls after it, under fail_on_recompile: on CUDA recording its CUDA graph (cudagraph trees:
    the 2nd and 3rd calls; regional compile: a warm run, the capture and one replay), on CPU a second run.
    graphs: Dynamo graphs compiled in it (regional: one per layer kind); fx_*: Inductor's FX graph cache hits,
    misses (an Inductor compile each) and bypasses; aot_*: AOTAutograd's cache."""

    kind: str
    rows: int
    width: int
    compiled: bool  # ServeConfig.compile
    compile_s: float
    dynamo_s: float
    backend_s: float
    capture_s: float
    graphs: int
    fx_hit: int
    fx_miss: int
    fx_bypass: int
    aot_hit: int
    aot_miss: int

    @property
    def source(self) -> str:
        """"compiled" (Inductor compiled at least one of its graphs), "cache" (every graph from Inductor's
        caches), "uncached" (bypassed the cache), "reused" (Dynamo reused graphs this process had compiled
        already: nothing traced) or "eager" (ServeConfig.compile off)."""
        if not self.compiled:
            return "eager"
        if self.fx_miss:
            return "compiled"
        if self.fx_bypass:
            return "uncached"
        return "cache" if self.fx_hit else "reused"

    def to_dict(self) -> dict:
        return dict(asdict(self), source=self.source)
