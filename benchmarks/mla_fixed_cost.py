"""The CuTe MLA kernels' fixed cost per CTA on a GPU: one split and one wave of 128 CTAs (H 128 with B 64, H 16
with B 128), the key count L swept from 512 to 8192, each kernel alone (`bench mla`'s method: CUDA graphs,
inputs larger than L2, median, the output checked against the reference first), and the time fitted as
(L / 64) * t + o: t the steady cost of 64 keys, o what a CTA pays once (launch, prologue, epilogue).

    python benchmarks/mla_fixed_cost.py

Results: benchmarks/results/h200.md, "Session 30".
"""

import math

import torch

from b12x_inductor.bench import mla as bm

# (heads, batch, family, (num_splits, block_n, num_stages, num_warps)): the seesaw kernel, mla.py at H16 and H128
ROWS = [(128, 64, "cute", (1, 64, 2, 8)), (16, 128, "cute", (1, 32, 4, 12)), (128, 64, "cute", (1, 32, 4, 12))]
LENGTHS = (512, 1024, 2048, 4096, 8192)


def main() -> None:
    for heads, batch, fam, var in ROWS:
        res = []
        for length in LENGTHS:
            n_sets = max(2, math.ceil(2 * bm.L2_BYTES / (batch * length * bm.WIDTH * 2)))
            sets = [bm.make_set(batch, length, 1, heads, torch.bfloat16, seed=17 * i + batch) for i in range(n_sets)]
            refs = bm.reference_slices(sets[0])
            made = [bm.b12x_variant_call(s, fam, var) for s in sets]
            calls, outs = [c for c, _ in made], [o for _, o in made]
            calls[0]()
            torch.cuda.synchronize()
            bm.check(refs, outs[0], f"H{heads} B{batch} L{length}")
            us, _ = bm.time_graph(calls)
            res.append((length / 64, us))
            print(f"H{heads} B{batch} L{length} {fam}{var}: {us:.1f} us", flush=True)
        mx = sum(x for x, _ in res) / len(res)
        my = sum(y for _, y in res) / len(res)
        t = sum((x - mx) * (y - my) for x, y in res) / sum((x - mx) ** 2 for x, _ in res)
        print(f"fit H{heads} {var}: {t:.3f} us per 64 keys, fixed {my - t * mx:.1f} us", flush=True)


if __name__ == "__main__":
    main()
