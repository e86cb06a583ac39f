"""gpt-fast-style decode loop with and without the automatic substitution:
`python -m b12x_inductor.bench gptfast [options]`.

A gpt-fast-style decoder (KV caches as module buffers [B, Hkv, max_seq_len, D] written at input_pos,
repeat_interleave GQA; Llama-3-8B layer shapes, --layers of them, random bf16 weights) decodes one token per
step with `torch.compile(mode="reduce-overhead", fullgraph=True)`. Run twice from the same weights and
caches: the pass off (SDPA over the whole max_seq_len buffer) and on (b12x.paged_attention). Both start at
--live filled positions; tokens/s = batch x steps / wall time. The first step's logits of the two runs are
compared.

--mask picks the mask (recorded in the JSON):
- published (the default): gpt-fast's own, `mask = self.causal_mask[None, None, input_pos]`, a bool
  [max_seq_len, max_seq_len] tril tensor kept on the model as a plain attribute (gpt-fast's model.py,
  `setup_caches`, in its SDPA version). Its values are unknown to the compile: the pass hands the mask to
  the op (key_mask), which reads it.
- rewritten: the mask built from the positions, `arange(max_seq_len) <= input_pos[:, None]`, which the
  pass proves causal (the op then reads only the live keys, no mask).

Options: --tiny (CPU, fp32, small shapes: a dry run of the harness), --out PATH (JSON), --mask
published|rewritten, --layers N, --batch B, --max-seq-len L, --live N, --steps N.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import b12x_inductor

FULL = dict(vocab=32000, dim=4096, heads=32, kv_heads=8, head_dim=128, hidden=14336, layers=4, batch=8,
            max_seq_len=4096, live=1024, steps=64, dtype=torch.bfloat16, device="cuda", mode="reduce-overhead",
            mask="published")
TINY = dict(vocab=256, dim=256, heads=4, kv_heads=2, head_dim=64, hidden=512, layers=2, batch=2,
            max_seq_len=128, live=32, steps=4, dtype=torch.float32, device="cpu", mode=None, mask="published")
MASKS = ("published", "rewritten")
MASK_TEXT = {"published": "causal_mask[None, None, input_pos]", "rewritten": "arange(L) <= input_pos"}


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wqkv = nn.Linear(c["dim"], (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"], bias=False)
        self.wo = nn.Linear(c["heads"] * c["head_dim"], c["dim"], bias=False)
        shape = (c["batch"], c["kv_heads"], c["max_seq_len"], c["head_dim"])
        self.register_buffer("k_cache", torch.randn(shape, dtype=c["dtype"]))
        self.register_buffer("v_cache", torch.randn(shape, dtype=c["dtype"]))

    def forward(self, x, mask, input_pos):
        c, (b, s, _) = self.c, x.shape
        hd, kvd = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
        q, k, v = self.wqkv(x).split([hd, kvd, kvd], dim=-1)
        q, k, v = (t.view(b, s, -1, c["head_dim"]).transpose(1, 2) for t in (q, k, v))
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        rep = c["heads"] // c["kv_heads"]
        k, v = self.k_cache.repeat_interleave(rep, dim=1), self.v_cache.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, hd))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn = Attention(c)
        self.norm1, self.norm2 = nn.RMSNorm(c["dim"]), nn.RMSNorm(c["dim"])
        self.w13 = nn.Linear(c["dim"], 2 * c["hidden"], bias=False)
        self.w2 = nn.Linear(c["hidden"], c["dim"], bias=False)

    def forward(self, x, mask, input_pos):
        x = x + self.attn(self.norm1(x), mask, input_pos)
        gate, up = self.w13(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.max_seq_len, self.mask_form = c["max_seq_len"], c["mask"]
        self.embed = nn.Embedding(c["vocab"], c["dim"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = nn.RMSNorm(c["dim"])
        self.output = nn.Linear(c["dim"], c["vocab"], bias=False)
        # gpt-fast's setup_caches: a plain attribute (not a buffer), a graph input under torch.compile
        self.causal_mask = torch.tril(torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool))

    def forward(self, idx, input_pos):
        if self.mask_form == "published":
            mask = self.causal_mask[None, None, input_pos]
        else:
            keys = torch.arange(self.max_seq_len, device=idx.device)
            mask = keys[None, None, None, :] <= input_pos[None, None, :, None]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, mask, input_pos)
        return self.output(self.norm(x))


def decode_one_token(model, token, input_pos):
    logits = model(token, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True), logits[:, -1].float()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model, c, substitute: bool) -> dict:
    torch._dynamo.reset()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    no_cache = dict(fx_graph_cache=False)  # a cached graph is not analyzed again: no decisions to report
    with b12x_inductor.substituting(substitute), torch.no_grad(), torch._inductor.config.patch(no_cache), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        step = torch.compile(decode_one_token, mode=c["mode"], fullgraph=True)
        token = torch.zeros(c["batch"], 1, dtype=torch.long, device=c["device"])
        t0 = time.perf_counter()
        first = None
        for i in range(3):  # compile, then CUDA-graph warm-up and recording
            pos = torch.tensor([c["live"] + i], device=c["device"])
            nxt, logits = step(model, token, pos)
            first = logits.clone() if first is None else first
        _sync(c["device"])
        compile_s = time.perf_counter() - t0
        decisions = [str(d) for d in b12x_inductor.last_decisions()] if substitute else []
        t0 = time.perf_counter()
        for i in range(c["steps"]):
            pos = torch.tensor([c["live"] + 3 + i], device=c["device"])
            nxt, _ = step(model, nxt, pos)
        _sync(c["device"])
        elapsed = time.perf_counter() - t0
    model.load_state_dict(state)  # the other run starts from the same caches
    return dict(substitute=substitute, tokens_per_s=c["batch"] * c["steps"] / elapsed,
                ms_per_step=1e3 * elapsed / c["steps"], compile_and_warmup_s=compile_s,
                substituted=sum("substituted:" in d for d in decisions), decisions=decisions,
                first_logits=first)


def main(argv) -> None:
    parser = argparse.ArgumentParser(prog="python -m b12x_inductor.bench gptfast")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--mask", choices=MASKS, help="published (default): gpt-fast's causal_mask[None, None, "
                        "input_pos]; rewritten: arange(max_seq_len) <= input_pos[:, None]")
    for name in ("layers", "batch", "max_seq_len", "live", "steps"):
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    args = parser.parse_args(argv)
    c = dict(TINY if args.tiny else FULL)
    c.update({k: v for k, v in vars(args).items() if k in c and v is not None})
    torch.manual_seed(0)
    with torch.device(c["device"]):
        model = Transformer(c).to(c["dtype"]).eval()
    off = run(model, c, substitute=False)
    on = run(model, c, substitute=True)
    diff = (on.pop("first_logits") - off.pop("first_logits")).abs().max().item()
    speedup = on["tokens_per_s"] / off["tokens_per_s"]
    print(f"\ngpt-fast-style decode: {c['layers']} layers dim {c['dim']}, Hq={c['heads']} Hkv={c['kv_heads']} "
          f"D={c['head_dim']}, batch {c['batch']}, max_seq_len {c['max_seq_len']}, live {c['live']}, "
          f"{str(c['dtype']).split('.')[-1]}, {c['device']}, mode={c['mode']}, mask {c['mask']} "
          f"({MASK_TEXT[c['mask']]})\n")
    print("| attention | substituted calls | tokens/s | ms/step | compile+warm-up s |")
    print("|---|---|---|---|---|")
    for r, name in ((off, "SDPA (pass off)"), (on, "b12x (pass on)")):
        print(f"| {name} | {r['substituted']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.3f} | "
              f"{r['compile_and_warmup_s']:.1f} |")
    print(f"\nspeedup {speedup:.2f}x; first-step logits max |diff| {diff:.3g}")
    for d in on["decisions"]:
        print("  " + d)
    if args.out:
        config = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in c.items()}
        with open(args.out, "w") as f:
            json.dump(dict(config=config, mask=c["mask"], off=off, on=on, speedup=speedup,
                           logits_max_abs_diff=diff, torch=torch.__version__), f, indent=2)
