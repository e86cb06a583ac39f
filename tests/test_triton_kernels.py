"""The Triton family against the reference.

CPU (CI): the same Triton kernels run under TRITON_INTERPRET=1 in one subprocess (the interpreter must be
chosen before the kernels are defined, and another test may have imported them already), on tiny shapes
that still walk every mode, page size, layout, dtype and feature; each case is checked here on its own.
The interpreter's bf16/fp16 `tl.dot` is wrong on CPU, so there the products run in fp32 (the index math,
masks, splits and merges are the same code).

GPU (`gpu` marker): every plan and feature through the public op, CUDA-graph capture and replay with the
outputs poisoned and the lengths and page tables changed between replays, and torch.compile with
mode="reduce-overhead" over changing lengths with no cudagraph skip and no recompile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch

F8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------------
# Random problems (shared by the interpreter worker and the GPU tests)

def make_inputs(*, batch=2, q_len=1, hq=4, hkv=2, d=64, page_size=4, kv_layout="NHD", dtype=torch.bfloat16,
                kv_dtype=None, packed=False, lens=None, q_lens=None, kv_start=False, sinks=False, descale=None,
                seed=0, device="cpu", spare_pages=1, nan_unused=False, key_mask=None, dv=None, v_view=False,
                split_q=False, window_left=-1, score_ramp=0.0):
    """Tensors of one call: caches are views of a combined [num_pages, 2, ...] cache (odd strides), pages in random
    order, fresh random values. `dv`: v's head dim where it differs from d (k and v are then the first d and dv
    columns of the two halves of a [..., max(d, dv)] cache); `v_view`: v is k's first dv columns, the same storage
    (absorbed MLA's latent cache: v = latent[..., :512]). Packed q has 3 padding rows past the live tokens.
    `kv_start`: True (request b's first visible key 1 + 2 b) or a list of each request's. `nan_unused`: every cache
    slot that holds no key of [kv_start, length) of a request is NaN (unwritten or evicted memory: a kernel must
    never let it reach out), and so are packed q's padding rows. `key_mask` "request" ([B, 1, capacity]) or "rows"
    ([B, S, capacity], 4-D q): random holes, one query row (request 0's first) that sees no key, and a strided view
    (every other key column of a wider mask); with nan_unused, slots no row of their request sees are NaN. With
    nan_unused and `window_left` >= 0 (the call's sliding window, causal rows), so are the slots before the window
    of the request's first query row. `split_q` (d 576): the query in two tensors, q its first 512 columns (a slice
    of a wider buffer) and q_pe the last 64 (a transposed view), as MLA's q_nope and q_pe come. `score_ramp`: key j
    of a request of n keys has its k row times 1 + score_ramp x j / n, so scores grow along the keys and a running
    max moves by more than 2^8 (the kernels' lazy rescale, softmax.RESCALE_LOG2) after the first tiles."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    dv = d if dv is None else dv
    lens = lens or [q_len + 9 + 7 * b for b in range(batch)]
    max_pages = max(-(-n // page_size) for n in lens) + spare_pages
    num_pages = batch * max_pages + 3
    width = max(d, dv)
    inner = (page_size, hkv, width) if kv_layout == "NHD" else (hkv, page_size, width)
    kv = torch.randn((num_pages, 2, *inner), generator=gen) * (2.0 if kv_dtype == F8 else 1.0)
    page_table = torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages)
    if score_ramp:
        for b, n in enumerate(lens):
            j = torch.arange(n)
            f = (1 + score_ramp * j / max(n, 1))[:, None, None]
            pages, slots = page_table[b, j // page_size], j % page_size
            if kv_layout == "NHD":
                kv[pages, 0, slots] *= f
            else:
                kv[pages, 0, :, slots] *= f
    if isinstance(kv_start, (list, tuple)):
        starts = list(kv_start)
    else:
        starts = [1 + 2 * b if kv_start else 0 for b in range(batch)]
    if packed:
        q_lens = q_lens or [min(n, 5 + 3 * b) for b, n in enumerate(lens)]
    mask = None
    if key_mask is not None:
        cap = max_pages * page_size
        wide = torch.rand(batch, q_len if key_mask == "rows" else 1, 2 * cap, generator=gen) < 0.7
        mask = wide[:, :, ::2]
        mask[0, 0] = False
    if nan_unused:
        live = torch.zeros(num_pages, page_size, dtype=torch.bool)
        new = q_lens if packed else [q_len] * batch  # query rows of each request
        for b, n in enumerate(lens):
            first = starts[b] if window_left < 0 else max(starts[b], n - new[b] - window_left)
            j = torch.arange(first, n)
            if mask is not None:
                j = j[mask[b, :, j].any(0)]
            live[page_table[b, j // page_size], j % page_size] = True
        live = live[:, None, :, None, None] if kv_layout == "NHD" else live[:, None, None, :, None]
        kv = kv.masked_fill(~live, float("nan"))
    kv = kv.to(kv_dtype).to(device)
    k_cache = kv[:, 0, ..., :d]
    v_cache = k_cache[..., :dv] if v_view else kv[:, 1, ..., :dv]
    t = dict(k_cache=k_cache, v_cache=v_cache, page_table=page_table.int().to(device),
             cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), cu_seqlens_q=None,
             kv_start=None, sinks=None, k_descale=None, v_descale=None,
             key_mask=None if mask is None else mask.to(device), q_pe=None)
    if packed:
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        t["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32, device=device)
        t["q"] = torch.randn(cu[-1] + 3, hq, d, generator=gen).to(dtype).to(device)
        if nan_unused:
            t["q"][cu[-1]:] = float("nan")  # no request's rows: a kernel's tiles may read them, never let them out
    else:
        t["q"] = torch.randn(batch, q_len, hq, d, generator=gen).to(dtype).to(device)
    if split_q:
        assert d == 576, "split_q is absorbed MLA's query (d 576 = 512 + 64)"
        q = t["q"]
        wide = torch.full(q.shape[:-1] + (640,), float("nan"), dtype=q.dtype, device=device)
        wide[..., :512] = q[..., :512]
        rope = q[..., 512:].movedim(-2, 0).contiguous().movedim(0, -2)  # heads outermost: strides not q's
        t["q"], t["q_pe"] = wide[..., :512], rope
    if kv_start:
        t["kv_start"] = torch.tensor(starts, dtype=torch.int32, device=device)
    if sinks:
        t["sinks"] = torch.randn(hq, generator=gen).to(device)
    if descale is not None:
        shape = {"scalar": (), "b": (batch,), "bh": (batch, hkv)}[descale]
        t["k_descale"] = (torch.rand(shape, generator=gen) + 0.5).to(device)
        t["v_descale"] = (torch.rand(shape, generator=gen) + 0.5).to(device)
    return t


def check_close(out, lse, ref_out, ref_lse, *, what=""):
    """bf16/fp16 outputs: within 2 % of the output's range plus 2e-3; lse within 2e-3 (fp32 math); -inf and
    zeros exactly where the reference has them."""
    out, lse = out.float().cpu(), lse.float().cpu()
    ref_inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), ref_inf), f"{what}: lse -inf pattern differs"
    assert torch.all(out[ref_inf] == 0), f"{what}: rows with no visible key must be zero"
    tol = 2e-2 * float(ref_out.abs().max()) + 2e-3
    err = float((out - ref_out).abs().max())
    assert err <= tol, f"{what}: out max error {err:.3g} > {tol:.3g}"
    if (~ref_inf).any():
        lerr = float((lse[~ref_inf] - ref_lse[~ref_inf]).abs().max())
        assert lerr <= 2e-3 + 1e-3 * float(ref_lse[~ref_inf].abs().max()), f"{what}: lse max error {lerr:.3g}"


def check_compiled_steps(step, t, names, change, reference, *, steps, what):
    """`step` (returning out * 2 and lse) under torch.compile(mode="reduce-overhead", fullgraph=True), called
    `steps` times on t's tensors `names` under error_on_recompile; before call i, change(i) changes them in place
    (lengths, page tables, new-token counts); after it, out / 2 and lse against reference(). No cudagraph skip."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(steps):
            change(i)
            out, lse = compiled(*(t[n] for n in names))
            torch.cuda.synchronize()
            check_close(out / 2.0, lse, *reference(), what=f"{what} step {i}")
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


# ----------------------------------------------------------------------------------------------------------
# CPU: the kernels under the Triton interpreter

# (name, mode, plan (num_splits, block_m, block_n[, v_from_k]), make_inputs kwargs, options)
INTERPRETER_CASES = [
    ("decode_nhd_split3", "decode", (3, 16, 16), dict(), dict()),
    ("decode_nosplit_page1", "decode", (1, 16, 16), dict(page_size=1), dict()),
    ("decode_hnd_page5_d96", "decode", (2, 16, 16), dict(kv_layout="HND", page_size=5, d=96, hq=8, hkv=1), dict()),
    ("decode_features", "decode", (3, 16, 16), dict(kv_start=True, sinks=True, dtype=torch.float16),
     dict(window_left=5, softcap=3.0)),
    ("decode_empty_and_noncausal", "decode", (2, 16, 16), dict(lens=[0, 11]), dict(causal=False)),
    # a group of 3 in 16 rows: the rows past it (masked) read the group's last head's sink
    ("decode_group3_sinks_nan", "decode", (2, 16, 16), dict(hq=6, hkv=2, sinks=True, nan_unused=True), dict()),
    ("decode_fp8_bh", "decode", (2, 16, 16), dict(kv_dtype=F8, descale="bh"), dict()),
    ("decode_fp8_b_hnd", "decode", (1, 16, 16), dict(kv_dtype=F8, descale="b", kv_layout="HND"), dict()),
    ("verify_features", "verify", (3, 16, 16), dict(q_len=4, kv_start=True, sinks=True), dict(window_left=3)),
    # scores that grow along the keys (score_ramp): running maxima that move by far more than 2^8 after the first tile
    ("decode_fp8_score_ramp", "decode", (2, 16, 16), dict(kv_dtype=F8, descale="bh", lens=[300, 90], score_ramp=8.0,
                                                          nan_unused=True), dict()),
    ("verify_score_ramp_window", "verify", (2, 16, 16), dict(q_len=3, lens=[260, 40], kv_start=True, score_ramp=8.0,
                                                             nan_unused=True), dict(window_left=150)),
    ("verify_mtiles_short", "verify", (2, 16, 16), dict(q_len=5, hq=8, hkv=1, lens=[3, 12], page_size=3), dict()),
    # whole pages per tile (pages of 4 under 16-key tiles, of 32 over them): the range start rounded down to
    # the alignment, the NaN slots before kv_start and before the window never loaded
    ("decode_page4_kv_start_nan", "decode", (2, 16, 16), dict(page_size=4, kv_start=True, sinks=True,
                                                            nan_unused=True, lens=[37, 60]), dict(window_left=6)),
    ("verify_page32_kv_start_nan", "verify", (2, 16, 16), dict(q_len=3, page_size=32, kv_start=True,
                                                             nan_unused=True, lens=[70, 45]), dict(window_left=20)),
    ("extend_4d_window", "extend", (1, 16, 16), dict(q_len=18, lens=[18, 30], d=96, sinks=True, kv_start=True),
     dict(window_left=4, softcap=2.0)),
    ("decode_key_mask", "decode", (3, 16, 16), dict(key_mask="request", nan_unused=True, sinks=True), dict()),
    ("verify_key_mask_rows", "verify", (2, 16, 16), dict(q_len=4, key_mask="rows", nan_unused=True, kv_start=True),
     dict(window_left=6)),
    ("verify_key_mask_noncausal", "verify", (1, 16, 16), dict(q_len=3, key_mask="rows", kv_dtype=F8, descale="b"),
     dict(causal=False)),
    ("extend_4d_key_mask", "extend", (1, 16, 16), dict(q_len=18, lens=[18, 40], key_mask="rows", nan_unused=True),
     dict()),
    ("extend_packed", "extend", (1, 16, 16), dict(packed=True, lens=[25, 33], page_size=5, kv_layout="HND"),
     dict()),
    ("extend_packed_fp8_noncausal", "extend", (1, 16, 16),
     dict(packed=True, lens=[21, 30], q_lens=[0, 17], kv_dtype=F8, descale="scalar"), dict(causal=False)),
    # value head dim != key head dim (MLA): DeepSeek-V3 non-absorbed D 192 / Dv 128, absorbed D 576 / Dv 512
    # with v a view of k's first 512 columns and one KV head (576 = a 512 and a 64 column block of q.k)
    ("decode_dv128_d192", "decode", (3, 16, 16), dict(d=192, dv=128, hq=4, hkv=4, nan_unused=True, sinks=True,
                                                      kv_start=True), dict(window_left=6)),
    ("decode_mla576_page1", "decode", (2, 16, 16), dict(d=576, dv=512, hq=8, hkv=1, v_view=True, page_size=1,
                                                        nan_unused=True, lens=[0, 23]), dict()),
    ("decode_mla576_nosplit_hnd", "decode", (1, 16, 16), dict(d=576, dv=512, hq=4, hkv=1, v_view=True,
                                                              kv_layout="HND", page_size=16, nan_unused=True),
     dict(softcap=5.0)),
    ("verify_mla576_fp8", "verify", (2, 16, 16), dict(q_len=3, d=576, dv=512, hq=4, hkv=1, v_view=True, kv_dtype=F8,
                                                      descale="b", nan_unused=True), dict()),
    ("verify_dv128_key_mask", "verify", (2, 16, 16), dict(q_len=4, d=192, dv=128, hq=4, hkv=1, key_mask="rows",
                                                          nan_unused=True), dict()),
    ("decode_dv_wider_than_d", "decode", (2, 16, 16), dict(d=64, dv=128, hq=4, hkv=2, nan_unused=True), dict()),
    ("extend_mla576_4d", "extend", (1, 32, 16), dict(q_len=18, lens=[18, 37], d=576, dv=512, hq=2, hkv=1,
                                                     v_view=True, page_size=16, nan_unused=True, kv_start=True),
     dict(window_left=9)),
    ("extend_dv128_packed_hnd", "extend", (1, 16, 16), dict(packed=True, lens=[25, 33], d=192, dv=128, hq=4, hkv=2,
                                                           kv_layout="HND", page_size=5, nan_unused=True),
     dict(causal=False)),
    ("extend_dv96_d128_key_mask", "extend", (1, 16, 16), dict(q_len=18, lens=[18, 40], d=128, dv=96, hq=2, hkv=2,
                                                              key_mask="rows", nan_unused=True), dict()),
    ("extend_mla576_packed_fp8", "extend", (1, 16, 16), dict(packed=True, lens=[20, 31], q_lens=[17, 9], d=576,
                                                             dv=512, hq=2, hkv=1, v_view=True, kv_dtype=F8,
                                                             descale="bh", nan_unused=True), dict()),
    # v_from_k: V's tile taken from K's (v = k's first 512 columns), per mode and feature
    ("decode_mla576_q_pe", "decode", (2, 16, 16), dict(d=576, dv=512, hq=8, hkv=1, v_view=True, split_q=True,
                                                          nan_unused=True, sinks=True), dict()),
    ("verify_mla576_q_pe_v_from_k", "verify", (1, 16, 16, True),
     dict(q_len=3, d=576, dv=512, hq=4, hkv=1, v_view=True, split_q=True, kv_start=True, nan_unused=True), dict()),
    ("extend_mla576_packed_q_pe", "extend", (1, 16, 16), dict(packed=True, lens=[20, 31], q_lens=[17, 9], d=576,
                                                                 dv=512, hq=2, hkv=1, v_view=True, split_q=True,
                                                                 nan_unused=True), dict()),
    ("decode_mla576_v_from_k", "decode", (2, 16, 16, True), dict(d=576, dv=512, hq=8, hkv=1, v_view=True,
                                                                 page_size=1, nan_unused=True, lens=[0, 23]),
     dict()),
    ("decode_mla576_v_from_k_page256", "decode", (2, 16, 16, True),
     dict(d=576, dv=512, hq=4, hkv=1, v_view=True, page_size=256, lens=[300, 40], kv_start=True, nan_unused=True),
     dict()),
    ("decode_mla576_v_from_k_key_mask", "decode", (3, 16, 16, True),
     dict(d=576, dv=512, hq=4, hkv=1, v_view=True, key_mask="request", nan_unused=True, sinks=True), dict()),
    ("verify_mla576_v_from_k_fp8", "verify", (2, 16, 16, True),
     dict(q_len=3, d=576, dv=512, hq=4, hkv=1, v_view=True, kv_dtype=F8, descale="b", nan_unused=True), dict()),
    # many splits: the merge takes a row's columns in blocks (kernels/triton/decode.py, merge_launch), and most
    # splits of these short requests see no key (-inf partials); 128 splits: the TILE form, DV 512 in 16 blocks
    # of 32 and DV 128 in 4; 64 splits: the loop, DV 128 in 2 blocks of 64
    ("decode_mla576_splits128_merge_blocks", "decode", (128, 16, 16, True),
     dict(d=576, dv=512, hq=4, hkv=1, v_view=True, lens=[0, 150], page_size=16, nan_unused=True, sinks=True), dict()),
    ("decode_splits128_merge_blocks", "decode", (128, 16, 16), dict(d=128, batch=3, lens=[301, 0, 45], sinks=True,
                                                                     nan_unused=True), dict()),
    ("decode_splits64_merge_blocks", "decode", (64, 16, 16), dict(d=128, lens=[37, 201], sinks=True, nan_unused=True,
                                                                   kv_start=True), dict()),
    ("extend_mla576_v_from_k_window", "extend", (1, 32, 16, True),
     dict(q_len=18, lens=[18, 37], d=576, dv=512, hq=2, hkv=1, v_view=True, page_size=16, nan_unused=True,
          kv_start=True), dict(window_left=9)),
    ("extend_mla576_v_from_k_packed_hnd", "extend", (1, 16, 16, True),
     dict(packed=True, lens=[20, 31], q_lens=[17, 9], d=576, dv=512, hq=2, hkv=1, v_view=True, kv_layout="HND",
          page_size=4, nan_unused=True), dict(causal=False)),
]


def _run_case(case, device="cpu") -> None:
    """Runs one INTERPRETER_CASES case through kernels.triton.run with its plan's tiles on `device` and checks
    it against the reference (raises where it differs)."""
    from b12x_inductor.kernels import triton as tk
    from b12x_inductor.kernels.reference import paged_attention_reference
    from tests.helpers import direct_call

    name, mode, (splits, block_m, block_n, *v_from_k), kw, opts = case
    t = make_inputs(**kw, device=device, window_left=opts.get("window_left", -1))
    q = t["q"]
    options = dict(kv_layout=kw.get("kv_layout", "NHD"), causal=True, scale=1.1 * q.shape[-1] ** -0.5,
                   window_left=-1, softcap=0.0)
    options.update(opts)
    call = direct_call(t, mode, options, dict(num_splits=splits, block_m=block_m, block_n=block_n,
                                              num_warps=4, num_stages=2, v_from_k=bool(v_from_k)))
    tk.run(call)
    ref_out, ref_lse = paged_attention_reference(**t, **options)
    check_close(call.out, call.lse, ref_out, ref_lse, what=name)


def _interpreter_worker() -> None:
    """Runs every INTERPRETER_CASES case (`_run_case`); prints one JSON line per case."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

    for case in INTERPRETER_CASES:
        try:
            _run_case(case)
            print(json.dumps({"case": case[0], "ok": True}), flush=True)
        except Exception as e:  # reported per case by the parent test
            print(json.dumps({"case": case[0], "ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--interpreter-worker"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    if not results:
        pytest.fail(f"interpreter worker produced no results (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return results


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check for CPU machines; the GPU tests run the kernels")
@pytest.mark.parametrize("name", [c[0] for c in INTERPRETER_CASES])
def test_interpreter_matches_reference(interpreter_results, name):
    r = interpreter_results.get(name)
    assert r is not None, f"{name}: no result from the interpreter worker"
    assert r["ok"], r.get("error")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c[0] for c in INTERPRETER_CASES if "merge_blocks" in c[0]])
def test_gpu_merge_in_column_blocks(name):
    """The many-split interpreter cases compiled and run on the GPU: 128 splits (the merge's TILE form) of MLA's
    512 columns and of 128 columns, and 64 of 128 columns (the loop, 2 blocks), most splits seeing no key, an
    empty request, sinks."""
    _run_case(next(c for c in INTERPRETER_CASES if c[0] == name), device="cuda")


def test_merge_launch_and_partials_layout():
    """merge_launch: below MERGE_TILE_SPLITS splits a program takes a whole row where the rows give
    MERGE_MIN_PROGRAMS programs, else narrower column blocks down to MERGE_MIN_BLOCK, a warp per 128 columns, the
    splits' loop unrolled min(splits, MERGE_UNROLL) times (that it is: tests/test_triton_compile_targets.py);
    from MERGE_TILE_SPLITS on, all splits of MERGE_TILE_ELEMS // splits columns at once (TILE) in
    MERGE_TILE_WARPS warps. split_partials: the partials in out's dtype first, then the fp32 LSEs, exactly
    filling the bytes split_scratch_bytes gives."""
    from b12x_inductor.kernels.triton import split_partials
    from b12x_inductor.kernels.triton.decode import (MERGE_MIN_BLOCK, MERGE_MIN_PROGRAMS, MERGE_TILE_ELEMS,
                                                     MERGE_TILE_SPLITS, MERGE_TILE_WARPS, MERGE_UNROLL, merge_launch)
    from b12x_inductor.plan import Problem, split_scratch_bytes

    # (rows, Dv, splits): (grid, BLOCK_DV, warps)
    cases = {(4096, 512, 2): ((4096, 1), 512, 4), (512, 512, 8): ((512, 2), 256, 2),
             (128, 512, 64): ((128, 8), 64, 1), (4, 512, 100): ((4, 8), 64, 1), (32, 128, 64): ((32, 2), 64, 1),
             (8192, 128, 4): ((8192, 1), 128, 1),
             (4, 512, 128): ((4, 16), 32, 2), (28, 128, 128): ((28, 4), 32, 2)}  # TILE
    assert (MERGE_TILE_SPLITS, MERGE_TILE_ELEMS, MERGE_TILE_WARPS) == (128, 4096, 2)  # the table above
    for (rows, dv, splits), want in cases.items():
        grid, meta = merge_launch(rows, 16, dv, splits)
        assert (grid, meta["BLOCK_DV"], meta["num_warps"], meta["NUM_SPLITS"]) == (*want, splits)
        if splits >= MERGE_TILE_SPLITS:
            assert meta["TILE"] and meta["UNROLL"] == 1 and meta["BLOCK_DV"] * meta["SPLITS_P2"] == MERGE_TILE_ELEMS
        else:
            assert not meta["TILE"] and meta["UNROLL"] == min(splits, MERGE_UNROLL)
            assert grid[0] * grid[1] >= MERGE_MIN_PROGRAMS or meta["BLOCK_DV"] == MERGE_MIN_BLOCK
    for dtype, itemsize in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        p = Problem(batch=3, q_len=2, packed=False, num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                    page_size=64, max_pages=8, q_dtype=dtype, kv_dtype=dtype, kv_layout="NHD", device_type="cuda",
                    sm_count=132, capability=(9, 0))
        n = 3 * 2 * 16 * 5  # rows x splits
        scratch = torch.empty(split_scratch_bytes(p, 5), dtype=torch.uint8)
        assert scratch.numel() == n * (512 * itemsize + 4)
        part_o, part_l = split_partials(scratch, n, 512, dtype)
        assert (part_o.dtype, part_o.numel(), part_l.dtype, part_l.numel()) == (dtype, n * 512, torch.float32, n)
        assert part_o.data_ptr() == scratch.data_ptr()
        assert part_l.data_ptr() == scratch.data_ptr() + n * 512 * itemsize
        assert part_l.data_ptr() + 4 * n == scratch.data_ptr() + scratch.numel()
        with pytest.raises(ValueError, match="scratch must hold"):  # a short scratch is refused, never overrun
            split_partials(scratch[:-4], n, 512, dtype)


def test_triton_plan_is_sized(monkeypatch):
    """The Triton branch of select_plan for a CUDA problem: splits fill the SMs, scratch fits the splits.
    (That select_plan is pure: tests/test_plan.py::TestPlanTable::test_pure.)"""
    from b12x_inductor.kernels import cute
    from b12x_inductor.plan import Problem, select_plan, split_scratch_bytes

    monkeypatch.setattr(cute, "available", lambda: False)  # installed or not: the Triton branch

    base = dict(batch=8, q_len=1, packed=False, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                max_pages=512, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD",
                device_type="cuda", sm_count=132, capability=(9, 0))
    p = Problem(**base)
    plan = select_plan(p)
    assert plan.family == "triton" and plan.mode == "decode"
    assert plan.block_m == 16 and plan.num_splits > 1
    assert plan.scratch_bytes == split_scratch_bytes(p, plan.num_splits)
    verify = select_plan(Problem(**{**base, "q_len": 4}))
    assert verify.mode == "verify" and verify.block_m == 16
    extend = select_plan(Problem(**{**base, "q_len": 64}))
    assert extend.mode == "extend" and extend.scratch_bytes == 0
    assert select_plan(Problem(**{**base, "device_type": "cpu", "sm_count": 0})).family == "torch"
    # every CUDA GPU from sm80 on; float8 caches from sm89 on (sm80-87 have no native e4m3: torch family)
    for cap in ((8, 0), (8, 6), (8, 9), (10, 0), (12, 0), (12, 1)):
        assert select_plan(Problem(**{**base, "capability": cap})).family == "triton"
    for cap in ((8, 0), (8, 6), (8, 7)):
        assert select_plan(Problem(**{**base, "capability": cap, "kv_dtype": torch.float8_e4m3fn})).family == "torch"
    for cap in ((8, 9), (10, 0), (12, 0)):
        assert select_plan(Problem(**{**base, "capability": cap, "kv_dtype": torch.float8_e4m3fn})).family == "triton"
    # fail closed: GPUs before sm80 or past what Triton targets, and q dtypes the kernels do not take, run torch
    assert select_plan(Problem(**{**base, "capability": (7, 5)})).family == "torch"
    assert select_plan(Problem(**{**base, "capability": (13, 0)})).family == "torch"
    assert select_plan(Problem(**{**base, "q_dtype": torch.float32, "kv_dtype": torch.float32})).family == "torch"
    assert select_plan(Problem(**{**base, "kv_dtype": torch.float8_e4m3fn})).family == "triton"


# ----------------------------------------------------------------------------------------------------------
# GPU

GPU_CASES = [
    # (name, make_inputs kwargs, options)
    ("decode_bf16_nhd_p16", dict(batch=3, hq=32, hkv=8, d=128, page_size=16, lens=[700, 1, 2053]), {}),
    ("decode_fp16_hnd_p1", dict(batch=2, hq=8, hkv=2, d=64, page_size=1, lens=[300, 77], dtype=torch.float16,
                                kv_layout="HND"), {}),
    ("decode_d96_p5", dict(batch=2, hq=12, hkv=4, d=96, page_size=5, lens=[333, 41]), {}),
    ("decode_p64_kv_start_window_nan", dict(batch=3, hq=32, hkv=8, d=128, page_size=64, lens=[900, 70, 2000],
                                            kv_start=True, sinks=True, nan_unused=True), dict(window_left=300)),
    ("verify_p4_kv_start_window_nan", dict(batch=2, q_len=3, hq=8, hkv=2, d=64, page_size=4, lens=[501, 30],
                                           kv_start=True, nan_unused=True), dict(window_left=100)),
    ("decode_d192_hnd", dict(batch=2, hq=8, hkv=1, d=192, page_size=16, lens=[513, 90], kv_layout="HND"), {}),
    ("decode_d256_p7", dict(batch=2, hq=16, hkv=2, d=256, page_size=7, lens=[400, 3]), {}),
    ("decode_features", dict(batch=3, hq=16, hkv=4, d=128, page_size=16, lens=[600, 37, 0], kv_start=True,
                             sinks=True), dict(window_left=100, softcap=20.0, scale=0.05)),
    # a window splits over the keys a query sees (window_left + 1), not over the capacity: 2 splits here
    ("decode_window_split", dict(batch=3, hq=16, hkv=4, d=128, page_size=16, lens=[3000, 37, 1500], kv_start=True,
                                 sinks=True, nan_unused=True), dict(window_left=700)),
    # one request, 4 KV heads (Qwen2-7B), capacity 32768: 128 splits of 256 keys, the rule's cap
    ("decode_gqa7_1x32768_split", dict(batch=1, hq=28, hkv=4, d=128, page_size=64, lens=[32700], sinks=True,
                                       nan_unused=True), {}),
    ("decode_noncausal_empty", dict(batch=2, hq=8, hkv=8, d=64, page_size=16, lens=[0, 129]), dict(causal=False)),
    ("decode_fp8_scalar", dict(batch=2, hq=32, hkv=8, d=128, page_size=16, lens=[900, 65], kv_dtype=F8,
                               descale="scalar"), {}),
    ("decode_fp8_b_hnd", dict(batch=2, hq=16, hkv=4, d=128, page_size=16, lens=[300, 999], kv_dtype=F8,
                              descale="b", kv_layout="HND"), {}),
    ("decode_fp8_bh_fp16", dict(batch=2, hq=8, hkv=2, d=64, page_size=4, lens=[222, 5], kv_dtype=F8,
                                descale="bh", dtype=torch.float16), {}),
    ("verify_s4", dict(batch=3, q_len=4, hq=32, hkv=8, d=128, page_size=16, lens=[800, 4, 2])),
    ("verify_s16_g8", dict(batch=2, q_len=16, hq=64, hkv=8, d=128, page_size=16, lens=[500, 31])),
    # 32 and 64 query rows a KV head (Llama-70B's group of 8 at S 4 / 8): 64-key tiles in two buffers
    ("verify_s4_g8_nan_sinks", dict(batch=3, q_len=4, hq=64, hkv=8, d=128, page_size=16, lens=[1500, 9, 700],
                                    nan_unused=True, sinks=True)),
    ("verify_s8_g8_window", dict(batch=2, q_len=8, hq=64, hkv=8, d=128, page_size=16, lens=[1200, 20],
                                 kv_start=True, nan_unused=True), dict(window_left=500)),
    # 16 rows a KV head with B x Hkv = 256 / 264: one wave unsplit on 64-key tiles (sm90 / sm100)
    ("decode_one_wave_nan", dict(batch=32, hq=32, hkv=8, d=128, page_size=16,
                                 lens=[(i * 397) % 2100 + 1 for i in range(32)], nan_unused=True, sinks=True), {}),
    ("verify_one_wave_window", dict(batch=33, q_len=4, hq=32, hkv=8, d=128, page_size=16,
                                    lens=[(i * 211) % 1500 + 4 for i in range(33)], kv_start=True, nan_unused=True),
     dict(window_left=300)),
    # scores that grow along the keys (score_ramp): running maxima that move by more than 2^8 mid-request
    ("decode_fp8_score_ramp", dict(batch=2, hq=32, hkv=8, d=128, page_size=16, lens=[2500, 700], kv_dtype=F8,
                                   descale="bh", nan_unused=True, score_ramp=8.0), {}),
    ("verify_s4_score_ramp_window", dict(batch=2, q_len=4, hq=32, hkv=8, d=128, page_size=16, lens=[1800, 300],
                                         kv_start=True, nan_unused=True, score_ramp=8.0), dict(window_left=900)),
    ("extend_d64_score_ramp", dict(batch=2, q_len=300, hq=8, hkv=2, d=64, page_size=16, lens=[1500, 300],
                                   nan_unused=True, score_ramp=8.0), {}),
    ("decode_mla576_h128_score_ramp", dict(batch=2, hq=128, hkv=1, d=576, dv=512, v_view=True, page_size=64,
                                           lens=[3000, 200], nan_unused=True, score_ramp=8.0), {}),
    ("decode_mla576_fp8_h16_score_ramp", dict(batch=2, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=64,
                                              lens=[2500, 77], kv_dtype=F8, descale="b", nan_unused=True,
                                              score_ramp=8.0), {}),
    # B x Hkv = 192: the split rule's 4 splits halved to 2 for one wave of five programs an SM (H200)
    ("decode_b24_split", dict(batch=24, hq=32, hkv=8, d=128, page_size=16,
                              lens=[(i * 733) % 3000 + 300 for i in range(24)], nan_unused=True), {}),
    ("decode_b28_split", dict(batch=28, hq=32, hkv=8, d=128, page_size=16,
                              lens=[(i * 577) % 2500 + 600 for i in range(28)], sinks=True), {}),
    # one request, 8 KV heads: 64 splits of 32-key tiles, two buffers
    ("decode_one_request_split", dict(batch=1, hq=32, hkv=8, d=128, page_size=16, lens=[17000], kv_start=True,
                                      sinks=True, nan_unused=True), {}),
    # above three programs an SM, one_wave_tile's tiles (ONE_WAVE_TILES on sm90 / sm100 with 132 SMs)
    ("decode_b56_wave", dict(batch=56, hq=32, hkv=8, d=128, page_size=16,
                             lens=[(i * 389) % 2600 + 700 for i in range(56)], nan_unused=True), {}),
    ("decode_gqa7_b200_wave", dict(batch=200, hq=28, hkv=4, d=128, page_size=16,
                                   lens=[(i * 571) % 2300 + 1 for i in range(200)], sinks=True, nan_unused=True), {}),
    ("verify_b100_wave_window", dict(batch=100, q_len=4, hq=32, hkv=8, d=128, page_size=16,
                                     lens=[(i * 263) % 1900 + 250 for i in range(100)], kv_start=True,
                                     nan_unused=True), dict(window_left=700)),
    ("decode_b120_wave", dict(batch=120, hq=32, hkv=8, d=128, page_size=16,
                              lens=[(i * 613) % 2900 + 20 for i in range(120)], sinks=True, nan_unused=True), {}),
    ("decode_g8_b128_wave", dict(batch=128, hq=64, hkv=8, d=128, page_size=16,
                                 lens=[(i * 457) % 1500 + 520 for i in range(128)], kv_start=True,
                                 nan_unused=True), {}),
    ("decode_b150_wave", dict(batch=150, hq=32, hkv=8, d=128, page_size=16,
                              lens=[(i * 541) % 2700 + 300 for i in range(150)], kv_start=True, sinks=True,
                              nan_unused=True), {}),
    # float8 at 32 and 64 rows (two buffers; 64-key tiles at D 64 and 64 rows)
    ("verify_fp8_g8_d64", dict(batch=2, q_len=4, hq=16, hkv=2, d=64, page_size=16, lens=[1000, 33], kv_dtype=F8,
                               descale="b", nan_unused=True, sinks=True)),
    ("verify_fp8_s8_g8_d64", dict(batch=2, q_len=8, hq=16, hkv=2, d=64, page_size=16, lens=[900, 70],
                                  kv_dtype=F8, descale="bh", nan_unused=True)),
    ("verify_fp8_s8_g8_hnd", dict(batch=2, q_len=8, hq=16, hkv=2, d=128, page_size=16, lens=[1100, 12],
                                  kv_dtype=F8, descale="scalar", kv_layout="HND", nan_unused=True, kv_start=True)),
    ("verify_features_hnd", dict(batch=2, q_len=3, hq=8, hkv=2, d=128, page_size=3, lens=[260, 20],
                                 kv_layout="HND", kv_start=True, sinks=True), dict(window_left=7, softcap=10.0)),
    ("verify_fp8_d256", dict(batch=2, q_len=5, hq=8, hkv=2, d=256, page_size=16, lens=[300, 40], kv_dtype=F8,
                             descale="bh")),
    ("extend_4d", dict(batch=2, q_len=200, hq=16, hkv=4, d=128, page_size=16, lens=[200, 333])),
    ("extend_4d_d64_p5_features", dict(batch=2, q_len=40, hq=8, hkv=2, d=64, page_size=5, lens=[40, 170],
                                       kv_start=True, sinks=True), dict(window_left=31, softcap=15.0)),
    ("extend_packed_hnd", dict(batch=3, hq=16, hkv=4, d=128, page_size=16, packed=True, lens=[300, 64, 129],
                               q_lens=[150, 0, 129], kv_layout="HND")),
    ("extend_packed_d192_noncausal", dict(batch=2, hq=8, hkv=2, d=192, page_size=16, packed=True,
                                          lens=[100, 220], q_lens=[33, 70]), dict(causal=False)),
    ("extend_packed_d96_fp8", dict(batch=2, hq=8, hkv=2, d=96, page_size=8, packed=True, lens=[90, 260],
                                   q_lens=[90, 100], kv_dtype=F8, descale="b")),
    ("extend_d256_fp16", dict(batch=1, q_len=130, hq=4, hkv=1, d=256, page_size=16, lens=[400],
                              dtype=torch.float16)),
    # key_mask (the substitution's route for masks only the device knows): the Triton family reads it
    ("decode_key_mask", dict(batch=3, hq=32, hkv=8, d=128, page_size=16, lens=[900, 65, 300], key_mask="request",
                             nan_unused=True, sinks=True), {}),
    ("verify_key_mask_rows_fp8", dict(batch=2, q_len=4, hq=16, hkv=4, d=128, page_size=16, lens=[700, 40],
                                      key_mask="rows", kv_dtype=F8, descale="b", nan_unused=True), {}),
    ("extend_4d_key_mask", dict(batch=2, q_len=150, hq=16, hkv=4, d=64, page_size=16, lens=[150, 420],
                                key_mask="rows", nan_unused=True), {}),
    # value head dim != key head dim (MLA; the Triton family, and for 16-bit absorbed MLA decode/verify the
    # CuTe family's MLA kernel where installed: select_plan's pick, then the Triton plan too)
    ("decode_dv128_d192", dict(batch=3, hq=16, hkv=16, d=192, dv=128, page_size=16, lens=[600, 37, 5],
                               nan_unused=True), {}),
    ("extend_dv128_d192_gqa", dict(batch=2, q_len=200, hq=16, hkv=4, d=192, dv=128, page_size=16, lens=[200, 333],
                                   nan_unused=True), {}),
    ("decode_mla576_p64", dict(batch=3, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=64,
                               lens=[700, 1, 2053], nan_unused=True), dict(scale=0.07)),
    ("decode_mla576_h128_p64_split", dict(batch=2, hq=128, hkv=1, d=576, dv=512, v_view=True, page_size=64,
                                          lens=[1900, 64], nan_unused=True), {}),  # the 64-row tile, 4 splits
    ("decode_mla576_fp8_p1_h128", dict(batch=2, hq=128, hkv=1, d=576, dv=512, v_view=True, page_size=1,
                                       lens=[300, 77], kv_dtype=F8, descale="scalar", nan_unused=True), {}),
    ("verify_mla576_s4", dict(batch=2, q_len=4, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=16,
                              lens=[500, 31], nan_unused=True), {}),
    ("extend_mla576_packed", dict(batch=2, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=16, packed=True,
                                  lens=[300, 129], q_lens=[150, 129], nan_unused=True), dict(scale=0.07)),
    # absorbed MLA's query in two tensors (q_pe: a transposed view; q: a slice whose other columns are NaN)
    ("decode_mla576_h128_q_pe", dict(batch=2, hq=128, hkv=1, d=576, dv=512, v_view=True, page_size=64,
                                        lens=[3000, 200], split_q=True, sinks=True, nan_unused=True), {}),
    ("verify_mla576_s4_q_pe_p16", dict(batch=3, q_len=4, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=16,
                                          lens=[900, 31, 9], split_q=True, kv_start=True, nan_unused=True), {}),
    ("decode_mla576_fp8_q_pe", dict(batch=2, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=64,
                                       lens=[1000, 77], kv_dtype=F8, descale="b", split_q=True, nan_unused=True), {}),
    ("extend_mla576_packed_q_pe", dict(batch=2, hq=16, hkv=1, d=576, dv=512, v_view=True, page_size=16,
                                          packed=True, lens=[300, 129], q_lens=[150, 129], split_q=True,
                                          nan_unused=True), dict(scale=0.07)),
]


def _call(t, options, out=None):
    import b12x_inductor as b12x

    return b12x.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                                t["cu_seqlens_q"], kv_start=t["kv_start"], sinks=t["sinks"],
                                k_descale=t["k_descale"], v_descale=t["v_descale"], key_mask=t.get("key_mask"),
                                q_pe=t.get("q_pe"), return_lse=True, out=out,
                                **options)


def _reference(t, options):
    from b12x_inductor.kernels.reference import paged_attention_reference

    return paged_attention_reference(**t, **options)


# (splits, block_n, num_stages) one_wave_tile gives these cases on 132 SMs (H100 / H200): B x Hkv = 448 at 2
# splits on one K / V buffer, 800 unsplit on one (seven an SM); beyond a wave, 960, 1024 (a group of 8) and 1200
# unsplit on 64-key tiles with one buffer
ONE_WAVE_TILES = {
    "decode_b56_wave": (2, 32, 2), "decode_gqa7_b200_wave": (1, 32, 2), "verify_b100_wave_window": (1, 32, 2),
    "decode_b120_wave": (1, 64, 2), "decode_g8_b128_wave": (1, 64, 2), "decode_b150_wave": (1, 64, 2)}


def _plan_of(t, options):
    from b12x_inductor import validate
    from b12x_inductor.plan import select_plan

    problem = validate.check_paged_attention(
        t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
        kv_layout=options.get("kv_layout", "NHD"), causal=options.get("causal", True), scale=options.get("scale"),
        window_left=options.get("window_left", -1), kv_start=t["kv_start"], sinks=t["sinks"],
        softcap=options.get("softcap", 0.0), k_descale=t["k_descale"], v_descale=t["v_descale"],
        key_mask=t.get("key_mask"), q_pe=t.get("q_pe"), out=None)
    return select_plan(problem)


def _gpu_case(name, kw, options):
    """(inputs on the GPU, options with the case's layout) of one GPU_CASES case; the seed follows the name."""
    options = dict(options, kv_layout=kw.get("kv_layout", "NHD"))
    return make_inputs(**kw, device="cuda", seed=zlib.crc32(name.encode()) % 1000,
                       window_left=options.get("window_left", -1)), options


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,options", [(c[0], c[1], c[2] if len(c) > 2 else {}) for c in GPU_CASES],
                         ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_reference(name, kw, options):
    t, options = _gpu_case(name, kw, options)
    plan = _plan_of(t, options)
    assert plan.family in ("triton", "cute"), f"{name}: expected a kernel family, got {plan}"
    assert "_split" not in name or plan.num_splits > 1, f"{name}: meant to split the keys, got {plan}"
    assert ("_one_wave" not in name or torch.cuda.get_device_capability()[0] not in (9, 10)
            or (plan.num_splits, plan.block_n) == (1, 64)), f"{name}: meant to run unsplit on 64 keys, got {plan}"
    if (name in ONE_WAVE_TILES and torch.cuda.get_device_capability()[0] in (9, 10)
            and torch.cuda.get_device_properties().multi_processor_count == 132):
        assert (plan.num_splits, plan.block_n, plan.num_stages) == ONE_WAVE_TILES[name], f"{name}: got {plan}"
    out = torch.full(t["q"].shape[:-1] + t["v_cache"].shape[-1:], float("nan"), dtype=t["q"].dtype, device="cuda")
    _, lse = _call(t, options, out=out)
    torch.cuda.synchronize()
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan}")
    if plan.family != "triton":  # select_plan picked the CuTe family: run the Triton plan too
        from tests.helpers import run_family

        out, lse, plan, _ = run_family(t, options, "triton")
        torch.cuda.synchronize()
        check_close(out, lse, *_reference(t, options), what=f"{name} {plan}")


V_FROM_K_CASES = [c for c in GPU_CASES if "mla576" in c[0]]


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw,options", [(c[0], c[1], c[2] if len(c) > 2 else {}) for c in V_FROM_K_CASES],
                         ids=[c[0] for c in V_FROM_K_CASES])
def test_gpu_v_from_k_matches_reference(name, kw, options):
    """The MLA cases with V's tile taken from K's (plan.v_from_k) asked for: the decode/verify plans take it
    themselves (kernels/triton/plan.py), the extend plan does not, so extend runs it here only."""
    from tests.helpers import run_family

    t, options = _gpu_case(name, kw, options)
    out, lse, plan, _ = run_family(t, options, "triton", overrides=dict(v_from_k=True))
    torch.cuda.synchronize()
    assert plan.v_from_k
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["decode_mla576_fp8_p1_h128", "decode_mla576_h128_q_pe"])
def test_gpu_wide_mla_is_deterministic_under_a_busy_stream(name):
    """The 64-row MLA tile (two warpgroups, wgmma, K widened from float8 through shared memory in one case)
    gives bitwise the same output on every run while another stream copies and runs the same kernel: a check
    that its results do not move with timing. (Under compute-sanitizer's memcheck and synccheck the float8 form
    gives wrong rows while the tools report no error; racecheck finds no hazard: h200.md, "Session 41".)"""
    from tests.helpers import run_family

    case = next(c for c in GPU_CASES if c[0] == name)
    case_options = case[2] if len(case) > 2 else {}
    t, options = _gpu_case(name, case[1], case_options)
    t2, _ = _gpu_case(name, case[1], case_options)  # the side stream's own inputs and outputs
    out0, lse0, plan, call = run_family(t, options, "triton")
    assert plan.block_m == 64, f"{name}: meant to run the 64-row tile, got {plan}"
    torch.cuda.synchronize()
    check_close(out0, lse0, *_reference(t, options), what=f"{name} {plan}")
    first = (out0.clone(), lse0.clone())
    _, _, _, side_call = run_family(t2, options, "triton")
    side = torch.cuda.Stream()
    big = torch.randn(64 << 20, device="cuda")  # 256 MB
    other = torch.empty_like(big)
    for i in range(200):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(i % 3):
                other.copy_(big)
            side_call()
        out0.fill_(float("nan"))
        call()
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(out0, first[0]) and torch.equal(lse0, first[1]), f"{name}: run {i} differs"


def _shifted(x: torch.Tensor) -> torch.Tensor:
    """x's values in a tensor whose data starts one element past a 16-byte boundary (its rows then unaligned)."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    y = buf[1:].view(x.shape)
    y.copy_(x)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode_split", "extend"])
def test_gpu_direct_launch_only_for_aligned_tensors(mode, monkeypatch):
    """A step launches its kernel directly (without the JIT's binder) once its tensors are all 16-byte aligned,
    through the compiled kernel made for that alignment; a launch with an unaligned tensor (q, out) goes through
    the JIT, which compiles the kernel for it. Both match the reference, before and after each other."""
    from b12x_inductor.kernels import triton as triton_kernels
    from b12x_inductor.kernels.triton import _compile_only
    from tests.helpers import run_family

    made, direct_runs = [], []
    real = _compile_only.direct_launcher

    def spy(kernel, grid, args, kwargs):
        launch, tail = real(kernel, grid, args, kwargs)
        made.append(kernel)

        def counted(*a):
            direct_runs.append(kernel)
            launch(*a)
        return counted, tail

    monkeypatch.setattr(_compile_only, "direct_launcher", spy)
    triton_kernels._steps.cache_clear()  # steps made by earlier tests hold launchers made without the spy
    triton_kernels.merge_step.cache_clear()  # and so may the merge steps, which both families share
    kw = dict(batch=3, hq=16, hkv=4, d=128, page_size=16, lens=[900, 260, 70], spare_pages=4)
    if mode == "extend":
        kw["q_len"] = 40
    t = make_inputs(**kw, device="cuda", seed=13)
    options = dict(kv_layout="NHD")
    overrides = dict(num_splits=4) if mode == "decode_split" else None
    ref = _reference(t, options)
    out, lse, plan, call = run_family(t, options, "triton", overrides=overrides)
    torch.cuda.synchronize()
    check_close(out, lse, *ref, what=f"{mode} aligned {plan}")
    steps = 2 if mode == "decode_split" else 1  # the split kernel and the merge, or the extend kernel
    assert (len(made), len(direct_runs)) == (steps, steps)

    unaligned = dict(t, q=_shifted(t["q"]))
    out_u = _shifted(torch.full_like(out, float("nan")))
    out2, lse2, plan2, _ = run_family(unaligned, options, "triton", out=out_u, overrides=overrides)
    torch.cuda.synchronize()
    assert plan2 == plan and out2.data_ptr() % 16 == 2
    check_close(out2, lse2, *ref, what=f"{mode} unaligned {plan}")
    assert (len(made), len(direct_runs)) == (steps, steps), "an unaligned launch took the direct launcher"

    out.fill_(float("nan"))
    call()  # the aligned launch again, after the JIT's unaligned compile
    torch.cuda.synchronize()
    check_close(out, lse, *ref, what=f"{mode} aligned again {plan}")
    assert (len(made), len(direct_runs)) == (steps, 2 * steps)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "verify", "extend_packed"])
def test_gpu_cuda_graph_replay(mode):
    """Capture once; poison the outputs, change lengths and page tables in place, replay, compare."""
    kw = dict(batch=3, hq=16, hkv=4, d=128, page_size=16, lens=[500, 260, 70], spare_pages=4)
    if mode == "verify":
        kw["q_len"] = 4
    if mode == "extend_packed":
        kw.update(packed=True, q_lens=[40, 20, 30])
    t = make_inputs(**kw, device="cuda", seed=7)
    options = dict(kv_layout="NHD")
    out = torch.empty_like(t["q"])
    _call(t, options, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = _call(t, options, out=out)
    from tests.helpers import replay_with_new_lengths

    replay_with_new_lengths(graph, t, out, lse, lambda step: check_close(
        out, lse, *_reference(t, options), what=f"{mode} replay {step}"))


@pytest.mark.gpu
def test_gpu_compile_reduce_overhead_no_skip_no_recompile():
    import b12x_inductor as b12x

    t = make_inputs(batch=4, hq=32, hkv=8, d=128, page_size=16, lens=[300, 200, 100, 50], spare_pages=8,
                    device="cuda", seed=11)

    def step(q, k, v, pt, lens):
        out, lse = b12x.paged_attention(q, k, v, pt, lens, return_lse=True)
        return out * 2.0, lse

    gen = torch.Generator().manual_seed(5)
    cap = t["page_table"].shape[1] * 16
    check_compiled_steps(
        step, t, ("q", "k_cache", "v_cache", "page_table", "cache_seqlens"),
        lambda i: t["cache_seqlens"].copy_(torch.randint(1, cap + 1, (4,), generator=gen).int()),
        lambda: _reference(t, dict(kv_layout="NHD")), steps=5, what="compiled")


@pytest.mark.gpu
def test_gpu_warmup_precompiles():
    """warmup() compiles the bucket's kernels (a split plan: the split kernel and the merge); the first real call
    then compiles nothing new."""
    import b12x_inductor as b12x
    from b12x_inductor.kernels.triton import decode

    t = make_inputs(batch=2, hq=8, hkv=2, d=64, page_size=16, lens=[77, 1000], device="cuda", seed=2)
    problem_plan = _plan_of(t, dict(kv_layout="NHD"))
    from b12x_inductor import validate

    problem = validate.check_paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_table"],
                                             t["cache_seqlens"], None, kv_layout="NHD", causal=True, scale=0.3,
                                             window_left=-1, kv_start=None, sinks=None, softcap=0.0,
                                             k_descale=None, v_descale=None, out=None)
    b12x.warmup([problem], scale=0.3)
    assert problem_plan.num_splits > 1  # so the merge kernel is part of the bucket

    def compiled_variants():
        try:
            return sum(len(c[0]) for k in (decode.split_kernel, decode.merge_kernel) for c in k.device_caches.values())
        except (AttributeError, TypeError):
            return None

    before = compiled_variants()
    assert before is None or before >= 2
    _call(t, dict(kv_layout="NHD", scale=0.3))
    torch.cuda.synchronize()
    assert compiled_variants() == before, "the first call compiled a new kernel variant"
    assert problem_plan.family == "triton"


if __name__ == "__main__" and "--interpreter-worker" in sys.argv:
    _interpreter_worker()
