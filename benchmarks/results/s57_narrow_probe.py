"""Session 57 probe (frozen as it ran; the three-consumer kernel it names was reverted after it): the narrow MLA kernel (float8 latent cache, 16 heads) with its splits merged in their cluster,
and with three consumer warpgroups, against the plan as committed (two consumers, the merge kernel), the bf16 rows
of the same sizes after them, in one process.

Each float8 row of `python -m b12x_inductor.bench mla --rows fp8` is timed as the bench times it, under each
configuration in turn (kernels/cute/plan.py and mla_narrow.py constants set, the plan and kernel caches cleared):
  w12        the plan as committed (num_warps 12: two consumers; splits through the Triton merge kernel)
  w12-pair   MLA_NARROW_CLUSTER_SPLITS = 2 (a 2-split plan merges in its cluster)
  w16        num_warps 16 (three consumers; S_CHUNK 4, V_BUFS 1, the bytes loaded after the widening)
  w16-pair   three consumers, MLA_NARROW_CLUSTER_SPLITS = 2
  w12        again (the spread between two runs of one configuration)
then the bf16 H16 decode rows of the same sizes (the 64-row kernels, as planned).

Usage (CuTe installed): python3 s57_narrow_probe.py > log
"""
import torch

from b12x_inductor import ops
from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm
from b12x_inductor.kernels import cute
from b12x_inductor.kernels.cute import plan as cute_plan

TILE = dict(cute_plan.MLA_NARROW_TILE)
CONFIGS = {"w12": (12, 0), "w12-pair": (12, 2), "w16": (16, 0), "w16-pair": (16, 2)}


def configure(warps, pairs):
    cute_plan.MLA_NARROW_TILE = dict(TILE, num_warps=warps)
    cute_plan.MLA_NARROW_CLUSTER_SPLITS = pairs
    ops.plan_for.cache_clear()
    cute._compiled_mla.cache_clear()


def main():
    bw, found = bk.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.2f} TB/s {found}", flush=True)
    for mode, b, n, s, h, dt in bm.todo_rows({"fp8"}, bm.HEADS):
        for name in [*CONFIGS, "w12"]:
            configure(*CONFIGS[name])
            print(f"config {name}:", flush=True)
            try:
                bm.run_row(mode, b, n, s, h, dt, set(), [], bw)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"config {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    configure(*CONFIGS["w12"])
    for mode, b, n, s, h, dt in bm.todo_rows({"decode"}, (16,)):
        if b > 1:
            bm.run_row(mode, b, n, s, h, dt, set(), [], bw)


if __name__ == "__main__":
    main()
