"""Session 55 probe: a decode call's fixed cost and its streaming rate, b12x and FlashInfer side by side.

For each group, the anchor row's plan (what select_plan picks at the anchor size) is forced at every length of
the group as a variant, so the grid and tiles stay the same and only the keys per program change; the plan
select_plan picks at each length ("b12x") and the FlashInfer peer run beside it. A least-squares fit
t = a + L * b over the lengths gives a, the cost that does not scale with the keys (launch, first loads, the last
programs' tail, the merge and its gap), and bytes(L) / (L * b), the rate at which the keys stream. A 1-element
fill timed the same way is the floor of one graph-launched kernel.

Usage (FlashInfer and, for the MLA groups, CuTe installed): python3 s55_fixed_cost.py [gqa] [mla] > log
"""
import sys

import torch

from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm


def fit(points):
    """(a us, b us per key) of t = a + L b, least squares over [(L, t)]."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def report(title, bytes_per_key, series):
    print(f"## {title}", flush=True)
    for name, pts in series.items():
        if len(pts) < 3:
            print(f"{name}: too few points {pts}")
            continue
        a, b = fit(pts)
        rate = bytes_per_key / (b * 1e-6) / 1e12
        print(f"{name}: fixed {a:.1f} us, streaming {rate:.2f} TB/s; points "
              + ", ".join(f"L={x}: {y:.1f}" for x, y in pts), flush=True)


def gqa(bw):
    shape = bk.DEFAULT_SHAPE
    for batch, anchor, lengths in ((1, 32768, (8192, 16384, 32768, 65536)), (8, 8192, (2048, 4096, 8192, 16384))):
        s = bk.make_set(shape, "decode", batch, anchor, 1, torch.bfloat16, seed=3)
        from b12x_inductor import validate
        from b12x_inductor.plan import select_plan
        p = select_plan(validate.check_paged_attention(
            s["q"], s["k_cache"], s["v_cache"], s["page_table"], s["cache_seqlens"], None, kv_layout="NHD",
            causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None,
            v_descale=None, out=None))
        del s
        v = (p.num_splits, p.block_n, p.num_stages, p.num_warps, p.block_m)
        vname = f"b12x-{p.family}-v" + ":".join(map(str, v))
        series = {}
        for length in lengths:
            row = bk.Row("decode", batch, length, 1, torch.bfloat16)
            r = bk.run_row(row, {"flashinfer"}, [(p.family, v)], bw)
            for name, e in r["impls"].items():
                if "us" in e:
                    series.setdefault(name.replace(vname, "anchor plan " + vname), []).append((length, e["us"]))
        report(f"GQA decode B={batch} (anchor {batch}x{anchor}, plan {p.family} {v})",
               batch * shape.hkv * shape.d * 2 * 2, series)


def mla(bw):
    for heads, batch, anchor, lengths in ((128, 32, 4096, (1024, 2048, 4096, 8192)),
                                          (16, 128, 2048, (512, 1024, 2048, 4096))):
        s = bm.make_set(batch, anchor, 1, heads, torch.bfloat16, seed=3)
        from b12x_inductor.plan import select_plan
        p = select_plan(bm._problem(s)[-1])
        del s
        v = (p.num_splits, p.block_n, p.num_stages, p.num_warps, p.block_m) + (("vk",) if p.v_from_k else ())
        series = {}
        for length in lengths:
            r = bm.run_row("decode", batch, length, 1, heads, torch.bfloat16, {"flashinfer"}, [(p.family, v)], bw)
            for name, e in r["impls"].items():
                if "us" in e:
                    series.setdefault(name, []).append((length, e["us"]))
        report(f"MLA decode H{heads} B={batch} (anchor {batch}x{anchor}, plan {p.family} {v})",
               batch * bm.WIDTH * 2, series)


def main():
    bw, found = bk.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.2f} TB/s {found}", flush=True)
    x = torch.zeros(1, device="cuda")
    us, _ = bk.time_graph([lambda: x.fill_(1.0)])
    print(f"one 1-element fill kernel in a graph: {us:.2f} us", flush=True)
    what = sys.argv[1:] or ["gqa", "mla"]
    if "gqa" in what:
        gqa(bw)
    if "mla" in what:
        mla(bw)


if __name__ == "__main__":
    main()
