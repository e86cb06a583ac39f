"""Session 73 probe: the MLA H 16 rows' time per kernel (split kernel and merge kernel apart), float8 and bf16.

Each row's plan (select_plan) runs eagerly over input sets larger than L2, round robin, under torch.profiler;
CUPTI's kernel durations are summed per kernel name and divided by the calls. The graph-timed total (the bench's
method) is printed beside them. Written for a GPU session (none came in session 73: not yet run).
Usage: python3 benchmarks/results/s73_mla_kernel_times.py > log"""
import collections
import math

import torch
from torch.profiler import ProfilerActivity, profile

from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm

F8, BF16 = torch.float8_e4m3fn, torch.bfloat16
ROWS = [(32, 4096), (64, 4096), (128, 2048), (1, 32768)]
CALLS = 40


def main():
    bw, found = bk.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.2f} TB/s {found}", flush=True)
    for batch, length in ROWS:
        for dtype in (F8, BF16):
            n_sets = max(2, math.ceil(2 * bm.L2_BYTES / (batch * length * bm.WIDTH * dtype.itemsize)))
            sets = [bm.make_set(batch, length, 1, 16, dtype, seed=7 * i + 1) for i in range(n_sets)]
            label = bm.plan_label(sets[0])
            made = [bm.b12x_call(s) for s in sets]
            calls = [c for c, _ in made]
            calls[0]()
            torch.cuda.synchronize()
            bm.check(bm.reference_slices(sets[0]), made[0][1], f"{dtype} {batch}x{length}")
            us, _ = bm.time_graph(calls)
            for c in calls:
                c()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(CALLS):
                    calls[i % len(calls)]()
                torch.cuda.synchronize()
            per = collections.defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name].append(e.device_time)
            parts = {name[:60]: (len(t) / CALLS, sorted(t)[len(t) // 2]) for name, t in per.items()}
            gb = batch * length * bm.WIDTH * dtype.itemsize / 1e9
            print(f"{str(dtype)[6:]} H16 {batch}x{length} [{label}] graph {us:.1f} us ({gb / us * 1e3:.2f} TB/s);"
                  f" kernels (per call, median us): "
                  + "; ".join(f"{n} x{k:.0f} {m:.1f}" for n, (k, m) in parts.items()), flush=True)
            del sets, made, calls


if __name__ == "__main__":
    main()
