"""Session 72 probe: where float8 MLA at H 16 spends its time (issue 18's 1.6x our bf16 is missed most at 32x4096).

1. fp8 H16 32x4096 (plan: mla_narrow.py, 4 splits and the merge kernel, 128 CTAs) beside the same tile at other
   split counts (variants).
2. The fixed cost and streaming rate of the fp8 and bf16 H16 plans at B=32 (the plan at 32x4096 forced at L 1024 to
   8192, so only the keys a CTA reads change; least squares t = a + L b, as s55_fixed_cost.py fits them).
No peers (CuTe installed). Usage: python3 benchmarks/results/s72_mla_fp8_probe.py > log"""
import torch

from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm
from b12x_inductor.plan import select_plan

F8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def fit(points):
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def plan_variant(batch, length, heads, dtype):
    s = bm.make_set(batch, length, 1, heads, dtype, seed=3)
    p = select_plan(bm._problem(s)[-1])
    del s
    return p, (p.num_splits, p.block_n, p.num_stages, p.num_warps, p.block_m) + (("vk",) if p.v_from_k else ())


def show(r):
    print(r["row"], {k: round(e["us"], 1) for k, e in r["impls"].items() if "us" in e},
          {k: e.get("error", e.get("reason")) for k, e in r["impls"].items() if "us" not in e}, flush=True)


def main():
    bw, found = bk.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.2f} TB/s {found}", flush=True)
    p, v = plan_variant(32, 4096, 16, F8)
    print("fp8 H16 32x4096 plan", p, flush=True)
    variants = [("cute", (n,) + v[1:]) for n in (2, 3, 5, 6, 8, 16)]
    show(bm.run_row("decode", 32, 4096, 1, 16, F8, set(), variants, bw))
    for dtype in (F8, BF16):
        p, v = plan_variant(32, 4096, 16, dtype)
        pts = []
        for length in (1024, 2048, 4096, 8192):
            r = bm.run_row("decode", 32, length, 1, 16, dtype, set(), [(p.family, v)], bw)
            show(r)
            cell = [e for k, e in r["impls"].items() if k != "b12x" and "us" in e]
            if cell:
                pts.append((length, cell[0]["us"]))
        if len(pts) >= 3:
            a, b = fit(pts)
            rate = 32 * bm.WIDTH * dtype.itemsize / (b * 1e-6) / 1e12
            print(f"## {dtype} H16 B=32 plan {v}: fixed {a:.1f} us, streaming {rate:.2f} TB/s; points {pts}",
                  flush=True)


if __name__ == "__main__":
    main()
