"""Session 53: the merge kernel alone at the split plans' shapes (rows x splits, DV 512, bf16 partials), the
current kernel against the pre-session-52 tile kernel and candidate forms; then (CuTe installed) per-kernel
times of the MLA 1x32768 rows with the landed merge (its loop unrolled min(splits, 32) times), the old tile kernel
and the chunked candidate patched in. `python3 prof.py alone kernels`.
Written in session 53, run in session 54 on 6e62b5c (h100_merge_alone_s54.log, h100_merge_kernels_s54.log)."""
import sys, statistics
import torch, triton
import triton.language as tl
from b12x_inductor.kernels.triton import decode
from b12x_inductor.kernels.triton.common import LN2, sink_logit
from b12x_inductor.plan import next_pow2


@triton.jit
def old_merge(PART_O, PART_L, SINKS, OUT, LSE, has_sinks, HQ: tl.constexpr, DV: tl.constexpr,
              BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < DV
    part_l = tl.load(PART_L + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(part_l, 0)
    seen = m > float("-inf")
    m_f = tl.where(seen, m, 0.0)
    w = tl.exp2(part_l - m_f)
    denom = tl.sum(w, 0)
    sink = sink_logit(SINKS, row % HQ, has_sinks)
    m_new = tl.maximum(m_f, sink)
    w = w * tl.exp2(m_f - m_new)
    denom = denom * tl.exp2(m_f - m_new) + tl.exp2(sink - m_new)
    m_f = m_new
    denom = tl.where(seen, denom, 1.0)
    part_o = tl.load(PART_O + (row * NUM_SPLITS + offs_s)[:, None] * DV + offs_d[None, :],
                     mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    o = tl.sum(part_o * (w / denom)[:, None], 0)
    o = tl.where(seen, o, 0.0)
    tl.store(OUT + row * DV + offs_d, o.to(OUT.dtype.element_ty), mask=d_ok)
    if tl.program_id(1) == 0:
        tl.store(LSE + row, tl.where(seen, (m_f + tl.log2(denom)) * LN2, float("-inf")))


@triton.jit
def unroll_merge(PART_O, PART_L, SINKS, OUT, LSE, has_sinks, HQ: tl.constexpr, DV: tl.constexpr,
                 BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, UNROLL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < DV
    lse_row = PART_L + row * NUM_SPLITS
    m = tl.max(tl.load(lse_row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf")), 0)
    seen = m > float("-inf")
    sink = sink_logit(SINKS, row % HQ, has_sinks)
    m = tl.maximum(tl.where(seen, m, 0.0), sink)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    denom = tl.exp2(sink - m)
    for s in tl.range(0, NUM_SPLITS, loop_unroll_factor=UNROLL):
        w = tl.exp2(tl.load(lse_row + s) - m)
        denom += w
        acc += w * tl.load(PART_O + (row * NUM_SPLITS + s) * DV + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    denom = tl.where(seen, denom, 1.0)
    tl.store(OUT + row * DV + offs_d, tl.where(seen, acc / denom, 0.0).to(OUT.dtype.element_ty), mask=d_ok)
    if tl.program_id(1) == 0:
        tl.store(LSE + row, tl.where(seen, (m + tl.log2(denom)) * LN2, float("-inf")))


@triton.jit
def chunk_merge(PART_O, PART_L, SINKS, OUT, LSE, has_sinks, HQ: tl.constexpr, DV: tl.constexpr,
                BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < DV
    lse_row = PART_L + row * NUM_SPLITS
    m = tl.max(tl.load(lse_row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf")), 0)
    seen = m > float("-inf")
    sink = sink_logit(SINKS, row % HQ, has_sinks)
    m = tl.maximum(tl.where(seen, m, 0.0), sink)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    wsum = tl.zeros([CHUNK], tl.float32)
    for s0 in tl.range(0, NUM_SPLITS, CHUNK):
        s = s0 + offs_c
        s_ok = s < NUM_SPLITS
        w = tl.exp2(tl.load(lse_row + s, mask=s_ok, other=float("-inf")) - m)
        wsum += w
        p = tl.load(PART_O + (row * NUM_SPLITS + s)[:, None] * DV + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(p * w[:, None], 0)
    denom = tl.sum(wsum, 0) + tl.exp2(sink - m)
    denom = tl.where(seen, denom, 1.0)
    tl.store(OUT + row * DV + offs_d, tl.where(seen, acc / denom, 0.0).to(OUT.dtype.element_ty), mask=d_ok)
    if tl.program_id(1) == 0:
        tl.store(LSE + row, tl.where(seen, (m + tl.log2(denom)) * LN2, float("-inf")))


def bench(f):
    return triton.testing.do_bench_cudagraph(f) * 1000


def alone():
    for nrows, splits in [(16, 128), (128, 64), (32, 64), (512, 8), (8192, 2), (4096, 2)]:
        po = torch.randn(nrows * splits * 512, device="cuda").to(torch.bfloat16)
        pl = torch.randn(nrows * splits, device="cuda") * 3
        out = torch.empty(nrows * 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(nrows, device="cuda")
        ref = torch.empty_like(out)
        grid, meta = decode.merge_launch(nrows, 128, 512, splits)
        res = []
        f = lambda: decode.merge_kernel[grid](po, pl, lse, ref, lse, 0, **meta)
        res.append(f"cur {bench(f):.1f} ({meta['BLOCK_DV']}/{meta['num_warps']}w)")
        sp2 = next_pow2(splits)
        bdv = min(512, max(16, 4096 // sp2))
        g = (nrows, 512 // bdv)
        f = lambda: old_merge[g](po, pl, lse, out, lse, 0, HQ=128, DV=512, BLOCK_DV=bdv, NUM_SPLITS=splits,
                                 SPLITS_P2=sp2, num_warps=4, num_stages=1)
        res.append(f"old {bench(f):.1f} ({bdv})")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        for u in (8, 16):
            f = lambda: unroll_merge[grid](po, pl, lse, out, lse, 0, HQ=128, DV=512, BLOCK_DV=meta["BLOCK_DV"],
                                           NUM_SPLITS=splits, SPLITS_P2=sp2, UNROLL=u,
                                           num_warps=meta["num_warps"], num_stages=2)
            res.append(f"unroll{u} {bench(f):.1f}")
        for c in (4, 8):
            if c > sp2:
                continue
            for bdv, w in ((64, 1), (128, 1), (256, 2), (512, 4)):
                g = (nrows, 512 // bdv)
                f = lambda: chunk_merge[g](po, pl, lse, out, lse, 0, HQ=128, DV=512, BLOCK_DV=bdv,
                                           NUM_SPLITS=splits, SPLITS_P2=sp2, CHUNK=c, num_warps=w, num_stages=2)
                t = bench(f)
                torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                res.append(f"c{c}/{bdv}/{w}w {t:.1f}")
        print(f"merge rows {nrows} splits {splits}: " + "; ".join(res), flush=True)


def per_kernel(tag):
    from torch.profiler import profile, ProfilerActivity
    from b12x_inductor.bench import mla as bm
    for b, L, h in [(1, 32768, 16), (1, 32768, 128), (32, 4096, 16)]:
        s = bm.make_set(b, L, 1, h, torch.bfloat16, 0)
        call, out = bm.b12x_call(s)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                call()
        g.replay(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
        times = {}
        for e in p.events():
            if e.device_type.name == "CUDA":
                times.setdefault(e.name[:40], []).append(e.device_time)
        print(f"[{tag}] H{h} {b}x{L}: " + "; ".join(f"{k} {statistics.median(v):.1f}us x{len(v)}"
                                                  for k, v in times.items()), flush=True)
        del s, g


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    if "alone" in sys.argv:
        alone()
    if "kernels" in sys.argv:
        per_kernel("cur")
        cur_launch, cur_kernel = decode.merge_launch, decode.merge_kernel

        def tile_launch(rows, hq, dv, splits):
            grid, meta = cur_launch(rows, hq, dv, splits)
            sp2 = next_pow2(splits)
            bdv = min(next_pow2(dv), max(16, 4096 // sp2))
            meta = {k: v for k, v in meta.items() if k != "UNROLL"}
            return (rows, -(-dv // bdv)), dict(meta, BLOCK_DV=bdv, num_warps=4, num_stages=1)
        decode.merge_launch, decode.merge_kernel = tile_launch, old_merge
        per_kernel("tile")

        def chunk_launch(rows, hq, dv, splits):
            grid, meta = cur_launch(rows, hq, dv, splits)
            meta = {k: v for k, v in meta.items() if k != "UNROLL"}
            return grid, dict(meta, CHUNK=min(8, next_pow2(splits)))
        decode.merge_launch, decode.merge_kernel = chunk_launch, chunk_merge
        per_kernel("chunk8")
