"""The kernel benchmark (default suite): `python -m b12x_inductor.bench [kernels] [options]`.

Rows (bf16, random page order; each row carries its Shape: Hq, Hkv, D, page size, window, sinks):
- decode, verify, extend, fp8 (the default rows: Hq=32, Hkv=8, D=128, page 16, no window, no sinks): decode
  B x L in 1x32768, 8x8192, 32x4096, 64x2048, 128x1024, 16x16384; verify S=4 in 8x8192, 32x4096, 64x2048,
  then S=2 and S=8 in the same sizes (labelled 'verify S=2 8x8192': a verify label without S is S=4); extend
  causal (q_len = kv_len) in 4x4096, 1x16384; the decode rows again with a float8_e4m3fn cache.
- models (model-shaped rows, labelled with the model shape):
  gpt-oss-120b (Hq 64, Hkv 8, D 64, learned attention sinks: one float32 logit per query head): its
  sliding-window layers ("gpt-oss swa128": window 128, i.e. window_left=127, a query sees itself and the 127
  keys before) and its full layers ("gpt-oss full"), each in decode 32x4096 and 8x16384 and verify S=4 32x4096;
  Gemma 2/3 9B-12B class ("gemma D256": Hq 16, Hkv 8, D 256) decode 32x4096, 8x8192 and extend 4x4096 (full
  causal prefill); Qwen2-7B ("qwen2 gqa7": Hq 28, Hkv 4, D 128) decode 32x4096, 8x8192, 1x32768; Llama-3-70B
  class ("llama3-70b gqa8": Hq 64, Hkv 8, D 128, one GPU's share at tensor parallelism 1) decode and verify S=4
  32x4096.
- nosinks (not in the default --rows): the gpt-oss rows without sinks, labelled "(no sinks)", so FlashInfer's
  plain decode/prefill wrappers can be compared on the window alone.
The sinks are drawn around log(keys a decode query sees) so that they carry a good part of the softmax mass:
an implementation that dropped them would fail the reference check (small sinks would hide that).

Side by side in one process: b12x (the public op, the plan select_plan picks), SDPA over a contiguous
exact-length cache (the window as an explicit boolean mask; sinks: n/a), FlexAttention (compiled, same
contiguous cache, the window as a mask_mod; sinks: n/a) and FlashInfer (decode wrapper with tensor cores;
prefill wrapper with the fa2 and fa3 backends; the window as plan(window_left=...); for sink rows
BatchAttentionWithAttentionSinkWrapper, fa2 and fa3, as "flashinfer-sink-fa2/-fa3", and the plain wrappers
marked n/a: their fa2/fa3 paths take a sinks= argument but ignore it), whichever import. An implementation
that cannot run a row's problem is recorded as "n/a: <reason>" (JSON entry {"na": ...} and the printed line),
never dropped. Each result is checked against the reference, window and sinks included (on two requests, or
for extend the first and last query rows of one), before it is timed. Timing: one CUDA graph replays the call
over rotating input sets whose touched bytes together exceed the 60 MB L2 (at most 64 sets; 2 in a CPU dry
run), about 3 ms of GPU work a replay, each timed replay queued behind an untimed one (time_graph), CUDA
events, the median of the replays. The device copy bandwidth is measured in the same run.
Metrics: decode and verify rows report TB/s over the bytes a call must touch (K/V of the keys inside the
window: min(L, window_left + S) keys a request, so min(L, window + 1) for decode; all L keys without a window;
plus q read and out written), extend rows TFLOP/s over the causal triangle (with a window, the keys each query
sees). Every timed cell also records host_us, the host time of one eager call (host_time: the least of five
batches; "host N us" on the printed line on a GPU): what a caller without CUDA graphs pays a call. Prints a
progress line per row, then writes JSON (each row with its model tag and shape) and a PNG chart.

Options: --out DIR (default benchmarks/results), --rows decode,verify,extend,fp8,models (default; also nosinks),
--models gpt-oss,gemma,qwen2,llama3-70b (the model rows of these models only; default all),
--peers sdpa,flex,flashinfer (default all importable), --families triton,cute (each family's own plan side by
side), --variants (tuning: other plan constants), --head-dim (D of the default rows, default 128), --page-size
(keys per page of every row, default 16), --extend-rows (other default extend rows, 'BxL[:S],...': S new tokens
on L keys, a chunked prefill when S < L), --sizes BxL[,BxL...] (a dry run or a sweep: every row at each size,
duplicates dropped), --flex-rows (only these row labels get FlexAttention), --packed (extend rows also time
"b12x-packed": the op on q packed [B x S, Hq, D] with cu_seqlens_q, as the serving engine calls extend),
--packed-batch M (implies --packed: cu_seqlens_q, the page table and the lengths of b12x-packed padded to M requests, as the serving engine pads them
to its max_batch; the requests past B have no new tokens and no keys), --tag (JSON/PNG name; default the device's:
h200, h100, ...), --profile (no timing: after its reference check each implementation runs once more inside an
NVTX range named after it, for `ncu --nvtx --nvtx-include "b12x-cute/" python -m b12x_inductor.bench ...
--profile`), --warm-peers (JIT-build FlashInfer's modules for the selected rows and exit).
B12X_BENCH_DEVICE=cpu runs the harness on the CPU (a dry run: the b12x op runs its torch family, wall-clock
timing, no bandwidth figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

import torch

from b12x_inductor.bench import device_tag, parse_sizes

L2_BYTES = 60 * 2**20
MAX_SETS = 64  # rotating input sets per row, at most (a windowed row touches little of each set)
PROFILE = False  # --profile: one call per implementation in an NVTX range instead of timing
DEVICE = os.environ.get("B12X_BENCH_DEVICE", "cuda")  # "cpu": a dry run of the harness (wall-clock timing)
DEFAULT_ROWS = "decode,verify,extend,fp8,models"
ROW_GROUPS = ("decode", "verify", "extend", "fp8", "models", "nosinks")


@dataclasses.dataclass(frozen=True)
class Shape:
    """The attention problem of a row apart from its sizes: heads, head dim, page size, window, sinks."""

    hq: int = 32
    hkv: int = 8
    d: int = 128
    page: int = 16
    window_left: int = -1  # paged_attention's window_left: >= 0 keeps keys j >= c - window_left; -1 none
    sinks: bool = False  # one float32 sink logit per query head (paged_attention's sinks=)

    def as_json(self) -> dict:
        return dict(hq=self.hq, hkv=self.hkv, d=self.d, page_size=self.page, window_left=self.window_left,
                    sinks=self.sinks)


DEFAULT_SHAPE = Shape()  # the default rows (--head-dim and --page-size replace d and page)
DECODE_ROWS = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 1024), (16, 16384)]
VERIFY_ROWS = [(8, 8192), (32, 4096), (64, 2048)]
VERIFY_S = 4  # the verify rows' new tokens a request; their labels name no S (as the first runs' labels did)
VERIFY_MORE_S = (2, 8)  # then the same sizes at these S (labels with S): speculative decoding's usual range
EXTEND_ROWS = [(4, 4096), (1, 16384)]

GPT_OSS_SWA = Shape(hq=64, hkv=8, d=64, window_left=127, sinks=True)  # gpt-oss-120b sliding layers (window 128)
GPT_OSS_FULL = Shape(hq=64, hkv=8, d=64, sinks=True)  # gpt-oss-120b full layers
GEMMA_D256 = Shape(hq=16, hkv=8, d=256)  # Gemma 2 9B / Gemma 3 12B class, full layers
QWEN2_GQA7 = Shape(hq=28, hkv=4, d=128)  # Qwen2-7B
LLAMA70_GQA8 = Shape(hq=64, hkv=8, d=128)  # Llama-3-70B / Qwen2.5-72B class: 8 query heads a KV head
MODEL_ROWS = [  # (model tag of the label, shape, mode, q_len (None: = L), [(B, L)])
    ("gpt-oss swa128", GPT_OSS_SWA, "decode", 1, [(32, 4096), (8, 16384)]),
    ("gpt-oss swa128", GPT_OSS_SWA, "verify", 4, [(32, 4096)]),
    ("gpt-oss full", GPT_OSS_FULL, "decode", 1, [(32, 4096), (8, 16384)]),
    ("gpt-oss full", GPT_OSS_FULL, "verify", 4, [(32, 4096)]),
    ("gemma D256", GEMMA_D256, "decode", 1, [(32, 4096), (8, 8192)]),
    ("gemma D256", GEMMA_D256, "extend", None, [(4, 4096)]),
    ("qwen2 gqa7", QWEN2_GQA7, "decode", 1, [(32, 4096), (8, 8192), (1, 32768)]),
    ("llama3-70b gqa8", LLAMA70_GQA8, "decode", 1, [(32, 4096)]),
    ("llama3-70b gqa8", LLAMA70_GQA8, "verify", 4, [(32, 4096)]),
]


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row: the mode, its sizes, the cache dtype and the Shape; model rows carry their model tag."""

    mode: str  # "decode" | "verify" | "extend"
    batch: int
    length: int  # keys per request (L), new tokens included
    q_len: int  # new tokens per request (S)
    kv_dtype: torch.dtype
    shape: Shape = DEFAULT_SHAPE
    model: str = ""  # e.g. "gpt-oss swa128"; "" for the default rows
    note: str = ""  # label suffix, e.g. "(no sinks)"

    @property
    def label(self) -> str:
        """Default rows: 'decode 8x8192', 'decode-fp8 8x8192', 'verify S=8 32x4096' (S when not VERIFY_S),
        'extend 1x8192:1024' (new tokens when fewer than the keys), with ' D64' when the head dim is not 128.
        Model rows: the model tag first, e.g. 'gpt-oss swa128 decode 32x4096', 'gemma D256 extend 4x4096', then
        the note."""
        fp8 = "-fp8" if self.kv_dtype == torch.float8_e4m3fn else ""
        s = f" S={self.q_len}" if self.mode == "verify" and self.q_len != VERIFY_S else ""
        label = f"{self.mode}{fp8}{s} {self.batch}x{self.length}"
        if self.mode == "extend" and self.q_len != self.length:
            label += f":{self.q_len}"
        if not self.model:
            return label + (f" D{self.shape.d}" if self.shape.d != 128 else "")
        return " ".join(x for x in (self.model, label, self.note) if x)


MODELS = tuple(dict.fromkeys(tag.split()[0] for tag, *_ in MODEL_ROWS))  # --models: gpt-oss, gemma, qwen2, llama3-70b


def build_rows(groups, default_shape=DEFAULT_SHAPE, extend_rows=None, sizes=None, page=None, models=None):
    """The rows of the --rows groups, in table order. extend_rows: the default extend rows [(B, L, S)];
    page: the page size of every row (default: each shape's); sizes [(B, L), ...]: every row at each of these
    sizes in turn (a dry run, or a sweep), rows that become identical kept once; models: the model rows (models,
    nosinks) of these models only (names in MODELS; default all)."""
    groups = [g for g in groups if g]
    unknown = sorted(set(groups) - set(ROW_GROUPS))
    if unknown:
        raise ValueError(f"unknown --rows {unknown}; known: {','.join(ROW_GROUPS)}")
    unknown = sorted(set(models or ()) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown --models {unknown}; known: {','.join(MODELS)}")
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    if extend_rows is None:
        extend_rows = [(b, n, n) for b, n in EXTEND_ROWS]
    rows = []
    if "decode" in groups:
        rows += [Row("decode", b, n, 1, bf16, default_shape) for b, n in DECODE_ROWS]
    if "verify" in groups:
        rows += [Row("verify", b, n, s, bf16, default_shape) for s in (VERIFY_S, *VERIFY_MORE_S)
                 for b, n in VERIFY_ROWS]
    if "extend" in groups:
        rows += [Row("extend", b, n, q, bf16, default_shape) for b, n, q in extend_rows]
    if "fp8" in groups:
        rows += [Row("decode", b, n, 1, fp8, default_shape) for b, n in DECODE_ROWS]
    if "models" in groups:
        rows += [Row(mode, b, n, q or n, bf16, shape, model) for model, shape, mode, q, sizes_ in MODEL_ROWS
                 for b, n in sizes_]
    if "nosinks" in groups:
        rows += [Row(mode, b, n, q or n, bf16, dataclasses.replace(shape, sinks=False), model, "(no sinks)")
                 for model, shape, mode, q, sizes_ in MODEL_ROWS if shape.sinks for b, n in sizes_]
    if models:
        rows = [r for r in rows if not r.model or r.model.split()[0] in models]
    if page is not None:
        rows = [dataclasses.replace(r, shape=dataclasses.replace(r.shape, page=page)) for r in rows]
    if sizes:
        rows = [dataclasses.replace(r, batch=b0, length=n0, q_len=n0 if r.mode == "extend" else r.q_len)
                for b0, n0 in sizes for r in rows]
        seen, unique = set(), []
        for r in rows:
            if (r.label, r.shape) not in seen:
                seen.add((r.label, r.shape))
                unique.append(r)
        rows = unique
    return rows


def log(msg: str) -> None:
    print(msg, flush=True)


class Unable(Exception):
    """An implementation cannot run a row's problem: recorded as "n/a: <reason>", never timed."""


# ----------------------------------------------------------------------------------------------------------
# inputs

def keys_seen(shape, length, q_len):
    """Keys of one request that some query of it sees: all L without a window, else min(L, window_left + S)
    (the S new queries' windows together; min(L, window_left + 1) for decode)."""
    return length if shape.window_left < 0 else min(length, shape.window_left + q_len)


def make_set(shape, mode, batch, length, q_len, kv_dtype, seed):
    """One input set: paged caches in random page order, q, out, and for sink shapes the sink logits (float32
    [Hq], about log(keys a decode query sees) + N(0, 1): enough softmax mass that dropping them shows)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    page = shape.page
    pages_per = length // page
    num_pages = batch * pages_per
    kv_shape = (num_pages, page, shape.hkv, shape.d)
    s = {}
    if kv_dtype == torch.float8_e4m3fn:
        s["k_cache"] = (torch.randn(kv_shape, device=DEVICE, generator=gen) * 2).to(kv_dtype)
        s["v_cache"] = (torch.randn(kv_shape, device=DEVICE, generator=gen) * 2).to(kv_dtype)
        s["k_descale"] = torch.tensor(0.5, device=DEVICE)
        s["v_descale"] = torch.tensor(0.75, device=DEVICE)
    else:
        s["k_cache"] = torch.randn(kv_shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
        s["v_cache"] = torch.randn(kv_shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
        s["k_descale"] = s["v_descale"] = None
    perm = torch.randperm(num_pages, device=DEVICE, generator=gen).int()
    s["page_table"] = perm.reshape(batch, pages_per)
    s["cache_seqlens"] = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    s["q"] = torch.randn(batch, q_len, shape.hq, shape.d, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    s["out"] = torch.empty_like(s["q"])
    s["sinks"] = None
    if shape.sinks:
        noise = torch.randn(shape.hq, device=DEVICE, generator=gen, dtype=torch.float32)
        s["sinks"] = math.log(keys_seen(shape, length, 1)) + noise
    return s


def make_sets(shape, mode, batch, length, q_len, kv_dtype):
    """A row's rotating input sets (make_set): enough that the K/V they touch is twice L2 (2 to MAX_SETS; 2 in a
    CPU dry run)."""
    touched = batch * keys_seen(shape, length, q_len) * shape.hkv * shape.d * 2 * kv_dtype.itemsize
    n_sets = 2 if DEVICE == "cpu" else min(MAX_SETS, max(2, math.ceil(2 * L2_BYTES / touched)))
    return [make_set(shape, mode, batch, length, q_len, kv_dtype, seed=17 * i + batch) for i in range(n_sets)]


def contiguous_kv(s, shape, name):
    """[B, Hkv, L, D] exact-length copy of a paged cache (what SDPA/Flex read)."""
    c = s[name][s["page_table"].long()]  # [B, P, page, Hkv, D]
    b, p = c.shape[:2]
    return c.reshape(b, p * shape.page, shape.hkv, shape.d).transpose(1, 2).contiguous()


def visible_mask(shape, q_len, length, device):
    """bool [S, L]: key j visible to new query i (causal, then the window)."""
    limit = torch.arange(length - q_len, length, device=device)[:, None]  # each query's causal limit
    pos = torch.arange(length, device=device)[None, :]
    mask = pos <= limit
    if shape.window_left >= 0:
        mask &= pos >= limit - shape.window_left
    return mask


def reference_slices(s, shape, mode):
    """The reference (window and sinks included) on a slice of the problem: [(request, query rows, fp32
    reference out)]: two requests, or for extend the first and last 4 query rows of request 0."""
    from b12x_inductor.kernels.reference import paged_attention_reference

    batch, q_len = s["q"].shape[:2]
    checks = []
    if mode == "extend":
        n = 4
        checks.append((0, slice(q_len - n, q_len), int(s["cache_seqlens"][0])))
        checks.append((0, slice(0, n), int(s["cache_seqlens"][0]) - q_len + n))
    else:
        for b in sorted({0, batch - 1}):
            checks.append((b, slice(0, q_len), int(s["cache_seqlens"][b])))
    refs = []
    for b, rows, length in checks:
        pages = s["page_table"][b, : -(-length // shape.page)].long()
        sub = dict(q=s["q"][b:b + 1, rows], k_cache=s["k_cache"][pages], v_cache=s["v_cache"][pages],
                   page_table=torch.arange(len(pages), dtype=torch.int32, device=DEVICE)[None],
                   cache_seqlens=torch.tensor([length], dtype=torch.int32, device=DEVICE),
                   window_left=shape.window_left, sinks=s["sinks"],
                   k_descale=s["k_descale"], v_descale=s["v_descale"])
        refs.append((b, rows, paged_attention_reference(**sub)[0]))
    return refs


def reference_check(refs, out, what):
    """Max abs error of `out` [B, S, Hq, D] against the reference slices; raises past the tolerance."""
    worst = 0.0
    for b, rows, ref in refs:
        got = out[b:b + 1, rows].float().cpu()
        err = float((got - ref).abs().max())
        tol = 2e-2 * float(ref.abs().max()) + 2e-3
        if not err <= tol:
            raise AssertionError(f"{what}: max error {err:.3g} > {tol:.3g} against the reference")
        worst = max(worst, err)
    return worst


# ----------------------------------------------------------------------------------------------------------
# timing

def _passes(calls, n=1):
    """The calls in turn, n times (eagerly, or into a graph being captured)."""
    for _ in range(n):
        for c in calls:
            c()


def time_graph(calls, target_ms=3.0, replays=15):
    """Median microseconds per call: the calls (one per rotating input set) captured in one CUDA graph,
    repeated to about target_ms of GPU time a replay, timed with events. Each timed replay is queued behind an
    untimed one, so the stream never idles between the events: the host's launch latency, which a replay of a
    few milliseconds would otherwise carry as a fixed share, stays outside them. The repeat count comes from
    the GPU time of one captured pass over the calls, not from eager calls, whose host overhead differs from
    one implementation to the next (a host-bound estimate gave fewer calls a replay, so a larger share of that
    latency). Falls back to eager timing, the repeat count from eager calls, if capture fails. On the CPU (a
    dry run): the wall time of one pass after a warm one (host_time)."""
    _passes(calls)
    if DEVICE == "cpu":
        return host_time(calls), "wall (cpu dry run)"
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed_ms(run):
        run()  # untimed: the GPU is still on it while the timed run below is queued
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def repeats(est_ms):
        return max(1, min(200, int(target_ms / (max(est_ms, 1e-3) * len(calls)))))

    def capture(inner):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _passes(calls, inner)
        graph.replay()
        return graph.replay

    method = "graph"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _passes(calls)
        torch.cuda.current_stream().wait_stream(side)
        once = capture(1)
        inner = repeats(min(timed_ms(once) for _ in range(3)) / len(calls))
        run = capture(inner) if inner > 1 else once
    except Exception as e:  # a peer that cannot be captured is timed eagerly (and says so)
        method = f"eager ({type(e).__name__})"
        torch.cuda.synchronize()
        start.record()
        _passes(calls)
        end.record()
        end.synchronize()
        inner = repeats(start.elapsed_time(end) / len(calls))
        run = functools.partial(_passes, calls, inner)
    torch.cuda.synchronize()
    times = [timed_ms(run) * 1e3 / (inner * len(calls)) for _ in range(replays)]
    return statistics.median(times), method


def host_time(calls, launches=100, batches=5):
    """Microseconds of host time an eager call takes: the calls in turn, about `launches` of them a batch, the
    clock stopped before the device sync; the least of `batches` batches, each after a sync (a shared host's
    noise only adds to a call's time). On the CPU, one batch of one pass. What a caller without CUDA graphs pays
    a call before its work reaches the GPU; a call that waits on the device counts the wait. At a few hundred
    kernel launches the launch queue takes them all without blocking the host."""
    cuda = DEVICE == "cuda"
    reps = max(1, launches // len(calls)) if cuda else 1
    best = float("inf")
    for _ in range(batches if cuda else 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _passes(calls, reps)
        best = min(best, time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
    return best * 1e6 / (reps * len(calls))


def warm_peers(rows):
    """Builds FlashInfer's JIT modules for the rows' configurations (head dim, window or not, sinks, cache
    dtype, decode or prefill wrapper) on tiny inputs (about 100 s once for the default rows)."""
    t0 = time.time()
    seen = set()
    for row in rows:
        shape = row.shape
        key = (row.mode == "decode", row.kv_dtype, shape.d, shape.page, shape.window_left >= 0, shape.sinks)
        if key in seen:
            continue
        seen.add(key)
        q_len = 1 if row.mode == "decode" else 4
        s = make_set(shape, row.mode, 1, shape.page * -(-256 // shape.page), q_len, row.kv_dtype, seed=1)
        what = f"{row.mode} D{shape.d} {str(row.kv_dtype).replace('torch.', '')}" + (
            " window" if shape.window_left >= 0 else "") + (" sinks" if shape.sinks else "")
        for name, make in peers_for(shape, row.mode, row.kv_dtype, {"flashinfer"}):
            try:
                make(s, shape, row.mode)[0]()
                torch.cuda.synchronize()
                log(f"warm {name} {what}: ok ({time.time() - t0:.0f} s)")
            except Unable as e:
                log(f"warm {name} {what}: n/a: {e}")
            except Exception as e:
                log(f"warm {name} {what}: {type(e).__name__}: {str(e)[:200]}")


def copy_bandwidth():
    """Device copy bandwidth in TB/s (bytes read + written) over 2 GiB: the better of cudaMemcpy (copy_) and
    an elementwise kernel (torch.neg), median of CUDA-graph replays. Returns (best, {method: TB/s})."""
    n = 2**30  # bf16 elements: 2 GiB
    src = torch.randn(n, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    found = {}
    for name, fn in (("memcpy", lambda: dst.copy_(src)), ("kernel", lambda: torch.neg(src, out=dst))):
        us, _ = time_graph([fn], target_ms=5.0, replays=10)
        found[name] = 2 * src.nbytes / (us * 1e-6) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return max(found.values()), found


# ----------------------------------------------------------------------------------------------------------
# implementations: each returns (a zero-argument callable that writes its output for one input set, a
# callable that returns that output [B, S, Hq, D]), or raises Unable

def b12x_call(s, shape, mode, variant=None, family=None):
    if variant is None and family is None:
        return _op_call(s, shape, s["q"], s["out"]), lambda: s["out"]
    out = torch.empty_like(s["q"])
    return _plan_call(s, shape, s["q"], out, variant=variant, family=family), lambda: out


def _plan_call(s, shape, q, out, cu_seqlens_q=None, page_table=None, seqlens=None, variant=None, family=None):
    """A zero-argument call of one kernel family's plan (family_plan; default the family select_plan picks) on
    input set s's cache, with this q (and cu_seqlens_q) into out, its (num_splits, block_n, num_stages,
    num_warps, block_m) replaced where the variant gives a nonzero value: kernels.run, past the op's checks."""
    from b12x_inductor import kernels, validate
    from b12x_inductor.plan import family_plan, select_plan

    page_table = s["page_table"] if page_table is None else page_table
    seqlens = s["cache_seqlens"] if seqlens is None else seqlens
    problem = validate.check_paged_attention(
        q, s["k_cache"], s["v_cache"], page_table, seqlens, cu_seqlens_q, kv_layout="NHD", causal=True,
        scale=None, window_left=shape.window_left, kv_start=None, sinks=s["sinks"], softcap=0.0,
        k_descale=s["k_descale"], v_descale=s["v_descale"], out=None)
    family = family or select_plan(problem).family
    if family == "cute":
        _cute_check(problem)
    fields = dict(zip(("num_splits", "block_n", "num_stages", "num_warps", "block_m"), variant or ()))
    plan = family_plan(problem, family, **{k: v for k, v in fields.items() if v})
    the_call = kernels.Call(
        q=q, k_cache=s["k_cache"], v_cache=s["v_cache"], page_table=page_table, cache_seqlens=seqlens,
        cu_seqlens_q=cu_seqlens_q, kv_start=None, sinks=s["sinks"], k_descale=s["k_descale"],
        v_descale=s["v_descale"], key_mask=None, q_pe=None, out=out,
        lse=torch.empty(q.shape[:-1], dtype=torch.float32, device=DEVICE),
        scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=DEVICE),
        options=kernels.Options(kv_layout="NHD", causal=True, scale=shape.d**-0.5, window_left=shape.window_left,
                                softcap=0.0),
        plan=plan)

    def call():
        kernels.run(the_call)
    return call


def b12x_packed_call(s, shape, mode, pad_to=0, variant=None, family=None):
    """The public op on the row's requests packed: q as [B x S, Hq, D] (a view of the same rows) with
    cu_seqlens_q (every request S new tokens), as the serving engine calls extend; out viewed back as
    [B, S, Hq, D]. pad_to > B: cu_seqlens_q [pad_to + 1], the page table [pad_to, pages] and the lengths
    [pad_to], the requests past B with no new tokens and no keys (the serving engine's max_batch). With a
    variant or a family: that plan on the same packed q (_plan_call) instead of the op."""
    if mode != "extend":
        raise Unable("packed q is timed on extend rows only")
    batch, q_len = s["q"].shape[:2]
    q = s["q"].reshape(batch * q_len, shape.hq, shape.d)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=DEVICE)
    page_table, seqlens = s["page_table"], s["cache_seqlens"]
    if pad_to > batch:
        more = pad_to - batch
        cu = torch.cat([cu, cu[-1:].expand(more)])
        page_table = torch.cat([page_table, page_table.new_zeros(more, page_table.shape[1])])
        seqlens = torch.cat([seqlens, seqlens.new_zeros(more)])
    out = torch.empty_like(q)
    if variant is None and family is None:
        call = _op_call(s, shape, q, out, cu, page_table=page_table, seqlens=seqlens)
    else:
        call = _plan_call(s, shape, q, out, cu, page_table=page_table, seqlens=seqlens, variant=variant,
                          family=family)
    return call, lambda: out.view(batch, q_len, shape.hq, shape.d)


def _op_call(s, shape, q, out, cu_seqlens_q=None, page_table=None, seqlens=None):
    """A zero-argument call of the public op on input set s's cache, with this q (and cu_seqlens_q) into out;
    page_table and seqlens default to the set's."""
    import b12x_inductor as b12x

    page_table = s["page_table"] if page_table is None else page_table
    seqlens = s["cache_seqlens"] if seqlens is None else seqlens

    def call():
        b12x.paged_attention(q, s["k_cache"], s["v_cache"], page_table, seqlens, cu_seqlens_q,
                             window_left=shape.window_left, sinks=s["sinks"], k_descale=s["k_descale"],
                             v_descale=s["v_descale"], out=out)
    return call


def _cute_check(problem):
    from b12x_inductor.kernels import cute

    if not cute.available():
        raise Unable("the CuTe family is not available (nvidia-cutlass-dsl, CUDA)")
    if not cute.supports(problem):
        raise Unable("the CuTe family refuses this problem (cute.supports)")


def sdpa_call(s, shape, mode):
    import torch.nn.functional as F

    if s["k_descale"] is not None:
        raise Unable("SDPA takes no fp8 cache")
    if shape.sinks:
        raise Unable("SDPA takes no attention sinks")
    k, v = contiguous_kv(s, shape, "k_cache"), contiguous_kv(s, shape, "v_cache")
    q = s["q"].transpose(1, 2)  # [B, Hq, S, D] view
    res = {}
    q_len, length = q.shape[2], k.shape[2]
    kwargs = dict(enable_gqa=True)
    if shape.window_left >= 0:  # an explicit boolean mask [S, L]: causal and the window
        kwargs["attn_mask"] = visible_mask(shape, q_len, length, q.device)
    elif mode == "extend" and q_len == length:
        kwargs["is_causal"] = True
    elif mode != "decode":  # verify, chunked prefill: the new tokens are the last q_len positions
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(q_len, length)

    def call():
        res["o"] = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return call, lambda: res["o"].transpose(1, 2)


_FLEX = {}


def flex_call(s, shape, mode):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if s["k_descale"] is not None:
        raise Unable("not run on fp8 caches")
    if shape.sinks:
        raise Unable("not run with attention sinks")
    if "fn" not in _FLEX:
        torch._dynamo.config.cache_size_limit = 64
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    k, v = contiguous_kv(s, shape, "k_cache"), contiguous_kv(s, shape, "v_cache")
    q = s["q"].transpose(1, 2).contiguous()
    q_len, length = q.shape[2], k.shape[2]
    block_mask = None
    offset, window = length - q_len, shape.window_left
    if window >= 0:
        def causal_window(b, h, qi, kj):
            return (kj <= qi + offset) & (kj >= qi + offset - window)
        block_mask = create_block_mask(causal_window, None, None, q_len, length, device=DEVICE)
    elif mode != "decode":
        def causal(b, h, qi, kj):
            return kj <= qi + offset
        block_mask = create_block_mask(causal, None, None, q_len, length, device=DEVICE)
    res = {}

    def call():
        res["o"] = _FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=True)
    return call, lambda: res["o"].transpose(1, 2)


_FI_WS = {}
# FlashInfer 0.7's plain wrappers take sinks= but their fa2/fa3 paths drop it: BatchDecodeWithPagedKVCacheWrapper
# (tensor cores) hands it to the batch-prefill module's paged_run, which forwards it only for trtllm-gen (sm100),
# and BatchPrefillWithPagedKVCacheWrapper likewise. Sinks on sm90 go through BatchAttentionWithAttentionSinkWrapper
# (the "AttentionSink" JIT variant of the prefill kernels, fa2 or fa3): the flashinfer-sink-* peers.
FI_NO_SINKS = {
    "decode": "the decode wrapper's fa2/fa3 paths ignore sinks= (only trtllm-gen, sm100, reads them); timed as "
              "flashinfer-sink-*",
    "prefill": "the prefill wrapper's fa2/fa3 paths ignore sinks= (only trtllm-gen, sm100, reads them); timed as "
               "flashinfer-sink-*",
}


def flashinfer_call(s, shape, mode, backend="fa2", sinks=False):
    """FlashInfer on the same problem: decode -> BatchDecodeWithPagedKVCacheWrapper (tensor cores), verify and
    extend -> BatchPrefillWithPagedKVCacheWrapper(backend); the window as plan(window_left=...). sinks=True:
    BatchAttentionWithAttentionSinkWrapper(backend) for every mode (q_len new tokens a request, causal), the
    sinks passed positionally to run (its JIT variant's extra tensor), with sm_scale. A sink shape without
    sinks=True raises Unable: the plain wrappers would drop the sinks silently."""
    if shape.sinks and not sinks:
        raise Unable(FI_NO_SINKS["decode" if mode == "decode" else "prefill"])
    import flashinfer

    if "ws" not in _FI_WS:
        _FI_WS["ws"] = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    ws = _FI_WS["ws"]
    hq, hkv, d, page, window = shape.hq, shape.hkv, shape.d, shape.page, shape.window_left
    batch, q_len = s["q"].shape[:2]
    pages_per = s["page_table"].shape[1]
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE) * pages_per
    indices = s["page_table"].reshape(-1).contiguous()
    last = torch.full((batch,), page, dtype=torch.int32, device=DEVICE)
    kv_dtype = s["k_cache"].dtype
    scales = {}
    if s["k_descale"] is not None:
        scales = dict(k_scale=float(s["k_descale"]), v_scale=float(s["v_descale"]))
    out = torch.empty_like(s["q"])
    if mode == "decode" and not sinks:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, hq, hkv, d, page, window_left=window, q_data_type=torch.bfloat16,
               kv_data_type=kv_dtype)
        q = s["q"][:, 0]
        o = out[:, 0]

        def call():
            w.run(q, (s["k_cache"], s["v_cache"]), out=o, **scales)
        return call, lambda: out
    qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE) * q_len
    q = s["q"].reshape(batch * q_len, hq, d)
    o = out.reshape(batch * q_len, hq, d)
    if sinks:
        w = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            ws, "NHD", backend=backend, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, head_dim_qk=d,
            head_dim_vo=d, window_left=window)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True, window_left=window,
               q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        sink, sm_scale = s["sinks"], d**-0.5

        def call():
            w.run(q, (s["k_cache"], s["v_cache"]), sink, sm_scale, out=o, **scales)
        return call, lambda: out
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True, window_left=window,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

    def call():
        w.run(q, (s["k_cache"], s["v_cache"]), out=o, **scales)
    return call, lambda: out


def peers_for(shape, mode, kv_dtype, wanted):
    """[(name, make(s, shape, mode))] of the wanted peers for this row. Sink rows keep the plain FlashInfer
    names (recorded n/a) and add flashinfer-sink-fa2/-fa3."""
    peers = []
    if "flashinfer" in wanted:
        if mode == "decode":
            peers.append(("flashinfer", lambda s, sh, m: flashinfer_call(s, sh, m)))
        else:
            peers.append(("flashinfer-fa2", lambda s, sh, m: flashinfer_call(s, sh, m, "fa2")))
            peers.append(("flashinfer-fa3", lambda s, sh, m: flashinfer_call(s, sh, m, "fa3")))
        if shape.sinks:
            for backend in ("fa2", "fa3"):
                peers.append((f"flashinfer-sink-{backend}",
                              lambda s, sh, m, backend=backend: flashinfer_call(s, sh, m, backend, sinks=True)))
    if kv_dtype != torch.float8_e4m3fn:
        if "sdpa" in wanted:
            peers.append(("sdpa", sdpa_call))
        if "flex" in wanted:
            peers.append(("flex", flex_call))
    return peers


# ----------------------------------------------------------------------------------------------------------
# the table

def row_metrics(shape, mode, batch, length, q_len, kv_dtype, us):
    """Decode/verify: TB/s over the bytes a call must touch: K and V of the keys some query sees (keys_seen:
    min(L, window_left + S) a request with a window, so min(L, window_left + 1) keys for decode; all L
    without), q read and out written. Extend: TFLOP/s of QK^T and PV over the visible (query, key) pairs: the
    causal triangle (as S*L - S^2/2 without a window), with a window the keys each query sees."""
    keys = keys_seen(shape, length, q_len)
    kv_bytes = batch * keys * shape.hkv * shape.d * 2 * (1 if kv_dtype == torch.float8_e4m3fn else 2)
    q_bytes = 2 * batch * q_len * shape.hq * shape.d * 2  # q read + out written
    if mode == "extend":
        if shape.window_left < 0:
            pairs = q_len * length - q_len * q_len / 2  # causal: the new tokens' triangle
        else:
            first = length - q_len  # position of the first new token; query i sees min(first + i + 1, w + 1)
            pairs = sum(min(first + i + 1, shape.window_left + 1) for i in range(q_len))
        flops = 4 * batch * shape.hq * shape.d * pairs
        return dict(tflops=flops / (us * 1e-6) / 1e12)
    return dict(tbps=(kv_bytes + q_bytes) / (us * 1e-6) / 1e12)


def run_row(row, peers, variants, bw, families=(), packed=False, packed_batch=0):
    label, shape, mode = row.label, row.shape, row.mode
    batch, length, q_len, kv_dtype = row.batch, row.length, row.q_len, row.kv_dtype
    sets = make_sets(shape, mode, batch, length, q_len, kv_dtype)
    impls = [("b12x", lambda s, sh, m: b12x_call(s, sh, m))] + peers_for(shape, mode, kv_dtype, peers)
    packed_too = packed and mode == "extend"  # the op, families and variants: b12x-packed-... cells beside theirs
    if packed_too:
        impls.append(("b12x-packed", lambda s, sh, m: b12x_packed_call(s, sh, m, pad_to=packed_batch)))
    for fam in families:
        impls.append((f"b12x-{fam}", lambda s, sh, m, fam=fam: b12x_call(s, sh, m, family=fam)))
        if packed_too:
            impls.append((f"b12x-packed-{fam}", lambda s, sh, m, fam=fam: b12x_packed_call(
                s, sh, m, pad_to=packed_batch, family=fam)))
    for fam, v in variants:
        if mode == "extend" and v[0]:
            continue
        name = f"{fam + '-' if fam else ''}v" + ":".join(map(str, v))
        impls.append((f"b12x-{name}", lambda s, sh, m, v=v, fam=fam: b12x_call(s, sh, m, v, family=fam)))
        if packed_too:
            impls.append((f"b12x-packed-{name}", lambda s, sh, m, v=v, fam=fam: b12x_packed_call(
                s, sh, m, pad_to=packed_batch, variant=v, family=fam)))
    refs = reference_slices(sets[0], shape, mode)
    result = dict(row=label, model=row.model, mode=mode, batch=batch, kv_len=length, q_len=q_len,
                  kv_dtype=str(kv_dtype).replace("torch.", ""), shape=shape.as_json(), sets=len(sets), impls={})
    for name, make in impls:
        entry = {}
        try:
            made = [make(s, shape, mode) for s in sets]
            calls, outs = [m[0] for m in made], [m[1] for m in made]
            calls[0]()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            entry["max_err"] = reference_check(refs, outs[0](), f"{label} {name}")
            if PROFILE and DEVICE == "cuda":
                with torch.cuda.nvtx.range(name):
                    calls[0]()
                torch.cuda.synchronize()
            if PROFILE:
                result["impls"][name] = entry
                continue
            us, method = time_graph(calls)
            entry.update(us=us, method=method, host_us=host_time(calls),
                         **row_metrics(shape, mode, batch, length, q_len, kv_dtype, us))
            if "tbps" in entry:
                entry["pct_copy_bw"] = 100 * entry["tbps"] / bw
        except Unable as e:
            entry = {"na": f"n/a: {e}"}
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["impls"][name] = entry
    ratio = versus_best_peer(result)
    parts = []
    for n, e in result["impls"].items():
        if "us" in e:
            m = f"{e['tflops']:.0f} TFLOP/s" if "tflops" in e else f"{e['tbps']:.2f} TB/s {e['pct_copy_bw']:.0f}%"
            parts.append(f"{n} {e['us']:.1f}us {m}" + (f" (host {e['host_us']:.0f}us)" if DEVICE == "cuda" else ""))
        elif "na" in e:
            parts.append(f"{n} {e['na']}")
        elif "error" in e:
            parts.append(f"{n} ERROR {e.get('error', '')[:120]}")
        else:
            parts.append(f"{n} checked (max err {e['max_err']:.2g})" + (", profiled" if DEVICE == "cuda" else ""))
    log(f"[{label}] " + "; ".join(parts) + ratio)
    del sets
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def versus_best_peer(result) -> str:
    """Sets a row's best_peer_us and speedup_vs_best_peer (the fastest timed peer's µs over b12x's: above 1,
    b12x is faster) where both were timed; returns the progress line's " | vs best peer xN.NN" ('' if not)."""
    peer_us = [e["us"] for n, e in result["impls"].items() if not n.startswith("b12x") and "us" in e]
    ours = result["impls"].get("b12x", {})
    if not (peer_us and "us" in ours):
        return ""
    result["best_peer_us"] = min(peer_us)
    result["speedup_vs_best_peer"] = min(peer_us) / ours["us"]
    return f" | vs best peer x{result['speedup_vs_best_peer']:.2f}"


def chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({n for r in results for n in r["impls"] if "us" in r["impls"][n] and not n.startswith("b12x-v")})
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.9), 5))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        xs, ys = [], []
        for j, r in enumerate(results):
            e, ours = r["impls"].get(n, {}), r["impls"].get("b12x", {})
            if "us" in e and "us" in ours:
                xs.append(j + i * width)
                ys.append(ours["us"] / e["us"])
        ax.bar(xs, ys, width, label=n)
    ax.set_xticks([j + 0.4 for j in range(len(results))])
    ax.set_xticklabels([r["row"] for r in results], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("speed relative to b12x (higher is faster)")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv) -> None:
    ap = argparse.ArgumentParser(prog="python -m b12x_inductor.bench kernels")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"row groups among {','.join(ROW_GROUPS)} (default "
                    f"{DEFAULT_ROWS}; nosinks: the gpt-oss rows without sinks)")
    ap.add_argument("--peers", default="sdpa,flex,flashinfer")
    ap.add_argument("--variants", default="", help="tuning: also time plan variants '[family:]splits:block_n:"
                    "stages:warps[:block_m],...' (0 keeps the plan's value; variants with splits skip extend rows)")
    ap.add_argument("--families", default="", help="also time these kernel families' plans, e.g. 'triton,cute' "
                    "(b12x-<family> rows; 'b12x' is always the plan select_plan picks)")
    ap.add_argument("--tag", default="", help="result files' suffix (default: the device's, e.g. h200, h100)")
    ap.add_argument("--flex-rows", default="", help="only these rows get FlexAttention (its compile is slow), "
                    "e.g. 'decode 8x8192,extend 1x16384'; default all")
    ap.add_argument("--models", default="", help=f"model rows of these models only, among {','.join(MODELS)} "
                    "(default all; FlashInfer's JIT builds follow the rows)")
    ap.add_argument("--warm-peers", action="store_true", help="JIT-build FlashInfer's modules first, then exit")
    ap.add_argument("--head-dim", type=int, default=DEFAULT_SHAPE.d, help="D of the default rows (default 128; "
                    "model rows keep their model's)")
    ap.add_argument("--page-size", type=int, default=DEFAULT_SHAPE.page, help="keys per page of every row "
                    "(default 16; L must be a multiple)")
    ap.add_argument("--extend-rows", default="", help="default extend rows 'BxL[:S],...' instead of the default "
                    "(S new tokens on L keys; default S = L)")
    ap.add_argument("--profile", action="store_true", help="no timing: each implementation runs once more "
                    "inside an NVTX range named after it (for ncu --nvtx --nvtx-include 'b12x-cute/')")
    ap.add_argument("--packed", action="store_true", help="extend rows also time b12x-packed: the op with q "
                    "packed [B x S, Hq, D] and cu_seqlens_q, as the serving engine calls it (and b12x-packed-<family> "
                    "and b12x-packed-<variant> beside --families' and --variants' rows)")
    ap.add_argument("--packed-batch", type=int, default=0, help="implies --packed: b12x-packed's cu_seqlens_q, "
                    "page table and lengths padded to this many requests (the serving engine's max_batch)")
    ap.add_argument("--sizes", default="", help="dry run or sweep: B x L overrides, e.g. 2x64 or "
                    "128x1024,160x1024 (all rows at each size)")
    args = ap.parse_args(argv)
    globals()["PROFILE"] = args.profile
    default_shape = dataclasses.replace(DEFAULT_SHAPE, d=args.head_dim, page=args.page_size)
    extend_rows = None
    if args.extend_rows:
        extend_rows = []
        for x in args.extend_rows.split(","):
            size, _, new = x.partition(":")
            b, n = (int(y) for y in size.split("x"))
            extend_rows.append((b, n, int(new) if new else n))
    try:
        sizes = parse_sizes(args.sizes) or None
        todo = build_rows(args.rows.split(","), default_shape, extend_rows, sizes, page=args.page_size,
                          models=[m for m in args.models.split(",") if m])
    except ValueError as e:
        sys.exit(f"b12x_inductor.bench kernels: {e}")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("b12x_inductor.bench kernels: needs a CUDA GPU")
    peers = set(p for p in args.peers.split(",") if p)
    if "flashinfer" in peers:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            log(f"flashinfer not importable ({type(e).__name__}: {e}); skipped")
            peers.discard("flashinfer")
    sweep = []
    for x in (x for x in args.variants.split(",") if x):
        fam, rest = x.split(":", 1) if not x.split(":")[0].isdigit() else ("", x)
        sweep.append((fam, tuple(int(y) for y in rest.split(":"))))
    families = [f for f in args.families.split(",") if f]
    versions = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                    date=datetime.datetime.now(datetime.timezone.utc)
                    .strftime("%Y-%m-%d %H:%M UTC"))
    tag = args.tag or device_tag(versions["device"])
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if "flashinfer" in peers:
        import flashinfer

        versions["flashinfer"] = flashinfer.__version__
    if "flashinfer" in peers and args.warm_peers:
        warm_peers(todo)
    if args.warm_peers:
        return
    bw, bw_all = copy_bandwidth() if DEVICE == "cuda" else (float("nan"), {})
    log(f"versions {versions}; copy bandwidth {bw:.2f} TB/s {bw_all}")
    results = []
    t0 = time.time()
    flex_rows = set(r.strip() for r in args.flex_rows.split(",") if r.strip())
    for row in todo:
        row_peers = peers
        if flex_rows and row.label not in flex_rows:
            row_peers = peers - {"flex"}
        results.append(run_row(row, row_peers, sweep, bw, families, args.packed or args.packed_batch > 0,
                               args.packed_batch))
    os.makedirs(args.out, exist_ok=True)
    doc = dict(versions=versions, copy_bandwidth_tbps=bw, copy_bandwidth_by_method=bw_all, argv=list(argv),
               shape=dict(hq=default_shape.hq, hkv=default_shape.hkv, d=default_shape.d,
                          page_size=default_shape.page), rows=results, seconds=time.time() - t0)
    with open(os.path.join(args.out, f"kernels_{tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    try:
        chart(results, os.path.join(args.out, f"kernels_{tag}.png"))
    except Exception as e:
        log(f"chart skipped: {type(e).__name__}: {e}")
    log(f"wrote {args.out}/kernels_{tag}.json ({time.time() - t0:.0f} s)")
