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
from b12x_inductor.serve.config import ServeConfig
from b12x_inductor.serve.scheduler import Step

ATTN_NAME = "b12x_serve"


def _attention(module, query, key, value, attention_mask, *, scaling=None, b12x_serve=None, sliding_window=None,
               softcap=None, **kwargs):
    """transformers attention interface: query [B, Hq, S, D], key/value [B, Hkv, S, D] of the new tokens
    -> [B, S, Hq, D]. `b12x_serve` (a dict from `ModelRunner._forward`) names the pool and the step's
    slot mapping, page table, lengths and cu_seqlens_q (extend steps: B == 1, tokens packed)."""
    if b12x_serve is None:
        raise ValueError(f"attention {ATTN_NAME!r} runs only inside b12x_inductor.serve.ModelRunner")
    k_cache, v_cache = b12x_serve["kv"][module.layer_idx]
    b, hkv, s, d = key.shape
    b12x.write_kv(key.transpose(1, 2).reshape(b * s, hkv, d), value.transpose(1, 2).reshape(b * s, hkv, d),
                  k_cache, v_cache, b12x_serve["slots"])
    q = query.transpose(1, 2)  # [B, S, Hq, D]
    cu = b12x_serve["cu_seqlens_q"]
    if cu is not None:
        q = q.reshape(b * s, -1, d)  # packed [T, Hq, D]
    out = b12x.paged_attention(q, k_cache, v_cache, b12x_serve["page_table"], b12x_serve["seqlens"], cu,
                               scale=scaling, window_left=-1 if sliding_window is None else sliding_window - 1,
                               softcap=softcap or 0.0)
    return out.reshape(b, s, -1, d), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


class ModelRunner:
    """Owns the paged KV pool of a transformers causal LM and runs scheduler steps through it.

    model: a transformers causal LM (Llama / Qwen2 family: decoder via get_decoder(), lm_head via
    get_output_embeddings()), switched to the "b12x_serve" attention. The pool: per layer, keys and values
    [num_pages, page_size, Hkv, D] in the model's dtype, on its device.
    """

    def __init__(self, model, config: ServeConfig) -> None:
        register_attention()
        self.model, self.config = model, config
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        cfg = model.config.get_text_config()
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
            limit = len(self.buckets) + 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
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
        info = dict(kv=self.kv, slots=slots, page_table=page_table.view(rows, pages).int(), seqlens=seqlens.int(),
                    cu_seqlens_q=parts[5].int() if kind == "extend" else None)
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
        """Compiles (and on CUDA captures) every bucket with padding-only inputs: writes nothing."""
        for kind, rows, width in self.buckets:
            for _ in range(3 if self.cuda_graphs else 1):  # cudagraph trees record on the 2nd/3rd call
                self._call(self.metadata(None, kind, rows, width), kind, rows, width).tolist()
