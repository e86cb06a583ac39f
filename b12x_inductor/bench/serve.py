"""The serving loop against transformers' own batching: `python -m b12x_inductor.bench serve`.

Model (--model): "llama", a Llama-3.2-1B-shaped random-weight model in bf16 (16 layers, hidden 2048, 32 query /
8 KV heads of 64, vocab 128256), or "gpt-oss", gpt-oss-20b's shapes in 4 layers (64 query / 8 KV heads of 64,
window 128 with attention sinks on alternate layers, 32 experts top 4, vocab 201088; only b12x runs by default:
transformers offers gpt-oss eager attention only, which the static and generate_batch systems then use), both
built in place (no download). Workload: 256 requests, all arriving at t = 0, prompts uniform in
128-2048 tokens (random phrases from a small phrase book), outputs uniform in 128-512 tokens, no EOS (every
request generates exactly its max_new_tokens). Systems, in one run, all greedy:

- static:         transformers `generate` with a StaticCache (SDPA, generate's compiled decode step with CUDA
                  graphs) in fixed batches of --static-batch requests, left-padded, each batch running to its
                  longest output; only each request's own tokens count.
- generate_batch: transformers' continuous batching (`generate_batch`'s manager, default config, per-request
                  max_new_tokens).
- b12x:           this package's serving loop (`b12x_inductor.serve`): paged KV, chunked prefill, decode in
                  CUDA graphs per bucket, no speculation.
- b12x+lookup:    the same engine with --num-draft prompt-lookup drafts checked by the verify plan.
- b12x-keep-window: (models with sliding-window layers: gpt-oss) b12x with recycle_window_pages=False: the
                  window layers keep a page for every position in the one pool of all layers, as before
                  window pages were recycled.

Throughput: output tokens / wall time from the first request to the last token (warm-up and compilation
excluded and reported apart). KV memory of b12x (kv_pool_gib, kv_peak_gib): the engine's paged pools, and the
most of them that requests held at once (per pool, peak pages x bytes per page over its layers, summed;
kv_peak_pages and kv_peak_window_pages: the peaks of the full and the window pool). With window pages recycled
(b12x, b12x+lookup) the window layers have a pool of their own (ServeConfig.default_window_pages pages) from
which a request holds only the pages its window still sees; b12x-keep-window holds every position's page in
every layer. TTFT: arrival to first token; TPOT: (last - first token) /
(tokens - 1), per request, p50 and p99. "same" compares each system's outputs with the static baseline's: identical requests /
requests with the same first token (bf16 near-ties can flip a token and everything after it).

Prints a markdown table and writes JSON to --out; --merge A.json B.json prints one table from runs split by
--systems (the "same" column needs one run). --quick: 64 requests, prompts 128-1024, outputs 64-256,
one bucket per step kind (about three minutes on an H200). Buckets trade compile time (each is one
Inductor compile and CUDA-graph capture) for padding: full compiles 8 (decode 32, 64, 128; verify the same;
extend 512, 2048), quick 3. --tiny: a tiny fp32 model (of --model's family) on CPU, to check the harness;
--no-compile runs b12x eagerly (harness checks only). b12x's warm-up is printed and kept per bucket in the JSON
(row "warmup": compile, Dynamo and backend seconds, capture, compiled or from cache); --compile-cache DIR and
--regional-compile / --whole-model-compile set the engine's ServeConfig.compile_cache and regional_compile
(default: regional where the model allows it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time

import torch

from b12x_inductor.serve import Engine, Request, ServeConfig
from b12x_inductor.serve.__main__ import add_compile_arguments
from b12x_inductor.serve.engine import percentile
from b12x_inductor.serve.workload import gpt_oss_config, llama_config, random_model, synthetic_requests

MODELS = {  # --model: (config builder, size of each preset, attention of the transformers baselines)
    "llama": (llama_config, dict(full="1b", quick="1b", tiny="tiny"), "sdpa"),
    "gpt-oss": (gpt_oss_config, dict(full="20b", quick="20b", tiny="tiny"), "eager"),
}

PRESETS = {
    "full": dict(size="1b", requests=256, prompt_lens=(128, 2048), output_lens=(128, 512), max_batch=128,
                 token_budget=2048, decode_buckets=(32, 64, 128), extend_buckets=(512, 2048),
                 static_batch=32),
    "quick": dict(size="1b", requests=64, prompt_lens=(128, 1024), output_lens=(64, 256), max_batch=64,
                  token_budget=2048, decode_buckets=(64,), extend_buckets=(2048,), static_batch=16),
    "tiny": dict(size="tiny", requests=8, prompt_lens=(8, 64), output_lens=(4, 16), max_batch=4, token_budget=128,
                 decode_buckets=(4,), extend_buckets=(128,), static_batch=4),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _summary(name, outputs, ttft, tpot, elapsed, warmup_s, notes="") -> dict:
    tokens = sum(len(o) for o in outputs)
    return dict(system=name, requests=len(outputs), output_tokens=tokens, elapsed_s=elapsed,
                throughput_tok_s=tokens / elapsed, ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99), warmup_s=warmup_s, notes=notes,
                outputs=outputs)


class _Clock:
    """A generate() streamer that records when each batch of new tokens arrives (the first put is the prompt)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_static(model, requests, batch: int, device, max_cache_len: int, attn: str = "sdpa") -> dict:
    from transformers import StaticCache

    model.set_attn_implementation(attn)
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    pad = 0

    def generate(group, max_new, clock=None):
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in group], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group], device=device)
        cache.reset()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad,
                                 streamer=clock)
        return out[:, width:].tolist()

    groups = [requests[i:i + batch] for i in range(0, len(requests), batch)]
    groups = [g + [g[-1]] * (batch - len(g)) for g in groups]  # one static shape: pad the last batch
    t = time.perf_counter()
    generate(groups[0], 4)  # compiles the decode step
    generate(groups[0], 4)
    warmup_s = time.perf_counter() - t
    outputs, ttft, tpot = [], [], []
    _sync(device)
    start = time.perf_counter()
    for g in groups:
        clock = _Clock(device)
        max_new = max(r.max_new_tokens for r in g)
        out = generate(g, max_new, clock)
        first, last = clock.times[1] - start, clock.times[-1] - start
        for r, o in zip(g, out):
            if len(outputs) == len(requests):
                break
            outputs.append(o[:r.max_new_tokens])
            ttft.append(first - r.arrival)
            step = (last - first) / max(1, max_new - 1)  # the batch runs to its longest output
            if r.max_new_tokens > 1:
                tpot.append(step)
    elapsed = time.perf_counter() - start
    del cache
    return _summary("static", outputs, ttft, tpot, elapsed, warmup_s,
                    f"generate, StaticCache {max_cache_len}, {attn}, generate's auto-compile, batches of {batch}")


def run_generate_batch(model, requests, device, attn: str = "sdpa") -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model.set_attn_implementation(attn)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(r.max_new_tokens for r in requests))
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in requests),
                          max_generated_length=config.max_new_tokens, num_requests=len(requests))
    t = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30,
                                                   workload_hints=hints) as manager:
        warmup_s = time.perf_counter() - t
        start = time.perf_counter()
        ids = [manager.add_request(input_ids=r.prompt, request_id=f"r{i}", max_new_tokens=r.max_new_tokens,
                                   record_timestamps=True) for i, r in enumerate(requests)]
        results = {}
        while len(results) < len(requests):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("generate_batch: the generation thread stopped")
        elapsed = time.perf_counter() - start
    outputs, ttft, tpot = [], [], []
    for rid in ids:
        res = results[rid]
        outputs.append(list(res.generated_tokens))
        stamps = res.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return _summary("generate_batch", outputs, ttft, tpot, elapsed, warmup_s,
                    f"transformers continuous batching, default config, {attn}")


def kv_bytes_per_page(engine: Engine, pool: str = "full") -> int:
    """Bytes of one page id across one of the engine's pools: keys and values (or MLA's one latent cache) of
    each layer in that pool."""
    runner = engine.runner
    caches = [(kv,) if isinstance(kv, torch.Tensor) else kv for kv in runner.kv]
    return sum(c[0].numel() * c.element_size() for layer, p in zip(caches, runner.layer_pool) if p == pool
               for c in layer)


def kv_gib(engine: Engine) -> tuple[float, float]:
    """(pool, peak) GiB over the engine's pools."""
    pool = peak = 0
    for name, alloc in (("full", engine.pages), ("window", engine.window_pages)):
        if alloc is not None:
            pool += alloc.num_pages * kv_bytes_per_page(engine, name)
            peak += alloc.peak_used * kv_bytes_per_page(engine, name)
    return pool / 2**30, peak / 2**30


def run_b12x(model, requests, preset: dict, device, num_draft: int, compile: bool = True,
             recycle: bool = True, compile_cache: str | None = None,
             regional: bool | None = None) -> tuple[list[dict], Engine]:
    max_len = preset["prompt_lens"][1] + preset["output_lens"][1]
    config = ServeConfig(
        num_pages=preset["max_batch"] * -(-max_len // 16) + 1, page_size=16, max_batch=preset["max_batch"],
        token_budget=preset["token_budget"], max_model_len=max_len, num_draft=num_draft,
        decode_buckets=preset["decode_buckets"], extend_buckets=preset["extend_buckets"], compile=compile,
        recycle_window_pages=recycle, compile_cache=compile_cache, regional_compile=regional)
    t = time.perf_counter()
    engine = Engine(model, config)
    warmup = engine.warmup()
    warmup_s = time.perf_counter() - t
    log(warmup.format())
    rows = []
    runs = (("b12x", 0), ("b12x+lookup", num_draft)) if num_draft else (("b12x", 0),)
    if not recycle:
        runs = (("b12x-keep-window", 0),)
    for name, draft in runs:
        engine.reset(num_draft=draft)
        reqs = [Request(prompt=r.prompt, max_new_tokens=r.max_new_tokens, arrival=r.arrival) for r in requests]
        report = engine.serve(reqs)
        assert engine.pools_free, "pages leaked"
        ttft = [r.first_token_time - r.arrival for r in reqs]
        tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
        notes = (f"max_batch {config.max_batch}, budget {config.token_budget}, {len(engine.runner.buckets)} buckets, "
                 f"{report.steps} steps, {report.preemptions} preemptions")
        if draft:
            notes += f", {draft} drafts, acceptance {report.draft_acceptance:.2f}"
        kv_pool, kv_peak = kv_gib(engine)
        full = engine.pages.peak_used if engine.pages is not None else 0
        window = engine.window_pages.peak_used if engine.window_pages is not None else 0
        notes += f", KV peak {kv_peak:.3g} of {kv_pool:.3g} GiB pool"
        if engine.window_pages is not None:
            notes += (f" (peak pages: {full} full of {engine.pages.num_pages if engine.pages else 0}, {window} "
                      f"window of {engine.window_pages.num_pages})")
        rows.append(dict(_summary(name, [r.output for r in reqs], ttft, tpot, report.elapsed_s, warmup_s, notes),
                         kv_pool_gib=kv_pool, kv_peak_gib=kv_peak, kv_peak_pages=full,
                         kv_peak_window_pages=window, recycle_window_pages=recycle, warmup=warmup.to_dict()))
    return rows, engine


def run_b12x_both(model, requests, preset: dict, device, num_draft: int, compile: bool = True,
                  compile_cache: str | None = None, regional: bool | None = None) -> list[dict]:
    """b12x (and b12x+lookup) with window pages recycled; for a model with sliding-window layers, then
    b12x-keep-window (a second engine, compiled anew: its pool layout differs; the same num_draft, so its
    page-table width, buckets and attention plans equal the first engine's and its outputs can be compared)."""
    rows, engine = run_b12x(model, requests, preset, device, num_draft, compile, compile_cache=compile_cache,
                            regional=regional)
    if engine.runner.window is None:
        return rows
    del engine
    _free(device)
    kept = run_b12x(model, requests, preset, device, num_draft, compile, recycle=False, compile_cache=compile_cache,
                    regional=regional)[0]  # same buckets and plans
    same = sum(a == b for a, b in zip(kept[0]["outputs"], rows[0]["outputs"])) / len(requests)
    kept[0]["notes"] += f", {same:.0%} of outputs equal b12x's"
    return rows + kept


def _agreement(rows: list[dict], ref: dict | None) -> None:
    for row in rows:
        if ref is None:
            row["same"] = None
            continue
        pairs = list(zip(row["outputs"], ref["outputs"]))
        row["same"] = (sum(a == b for a, b in pairs) / len(pairs), sum(a[:1] == b[:1] for a, b in pairs) / len(pairs))


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["system"] == "generate_batch"), None)
    lines = ["| system | tok/s | vs generate_batch | time (s) | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
             "same (all / first) | warm-up (s) | notes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | failed | | | | | | | {r['error']} |")
            continue
        speedup = f"{r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x" if base and "error" not in base else ""
        same = "" if r.get("same") is None else f"{r['same'][0]:.0%} / {r['same'][1]:.0%}"
        lines.append(f"| {r['system']} | {r['throughput_tok_s']:.0f} | {speedup} | {r['elapsed_s']:.1f} | "
                     f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} | "
                     f"{r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p99_s'] * 1e3:.1f} | {same} | {r['warmup_s']:.0f} | "
                     f"{r['notes']} |")
    return "\n".join(lines)


def main(argv) -> None:
    p = argparse.ArgumentParser(prog="python -m b12x_inductor.bench serve", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="64 requests, fewer buckets (~3 min on an H200)")
    mode.add_argument("--tiny", action="store_true", help="a tiny fp32 model on CPU: checks the harness")
    p.add_argument("--model", choices=sorted(MODELS), default="llama", help="the random-weight model (default llama)")
    p.add_argument("--no-compile", action="store_true", help="run b12x eagerly (checks the harness only)")
    p.add_argument("--requests", type=int)
    p.add_argument("--num-draft", type=int, default=4, help="prompt-lookup drafts of b12x+lookup (0: skip it)")
    p.add_argument("--systems", help="comma-separated: static, generate_batch, b12x (b12x includes b12x+lookup); "
                   "default: all three for llama, b12x for gpt-oss")
    p.add_argument("--seed", type=int, default=0)
    add_compile_arguments(p, "b12x: ")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print one table from runs split by --systems")
    args = p.parse_args(argv)
    if args.merge:
        rows = []
        for path in args.merge:
            with open(path) as f:
                rows += json.load(f)["rows"]
        print(table(rows))
        return

    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    preset = dict(PRESETS[name])
    build_config, sizes, attn = MODELS[args.model]
    preset["size"] = sizes[name]
    if args.requests:
        preset["requests"] = args.requests
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = build_config(preset["size"])
    model = random_model(config, dtype=dtype, device=device, seed=args.seed)
    model.generation_config.eos_token_id = None
    requests = synthetic_requests(preset["requests"], prompt_lens=preset["prompt_lens"],
                                  output_lens=preset["output_lens"], vocab=config.vocab_size, seed=args.seed)
    systems = (args.systems or ("b12x" if args.model == "gpt-oss" else "static,generate_batch,b12x")).split(",")
    log(f"{len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt tokens, "
        f"{sum(r.max_new_tokens for r in requests)} output tokens; {preset['size']} {args.model}, {dtype}, {device}")

    rows = []
    runners = {
        "static": lambda: [run_static(model, requests, preset["static_batch"], device,
                                      preset["prompt_lens"][1] + preset["output_lens"][1], attn)],
        "generate_batch": lambda: [run_generate_batch(model, requests, device, attn)],
        "b12x": lambda: run_b12x_both(model, requests, preset, device, args.num_draft, not args.no_compile,
                                      args.compile_cache, args.regional_compile),
    }
    for name in systems:  # b12x last: it switches the model's attention implementation
        if name not in runners:
            raise SystemExit(f"bench serve: unknown system {name!r}; expected {sorted(runners)}")
    for name in sorted(systems, key=lambda s: s == "b12x"):
        log(f"running {name} ...")
        try:
            got = runners[name]()
        except Exception as e:  # a baseline that breaks is reported, not fatal
            got = [dict(system=name, error=f"{type(e).__name__}: {e}"[:300])]
            log(f"{name} failed: {got[0]['error']}")
        for row in got:
            if "error" not in row:
                log(f"{row['system']}: {row['throughput_tok_s']:.0f} tok/s in {row['elapsed_s']:.1f} s "
                    f"(warm-up {row['warmup_s']:.0f} s)")
        rows += got
        _free(device)
    ref = next((r for r in rows if r["system"] == "static" and "error" not in r), None)
    _agreement([r for r in rows if "error" not in r], ref)
    print(table(rows))
    if args.out:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), torch=torch.__version__,
                    device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                    preset=preset, model=args.model, num_draft=args.num_draft, compile_cache=args.compile_cache,
                    regional_compile=args.regional_compile)
        try:
            import transformers

            meta["transformers"] = transformers.__version__
        except ImportError:
            pass
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=[{k: v for k, v in r.items() if k != "outputs"} for r in rows]), f,
                      indent=2, default=str)
        log(f"wrote {args.out}")
