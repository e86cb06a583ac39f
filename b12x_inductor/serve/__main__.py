"""`python -m b12x_inductor.serve`: serve a synthetic workload and report throughput and latencies.

    python -m b12x_inductor.serve --demo               # random-weight Llama: tiny on CPU, ~1B bf16 on CUDA
    python -m b12x_inductor.serve --model PATH --requests 64 --num-draft 4 --json
    python -m b12x_inductor.serve --demo --compile-cache DIR   # saves compiled artifacts to DIR, or starts from them

Warm-up is reported per bucket: compile seconds (Dynamo's share, the backend's: AOTAutograd and Inductor or
their caches), capture seconds (CUDA graphs), and whether Inductor compiled the bucket or found it cached.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from b12x_inductor.serve import Engine, ServeConfig
from b12x_inductor.serve.workload import llama_config, random_model, synthetic_requests


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX; got {text!r}")
    return lo, hi


def _buckets(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


# What --demo runs where no option says otherwise: (CPU, CUDA).
_DEMO = {
    "cpu": dict(size="tiny", requests=16, prompt_lens=(8, 200), output_lens=(8, 40), max_batch=8, token_budget=128,
                decode_buckets=(8,), extend_buckets=(128,), num_draft=0, max_model_len=256),  # 2 buckets
    "cuda": dict(size="small", requests=128, prompt_lens=(128, 1024), output_lens=(64, 256), max_batch=64,
                 token_budget=2048, decode_buckets=(16, 64), extend_buckets=(512, 2048), num_draft=3,
                 max_model_len=1536),  # 6 buckets
}


def add_compile_arguments(p, who: str = "") -> None:
    """--compile-cache DIR and --regional-compile / --whole-model-compile (ServeConfig.compile_cache and
    regional_compile), for this CLI and `bench serve` (`who`: a prefix of the help texts)."""
    p.add_argument("--compile-cache", metavar="DIR", help=f"{who}load compiled artifacts from DIR before warm-up and "
                   "save them there after it (copy DIR to another machine of the same kind to start it warm)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--regional-compile", dest="regional_compile", action="store_const", const=True, default=None,
                     help=f"{who}compile one decoder layer per bucket and reuse it for every layer (less compile "
                     "work; the step is still one CUDA graph); the default where the model keeps its layers in a "
                     "ModuleList")
    how.add_argument("--whole-model-compile", dest="regional_compile", action="store_const", const=False,
                     help=f"{who}compile the whole model per bucket instead")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m b12x_inductor.serve", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", action="store_true", help="a random-weight Llama built locally (no download)")
    src.add_argument("--model", metavar="PATH", help="a local transformers checkpoint (causal full and sliding-window "
                     "attention layers: Llama, Mistral, Qwen2, Gemma 2 / 3, gpt-oss, ...)")
    p.add_argument("--size", choices=("tiny", "small", "1b"), help="demo model size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--requests", type=int, help="number of requests")
    p.add_argument("--prompt-lens", type=_range, metavar="MIN,MAX")
    p.add_argument("--output-lens", type=_range, metavar="MIN,MAX")
    p.add_argument("--rate", type=float, default=float("inf"), help="arrivals per second (default: all at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int)
    p.add_argument("--token-budget", type=int)
    p.add_argument("--decode-buckets", type=_buckets, metavar="B1,B2,...")
    p.add_argument("--extend-buckets", type=_buckets, metavar="T1,T2,...")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, help="default: enough for max_batch requests of max_model_len")
    p.add_argument("--num-draft", type=int, help="prompt-lookup draft tokens per step (0: no speculation)")
    p.add_argument("--threads", type=int, help="CPU threads (default on CPU: 1; small models gain nothing from "
                   "more and lose much when the cores are shared)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (debugging)")
    add_compile_arguments(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def build(args):
    """(engine, requests, description) from parsed arguments."""
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    demo = _DEMO["cuda" if device.type == "cuda" else "cpu"]
    pick = lambda name: demo[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.demo:
        model = random_model(llama_config(pick("size")), dtype=dtype, device=device, seed=args.seed)
        eos = ()
        name = f"random Llama ({pick('size')})"
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        eos = model.generation_config.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        name = args.model
    max_batch, max_model_len = pick("max_batch"), pick("max_model_len")
    prompt_lens, output_lens = pick("prompt_lens"), pick("output_lens")
    max_model_len = max(max_model_len, prompt_lens[1] + output_lens[1])
    pages_per_request = -(-max_model_len // args.page_size)
    config = ServeConfig(
        num_pages=args.num_pages or max_batch * pages_per_request, page_size=args.page_size, max_batch=max_batch,
        token_budget=pick("token_budget"), max_model_len=max_model_len, num_draft=pick("num_draft"),
        eos_token_ids=eos, compile=not args.no_compile, compile_cache=args.compile_cache,
        regional_compile=args.regional_compile,  # the demo's buckets unless the sizes change:
        decode_buckets=args.decode_buckets or (None if args.max_batch else demo["decode_buckets"]),
        extend_buckets=args.extend_buckets or (None if args.token_budget else demo["extend_buckets"]))
    vocab = model.config.get_text_config().vocab_size
    requests = synthetic_requests(pick("requests"), prompt_lens=prompt_lens, output_lens=output_lens, vocab=vocab,
                                  rate=args.rate, seed=args.seed)
    return Engine(model, config), requests, f"{name}, {dtype}, {device}"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    engine, requests, what = build(args)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    c = engine.config
    log(f"serving {len(requests)} requests on {what}: max_batch {c.max_batch}, token budget {c.token_budget}, "
        f"{c.num_pages} pages of {c.page_size}, {c.num_draft} draft tokens")
    warmup = engine.warmup()
    log(warmup.format())
    report = engine.serve(requests, progress=not args.no_progress)
    if args.json:
        print(json.dumps(dict(report.to_dict(), warmup_s=warmup.total_s, warmup=warmup.to_dict(), model=what,
                              config=_config_dict(c)), indent=2))
    else:
        print(report.format())
    leaked = sum(a.num_pages - a.num_free for a in (engine.pages, engine.window_pages) if a is not None)
    if leaked:
        print(f"error: {leaked} pages still allocated", file=sys.stderr)
        return 1
    return 0


def _config_dict(c: ServeConfig) -> dict:
    return dict(num_pages=c.num_pages, page_size=c.page_size, max_batch=c.max_batch, token_budget=c.token_budget,
                max_model_len=c.max_model_len, num_draft=c.num_draft, decode_buckets=list(c.decode_sizes),
                extend_buckets=list(c.extend_sizes), compile=c.compile, recycle_window_pages=c.recycle_window_pages,
                window_num_pages=c.window_num_pages, compile_cache=c.compile_cache, regional_compile=c.regional_compile)


if __name__ == "__main__":
    sys.exit(main())
