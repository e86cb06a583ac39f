"""Session 54: the merge alone, its loop form (merge_launch's meta) against the TILE form (all splits' BLOCK_DV
columns as one tile) over BLOCK_DV and warps, at the rows x splits x DV of the split plans. Each TILE result is
checked against the loop form's. Run in session 54 before merge_launch chose TILE (so its first column is the loop
form; h100_merge_tile_sweep_s54.log): `python3 s54_merge_tile_sweep.py`."""
import torch, triton
from b12x_inductor.kernels.triton import decode
from b12x_inductor.plan import next_pow2

print(torch.cuda.get_device_name(), flush=True)
for nrows, splits, dv in [(16, 128, 512), (28, 128, 128), (32, 128, 128), (64, 128, 128), (8, 128, 512),
                          (32, 64, 128), (16, 64, 512), (128, 64, 512), (64, 64, 128), (256, 8, 128), (224, 16, 128)]:
    po = torch.randn(nrows * splits * dv, device="cuda").to(torch.bfloat16)
    pl = torch.randn(nrows * splits, device="cuda") * 3
    ref, out = (torch.empty(nrows * dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.empty(nrows, device="cuda")
    grid, meta = decode.merge_launch(nrows, 8, dv, splits)
    f = lambda: decode.merge_kernel[grid](po, pl, lse, ref, lse, 0, **meta)
    base = triton.testing.do_bench_cudagraph(f) * 1000
    res = [f"{'tile' if meta['TILE'] else 'loop'} {base:.2f} ({meta['BLOCK_DV']}/{meta['num_warps']}w)"]
    if meta["TILE"]:  # the loop form too
        m2 = dict(meta, TILE=False, BLOCK_DV=64, UNROLL=min(splits, 64), num_warps=1, num_stages=2)
        g2 = (nrows, -(-dv // 64))
        t = triton.testing.do_bench_cudagraph(lambda: decode.merge_kernel[g2](po, pl, lse, out, lse, 0, **m2)) * 1000
        res.append(f"loop {t:.2f}")
    sp2 = next_pow2(splits)
    for bdv in (16, 32, 64, 128):
        if bdv > dv or sp2 * bdv > 16384 or sp2 * bdv < 1024:
            continue
        for w in (2, 4, 8):
            m = dict(meta, TILE=True, BLOCK_DV=bdv, UNROLL=1, num_warps=w, num_stages=1)
            g = (nrows, -(-dv // bdv))
            t = triton.testing.do_bench_cudagraph(lambda: decode.merge_kernel[g](po, pl, lse, out, lse, 0, **m)) * 1000
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
            res.append(f"t{bdv}/{w}w {t:.2f}")
    print(f"rows {nrows} splits {splits} dv {dv}: " + "; ".join(res), flush=True)
