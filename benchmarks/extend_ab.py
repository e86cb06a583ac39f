"""A/B of versions of kernels/cute/extend.py in one process, interleaved, with SDPA on the same inputs.

    python3 benchmarks/extend_ab.py --versions main=kernels/cute/extend.py,new=/tmp/extend_new.py \
        --head-dims 128,64 --rows 16x1024,8x2048,4x4096 --passes 7

Each version is loaded from its file as `b12x_inductor.kernels.cute.extend` (so its relative imports resolve
to the installed package's storage.py, tma.py, ptx.py: every version must run with those) and compiled once
per kernel key; the op (`b12x.paged_attention`, 4D and packed q, as `python -m b12x_inductor.bench
kernels --packed` times them) then runs with that version's kernel. Every version is checked against the
reference on each row before it is timed. Passes go over SDPA and the versions in turn on the same input
sets, each pass starting one place later than the last (the place in a pass showed a bias of a few percent), so
drift and place reach every entry alike with --passes a multiple of the entries (SDPA, and 4D and packed per
version); the table gives each version's median over the passes.

Needs a CUDA GPU and the CuTe DSL (../shared/device/README.md). CUTE_DSL_DISABLE_FILE_CACHING=1 is set here:
the versions share one module and class name, which the DSL's file cache would not tell apart."""

import argparse
import importlib.util
import os
import statistics
import sys

os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"

import torch  # noqa: E402

from b12x_inductor.bench import kernels as bk  # noqa: E402
from b12x_inductor.kernels import cute  # noqa: E402

MODULE = "b12x_inductor.kernels.cute.extend"


def load(path: str):
    spec = importlib.util.spec_from_file_location(MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = mod  # relative imports inside the module resolve through its package
    spec.loader.exec_module(mod)
    return mod


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", required=True, help="name=path,... of extend.py versions")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--rows", default="16x1024,8x2048,4x4096", help="BxL extend rows (S = L, causal)")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--no-packed", action="store_true")
    args = ap.parse_args(argv)
    versions = {}
    for item in args.versions.split(","):
        name, _, path = item.partition("=")
        versions[name] = load(path)
    current = {"name": None}
    compiled = {}
    compile_one = cute._compiled_extend.__wrapped__

    def compiled_extend(key):  # the kernel of the version in use, compiled once per (version, key)
        name = current["name"]
        if (name, key) not in compiled:
            compiled[(name, key)] = compile_one(key)
        return compiled[(name, key)]

    def use(name):
        current["name"] = name
        sys.modules[MODULE] = versions[name]
        cute.extend = versions[name]

    cute._compiled_extend = compiled_extend
    bw, _ = bk.copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw:.2f} TB/s", flush=True)
    table = []
    for d in (int(x) for x in args.head_dims.split(",")):
        shape = bk.Shape(d=d)
        for size in args.rows.split(","):
            b, n = (int(x) for x in size.split("x"))
            sets = bk.make_sets(shape, "extend", b, n, n, torch.bfloat16)
            refs = bk.reference_slices(sets[0], shape, "extend")
            impls = [("4d", bk.b12x_call)] + ([] if args.no_packed else [("packed", bk.b12x_packed_call)])
            times = {}
            for name in versions:
                use(name)
                for kind, make in impls:
                    made = [make(s, shape, "extend") for s in sets]
                    made[0][0]()
                    torch.cuda.synchronize()
                    err = bk.reference_check(refs, made[0][1](), f"{name} {kind} D{d} {size}")
                    times[(name, kind)] = ([m[0] for m in made], [], err)
            sdpa = [bk.sdpa_call(s, shape, "extend") for s in sets]
            sdpa_us = []
            order = [None] + list(times)  # SDPA, then each (version, kind)
            for p in range(args.passes):
                # each pass starts one place later, so every entry takes every place in turn over len(order)
                # passes: the place in a pass showed a bias (the first after SDPA ran slower) on the H100
                for entry in order[p % len(order):] + order[:p % len(order)]:
                    if entry is None:
                        sdpa_us.append(bk.time_graph([c for c, _ in sdpa])[0])
                        continue
                    use(entry[0])
                    calls, us, _ = times[entry]
                    us.append(bk.time_graph(calls)[0])
            flops = lambda us: bk.row_metrics(shape, "extend", b, n, n, torch.bfloat16, us)["tflops"]  # noqa: E731
            s_us = statistics.median(sdpa_us)
            parts = [f"sdpa {s_us:.1f}us {flops(s_us):.0f}TF"]
            for (name, kind), (_, us, err) in times.items():
                m = statistics.median(us)
                parts.append(f"{name}-{kind} {m:.1f}us {flops(m):.0f}TF ({s_us / m:.2f}x sdpa; "
                             f"passes {' '.join(f'{u:.1f}' for u in us)}; err {err:.2g})")
                table.append((d, size, name, kind, m))
            print(f"[extend {size} D{d}] " + "; ".join(parts), flush=True)
            del sets, times, sdpa
            torch.cuda.empty_cache()
    base = next(iter(versions))
    print(f"\nmedian us, and against {base} (>1: faster than {base})")
    for d, size, name, kind, m in table:
        ref = next(x[4] for x in table if x[:2] == (d, size) and x[2] == base and x[3] == kind)
        print(f"D{d:<4} {size:<9} {kind:<7} {name:<10} {m:8.1f}  {ref / m:5.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
