"""The MLA benchmark: `python -m b12x_inductor.bench mla [options]`.

Absorbed multi-head latent attention (DeepSeek-V3: kv_lora_rank 512, rope 64) over one paged latent cache
[num_pages, page_size, 576] (vLLM's layout), pages in random order, bf16 q, scale 192 ** -0.5 (the 192-dim
qk head's softmax scale).

Rows, for each H in --heads (default 128, 16): decode B x L in 1x32768, 32x4096, 64x4096, 128x2048; verify
S=4 (causal) in 32x4096; and decode with a float8_e4m3fn cache (descale 0.5) in 32x4096, 64x4096, 128x2048 at
H=16 (at every H of --heads when 16 is not among them).

Side by side in one process: b12x (`b12x_inductor.mla_attention`, the plan select_plan picks; q_nope and
q_pe apart, which the kernels read in place) and FlashInfer's `flashinfer.mla.BatchMLAPagedAttentionWrapper` with the
"fa2" and "fa3" backends (q_nope and q_pe apart, as it takes them; ckv = kv_cache[..., :512] and kpe =
kv_cache[..., 512:], views of the one latent cache: no copy; should FlashInfer refuse the views or get them
wrong, it runs on contiguous separate ckv/kpe copies, its own layout, and the JSON cell says so;
fp8 through its per-tensor ckv_scale / kpe_scale, the descale). FlashInfer is imported lazily and skipped
with the reason logged when it does not import. Each result is checked against
`kernels.reference.paged_attention_reference` (q = cat(q_nope, q_pe), k = the 576 view, v = its first 512:
the first and the last request, at most 8 of the heads) before it is timed; a failed check is the cell's
error, never timed. Timing as bench/kernels.py (its time_graph and copy_bandwidth): one CUDA graph replays the
call over rotating input sets that together exceed twice the L2, CUDA events, the median of the replays;
the device copy bandwidth is measured in the same run. Metrics: FLOPs 2 x H x S x L x (576 + 512) a request
(q.k over 576 columns, p.v over 512; verify counts all S x L pairs), bytes the latent cache read (B x L x
576 x itemsize) plus q (576 a head and token, bf16) read and out (512) written; TFLOP/s, TB/s and the
percentage of the copy bandwidth; host_us, an eager call's host time (bench/kernels.py's host_time). The b12x
cell also names its plan ("family splits:block_n:stages w<warps>
m<block_m>", `plan_label`). Prints a progress line per row, then a markdown table, and writes JSON (versions,
copy bandwidth, argv, rows) to DIR/mla_<tag>.json.

Options: --heads (comma list, default 128,16), --rows decode,verify,fp8 (default all), --page-size (keys per
page, default 64; L must be a multiple), --peers flashinfer (default; '' for b12x alone), --out DIR (default
benchmarks/results), --tag (default the device's: h200, h100, ...), --sizes BxL[,BxL...] (a dry run or a
sweep: every row at each size, duplicates dropped, e.g. 2x128), --variants (tuning:
'[family:]splits:block_n:stages:warps[:block_m][:vk],...' (vk: V's tile
taken from K's, plan.v_from_k), family default
triton, 0 keeps the plan's value: that family's plan through plan.family_plan, as bench/kernels.py's
b12x_call, on q_nope and q_pe as mla_attention passes them, without its checks), --warm-peers (JIT-build FlashInfer's MLA modules
on tiny inputs, then exit). B12X_BENCH_DEVICE=cpu runs the harness on the CPU (wall-clock timing, two input
sets, no FlashInfer): a dry run.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import sys
import time

import torch

from b12x_inductor.bench import device_tag, kernels, parse_sizes
from b12x_inductor.bench.kernels import L2_BYTES, copy_bandwidth, host_time, log, reference_check, time_graph

RANK, ROPE = 512, 64  # kv_lora_rank (the values, out's width) and the rope key: 576 values a token
WIDTH = RANK + ROPE
SCALE = 192**-0.5  # DeepSeek-V3's qk head dim (128 no-rope + 64 rope); the absorbed q.k equals that product
PAGE = 64
HEADS = (128, 16)
FP8_HEADS = 16
DECODE_ROWS = [(1, 32768), (32, 4096), (64, 4096), (128, 2048)]
VERIFY_ROWS = [(32, 4096)]
VERIFY_LEN = 4
FP8_ROWS = [(32, 4096), (64, 4096), (128, 2048)]
FP8_DESCALE = 0.5
CHECK_HEADS = 8  # the reference runs on at most this many of the heads (every H // 8-th)
PEER_COLUMNS = ("flashinfer-fa2", "flashinfer-fa3")


class Unsupported(Exception):
    """An implementation that cannot express the row (its cell is "n/a" with this reason)."""


def _device():
    return kernels.DEVICE  # read at call time: tests set kernels.DEVICE = "cpu"


def _sync():
    if _device() == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------
# inputs

def make_set(batch, length, q_len, heads, kv_dtype, seed):
    """One input set: the latent cache [num_pages, PAGE, 576] with the pages of request b in random order
    (page_table [B, L / PAGE] int32), full lengths, q_nope [B, S, H, 512] and q_pe [B, S, H, 64] bf16."""
    dev = _device()
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages_per = length // PAGE
    num_pages = batch * pages_per
    shape = (num_pages, PAGE, WIDTH)
    s = dict(heads=heads)
    if kv_dtype == torch.float8_e4m3fn:
        s["kv_cache"] = (torch.randn(shape, device=dev, generator=gen) * 2).to(kv_dtype)
        s["k_descale"] = torch.tensor(FP8_DESCALE, device=dev)
    else:
        s["kv_cache"] = torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16)
        s["k_descale"] = None
    perm = torch.randperm(num_pages, device=dev, generator=gen).int()
    s["page_table"] = perm.reshape(batch, pages_per)
    s["cache_seqlens"] = torch.full((batch,), length, dtype=torch.int32, device=dev)
    s["q_nope"] = torch.randn(batch, q_len, heads, RANK, device=dev, generator=gen, dtype=torch.bfloat16)
    s["q_pe"] = torch.randn(batch, q_len, heads, ROPE, device=dev, generator=gen, dtype=torch.bfloat16)
    return s


def check_heads(heads):
    """The heads the reference runs on: every (H // 8)-th, at most 8 (MQA: each head is independent)."""
    return slice(0, heads, max(1, heads // CHECK_HEADS))


def reference_slices(s):
    """The reference on a slice of the problem: [(request, query rows, fp32 out [1, S, h, 512])] for the
    first and the last request, on the heads check_heads picks."""
    from b12x_inductor.kernels.reference import paged_attention_reference

    dev = _device()
    batch, q_len, heads = s["q_nope"].shape[:3]
    sel = check_heads(heads)
    refs = []
    for b in sorted({0, batch - 1}):
        length = int(s["cache_seqlens"][b])
        pages = s["page_table"][b, : -(-length // PAGE)].long()
        k_cache = s["kv_cache"][pages].unsqueeze(2)  # [P, PAGE, 1, 576]: one KV head
        q = torch.cat([s["q_nope"][b:b + 1, :, sel], s["q_pe"][b:b + 1, :, sel]], dim=-1)
        ref = paged_attention_reference(
            q, k_cache, k_cache[..., :RANK], torch.arange(len(pages), dtype=torch.int32, device=dev)[None],
            torch.tensor([length], dtype=torch.int32, device=dev), causal=True, scale=SCALE,
            k_descale=s["k_descale"], v_descale=s["k_descale"])[0]
        refs.append((b, slice(0, q_len), ref))
    return refs


def check(refs, out, what):
    """Max abs error of `out` [B, S, H, 512] on the reference's heads against the reference slices
    (kernels.reference_check's tolerance); raises AssertionError past it."""
    return reference_check(refs, out[:, :, check_heads(out.shape[2])], what)


def _poisoned_out(s):
    """A fresh output [B, S, H, 512] full of NaN: an implementation that leaves it unwritten fails the check."""
    batch, q_len, heads = s["q_nope"].shape[:3]
    return torch.full((batch, q_len, heads, RANK), float("nan"), dtype=torch.bfloat16, device=_device())


# ----------------------------------------------------------------------------------------------------------
# implementations: each returns (a zero-argument callable that writes its output for one input set, the
# output [B, S, H, 512])

def b12x_call(s):
    import b12x_inductor as b12x

    out = _poisoned_out(s)

    def call():
        b12x.mla_attention(s["q_nope"], s["q_pe"], s["kv_cache"], s["page_table"], s["cache_seqlens"],
                           scale=SCALE, k_descale=s["k_descale"], out=out)
    return call, out


def _problem(s):
    """(q_nope, q_pe, the cache as one K head [pages, PAGE, 1, 576], V its first 512 columns, the Problem) of
    an input set, the views mla_attention builds."""
    from b12x_inductor import validate

    q, q_pe = s["q_nope"], s["q_pe"]
    k_cache = s["kv_cache"].unsqueeze(2)
    v_cache = k_cache[..., :RANK]
    problem = validate.check_paged_attention(
        q, k_cache, v_cache, s["page_table"], s["cache_seqlens"], None, kv_layout="NHD", causal=True,
        scale=SCALE, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=s["k_descale"],
        v_descale=s["k_descale"], q_pe=q_pe, out=None)
    return q, q_pe, k_cache, v_cache, problem


def plan_label(s) -> str:
    """The plan select_plan gives the set's problem, as "family splits:block_n:stages w<warps> m<block_m>"
    (" vk": V's tile taken from K's)."""
    from b12x_inductor.plan import select_plan

    p = select_plan(_problem(s)[-1])
    return (f"{p.family} {p.num_splits}:{p.block_n}:{p.num_stages} w{p.num_warps} m{p.block_m}"
            + (" vk" if p.v_from_k else ""))


def b12x_variant_call(s, family, variant):
    """One family's plan (plan.family_plan) with (num_splits, block_n, num_stages, num_warps, block_m)
    replaced where the variant gives a nonzero value, and a last field "vk" for v_from_k (V's tile taken from
    K's), as kernels.b12x_call runs its variants, on the views mla_attention builds (q_nope and q_pe apart, the
    one-head cache views: the timed call is the kernels alone, without mla_attention's checks)."""
    from b12x_inductor import kernels as kfam
    from b12x_inductor.plan import family_plan

    q, q_pe, k_cache, v_cache, problem = _problem(s)
    v_from_k = bool(variant) and variant[-1] == "vk"
    fields = dict(zip(("num_splits", "block_n", "num_stages", "num_warps", "block_m"),
                      variant[:-1] if v_from_k else variant))
    tiles = {k: v for k, v in fields.items() if v}
    if v_from_k:
        tiles["v_from_k"] = True
    plan = family_plan(problem, family, **tiles)
    out = _poisoned_out(s)
    the_call = kfam.Call(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=s["page_table"], cache_seqlens=s["cache_seqlens"],
        cu_seqlens_q=None, kv_start=None, sinks=None, k_descale=s["k_descale"], v_descale=s["k_descale"],
        key_mask=None, q_pe=q_pe, out=out, lse=torch.empty(q.shape[:-1], dtype=torch.float32, device=_device()),
        scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=_device()),
        options=kfam.Options(kv_layout="NHD", causal=True, scale=SCALE, window_left=-1, softcap=0.0),
        plan=plan)

    def call():
        kfam.run(the_call)
    return call, out


_FI_WS = {}


def flashinfer_call(s, backend, separate=False):
    """FlashInfer's MLA wrapper (backend "fa2" or "fa3") planned for this set: CSR metadata (qo_indptr in
    tokens, kv_indptr in pages, kv_indices the page table's rows, kv_len in tokens), causal for S > 1.
    separate=False: ckv and kpe are views of the 576 cache; True: contiguous copies of their own."""
    from flashinfer import mla as fi_mla

    dev = _device()
    if "ws" not in _FI_WS:
        _FI_WS["ws"] = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
    batch, q_len, heads = s["q_nope"].shape[:3]
    pages_per = s["page_table"].shape[1]
    qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * q_len
    kv_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * pages_per
    kv_indices = s["page_table"].reshape(-1).contiguous()
    kv_len = s["cache_seqlens"]
    kv_dtype = s["kv_cache"].dtype
    fp8 = kv_dtype == torch.float8_e4m3fn
    causal = q_len > 1
    ckv, kpe = s["kv_cache"][..., :RANK], s["kv_cache"][..., RANK:]
    if separate:
        ckv, kpe = ckv.contiguous(), kpe.contiguous()
    q_nope = s["q_nope"].reshape(batch * q_len, heads, RANK)
    q_pe = s["q_pe"].reshape(batch * q_len, heads, ROPE)
    out = _poisoned_out(s)
    o = out.view(batch * q_len, heads, RANK)
    w = fi_mla.BatchMLAPagedAttentionWrapper(_FI_WS["ws"], backend=backend)
    common = dict(num_heads=heads, head_dim_ckv=RANK, head_dim_kpe=ROPE, page_size=PAGE, causal=causal,
                  sm_scale=SCALE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    scales = {}
    if fp8:
        if "ckv_scale" not in inspect.signature(w.run).parameters:
            raise Unsupported(f"flashinfer {_fi_version()}: BatchMLAPagedAttentionWrapper.run takes no KV scale "
                              "(no fp8 path)")
        descale = float(s["k_descale"])
        scales = dict(ckv_scale=descale, kpe_scale=descale)  # dequantized value = fp8 value x scale
    if hasattr(fi_mla, "MLAPlanMetadata"):  # 0.7: canonical metadata and structural inputs, by keyword
        extra = dict(scale_mode="kv-per-tensor") if fp8 else {}
        w.plan(metadata=fi_mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
               query_layout="split", kv_cache_layout="split", **common, **extra)

        def call():
            w.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=o, **scales)
    else:  # before 0.7: the flat positional form
        w.plan(qo_indptr, kv_indptr, kv_indices, kv_len, *common.values())

        def call():
            w.run(q_nope, q_pe, ckv, kpe, out=o, **scales)
    return call, out


def _fi_version():
    try:
        import flashinfer

        return flashinfer.__version__
    except Exception:
        return "?"


def impls_for(peers, variants):
    """[(name, make(s), fallback make or None)]: b12x, the FlashInfer backends, the b12x variants."""
    impls = [("b12x", lambda s: b12x_call(s), None)]
    if "flashinfer" in peers:
        for backend in ("fa2", "fa3"):
            impls.append((f"flashinfer-{backend}", lambda s, b=backend: flashinfer_call(s, b),
                          lambda s, b=backend: flashinfer_call(s, b, separate=True)))
    for fam, v in variants:
        impls.append((f"b12x-{fam}-v" + ":".join(map(str, v)),
                      lambda s, fam=fam, v=v: b12x_variant_call(s, fam, v), None))
    return impls


def warm_peers():
    """Builds FlashInfer's MLA modules (fa2, fa3; bf16 and fp8 caches) on tiny inputs."""
    t0 = time.time()
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        s = make_set(1, 4 * PAGE, 1, 16, kv_dtype, seed=1)
        for backend in ("fa2", "fa3"):
            try:
                flashinfer_call(s, backend)[0]()
                _sync()
                log(f"warm flashinfer-{backend} {kv_dtype}: ok ({time.time() - t0:.0f} s)")
            except Exception as e:
                log(f"warm flashinfer-{backend} {kv_dtype}: {type(e).__name__}: {str(e)[:200]}")


# ----------------------------------------------------------------------------------------------------------
# the table

def row_metrics(batch, length, q_len, heads, kv_dtype, us):
    flops = 2 * batch * heads * q_len * length * (WIDTH + RANK)
    nbytes = batch * length * WIDTH * kv_dtype.itemsize + batch * q_len * heads * (WIDTH + RANK) * 2
    return dict(tflops=flops / (us * 1e-6) / 1e12, tbps=nbytes / (us * 1e-6) / 1e12)


def row_label(mode, batch, length, q_len, heads, kv_dtype):
    """'decode H128 32x4096', 'verify S=4 H16 32x4096', 'decode-fp8 H16 64x4096'."""
    kind = "verify S=%d" % q_len if mode == "verify" else "decode"
    return f"{kind}{'-fp8' if kv_dtype == torch.float8_e4m3fn else ''} H{heads} {batch}x{length}"


def _make_all(make, sets):
    """One implementation's (calls, outputs) over the sets (FlashInfer plans, and JIT-builds, here)."""
    made = [make(s) for s in sets]
    return [c for c, _ in made], [o for _, o in made]


def _first_checked(calls, outs, refs, what):
    """Runs the first set's call once and checks its output: max_err; raises if it fails or is off."""
    calls[0]()
    _sync()
    return check(refs, outs[0], what)


def run_row(mode, batch, length, q_len, heads, kv_dtype, peers, variants, bw):
    label = row_label(mode, batch, length, q_len, heads, kv_dtype)
    set_bytes = batch * length * WIDTH * kv_dtype.itemsize
    n_sets = 2 if _device() == "cpu" else max(2, math.ceil(2 * L2_BYTES / set_bytes))
    sets = [make_set(batch, length, q_len, heads, kv_dtype, seed=17 * i + batch) for i in range(n_sets)]
    refs = reference_slices(sets[0])
    result = dict(row=label, mode=mode, batch=batch, kv_len=length, q_len=q_len, heads=heads,
                  kv_dtype=str(kv_dtype).replace("torch.", ""), page_size=PAGE, sets=n_sets, impls={})
    for name, make, fallback in impls_for(peers, variants):
        entry = {}
        try:
            calls, outs = _make_all(make, sets)  # a plan that fails fails on copies too: no second try
            try:
                entry["max_err"] = _first_checked(calls, outs, refs, f"{label} {name}")
                if fallback is not None:
                    entry["kv_cache"] = "views of the 576 cache"
            except Exception as e:
                if fallback is None:
                    raise
                why = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"[{label}] {name} on views of the 576 cache: {why}; again on separate ckv/kpe copies")
                del calls, outs
                calls, outs = _make_all(fallback, sets)
                entry["max_err"] = _first_checked(calls, outs, refs, f"{label} {name}")
                entry["kv_cache"] = f"separate contiguous ckv/kpe copies (on the views: {why})"
            del outs
            us, method = time_graph(calls)
            entry.update(us=us, method=method, host_us=host_time(calls),
                         **row_metrics(batch, length, q_len, heads, kv_dtype, us))
            if name == "b12x":
                entry["plan"] = plan_label(sets[0])
            entry["pct_copy_bw"] = 100 * entry["tbps"] / bw
        except Unsupported as e:
            entry["unsupported"] = str(e)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["impls"][name] = entry
    ratio = kernels.versus_best_peer(result)
    parts = []
    for n, e in result["impls"].items():
        if "us" in e:
            parts.append(f"{n} {e['us']:.1f}us {e['tflops']:.1f} TFLOP/s {e['tbps']:.2f} TB/s "
                         f"{e['pct_copy_bw']:.0f}%" + (f" ({e['plan']})" if "plan" in e else "")
                         + (f" (host {e['host_us']:.0f}us)" if _device() == "cuda" else ""))
        elif "unsupported" in e:
            parts.append(f"{n} n/a ({e['unsupported'][:120]})")
        else:
            parts.append(f"{n} ERROR {e['error'][:160]}")
    log(f"[{label}] " + "; ".join(parts) + ratio)
    del sets
    if _device() == "cuda":
        torch.cuda.empty_cache()
    return result


def markdown(results, skipped):
    """The table: row | b12x us | TFLOP/s | TB/s (% copy) | fa2 us | fa3 us | b12x vs best (best peer us /
    b12x us, above 1: b12x faster)."""
    lines = ["| row | b12x us | TFLOP/s | TB/s | fa2 us | fa3 us | b12x vs best |",
             "|---|---|---|---|---|---|---|"]

    notes = {f"{p}: not importable ({why})": None for p, why in skipped.items()}

    def cell(r, name):
        e = r["impls"].get(name)
        if e is None:
            return "n/a"
        if "us" in e:
            return f"{e['us']:.1f}"
        if "unsupported" in e:
            notes[f"{name}: {e['unsupported']}"] = None
            return "n/a"
        return "error"
    for r in results:
        ours = r["impls"]["b12x"]
        if "us" in ours:
            pct = "" if math.isnan(ours["pct_copy_bw"]) else f" ({ours['pct_copy_bw']:.0f} %)"
            mine = [f"{ours['us']:.1f}", f"{ours['tflops']:.1f}", f"{ours['tbps']:.2f}{pct}"]
        else:
            mine = ["error", "", ""]
        vs = f"{r['speedup_vs_best_peer']:.2f}x" if "speedup_vs_best_peer" in r else "–"
        lines.append("| " + " | ".join([r["row"]] + mine + [cell(r, n) for n in PEER_COLUMNS] + [vs]) + " |")
    return "\n".join(lines + ["", *(f"n/a: {n}" for n in notes)] if notes else lines)


def todo_rows(rows, heads, sizes=()):
    """[(mode, B, L, S, H, kv dtype)] in table order; with sizes [(B, L), ...] (`parse_sizes`) every row at each
    size in turn, duplicates dropped."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    todo = []
    for h in heads:
        if "decode" in rows:
            todo += [("decode", b, n, 1, h, bf16) for b, n in DECODE_ROWS]
        if "verify" in rows:
            todo += [("verify", b, n, VERIFY_LEN, h, bf16) for b, n in VERIFY_ROWS]
    if "fp8" in rows:
        for h in ([FP8_HEADS] if FP8_HEADS in heads else heads):
            todo += [("decode", b, n, 1, h, fp8) for b, n in FP8_ROWS]
    if sizes:
        todo = list(dict.fromkeys((m, b0, n0, s, h, dt) for b0, n0 in sizes for m, b, n, s, h, dt in todo))
    return todo


def main(argv) -> None:
    ap = argparse.ArgumentParser(prog="python -m b12x_inductor.bench mla")
    ap.add_argument("--out", default="benchmarks/results", help="directory of mla_<tag>.json")
    ap.add_argument("--tag", default="", help="result files' suffix (default: the device's, e.g. h200, h100)")
    ap.add_argument("--heads", default=",".join(map(str, HEADS)), help="query heads H, comma list (default "
                    "128,16)")
    ap.add_argument("--rows", default="decode,verify,fp8")
    ap.add_argument("--page-size", type=int, default=PAGE, help="keys per page (default 64; L must be a "
                    "multiple)")
    ap.add_argument("--peers", default="flashinfer", help="'flashinfer' (its fa2 and fa3 backends) or ''")
    ap.add_argument("--sizes", default="", help="dry run or sweep: B x L of every row, e.g. 2x128 or "
                    "32x4096,64x2048 (every row at each size)")
    ap.add_argument("--variants", default="", help="tuning: also time plan variants '[family:]splits:block_n:"
                    "stages:warps[:block_m],...' (family default triton; 0 keeps the plan's value)")
    ap.add_argument("--warm-peers", action="store_true", help="JIT-build FlashInfer's MLA modules, then exit")
    args = ap.parse_args(argv)
    globals()["PAGE"] = args.page_size
    heads = [int(h) for h in args.heads.split(",") if h]
    rows = set(r for r in args.rows.split(",") if r)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        sys.exit(f"b12x_inductor.bench mla: {e}")
    if _device() == "cuda" and not torch.cuda.is_available():
        sys.exit("b12x_inductor.bench mla: needs a CUDA GPU (B12X_BENCH_DEVICE=cpu: a dry run)")
    peers = set(p for p in args.peers.split(",") if p)
    skipped = {}
    if "flashinfer" in peers:
        try:
            import flashinfer.mla  # noqa: F401
        except Exception as e:
            skipped["flashinfer"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"flashinfer not importable ({skipped['flashinfer']}); skipped")
            peers.discard("flashinfer")
    variants = []
    for x in (x for x in args.variants.split(",") if x):
        fam, rest = x.split(":", 1) if not x.split(":")[0].isdigit() else ("triton", x)
        variants.append((fam, tuple(y if y == "vk" else int(y) for y in rest.split(":"))))
    versions = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if _device() == "cuda"
                    else _device(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    tag = args.tag or device_tag(versions["device"])
    import triton

    versions["triton"] = triton.__version__
    if "flashinfer" in peers:
        versions["flashinfer"] = _fi_version()
    if args.warm_peers:
        if "flashinfer" in peers:
            warm_peers()
        return
    bw, bw_all = copy_bandwidth() if _device() == "cuda" else (float("nan"), {})
    log(f"versions {versions}; copy bandwidth {bw:.2f} TB/s {bw_all}")
    t0 = time.time()
    results = [run_row(m, b, n, s, h, dt, peers, variants, bw)
               for m, b, n, s, h, dt in todo_rows(rows, heads, sizes)]
    table = markdown(results, skipped)
    log(table)
    os.makedirs(args.out, exist_ok=True)
    doc = dict(versions=versions, copy_bandwidth_tbps=bw, copy_bandwidth_by_method=bw_all, argv=list(argv),
               shape=dict(kv_lora_rank=RANK, rope_dim=ROPE, page_size=PAGE, scale=SCALE, q_dtype="bfloat16",
                          fp8_descale=FP8_DESCALE),
               peers_skipped=skipped, rows=results, markdown=table, seconds=time.time() - t0)
    path = os.path.join(args.out, f"mla_{tag}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    log(f"wrote {path} ({time.time() - t0:.0f} s)")
