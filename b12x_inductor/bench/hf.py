"""transformers generate() with attn_implementation="b12x" against "sdpa": `python -m b12x_inductor.bench hf`.

Model: a Llama-3.2-1B-shaped random-weight model in bf16 (16 layers, hidden 2048, 32 query / 8 KV heads,
head_dim 64, vocab 128256), built in place (no download). Both implementations use transformers' static
cache of max_cache_len 4096 (`cache_implementation="static"`; b12x reads its buffers in place and attends
to the live length only, SDPA reads the whole buffer under a mask) and generate's compiled decode step
(`CompileConfig(fullgraph=True, mode="reduce-overhead")`: CUDA graphs). Optionally (--paged) a third
column: b12x with a `B12xCache` (page size 64).

Rows: batch 1, 8, 32 x prompt 512, 3072 (random tokens, no padding). Decode tokens/s of one row:
batch * (N - 1) / (time from the first generated token to the N-th), clocked after every token by a
stopping criterion that synchronizes (generate synchronizes every step anyway); the median of --repeats
generate calls after a warm-up call that compiles. Prefill is excluded. Targets (issue 4): b12x >= 1.3x SDPA
where the live length stays <= max_cache_len / 2 (prompt 512), >= 1.0x everywhere.

Prints a markdown table and writes JSON to --out. --quick: batch 8 only, 32 new tokens, 2 repeats (about
two minutes on an H200). --tiny: a tiny fp32 model on CPU with small sizes, to check the harness itself.
--merge A.json B.json: one table from runs split by --batches (each batch compiles two decode graphs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(config_kwargs: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with device:
        model = LlamaForCausalLM(LlamaConfig(**config_kwargs)).to(dtype).eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id = None, 0  # random weights: never stop early
    return model


def compile_config(device: torch.device):
    from transformers.generation.configuration_utils import CompileConfig

    if device.type == "cuda":
        return CompileConfig(fullgraph=True, mode="reduce-overhead")
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate auto-compiles on CUDA only, unless told
    return config


class Runner:
    """generate() for one implementation and batch, with its cache and compiled step reused across calls."""

    def __init__(self, model, impl: str, batch: int, max_cache_len: int, device: torch.device):
        from b12x_inductor.integrations import hf

        self.model, self.impl, self.device = model, impl, device
        self.kwargs = dict(compile_config=compile_config(device), do_sample=False)  # equal configs: one compile
        self.paged = None
        if impl == "b12x-paged":
            self.paged = hf.B12xCache(model.config, max_batch_size=batch, max_cache_len=max_cache_len,
                                      page_size=64, device=device, dtype=model.dtype)
            name = "cache" if "cache" in _forward_params(model) else "past_key_values"
            self.kwargs[name] = self.paged
        else:
            self.kwargs.update(cache_implementation="static", max_cache_len=max_cache_len)

    def __call__(self, ids: torch.Tensor, new_tokens: int) -> list[float]:
        """Times of one generate call: [start, after token 1, ..., after token new_tokens] (seconds)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        device = self.device

        class Clock(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                _sync(device)
                times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        self.model.set_attn_implementation("sdpa" if self.impl == "sdpa" else "b12x")
        if self.paged is not None:
            self.paged.reset()
        _sync(device)
        times = [time.perf_counter()]
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, stopping_criteria=StoppingCriteriaList([Clock()]),
                                  **self.kwargs)
        assert out.shape[1] == ids.shape[1] + new_tokens and len(times) == new_tokens + 1, (out.shape, len(times))
        return times


def _forward_params(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_tokens_per_s(runner: Runner, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """Decode throughput from per-token clocks: the time from the first generated token to the last, i.e.
    new_tokens - 1 decode steps of generate (prefill excluded), the median over `repeats` calls."""
    runner(ids, 3)  # warm-up: compiles the decode step, records its CUDA graph
    calls = [runner(ids, new_tokens) for _ in range(repeats)]
    steps = new_tokens - 1
    decode = statistics.median(t[-1] - t[1] for t in calls)
    prefill = statistics.median(t[1] - t[0] for t in calls)
    return dict(tokens_per_s=ids.shape[0] * steps / decode, ms_per_step=1e3 * decode / steps,
                prefill_s=prefill, decode_s=decode)


def run(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    import b12x_inductor.integrations.hf  # noqa: F401  (registers "b12x")

    model = build_model(TINY if args.tiny else LLAMA_1B, device, dtype)
    # One decode graph per (implementation, batch); the prompt length does not change it.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    impls = ["sdpa", "b12x"] + (["b12x-paged"] if args.paged else [])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        runners = {impl: Runner(model, impl, batch, args.max_cache_len, device) for impl in impls}
        for prompt in args.prompts:
            if prompt + args.new_tokens > args.max_cache_len:
                raise SystemExit(f"prompt {prompt} + {args.new_tokens} new tokens exceed max_cache_len "
                                 f"{args.max_cache_len}")
            ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
            row = dict(batch=batch, prompt=prompt, new_tokens=args.new_tokens, max_cache_len=args.max_cache_len,
                       live_max=prompt + args.new_tokens)
            for impl in impls:
                row[impl] = decode_tokens_per_s(runners[impl], ids, args.new_tokens, args.repeats)
            for impl in impls[1:]:
                row[f"{impl}_speedup"] = row[impl]["tokens_per_s"] / row["sdpa"]["tokens_per_s"]
            log(f"B={batch} prompt={prompt}: " + ", ".join(
                f"{impl} {row[impl]['tokens_per_s']:.1f} tok/s" for impl in impls))
            rows.append(row)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    import transformers

    env["transformers"] = transformers.__version__
    return dict(suite="hf", env=env, config=dict(vars(args)), model={"tiny": TINY} if args.tiny else LLAMA_1B,
                impls=impls, rows=rows)


def markdown(result: dict) -> str:
    impls = result["impls"]
    head = "| batch | prompt | live max / cache | " + " | ".join(f"{i} tok/s" for i in impls) + " | " + " | ".join(
        f"{i} / sdpa" for i in impls[1:]) + " |"
    lines = [head, "|" + "---|" * (3 + len(impls) + len(impls) - 1)]
    for r in result["rows"]:
        cells = [str(r["batch"]), str(r["prompt"]), f"{r['live_max']} / {r['max_cache_len']}"]
        cells += [f"{r[i]['tokens_per_s']:.1f}" for i in impls]
        cells += [f"{r[f'{i}_speedup']:.2f}x" for i in impls[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    e = result["env"]
    lines.append("")
    lines.append(f"Decode tokens/s of generate(), static caches, compiled; {e['device']}, torch {e['torch']}, "
                 f"transformers {e['transformers']}, {e['date']}.")
    return "\n".join(lines)


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m b12x_inductor.bench hf", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/hf.json", help="JSON output path")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 3072])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-cache-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paged", action="store_true", help="also time b12x with a B12xCache")
    ap.add_argument("--quick", action="store_true", help="batch 8 only, 32 new tokens, 2 repeats")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on CPU: checks the harness only")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge the rows of earlier runs into --out and "
                    "print their table (to split a long run into several commands, e.g. by --batches)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = [8], 32, 2
    if args.tiny:
        args.batches, args.prompts, args.new_tokens, args.repeats = [2], [24], 4, 1
        args.max_cache_len = min(args.max_cache_len, 64)
    return args


def merge(paths: list[str]) -> dict:
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    impls = results[0]["impls"]
    if any(r["impls"] != impls for r in results):
        raise SystemExit(f"bench hf --merge: runs with different implementations: {[r['impls'] for r in results]}")
    rows = sorted((row for r in results for row in r["rows"]), key=lambda row: (row["batch"], row["prompt"]))
    return dict(results[0], rows=rows, merged_from=paths)


def main(argv) -> None:
    args = parse_args(argv)
    if args.merge:
        result = merge(args.merge)
    elif not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench hf: needs CUDA (or --tiny for a CPU dry run)")
    else:
        result = run(args)
    table = markdown(result)
    print(table, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(result, markdown=table), f, indent=1)
    log(f"wrote {args.out}")
