"""The kernel benchmark (default suite): `python -m b12x_inductor.bench [kernels] [options]`.

Rows (Hq=32, Hkv=8, D=128, page 16, bf16, random page order): decode B x L in 1x32768, 8x8192, 32x4096,
64x2048, 128x1024, 16x16384; verify S=4 in 8x8192, 32x4096, 64x2048; extend causal (q_len = kv_len) in
4x4096, 1x16384; the decode rows again with a float8_e4m3fn cache.

Side by side in one process: b12x (the public op, the plan select_plan picks), SDPA over a contiguous
exact-length cache, FlexAttention (compiled, same contiguous cache) and FlashInfer (decode wrapper with
tensor cores; prefill wrapper with the fa2 and fa3 backends), whichever import. Each result is checked
against the reference (on two requests, or for extend the first and last query rows of one) before it is
timed. Timing: one CUDA graph replays the call over rotating input sets that together exceed the 60 MB
L2, CUDA events, the median of the replays. The device copy bandwidth is measured in the same run.
Prints a progress line per row, then writes JSON and a PNG chart.

Options: --out DIR (default benchmarks/results), --rows decode,verify,extend,fp8 (default all), --peers
sdpa,flex,flashinfer (default all importable), --families triton,cute (each family's own plan side by side),
--variants (tuning: other plan constants), --head-dim (D of every row, default 128), --page-size (keys per
page, default 16), --extend-rows (other extend rows, 'BxL[:S],...': S new tokens on L keys, a chunked prefill
when S < L), --profile (no timing: after its reference check each implementation runs once more inside an NVTX
range named after it, for
`ncu --nvtx --nvtx-include "b12x-cute/" python -m b12x_inductor.bench ... --profile`),
--warm-peers (JIT-build FlashInfer's modules and exit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

HQ, HKV, D, PAGE = 32, 8, 128, 16
L2_BYTES = 60 * 2**20
PROFILE = False  # --profile: one call per implementation in an NVTX range instead of timing
DEVICE = os.environ.get("B12X_BENCH_DEVICE", "cuda")  # "cpu": a dry run of the harness (wall-clock timing)
DECODE_ROWS = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 1024), (16, 16384)]
VERIFY_ROWS = [(8, 8192), (32, 4096), (64, 2048)]
EXTEND_ROWS = [(4, 4096), (1, 16384)]


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------------
# inputs

def make_set(mode, batch, length, q_len, kv_dtype, seed):
    """One input set: paged caches in random page order, q, and a contiguous exact-length copy for peers."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pages_per = length // PAGE
    num_pages = batch * pages_per
    kv_shape = (num_pages, PAGE, HKV, D)
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
    s["q"] = torch.randn(batch, q_len, HQ, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    s["out"] = torch.empty_like(s["q"])
    return s


def contiguous_kv(s, name):
    """[B, Hkv, L, D] exact-length copy of a paged cache (what SDPA/Flex read)."""
    c = s[name][s["page_table"].long()]  # [B, P, page, Hkv, D]
    b, p = c.shape[:2]
    return c.reshape(b, p * PAGE, HKV, D).transpose(1, 2).contiguous()


def reference_slices(s, mode):
    """The reference on a slice of the problem: [(request, query rows, fp32 reference out)]: two requests,
    or for extend the first and last 4 query rows of request 0."""
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
        pages = s["page_table"][b, : -(-length // PAGE)].long()
        sub = dict(q=s["q"][b:b + 1, rows], k_cache=s["k_cache"][pages], v_cache=s["v_cache"][pages],
                   page_table=torch.arange(len(pages), dtype=torch.int32, device=DEVICE)[None],
                   cache_seqlens=torch.tensor([length], dtype=torch.int32, device=DEVICE),
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

def time_graph(calls, target_ms=3.0, replays=15):
    """Median microseconds per call: the calls (one per rotating input set) captured in one CUDA graph,
    repeated to about target_ms per replay, timed with events. Falls back to eager timing if capture fails."""
    for c in calls:
        c()
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls), "wall (cpu dry run)"
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end) / len(calls), 1e-3)
    inner = max(1, min(200, int(target_ms / (est_ms * len(calls)))))
    method = "graph"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                for c in calls:
                    c()
        run = graph.replay
        graph.replay()
    except Exception as e:  # a peer that cannot be captured is timed eagerly (and says so)
        method = f"eager ({type(e).__name__})"
        torch.cuda.synchronize()

        def run():
            for _ in range(inner):
                for c in calls:
                    c()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (inner * len(calls)))
    return statistics.median(times), method


def warm_peers():
    """Builds FlashInfer's JIT modules for the table's configurations on tiny inputs (about 100 s once)."""
    t0 = time.time()
    for mode, q_len, kv_dtype in (("decode", 1, torch.bfloat16), ("decode", 1, torch.float8_e4m3fn),
                                  ("verify", 4, torch.bfloat16)):
        s = make_set(mode, 1, 256, q_len, kv_dtype, seed=1)
        for name, make in peers_for(mode, kv_dtype, {"flashinfer"}):
            try:
                make(s, mode)[0]()
                torch.cuda.synchronize()
                log(f"warm {name} {mode} {kv_dtype}: ok ({time.time() - t0:.0f} s)")
            except Exception as e:
                log(f"warm {name} {mode} {kv_dtype}: {type(e).__name__}: {str(e)[:200]}")


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
# implementations: each returns a zero-argument callable that writes its output for one input set

def b12x_call(s, mode, variant=None, family=None):
    import b12x_inductor as b12x

    if variant is None and family is None:
        def call():
            b12x.paged_attention(s["q"], s["k_cache"], s["v_cache"], s["page_table"], s["cache_seqlens"],
                                 k_descale=s["k_descale"], v_descale=s["v_descale"], out=s["out"])
        return call, lambda: s["out"]
    # one kernel family's plan (family_plan), with (num_splits, block_n, num_stages, num_warps, block_m)
    # replaced where the variant gives a nonzero value
    from b12x_inductor import kernels, validate
    from b12x_inductor.plan import family_plan, select_plan

    problem = validate.check_paged_attention(
        s["q"], s["k_cache"], s["v_cache"], s["page_table"], s["cache_seqlens"], None, kv_layout="NHD",
        causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0,
        k_descale=s["k_descale"], v_descale=s["v_descale"], out=None)
    family = family or select_plan(problem).family
    if family == "cute" and not _cute_supports(problem):
        return None
    fields = dict(zip(("num_splits", "block_n", "num_stages", "num_warps", "block_m"), variant or ()))
    plan = family_plan(problem, family, **{k: v for k, v in fields.items() if v})
    out = torch.empty_like(s["q"])
    the_call = kernels.Call(
        q=s["q"], k_cache=s["k_cache"], v_cache=s["v_cache"], page_table=s["page_table"],
        cache_seqlens=s["cache_seqlens"], cu_seqlens_q=None, kv_start=None, sinks=None, k_descale=s["k_descale"],
        v_descale=s["v_descale"], key_mask=None, out=out, lse=torch.empty(s["q"].shape[:-1], dtype=torch.float32, device=DEVICE),
        scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=DEVICE),
        options=kernels.Options(kv_layout="NHD", causal=True, scale=D**-0.5, window_left=-1, softcap=0.0),
        plan=plan)

    def call():
        kernels.run(the_call)
    return call, lambda: out


def _cute_supports(problem):
    from b12x_inductor.kernels import cute

    return cute.available() and cute.supports(problem)


def sdpa_call(s, mode):
    import torch.nn.functional as F

    if s["k_descale"] is not None:
        return None
    k, v = contiguous_kv(s, "k_cache"), contiguous_kv(s, "v_cache")
    q = s["q"].transpose(1, 2)  # [B, Hq, S, D] view
    res = {}
    q_len, length = q.shape[2], k.shape[2]
    kwargs = dict(enable_gqa=True)
    if mode == "extend" and q_len == length:
        kwargs["is_causal"] = True
    elif mode != "decode":  # verify, chunked prefill: the new tokens are the last q_len positions
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(q_len, length)

    def call():
        res["o"] = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return call, lambda: res["o"].transpose(1, 2)


_FLEX = {}


def flex_call(s, mode):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if s["k_descale"] is not None:
        return None
    if "fn" not in _FLEX:
        torch._dynamo.config.cache_size_limit = 64
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    k, v = contiguous_kv(s, "k_cache"), contiguous_kv(s, "v_cache")
    q = s["q"].transpose(1, 2).contiguous()
    q_len, length = q.shape[2], k.shape[2]
    block_mask = None
    if mode != "decode":
        offset = length - q_len

        def causal(b, h, qi, kj):
            return kj <= qi + offset
        block_mask = create_block_mask(causal, None, None, q_len, length, device=DEVICE)
    res = {}

    def call():
        res["o"] = _FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=True)
    return call, lambda: res["o"].transpose(1, 2)


_FI_WS = {}


def flashinfer_call(s, mode, backend="fa2"):
    import flashinfer

    if "ws" not in _FI_WS:
        _FI_WS["ws"] = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
    ws = _FI_WS["ws"]
    batch, q_len = s["q"].shape[:2]
    pages_per = s["page_table"].shape[1]
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE) * pages_per
    indices = s["page_table"].reshape(-1).contiguous()
    last = torch.full((batch,), PAGE, dtype=torch.int32, device=DEVICE)
    kv_dtype = s["k_cache"].dtype
    scales = {}
    if s["k_descale"] is not None:
        scales = dict(k_scale=float(s["k_descale"]), v_scale=float(s["v_descale"]))
    out = torch.empty_like(s["q"])
    if mode == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        q = s["q"][:, 0]
        o = out[:, 0]

        def call():
            w.run(q, (s["k_cache"], s["v_cache"]), out=o, **scales)
        return call, lambda: out
    qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=DEVICE) * q_len
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=torch.bfloat16,
           kv_data_type=kv_dtype)
    q = s["q"].reshape(batch * q_len, HQ, D)
    o = out.reshape(batch * q_len, HQ, D)

    def call():
        w.run(q, (s["k_cache"], s["v_cache"]), out=o, **scales)
    return call, lambda: out


def peers_for(mode, kv_dtype, wanted):
    peers = []
    if "flashinfer" in wanted:
        if mode == "decode":
            peers.append(("flashinfer", lambda s, m: flashinfer_call(s, m)))
        else:
            peers.append(("flashinfer-fa2", lambda s, m: flashinfer_call(s, m, "fa2")))
            peers.append(("flashinfer-fa3", lambda s, m: flashinfer_call(s, m, "fa3")))
    if kv_dtype != torch.float8_e4m3fn:
        if "sdpa" in wanted:
            peers.append(("sdpa", sdpa_call))
        if "flex" in wanted:
            peers.append(("flex", flex_call))
    return peers


# ----------------------------------------------------------------------------------------------------------
# the table

def row_metrics(mode, batch, length, q_len, kv_dtype, us):
    kv_bytes = batch * length * HKV * D * 2 * (1 if kv_dtype == torch.float8_e4m3fn else 2)
    q_bytes = 2 * batch * q_len * HQ * D * 2  # q read + out written
    if mode == "extend":
        flops = 4 * batch * HQ * D * (q_len * length - q_len * q_len / 2)  # causal: the new tokens' triangle
        return dict(tflops=flops / (us * 1e-6) / 1e12)
    return dict(tbps=(kv_bytes + q_bytes) / (us * 1e-6) / 1e12)


def row_label(mode, batch, length, q_len, kv_dtype):
    """'decode 8x8192', 'decode-fp8 8x8192', 'extend 1x8192:1024' (new tokens when fewer than the keys),
    with ' D64' when the head dim is not 128."""
    label = f"{mode}{'-fp8' if kv_dtype == torch.float8_e4m3fn else ''} {batch}x{length}"
    if mode == "extend" and q_len != length:
        label += f":{q_len}"
    return label + (f" D{D}" if D != 128 else "")


def run_row(mode, batch, length, q_len, kv_dtype, peers, variants, bw, families=()):
    label = row_label(mode, batch, length, q_len, kv_dtype)
    set_bytes = batch * length * HKV * D * 2 * kv_dtype.itemsize
    n_sets = max(2, math.ceil(2 * L2_BYTES / set_bytes))
    sets = [make_set(mode, batch, length, q_len, kv_dtype, seed=17 * i + batch) for i in range(n_sets)]
    impls = [("b12x", lambda s, m: b12x_call(s, m))] + peers_for(mode, kv_dtype, peers)
    for fam in families:
        impls.append((f"b12x-{fam}", lambda s, m, fam=fam: b12x_call(s, m, family=fam)))
    for fam, v in variants:
        if mode == "extend" and v[0]:
            continue
        name = f"b12x-{fam + '-' if fam else ''}v" + ":".join(map(str, v))
        impls.append((name, lambda s, m, v=v, fam=fam: b12x_call(s, m, v, family=fam)))
    refs = reference_slices(sets[0], mode)
    result = dict(row=label, mode=mode, batch=batch, kv_len=length, q_len=q_len,
                  kv_dtype=str(kv_dtype).replace("torch.", ""), sets=n_sets, impls={})
    for name, make in impls:
        entry = {}
        try:
            calls, outs = [], []
            for s in sets:
                made = make(s, mode)
                if made is None:
                    break
                calls.append(made[0])
                outs.append(made[1])
            if not calls:
                continue
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
            entry.update(us=us, method=method, **row_metrics(mode, batch, length, q_len, kv_dtype, us))
            if "tbps" in entry:
                entry["pct_copy_bw"] = 100 * entry["tbps"] / bw
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["impls"][name] = entry
    peer_us = [e["us"] for n, e in result["impls"].items() if not n.startswith("b12x") and "us" in e]
    ours = result["impls"].get("b12x", {})
    if peer_us and "us" in ours:
        result["best_peer_us"] = min(peer_us)
        result["speedup_vs_best_peer"] = min(peer_us) / ours["us"]
    parts = []
    for n, e in result["impls"].items():
        if "us" in e:
            m = f"{e['tflops']:.0f} TFLOP/s" if "tflops" in e else f"{e['tbps']:.2f} TB/s {e['pct_copy_bw']:.0f}%"
            parts.append(f"{n} {e['us']:.1f}us {m}")
        elif "error" in e:
            parts.append(f"{n} ERROR {e.get('error', '')[:120]}")
        else:
            parts.append(f"{n} checked (max err {e['max_err']:.2g})" + (", profiled" if DEVICE == "cuda" else ""))
    ratio = f" | vs best peer x{result['speedup_vs_best_peer']:.2f}" if "speedup_vs_best_peer" in result else ""
    log(f"[{label}] " + "; ".join(parts) + ratio)
    del sets
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


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
    ap.add_argument("--rows", default="decode,verify,extend,fp8")
    ap.add_argument("--peers", default="sdpa,flex,flashinfer")
    ap.add_argument("--variants", default="", help="tuning: also time plan variants '[family:]splits:block_n:"
                    "stages:warps[:block_m],...' (0 keeps the plan's value; variants with splits skip extend rows)")
    ap.add_argument("--families", default="", help="also time these kernel families' plans, e.g. 'triton,cute' "
                    "(b12x-<family> rows; 'b12x' is always the plan select_plan picks)")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--flex-rows", default="", help="only these rows get FlexAttention (its compile is slow), "
                    "e.g. 'decode 8x8192,extend 1x16384'; default all")
    ap.add_argument("--warm-peers", action="store_true", help="JIT-build FlashInfer's modules first, then exit")
    ap.add_argument("--head-dim", type=int, default=D, help="D of every row (default 128)")
    ap.add_argument("--page-size", type=int, default=PAGE, help="keys per page of every row (default 16; L must "
                    "be a multiple)")
    ap.add_argument("--extend-rows", default="", help="extend rows 'BxL[:S],...' instead of the default "
                    "(S new tokens on L keys; default S = L)")
    ap.add_argument("--profile", action="store_true", help="no timing: each implementation runs once more "
                    "inside an NVTX range named after it (for ncu --nvtx --nvtx-include 'b12x-cute/')")
    ap.add_argument("--sizes", default="", help="dry run: B x L overrides, e.g. 2x64 (all rows that size)")
    args = ap.parse_args(argv)
    globals()["D"] = args.head_dim
    globals()["PAGE"] = args.page_size
    globals()["PROFILE"] = args.profile
    extend_rows = [(b, n, n) for b, n in EXTEND_ROWS]
    if args.extend_rows:
        extend_rows = []
        for x in args.extend_rows.split(","):
            size, _, new = x.partition(":")
            b, n = (int(y) for y in size.split("x"))
            extend_rows.append((b, n, int(new) if new else n))
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
    rows = set(args.rows.split(","))
    versions = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                    date=datetime.datetime.now(datetime.timezone.utc)
                    .strftime("%Y-%m-%d %H:%M UTC"))
    import triton

    versions["triton"] = triton.__version__
    if "flashinfer" in peers:
        import flashinfer

        versions["flashinfer"] = flashinfer.__version__
    if "flashinfer" in peers and args.warm_peers:
        warm_peers()
    if args.warm_peers:
        return
    bw, bw_all = copy_bandwidth() if DEVICE == "cuda" else (float("nan"), {})
    log(f"versions {versions}; copy bandwidth {bw:.2f} TB/s {bw_all}")
    results = []
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    todo = []
    if "decode" in rows:
        todo += [("decode", b, n, 1, bf16) for b, n in DECODE_ROWS]
    if "verify" in rows:
        todo += [("verify", b, n, 4, bf16) for b, n in VERIFY_ROWS]
    if "extend" in rows:
        todo += [("extend", b, n, q, bf16) for b, n, q in extend_rows]
    if "fp8" in rows:
        todo += [("decode", b, n, 1, fp8) for b, n in DECODE_ROWS]
    if args.sizes:
        b0, n0 = (int(x) for x in args.sizes.split("x"))
        todo = [(m, b0, n0, s if m != "extend" else n0, dt) for m, b, n, s, dt in todo]
    t0 = time.time()
    flex_rows = set(r.strip() for r in args.flex_rows.split(",") if r.strip())
    for mode, b, n, s, dt in todo:
        row_peers = peers
        label = row_label(mode, b, n, s, dt)
        if flex_rows and label not in flex_rows:
            row_peers = peers - {"flex"}
        results.append(run_row(mode, b, n, s, dt, row_peers, sweep, bw, families))
    os.makedirs(args.out, exist_ok=True)
    doc = dict(versions=versions, copy_bandwidth_tbps=bw, copy_bandwidth_by_method=bw_all, argv=list(argv),
               shape=dict(hq=HQ, hkv=HKV, d=D, page_size=PAGE), rows=results, seconds=time.time() - t0)
    with open(os.path.join(args.out, f"kernels_{args.tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    try:
        chart(results, os.path.join(args.out, f"kernels_{args.tag}.png"))
    except Exception as e:
        log(f"chart skipped: {type(e).__name__}: {e}")
    log(f"wrote {args.out}/kernels_{args.tag}.json ({time.time() - t0:.0f} s)")
