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

Padding (rows of a bucket that no request uses) gets slot -1 (nothing written), seqlen 0 and page 0, and sits
past cu_seqlens_q[-1] in extend steps; its outputs are ignored. The host copies the metadata in once and
reads the sampled tokens once per step; nothing else syncs.
"""

from __future__ import annotations

import weakref

import torch

import b12x_inductor as b12x
from b12x_inductor.plan import HEAD_DIMS
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


def attention_arguments(module, query, key, value, attention_mask, kwargs: dict, window: int | None) -> dict:
    """The `paged_attention` keyword arguments (scale, window_left, softcap, sinks) of one transformers
    attention call, or ValueError naming the argument that the engine cannot honor.

    `window` is the layer's sliding window by its config (None: a full-attention layer); the call must pass
    the same. Every keyword is honored (HONORED_KWARGS), harmless (HARMLESS_KWARGS) or None; anything else is
    refused, so no argument is ever silently dropped."""
    where = f"attention {ATTN_NAME!r} (layer {getattr(module, 'layer_idx', '?')})"
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
    q_heads, d = query.shape[1], query.shape[-1]
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
    -> [B, S, Hq, D]. `b12x_serve` (a dict from `ModelRunner._forward`) names the pool, each layer's window and
    the step's slot mapping, page table, lengths and cu_seqlens_q (extend steps: B == 1, tokens packed).
    Every other keyword is honored or refused (`attention_arguments`)."""
    info = kwargs.get("b12x_serve")
    if info is None:
        raise ValueError(f"attention {ATTN_NAME!r} runs only inside b12x_inductor.serve.ModelRunner")
    layer = module.layer_idx
    options = attention_arguments(module, query, key, value, attention_mask, kwargs, info["windows"][layer])
    k_cache, v_cache = info["kv"][layer]
    b, hkv, s, d = key.shape
    b12x.write_kv(key.transpose(1, 2).reshape(b * s, hkv, d), value.transpose(1, 2).reshape(b * s, hkv, d),
                  k_cache, v_cache, info["slots"])
    q = query.transpose(1, 2)  # [B, S, Hq, D]
    cu = info["cu_seqlens_q"]
    if cu is not None:
        q = q.reshape(b * s, -1, d)  # packed [T, Hq, D]
    out = b12x.paged_attention(q, k_cache, v_cache, info["page_table"], info["seqlens"], cu, **options)
    return out.reshape(b, s, -1, d), None


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
    if head_dim not in HEAD_DIMS:
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


class ModelRunner:
    """Owns the paged KV pool of a transformers causal LM and runs scheduler steps through it.

    model: a transformers causal LM (decoder via get_decoder(), lm_head via get_output_embeddings()) whose
    layers are causal full-attention or sliding-window layers (`layer_windows`; windows, logit softcap, any
    scaling and attention sinks are honored), switched to the "b12x_serve" attention. The pool: per layer,
    keys and values [num_pages, page_size, Hkv, D] in the model's dtype, on its device.
    """

    def __init__(self, model, config: ServeConfig) -> None:
        self.windows = layer_windows(model)  # refuses what the engine cannot serve, before touching the model
        register_attention()
        self.model, self.config = model, config
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        cfg = model.config.get_text_config(decoder=True)
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (config.num_pages, config.page_size, hkv, head_dim)
        self.kv = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_hidden_layers)]
        model.set_attn_implementation(ATTN_NAME)
        model.eval()
        self.cuda_graphs = config.cuda_graphs and self.device.type == "cuda"
        if self.cuda_graphs:
            for k, v in self.kv:  # mutated in place by the graphs: their addresses must stay fixed
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)
        self.buckets = ([("decode", b, 1) for b in config.decode_sizes]
                        + [("verify", b, 1 + config.num_draft) for b in config.decode_sizes if config.num_draft]
                        + [("extend", config.max_batch, t) for t in config.extend_sizes])
        self._rows = weakref.WeakKeyDictionary()  # request -> (page count, its page-table row)
        self.forward = self._forward
        if config.compile:
            # Every runner's buckets are cache entries of the same code object (ModelRunner._forward), so each
            # runner adds its bucket count to Dynamo's limits: several engines in one process never hit them.
            dyn = torch._dynamo.config
            dyn.recompile_limit += len(self.buckets)
            dyn.accumulated_recompile_limit += 4 * len(self.buckets)
            self.forward = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                         mode="reduce-overhead" if self.cuda_graphs else None)

    # -- the compiled region --------------------------------------------------------------------------------
    def _forward(self, meta: torch.Tensor, kind: str, rows: int, width: int) -> torch.Tensor:
        """meta: int64, the layout of the module docstring; (rows, width) = (B, S) or (M, T) for extend."""
        pages = self.config.max_pages
        n = width if kind == "extend" else rows * width
        sizes = [n, n, n, rows * pages, rows] + ([rows + 1, rows] if kind == "extend" else [])
        parts = meta.split(sizes)
        ids, positions, slots, page_table, seqlens = parts[:5]
        shape = (1, width) if kind == "extend" else (rows, width)
        info = dict(kv=self.kv, windows=self.windows, slots=slots, page_table=page_table.view(rows, pages).int(),
                    seqlens=seqlens.int(), cu_seqlens_q=parts[5].int() if kind == "extend" else None)
        hidden = self.decoder(input_ids=ids.view(shape), position_ids=positions.view(shape), use_cache=False,
                              b12x_serve=info).last_hidden_state
        hidden = hidden.flatten(0, 1)  # [n, H]
        if kind == "extend":
            hidden = hidden[parts[6]]  # the last token of each request: [M, H]
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
        ids, pos, slots, seqlens, cu, logit_rows, table = [], [], [], [], [0], [], []
        for w in work:
            r_pages, n = w.request.pages, len(w.tokens)
            span = range(w.start, w.start + n)
            ids += w.tokens
            pos += span
            slots += [r_pages[p // ps] * ps + p % ps for p in span]
            if kind == "verify":  # pad to S tokens; padding writes nothing
                ids += [w.tokens[-1]] * (width - n)
                pos += range(w.start + n, w.start + width)
                slots += [-1] * (width - n)
            table.append(self._table_row(w.request))
            seqlens.append(w.start + (width if kind == "verify" else n))
            cu.append(cu[-1] + n)
            logit_rows.append(cu[-1] - 1)
        pad = (width if kind == "extend" else rows * width) - len(ids)
        free_rows = rows - len(work)
        head = ids + [0] * pad + pos + [0] * pad + slots + [-1] * pad
        tail = seqlens + [0] * free_rows
        if kind == "extend":
            tail += cu + [cu[-1]] * free_rows + logit_rows + [0] * free_rows
        table.append(torch.zeros(free_rows * pages, dtype=torch.int64))
        return torch.cat([torch.tensor(head, dtype=torch.int64), *table, torch.tensor(tail, dtype=torch.int64)])

    def _table_row(self, request) -> torch.Tensor:
        """A request's page-table row, padded with page 0, rebuilt only when its page count changes."""
        cached = self._rows.get(request)
        if cached is None or cached[0] != len(request.pages):
            row = torch.zeros(self.config.max_pages, dtype=torch.int64)
            row[:len(request.pages)] = torch.tensor(request.pages, dtype=torch.int64)
            cached = self._rows[request] = (len(request.pages), row)
        return cached[1]

    def run(self, step: Step) -> list[list[int]]:
        """Runs a step; per work item, the greedy token after each of its tokens (verify) or after its last."""
        kind, rows, width = self.bucket(step)
        tokens = self._call(self.metadata(step, kind, rows, width), kind, rows, width).tolist()  # the host read
        if kind == "verify":
            return [tokens[i] for i in range(len(step.work))]
        return [[tokens[i]] for i in range(len(step.work))]

    def _call(self, meta: torch.Tensor, kind: str, rows: int, width: int) -> torch.Tensor:
        if self.device.type == "cuda":
            meta = meta.pin_memory().to(self.device, non_blocking=True)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return self.forward(meta, kind, rows, width)

    def warmup(self) -> None:
        """Compiles (and on CUDA captures) every bucket with padding-only inputs: writes nothing. First runs
        the smallest bucket eagerly, so an attention argument the engine refuses raises its ValueError here
        (under torch.compile it would surface wrapped in a Dynamo error)."""
        kind, rows, width = self.buckets[0]
        with torch.no_grad():
            self._forward(self.metadata(None, kind, rows, width).to(self.device), kind, rows, width)
        for kind, rows, width in self.buckets:
            for _ in range(3 if self.cuda_graphs else 1):  # cudagraph trees record on the 2nd/3rd call
                self._call(self.metadata(None, kind, rows, width), kind, rows, width).tolist()
