"""transformers generate() with attn_implementation="b12x" against the best attention transformers offers
offline for each model: `python -m b12x_inductor.bench hf [--model llama|gpt-oss|gemma3|all]`.

Models (random weights in bf16, built in place from transformers' config classes, no download):
- llama (the default): Llama-3.2-1B-shaped (16 layers, hidden 2048, 32 query / 8 KV heads, head_dim 64, vocab
  128256). Peer: "sdpa".
- gpt-oss: gpt-oss-20b-shaped, 4 of its 24 layers (`GptOssConfig` / `GptOssForCausalLM`): hidden 2880, 64
  query / 8 KV heads, head_dim 64, vocab 201088, yarn RoPE, layers alternating a 128-token sliding window and
  full attention, attention sinks on every layer (one logit per query head, drawn from N(0, 1)). The MoE is
  shrunk from 32 to 8 experts per layer, top-4 routing and the expert shape (2880 -> 2 x 2880 -> 2880) kept:
  the four layers' experts take 1.6 GB instead of 6.4 GB (tests/test_gpu_models.py builds this model too) and
  a batch-8 or batch-32 decode step, which hits nearly every expert, reads 8 experts' weights per layer
  instead of up to 32. The MoE is the same in both columns, so shrinking it raises b12x / eager above what the same layers with the full
  MoE would give. Peer: "eager" (gpt-oss refuses sdpa; it also declares flex_attention, which `--peer
  flex_attention` times instead: not tried, transformers runs flex attention with sinks on CUDA only).
- gemma3: Gemma-3-4B-shaped, 6 of its 34 layers (`Gemma3TextConfig` / `Gemma3ForCausalLM`): 5 layers with a
  1024-token sliding window, then 1 full layer (Gemma 3's pattern), hidden 2560, 8 query / 4 KV heads,
  head_dim 256, query_pre_attn_scalar 256, intermediate 10240, vocab 262208 (the full layer's RoPE without
  the 4B's linear scaling). Peer: "sdpa".
With few layers the embedding and the vocab projection, a fixed cost per step in both columns, weigh more
than in the full models, which lowers every ratio.

All columns use generate's compiled decode step with fullgraph CUDA graphs (`mode="reduce-overhead"`) and
transformers' static cache of max_cache_len 4096 (`cache_implementation="static"`): b12x reads its buffers in
place and attends to the live keys only, SDPA and eager read whole buffers under a mask. `--paged` adds a
column: b12x with a `B12xCache` (page size 64). `--substituted` adds a column "sdpa+enable": the model with
attn_implementation="sdpa" exactly as the sdpa column, its decode step compiled under
`b12x_inductor.substituting()` (what `b12x_inductor.enable()` does to a user's compile), so the automatic
substitution replaces SDPA by b12x.paged_attention where it can (the padding mask generate passes is read by
the kernel as key_mask); the JSON gives per row its decisions (`substituted` of `decisions`). `--peer
sdpa+enable` makes it the reference column instead. The pass is no Dynamo guard: under the same compile config
this column would reuse the sdpa column's graph (or the other way round), so its config names a backend of
its own, `SubstitutingInductor` (Inductor with the config patches of the column's mode, compiling under
`b12x_inductor.substituting()`), which Dynamo keeps apart from plain Inductor's graphs. Not for gpt-oss,
which refuses sdpa. The llama model compiles with `CompileConfig(fullgraph=True,
mode="reduce-overhead")`. The sliding-window models compile with `dynamic=None` (automatic dynamic), whatever
the attention: transformers 5.24's `StaticSlidingWindowLayer` keeps its length in a Python int
(`cumulative_length_int`) that changes every step, so `dynamic=False` recompiles every step until the
recompile limit and fullgraph generate fails; with `dynamic=None` the second decode step recompiles with that
int symbolic and later steps reuse the graph. The int is then an input of the compiled graph, and CUDA graph
trees record one graph per value of an int input (and warm a graph up once before recording it): each decode
step at a length not seen before first runs without a CUDA graph, the next time it is recorded, after that
replayed. So a row of these models runs two
untimed generate calls of the full length per column (the first compiles and warms every step up, the second
records every step's graph) before the timed ones, and the JSON gives, per column, the CUDA graphs recorded
during the warm-up and the timed calls (`cudagraph_records`; 0 in the timed calls means they replayed only).
A first generate call at a new length, as a user makes it, runs these models' decode steps without CUDA
graphs where the graph takes that int.

The eager peer runs transformers' own eager attention function of the model under another name (with eager's
mask function): decode calls it unchanged, and a prefill whose score tensor would exceed 4 GiB calls it on
chunks of queries. Eager materializes [B, Hq, S, L] scores several times over; at batch 32 x prompt 3072 with
64 heads and a 4096-key buffer each copy is 51.5 GB, so unchunked it does not fit an H200. Prefill is not
timed.

Rows: batch 1, 8, 32 x prompt 512, 3072 (random tokens, no padding); --new-tokens 128 for llama, 64 for the
others. Decode tokens/s of one row: batch * (N - 1) / (time from the first generated token to the N-th),
clocked after every token by a stopping criterion that synchronizes (generate synchronizes every step
anyway); the median of --repeats generate calls after the warm-up (llama: one call of 3 tokens that compiles).
Prefill is excluded. Each batch starts from `torch._dynamo.reset()`, so that its graphs are compiled for its
own batch size (automatic dynamic would make the batch size symbolic). Targets: llama (issue 4) b12x >= 1.3x
SDPA where the live length stays <= max_cache_len / 2 (prompt 512), >= 1.0x everywhere; gpt-oss and gemma3
(issue 14) b12x >= 1.5x the peer at batch 8 and 32. Each model's full run is meant to take at most about 8
minutes on an H200 (not timed there yet), most of it compiling (per batch and column one decode graph for llama, two or three for
the others); where a command limit is tighter, split it by --batches and --merge the JSON files.

Prints a markdown table ("<peer> tok/s" and "b12x / <peer>" columns name the peer) and writes JSON to --out
(default benchmarks/results/hf.json for llama, hf_gpt_oss.json, hf_gemma3.json, hf_all.json). --quick: batch 8
only, 32 new tokens, 2 repeats. --tiny: tiny fp32 models on CPU with small sizes, to check the harness itself.
--merge A.json B.json: one table per model from runs split by --batches (or of different models).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=8,
                   num_experts_per_tok=4, max_position_embeddings=131072)
TINY_GPT_OSS = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
                    initializer_range=0.1)
GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=1024, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                 max_position_embeddings=131072)
TINY_GEMMA3 = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=48,
                   sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   initializer_range=0.1)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str          # "llama", "gpt_oss" or "gemma3": which transformers config and model classes
    config: dict       # config kwargs of the benchmarked model
    tiny: dict         # config kwargs of the --tiny model
    peer: str          # the attention implementation b12x is compared with
    sliding: bool      # sliding-window layers: automatic-dynamic compile and full-length warm-up calls
    new_tokens: int    # default --new-tokens
    title: str


MODELS = {
    "llama": ModelSpec("llama", LLAMA_1B, TINY, "sdpa", False, 128, "Llama-3.2-1B-shaped model (16 layers)"),
    "gpt-oss": ModelSpec("gpt_oss", GPT_OSS_20B, TINY_GPT_OSS, "eager", True, 64,
                         "gpt-oss-20b-shaped model (4 layers: window 128 / full, sinks; 8 experts, top-4)"),
    "gemma3": ModelSpec("gemma3", GEMMA3_4B, TINY_GEMMA3, "sdpa", True, 64,
                        "Gemma-3-4B-shaped model (6 layers: 5 window 1024 : 1 full; head_dim 256)"),
}
OUT = {"llama": "benchmarks/results/hf.json", "gpt-oss": "benchmarks/results/hf_gpt_oss.json",
       "gemma3": "benchmarks/results/hf_gemma3.json", "all": "benchmarks/results/hf_all.json"}
EAGER_NAME = "b12x_bench_eager"  # the eager peer's registered name (transformers' eager, prefill in chunks)
EAGER_SCORE_BYTES = 4 << 30      # the eager peer's bound on one [B, Hq, S, L] score tensor (fp32 counted)
TINY_EAGER_SCORE_BYTES = 16 << 10  # --tiny: small enough that the tiny prefill runs in chunks too


def log(msg: str) -> None:
    print(msg, flush=True)


def _classes(arch: str):
    import transformers

    return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
            "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]


def build_model(config_kwargs: dict, device: torch.device, dtype: torch.dtype, seed: int = 0,
                arch: str = "llama"):
    """An eval-mode random-weight causal LM of `arch` (see `_classes`) on `device` in `dtype`; attention sinks
    (gpt-oss) drawn from N(0, 1); generation never stops early (no EOS), pad id 0."""
    config_cls, model_cls = _classes(arch)
    torch.manual_seed(seed)
    with device:
        model = model_cls(config_cls(**config_kwargs))
        with torch.no_grad():
            for module in model.modules():
                sinks = getattr(module, "sinks", None)
                if isinstance(sinks, torch.Tensor):
                    sinks.normal_(0.0, 1.0)
        model = model.to(dtype).eval()
    gc_ = model.generation_config
    gc_.eos_token_id, gc_.pad_token_id = None, 0  # random weights: never stop early
    return model


def compile_config(device: torch.device, sliding: bool = False, substituting: bool = False):
    """generate's compile config: fullgraph, reduce-overhead on CUDA (default mode on CPU); `sliding` adds
    dynamic=None (automatic dynamic, see the module docstring); `substituting`: the mode's Inductor under the
    substitution, as the backend `SubstitutingInductor` (the sdpa+enable column)."""
    from transformers.generation.configuration_utils import CompileConfig

    kw = dict(dynamic=None) if sliding else {}
    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default", **kw)
    if substituting:
        config.backend, config.mode = SubstitutingInductor(config.mode, config.dynamic), None
    if device.type != "cuda":
        config._compile_all_devices = True  # generate auto-compiles on CUDA only, unless told
    return config


def chunked_eager_attention(module, query, key, value, attention_mask, *, score_bytes: int, **kwargs):
    """transformers' eager attention of `module`'s model (its modeling module's `eager_attention_forward`),
    called as is where the [B, Hq, S, L] scores stay within `score_bytes` (counted as fp32; every decode step),
    otherwise on chunks of queries with the matching rows of the mask. Returns ([B, S, Hq, D], None) for
    chunks, what eager returns otherwise."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    b, h, s, _ = query.shape
    rows = max(1, score_bytes // (b * h * key.shape[-2] * 4))
    if s <= rows:
        return eager(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for i in range(0, s, rows):
        mask = attention_mask
        if mask is not None and mask.dim() == 4 and mask.shape[-2] == s:
            mask = mask[:, :, i:i + rows]
        outs.append(eager(module, query[:, :, i:i + rows], key, value, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def register_chunked_eager(score_bytes: int = EAGER_SCORE_BYTES) -> str:
    """Registers `chunked_eager_attention` (bound to `score_bytes`) with eager's mask function under
    EAGER_NAME; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, **kwargs):
        return chunked_eager_attention(module, query, key, value, attention_mask, score_bytes=score_bytes, **kwargs)

    AttentionInterface.register(EAGER_NAME, attention)
    AttentionMaskInterface.register(EAGER_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return EAGER_NAME


SUBSTITUTED = "sdpa+enable"  # attn_implementation="sdpa", generate compiled under b12x_inductor.substituting()


def attn_name(impl: str) -> str:
    """The attn_implementation a column runs: "b12x" for b12x and b12x-paged, EAGER_NAME for eager, "sdpa" for
    sdpa+enable."""
    return {"b12x": "b12x", "b12x-paged": "b12x", "eager": EAGER_NAME, SUBSTITUTED: "sdpa"}.get(impl, impl)


class SubstitutingInductor:
    """torch.compile backend of the sdpa+enable column: Inductor with the config patches of `mode` (as
    torch.compile(mode=...) applies them), compiling under `b12x_inductor.substituting()`. A backend of its own
    makes Dynamo keep its graphs apart from plain Inductor's (the pass is no guard). transformers deep-copies
    compile configs: a copy is this object, so configs stay equal and the compiled call is reused.
    `decisions`: those of the last graph it compiled that had attention calls."""

    def __init__(self, mode: str | None, dynamic: bool | None):
        import torch._inductor

        self.options = dict(torch._inductor.list_mode_options(mode, dynamic)) if mode else {}
        self.decisions: list[str] | None = None

    def __deepcopy__(self, memo):
        return self

    def __call__(self, gm, example_inputs):
        import b12x_inductor
        from torch._inductor.compile_fx import compile_fx

        before = b12x_inductor.last_decisions()
        with b12x_inductor.substituting(True):
            compiled = compile_fx(gm, example_inputs, config_patches=self.options)
        after = b12x_inductor.last_decisions()
        if after is not before:  # not when the graph came from the FX graph cache
            self.decisions = [str(d) for d in after]
        return compiled


class CudagraphCounter:
    """Counts CUDA graph trees' recordings (`records`) and warm-up runs without a graph (`warmups`) while
    active, by wrapping `CUDAGraphTreeManager.record_function` / `run_eager`; both stay None off CUDA or
    where those methods do not exist."""

    def __init__(self, device: torch.device):
        self.device, self.records, self.warmups, self._patched = device, None, None, []

    def __enter__(self):
        if self.device.type != "cuda":
            return self
        try:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager as manager
        except ImportError:
            return self
        for name, attr in (("record_function", "records"), ("run_eager", "warmups")):
            orig = getattr(manager, name, None)
            if orig is None:
                continue
            setattr(self, attr, 0)

            def counting(mgr, *args, _orig=orig, _attr=attr, **kwargs):
                setattr(self, _attr, getattr(self, _attr) + 1)
                return _orig(mgr, *args, **kwargs)

            setattr(manager, name, counting)
            self._patched.append((manager, name, orig))
        return self

    def __exit__(self, *exc):
        for manager, name, orig in self._patched:
            setattr(manager, name, orig)
        self._patched = []


class Runner:
    """generate() for one implementation and batch, with its cache and compiled step reused across calls."""

    def __init__(self, model, impl: str, batch: int, max_cache_len: int, device: torch.device,
                 sliding: bool = False):
        from b12x_inductor.integrations import hf

        self.model, self.impl, self.device = model, impl, device
        # equal configs: one compile
        self.config = compile_config(device, sliding, substituting=impl == SUBSTITUTED)
        self.kwargs = dict(compile_config=self.config, do_sample=False)
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

        import b12x_inductor

        self.model.set_attn_implementation(attn_name(self.impl))
        if self.paged is not None:
            self.paged.reset()
        _sync(device)
        times = [time.perf_counter()]
        with b12x_inductor.substituting(self.impl == SUBSTITUTED):  # off for every other column
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


def decode_tokens_per_s(runner: Runner, ids: torch.Tensor, new_tokens: int, repeats: int,
                        full_warmup: bool = False) -> dict:
    """Decode throughput from per-token clocks: the time from the first generated token to the last, i.e.
    new_tokens - 1 decode steps of generate (prefill excluded), the median over `repeats` calls. Warm-up: one
    call of 3 tokens (compiles the decode step, records its CUDA graph), or with `full_warmup` two calls of
    new_tokens (every step's graph warmed up, then recorded: sliding-window models)."""
    with CudagraphCounter(runner.device) as warm:
        for _ in range(2 if full_warmup else 1):
            runner(ids, new_tokens if full_warmup else 3)
    with CudagraphCounter(runner.device) as timed:
        calls = [runner(ids, new_tokens) for _ in range(repeats)]
    steps = new_tokens - 1
    decode = statistics.median(t[-1] - t[1] for t in calls)
    prefill = statistics.median(t[1] - t[0] for t in calls)
    out = dict(tokens_per_s=ids.shape[0] * steps / decode, ms_per_step=1e3 * decode / steps,
               prefill_s=prefill, decode_s=decode)
    if runner.impl == SUBSTITUTED:
        decisions = runner.config.backend.decisions or []
        out.update(decisions=decisions, substituted=sum(d.startswith("substituted:") for d in decisions))
        if not decisions:
            log(f"  warning: {SUBSTITUTED}: no decisions recorded (its graph came from the FX graph cache?)")
    if timed.records is not None:
        out.update(cudagraph_records=timed.records, cudagraph_warmups=timed.warmups,
                   warmup_cudagraph_records=warm.records)
        if timed.records or timed.warmups:
            log(f"  warning: {runner.impl}: {timed.records} CUDA graph recordings and {timed.warmups} runs "
                "without a graph during the timed calls (not a steady state)")
    return out


def run_model(args, name: str) -> dict:
    """One model's rows (see the module docstring) as a result dict."""
    spec = MODELS[name]
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    import b12x_inductor.integrations.hf  # noqa: F401  (registers "b12x")

    new_tokens = args.new_tokens or spec.new_tokens
    peer = args.peer or spec.peer
    if peer == "eager":
        register_chunked_eager(TINY_EAGER_SCORE_BYTES if args.tiny else EAGER_SCORE_BYTES)
    config = spec.tiny if args.tiny else spec.config
    model = build_model(config, device, dtype, arch=spec.arch)
    # One decode graph per (implementation, batch) (two or three for sliding models); the prompt length does
    # not change it.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    impls = [peer, "b12x"] + (["b12x-paged"] if args.paged else []) \
        + ([SUBSTITUTED] if args.substituted and peer != SUBSTITUTED else [])
    if SUBSTITUTED in impls:
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError) as e:
            raise SystemExit(f"bench hf: {SUBSTITUTED} runs attn_implementation=\"sdpa\", which {name} refuses: {e}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        torch._dynamo.reset()  # this batch's graphs compile for its own batch size
        runners = {impl: Runner(model, impl, batch, args.max_cache_len, device, spec.sliding) for impl in impls}
        for prompt in args.prompts:
            if prompt + new_tokens > args.max_cache_len:
                raise SystemExit(f"prompt {prompt} + {new_tokens} new tokens exceed max_cache_len "
                                 f"{args.max_cache_len}")
            ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
            row = dict(model=name, batch=batch, prompt=prompt, new_tokens=new_tokens,
                       max_cache_len=args.max_cache_len, live_max=prompt + new_tokens)
            for impl in impls:
                row[impl] = decode_tokens_per_s(runners[impl], ids, new_tokens, args.repeats, spec.sliding)
            for impl in impls[1:]:
                row[f"{impl}_speedup"] = row[impl]["tokens_per_s"] / row[peer]["tokens_per_s"]
            log(f"{name} B={batch} prompt={prompt}: " + ", ".join(
                f"{impl} {row[impl]['tokens_per_s']:.1f} tok/s" for impl in impls))
            rows.append(row)
        del runners
        _free(device)
    del model
    torch._dynamo.reset()
    _free(device)
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    import transformers

    env["transformers"] = transformers.__version__
    title = f"tiny stand-in for the {spec.title}" if args.tiny else spec.title
    return dict(suite="hf", env=env, config=dict(vars(args), new_tokens=new_tokens, peer=peer), model_name=name,
                title=title, peer=peer, model={"tiny": config} if args.tiny else config, impls=impls, rows=rows)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> dict:
    names = list(MODELS) if args.model == "all" else [args.model]
    return combine([run_model(args, name) for name in names])


def _models(result: dict) -> dict:
    """{model name: dict(impls=..., peer=..., title=..., model=...)} of a result (one model or several)."""
    if "models" in result:
        return result["models"]
    name = result.get("model_name", "llama")
    return {name: dict(impls=result["impls"], peer=result.get("peer", result["impls"][0]),
                       title=result.get("title", MODELS[name].title if name in MODELS else name),
                       model=result.get("model"))}


def combine(results: list[dict], paths: list[str] | None = None) -> dict:
    """One result from several: a single model's keeps today's layout (its rows sorted by batch and prompt);
    several models' go into `models` (their implementations and configs) with the rows of all."""
    models: dict = {}
    rows = []
    for result in results:
        infos = _models(result)
        for name, info in infos.items():
            if name in models and models[name]["impls"] != info["impls"]:
                raise SystemExit(f"bench hf --merge: runs of {name} with different implementations: "
                                 f"{models[name]['impls']} and {info['impls']}")
            models.setdefault(name, info)
        default = next(iter(infos))
        rows += [dict(row, model=row.get("model", default)) for row in result["rows"]]
    order = list(models)
    rows.sort(key=lambda row: (order.index(row["model"]), row["batch"], row["prompt"]))
    extra = {} if paths is None else dict(merged_from=paths)
    if len(models) == 1:
        return dict(results[0], rows=rows, **extra)
    return dict(suite="hf", env=results[0]["env"], models=models, rows=rows, **extra)


def markdown(result: dict) -> str:
    models = _models(result)
    lines = []
    for name, info in models.items():
        impls, peer = info["impls"], info["impls"][0]
        rows = [r for r in result["rows"] if r.get("model", name) == name]
        if len(models) > 1:
            lines += [f"{name}: {info['title']}", ""]
        head = "| batch | prompt | live max / cache | " + " | ".join(f"{i} tok/s" for i in impls) + " | " + " | ".join(
            f"{i} / {peer}" for i in impls[1:]) + " |"
        lines += [head, "|" + "---|" * (3 + len(impls) + len(impls) - 1)]
        for r in rows:
            cells = [str(r["batch"]), str(r["prompt"]), f"{r['live_max']} / {r['max_cache_len']}"]
            cells += [f"{r[i]['tokens_per_s']:.1f}" for i in impls]
            cells += [f"{r[f'{i}_speedup']:.2f}x" for i in impls[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    e = result["env"]
    only = next(iter(models)) if len(models) == 1 else None
    model = "" if only in (None, "llama") else f", {models[only]['title']}"
    lines.append(f"Decode tokens/s of generate(){model}, static caches, compiled; {e['device']}, torch {e['torch']}, "
                 f"transformers {e['transformers']}, {e['date']}.")
    return "\n".join(lines)


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m b12x_inductor.bench hf", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=[*MODELS, "all"], default="llama",
                    help="which model (default llama); all: each in turn, one table per model")
    ap.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/hf.json for "
                    "llama, hf_gpt_oss.json, hf_gemma3.json, hf_all.json)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 3072])
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 for llama, 64 for the others")
    ap.add_argument("--max-cache-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", default=None, help="the attention implementation to compare with (default: sdpa "
                    f"for llama and gemma3, eager for gpt-oss; {SUBSTITUTED}: sdpa under the substitution)")
    ap.add_argument("--paged", action="store_true", help="also time b12x with a B12xCache")
    ap.add_argument("--substituted", action="store_true", help=f"also time {SUBSTITUTED}: attn_implementation="
                    "\"sdpa\" compiled under b12x_inductor.substituting() (the automatic substitution)")
    ap.add_argument("--quick", action="store_true", help="batch 8 only, 32 new tokens, 2 repeats")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 models on CPU: checks the harness only")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge the rows of earlier runs into --out and "
                    "print their tables (to split a long run into several commands, e.g. by --batches)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = OUT[args.model]
    if args.new_tokens is None and args.model != "all":
        args.new_tokens = MODELS[args.model].new_tokens
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
    return combine(results, paths)


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
