"""Session 56 probe: MLA splits merged in their cluster (plan.mla_cluster_merge) against the same plan's partials
and the Triton merge kernel, FlashInfer beside them, in one process.

Each row of `python -m b12x_inductor.bench mla`'s default run is timed as the bench times it, first as the code
plans it (2 to 8 splits of the 64-row kernels: one cluster a row block, merged through distributed shared
memory; MLA_CLUSTER_SPLITS was 8 when it ran), then, where that plan has 2 to 8 splits, again with
MLA_CLUSTER_SPLITS = 1 (the split kernel writes
partials to scratch and the merge kernel combines them: the code before session 56), the two runs back to back.

Usage (FlashInfer and CuTe installed): python3 s56_cluster_probe.py > log
"""
import torch

from b12x_inductor import ops
from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm
from b12x_inductor.kernels.cute import plan as cute_plan


def main():
    cute_plan.MLA_CLUSTER_SPLITS = 8  # as it ran: every plan of 2 to 8 splits in a cluster
    bw, found = bk.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.2f} TB/s {found}", flush=True)
    for mode, b, n, s, h, dt in bm.todo_rows({"decode", "verify", "fp8"}, bm.HEADS):
        r = bm.run_row(mode, b, n, s, h, dt, {"flashinfer"}, [], bw)
        plan = r["impls"].get("b12x", {}).get("plan", "")
        splits, m = int(plan.split()[1].split(":")[0]), plan.split()[3]
        if 2 <= splits <= cute_plan.MLA_CLUSTER_SPLITS and m == "m64":
            cute_plan.MLA_CLUSTER_SPLITS = 1
            ops.plan_for.cache_clear()
            try:
                bm.run_row(mode, b, n, s, h, dt, set(), [], bw)  # logs "[row] b12x ..." with the merge kernel
            finally:
                cute_plan.MLA_CLUSTER_SPLITS = 8
                ops.plan_for.cache_clear()
            print(f"^ the row above: the Triton merge kernel (MLA_CLUSTER_SPLITS = 1), after the cluster merge",
                  flush=True)


if __name__ == "__main__":
    main()
