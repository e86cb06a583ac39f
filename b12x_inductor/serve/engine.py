"""The serving loop: requests arrive, the scheduler picks a step, the runner runs it, repeat.

    engine = Engine(model, ServeConfig(num_pages=512, max_batch=16, token_budget=512))
    print(engine.warmup().format())        # compiles every bucket once; where the time went, per bucket
    report = engine.serve(requests)        # under torch.compiler.set_stance("fail_on_recompile")
    print(report.format())
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from b12x_inductor.serve.config import ServeConfig
from b12x_inductor.serve.pages import PageAllocator
from b12x_inductor.serve.runner import BucketWarmup, ModelRunner
from b12x_inductor.serve.scheduler import Request, Scheduler


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list; nan for an empty one."""
    if not values:
        return float("nan")
    v = sorted(values)
    x = (len(v) - 1) * q / 100
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


@dataclass(frozen=True, kw_only=True)
class Report:
    """What a `serve` call measured. Times in seconds; TTFT from arrival to the first token; TPOT is
    (finish - first token) / (output tokens - 1) per request."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    throughput_tok_s: float  # output tokens / elapsed
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    steps: int
    preemptions: int
    draft_acceptance: float  # accepted / proposed draft tokens (nan without drafts)

    def to_dict(self) -> dict:
        """The fields, with nan (no drafts, no request) as None: strict JSON."""
        return {k: (None if v != v else v) for k, v in asdict(self).items()}

    def format(self) -> str:
        return (f"{self.requests} requests, {self.prompt_tokens} prompt + {self.output_tokens} output tokens in "
                f"{self.elapsed_s:.2f} s ({self.steps} steps, {self.preemptions} preemptions)\n"
                f"throughput {self.throughput_tok_s:.1f} output tokens/s\n"
                f"TTFT p50 {self.ttft_p50_s * 1e3:.1f} ms, p99 {self.ttft_p99_s * 1e3:.1f} ms\n"
                f"TPOT p50 {self.tpot_p50_s * 1e3:.2f} ms, p99 {self.tpot_p99_s * 1e3:.2f} ms"
                + (f"\ndraft acceptance {self.draft_acceptance:.2f}" if self.draft_acceptance == self.draft_acceptance
                   else ""))


@dataclass(frozen=True, kw_only=True)
class WarmupReport:
    """What `Engine.warmup` did, in seconds: per bucket (`BucketWarmup`: compile, Dynamo and backend shares,
    capture, cold or from cache), the eager check before them (check_s), and with a compile cache its
    directory, the artifacts loaded from it (and the time), the bytes saved to it (and the time)."""

    total_s: float
    check_s: float
    buckets: tuple[BucketWarmup, ...]
    compiled: bool
    regional: bool
    cache_dir: str | None = None
    loaded_artifacts: int = 0
    load_s: float = 0.0
    saved_bytes: int = 0
    save_s: float = 0.0
    warnings: tuple[str, ...] = field(default=())

    @property
    def compile_s(self) -> float:
        return sum(b.compile_s for b in self.buckets)

    @property
    def capture_s(self) -> float:
        return sum(b.capture_s for b in self.buckets)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "buckets"}
        return dict(out, compile_s=self.compile_s, capture_s=self.capture_s, warnings=list(self.warnings),
                    buckets=[b.to_dict() for b in self.buckets])

    def format(self) -> str:
        how = ("eager" if not self.compiled else "regional compile" if self.regional else "whole-model compile")
        sources = [b.source for b in self.buckets]
        lines = [f"warm-up: {len(self.buckets)} buckets ({how}) in {self.total_s:.1f} s: compile "
                 f"{self.compile_s:.1f} s, capture/2nd run {self.capture_s:.1f} s, eager check {self.check_s:.1f} s; "
                 f"{sources.count('compiled')} compiled, {sources.count('cache')} from cache"]
        if self.cache_dir is not None:
            lines.append(f"compile cache {self.cache_dir}: loaded {self.loaded_artifacts} artifacts in "
                         f"{self.load_s:.2f} s, saved {self.saved_bytes / 2**20:.1f} MiB in {self.save_s:.2f} s")
        lines += [f"warning: {w}" for w in self.warnings]
        lines.append("  bucket          compile s  dynamo s  backend s  capture s  graphs  source    fx hit/miss")
        for b in self.buckets:
            shape = f"{b.kind} {b.rows}x{b.width}"
            lines.append(f"  {shape:<15} {b.compile_s:9.2f} {b.dynamo_s:9.2f} {b.backend_s:10.2f} {b.capture_s:10.2f} "
                         f"{b.graphs:7d}  {b.source:<9} {b.fx_hit}/{b.fx_miss}")
        return "\n".join(lines)


class Engine:
    def __init__(self, model, config: ServeConfig) -> None:
        self.config = config
        self.runner = ModelRunner(model, config)
        self._allocators()
        self.steps = 0
        self.warm = False
        self.warmup_report: WarmupReport | None = None

    def _allocators(self) -> None:
        """A free list per pool of the runner (`pages`: full layers, `window_pages`: window layers that
        recycle their pages; None where the model has no such pool) and a scheduler over them."""
        c, runner = self.config, self.runner
        self.pages = PageAllocator(c.num_pages, c.page_size) if "full" in runner.pools else None
        self.window_pages = None
        if "window" in runner.pools:
            self.window_pages = PageAllocator(c.window_num_pages or runner.pool_pages["window"], c.page_size)
        self.scheduler = Scheduler(c, self.pages, self.window_pages, runner.window)

    @property
    def pools_free(self) -> bool:
        """Every page of every pool is on its free list."""
        return all(a.num_free == a.num_pages for a in (self.pages, self.window_pages) if a is not None)

    def reset(self, *, num_pages: int | None = None, num_draft: int | None = None,
              eos_token_ids: tuple[int, ...] | None = None, window_num_pages: int | None = None) -> None:
        """A fresh scheduler and free lists over the same pools and compiled buckets (nothing recompiles), with
        the engine's config but for the given `num_pages` (<= the pool's), `window_num_pages` (<= the window
        pool's), `num_draft` (<= the compiled verify width) and `eos_token_ids`. Raises ValueError while
        requests are still in flight."""
        if not self.scheduler.idle:
            raise ValueError("Engine.reset: requests are still waiting or running")
        pool, width = self.runner.config.num_pages, self.runner.config.num_draft
        if num_pages is not None and not 1 <= num_pages <= pool:
            raise ValueError(f"Engine.reset: num_pages must be in 1..{pool} (the pool); got {num_pages}")
        window_pool = self.runner.pool_pages.get("window", 0)
        if window_num_pages is not None and not 1 <= window_num_pages <= window_pool:
            raise ValueError(f"Engine.reset: window_num_pages must be in 1..{window_pool} (the window pool); "
                             f"got {window_num_pages}")
        if num_draft is not None and not 0 <= num_draft <= width:
            raise ValueError(f"Engine.reset: num_draft must be in 0..{width} (compiled verify width - 1); "
                             f"got {num_draft}")
        changes = dict(num_pages=num_pages, num_draft=num_draft, eos_token_ids=eos_token_ids,
                       window_num_pages=window_num_pages)
        self.config = replace(self.runner.config, **{k: v for k, v in changes.items() if v is not None})
        self._allocators()

    def warmup(self) -> WarmupReport:
        """Compiles (on CUDA also captures) every bucket; returns where the time went, also kept as
        `warmup_report`. With `config.compile_cache`, first loads the directory's artifacts, compiles with
        Inductor's on-disk caches there, then saves what this process compiled or found (`serve.compile_cache`)."""
        from b12x_inductor.serve.compile_cache import CompileCache, Loaded

        start = time.perf_counter()
        c = self.runner.config
        cache = CompileCache(c.compile_cache, self.runner.device) if c.compile and c.compile_cache else None
        loaded, saved, save_s = Loaded(), 0, 0.0
        with cache.activate() if cache is not None else contextlib.nullcontext():
            if cache is not None:
                loaded = cache.load()
            check = time.perf_counter()
            buckets = self.runner.warmup()
            check_s = time.perf_counter() - check - sum(b.compile_s + b.capture_s for b in buckets)
            if cache is not None:
                saved, save_s = cache.save(self.runner.buckets)
        self.warm = True
        self.warmup_report = WarmupReport(
            total_s=time.perf_counter() - start, check_s=check_s, buckets=tuple(buckets), compiled=c.compile,
            regional=self.runner.regional, cache_dir=None if cache is None else cache.path,
            loaded_artifacts=loaded.artifacts, load_s=loaded.seconds, saved_bytes=saved, save_s=save_s,
            warnings=loaded.warnings)
        return self.warmup_report

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def step(self, start: float | None = None) -> list[Request]:
        """One scheduler step through the model; returns the requests that finished in it. Times are
        recorded in seconds after `start` (a time.perf_counter() value), or as 0 without it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        sampled = self.runner.run(step)
        self.steps += 1
        now = 0.0 if start is None else time.perf_counter() - start
        return self.scheduler.update(step, sampled, now=now)

    def serve(self, requests: list[Request], *, progress: bool = False) -> Report:
        """Serves requests by their arrival times (seconds after the call) until all finish; compiles first
        if `warmup` was not called. No bucket compiles again while serving (fail_on_recompile)."""
        if not self.warm:
            self.warmup()
        pending = sorted(requests, key=lambda r: r.arrival)
        steps0, preempt0 = self.steps, self.scheduler.num_preemptions
        bar = _progress(len(requests), progress)
        start = time.perf_counter()
        with torch.compiler.set_stance("fail_on_recompile"):
            while pending or not self.scheduler.idle:
                now = time.perf_counter() - start
                while pending and pending[0].arrival <= now:
                    self.add(pending.pop(0))
                if self.scheduler.idle:
                    time.sleep(max(0.0, pending[0].arrival - now))
                    continue
                finished = self.step(start)
                if bar is not None and finished:
                    bar.update(len(finished))
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        return self._report(requests, elapsed, self.steps - steps0, self.scheduler.num_preemptions - preempt0)

    @staticmethod
    def _report(requests: list[Request], elapsed: float, steps: int, preemptions: int) -> Report:
        out = sum(len(r.output) for r in requests)
        ttft = [r.first_token_time - r.arrival for r in requests]
        tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in requests if len(r.output) > 1]
        drafted = sum(r.num_drafted for r in requests)
        return Report(
            requests=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests), output_tokens=out,
            elapsed_s=elapsed, throughput_tok_s=out / elapsed if elapsed > 0 else float("nan"),
            ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99), tpot_p50_s=percentile(tpot, 50),
            tpot_p99_s=percentile(tpot, 99), steps=steps, preemptions=preemptions,
            draft_acceptance=sum(r.num_accepted for r in requests) / drafted if drafted else float("nan"))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="req", desc="serving", dynamic_ncols=True)
