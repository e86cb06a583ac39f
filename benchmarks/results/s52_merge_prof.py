"""Session 52 (call E): per-kernel CUDA times (torch.profiler, 5 replays of a CUDA graph of 20 calls) of the MLA
plan's launches, and the merge kernel alone (triton.testing.do_bench_cudagraph) on fp32 and bf16 partials, with
the code the process imports; with tag "new" also the merge at other column blocks and warp counts. Run from the
project root as `python3 benchmarks/results/s52_merge_prof.py TAG`, once per version of the code, each in its own
process (the call copied main's versions of the changed files over the tree and back). Output:
h100_merge_prof_s52e.log."""
import sys, statistics
import torch, triton
from torch.profiler import profile, ProfilerActivity
from b12x_inductor.bench import mla as bm
from b12x_inductor.kernels.triton import decode

tag = sys.argv[1]
rows = [(32, 4096, 128), (1, 32768, 128), (32, 4096, 16), (64, 4096, 16)]
for b, L, h in rows:
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
    print(f"[{tag}] H{h} {b}x{L}: " + "; ".join(f"{k} {statistics.median(v):.1f}us x{len(v)}" for k, v in times.items()))
    del s, g


for nrows, splits in [(4096, 2), (128, 64), (512, 8), (8192, 2), (32, 64)]:
    res = []
    for dt in (torch.float32, torch.bfloat16):
        po = torch.randn(nrows * splits * 512, device="cuda").to(dt)
        pl = torch.randn(nrows * splits, device="cuda")
        out = torch.empty(nrows * 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(nrows, device="cuda")
        grid, meta = decode.merge_launch(nrows, 128, 512, splits)
        f = lambda: decode.merge_kernel[grid](po, pl, lse, out, lse, 0, **meta)
        res.append(f"{str(dt)[6:]} {triton.testing.do_bench_cudagraph(f)*1000:.1f}us (block {meta['BLOCK_DV']})")
        if tag == "new" and dt == torch.bfloat16:
            for bdv, w in [(64, 1), (128, 1), (128, 2), (256, 2), (512, 4), (32, 1)]:
                m2 = dict(meta, BLOCK_DV=bdv, num_warps=w)
                g2 = (nrows, 512 // bdv)
                f2 = lambda: decode.merge_kernel[g2](po, pl, lse, out, lse, 0, **m2)
                res.append(f"{bdv}/{w}w {triton.testing.do_bench_cudagraph(f2)*1000:.1f}")
    print(f"[{tag}] merge alone rows {nrows} splits {splits}: " + "; ".join(res))
