"""Session 61 probe: where an extend item's fixed cost goes, from SM clock stamps in the consumer loop.

A copy of kernels/cute/extend.py with stamps added (a source transform: thread 0 of each consumer warpgroup writes
`clock() - t0` as float32 at 8 points of each item, and the item's key tiles) is loaded in place of the module and
run on one bench row. The stamps go into the sinks pointer, whose reads the copy disables (has_sinks never
matches), so no launch argument changes. Its output is checked against the unmodified kernel's (same inputs) and
both are timed, so the stamps' own cost shows. Stamps per item j of a consumer warpgroup:

  0 loop top   1 Q landed (_wait_q)   2 K of tile 0 landed   3 S(0) done   4 softmax(0) done
  5 open item closed (its P V waited, its rows stored)   6 tile loop done   7 item end (after _finalize)

Usage (GPU, CuTe DSL installed; from the project root): python3 benchmarks/results/s61_item_timeline.py [D] [BxL]
"""
import dataclasses
import importlib.util
import math
import os
import statistics
import sys
import tempfile

import torch

D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
B, L = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "16x1024").split("x"))
JM, NE = 64, 9  # items a consumer warpgroup, at most; slots an item (8 stamps + its key tiles)
NAMES = ["Q landed", "K0 landed", "S0 done", "softmax0", "open closed", "tile loop", "finalize"]

import b12x_inductor.kernels.cute as kc  # noqa: E402
import b12x_inductor.kernels.cute.extend as ext  # noqa: E402

src = open(ext.__file__).read()


def sub(old, new, count=1):
    global src
    assert src.count(old) == count, (old, src.count(old))
    src = src.replace(old, new)


def stamp(e, indent, extra=""):
    pad = " " * indent
    return (f"{pad}if ctid % 128 == 0 and jj < {JM}:\n"
            f"{pad}    trb[((cta * 4 + wgc) * {JM} + jj) * {NE} + {e}] = Float32(cute.arch.clock() - t0)\n{extra}")


sub("        if has_sinks != 0:\n", "        if has_sinks == 123456789:  # the trace buffer is no sinks\n")
sub("            fin = cute.make_rmem_tensor((4,), Float32)\n",
    "            fin = cute.make_rmem_tensor((4,), Float32)\n            t0 = cute.arch.clock()\n"
    "            jj = Int32(0)\n            trb = cute.make_tensor(sinks_ptr, cute.make_layout((1 << 30,)))\n")
sub("                b, r0, n_b, row0, pad_from = nb, nr0, nn_b, nrow0, npad_from\n",
    "                b, r0, n_b, row0, pad_from = nb, nr0, nn_b, nrow0, npad_from\n" + stamp(0, 16))
sub("                    self._wait_q(wgc)\n", "                    self._wait_q(wgc)\n" + stamp(1, 20))
sub("                        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, done % NS), stage_phase(done, NS))\n",
    "                        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, done % NS), stage_phase(done, NS))\n"
    + stamp(2, 24))
sub("                        warpgroup.wait_group(1 if OV else 0)\n",
    "                        warpgroup.wait_group(1 if OV else 0)\n" + stamp(3, 24))
sub("                    if const_expr(OV):\n                        if n_tiles == 0:\n",
    stamp(4, 20) + "                    if const_expr(OV):\n                        if n_tiles == 0:\n")
sub("issued=True)\n                        acc_o.fill(0.0)\n",
    "issued=True)\n                        acc_o.fill(0.0)\n" + stamp(5, 24))
sub("                    if n_tiles > 0:\n                        # the last tile's P into registers",
    stamp(6, 20) + "                    if n_tiles > 0:\n                        # the last tile's P into registers")
sub("out_ptr, lse_rows, tidx % 32)\n                    done = done + n_tiles\n",
    "out_ptr, lse_rows, tidx % 32)\n                    done = done + n_tiles\n" + stamp(7, 20)
    + f"                    if ctid % 128 == 0 and jj < {JM}:\n"
    f"                        trb[((cta * 4 + wgc) * {JM} + jj) * {NE} + 8] = Float32(n_tiles)\n"
    "                    jj = jj + 1\n")

# a real file: the DSL reads the kernel's source (inspect) to rewrite its control flow
path = os.path.join(tempfile.mkdtemp(), "extend_traced.py")
with open(path, "w") as f:
    f.write(src)
spec = importlib.util.spec_from_file_location(ext.__name__, path)
traced = importlib.util.module_from_spec(spec)

from b12x_inductor import kernels, validate  # noqa: E402
from b12x_inductor.bench import kernels as bk  # noqa: E402
from b12x_inductor.plan import family_plan  # noqa: E402

shape = dataclasses.replace(bk.DEFAULT_SHAPE, d=D)
s = bk.make_set(shape, "extend", B, L, L, torch.bfloat16, seed=3)
problem = validate.check_paged_attention(
    s["q"], s["k_cache"], s["v_cache"], s["page_table"], s["cache_seqlens"], None, kv_layout="NHD", causal=True,
    scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None, v_descale=None, out=None)
plan = family_plan(problem, "cute")
opts = kernels.Options.of(D, kv_layout="NHD", causal=True, scale=None, window_left=-1, softcap=0.0)
lse = torch.empty(s["q"].shape[:-1], device="cuda")
call = kernels.Call(**{k: s.get(k) for k in kernels.Call.INPUTS}, out=s["out"], lse=lse, scratch=None,
                    options=opts, plan=plan)
items = shape.hq * B * -(-L // plan.block_m)
ctas = min(items, torch.cuda.get_device_properties(0).multi_processor_count)
buf = torch.full((ctas * 4 * JM * NE,), float("nan"), device="cuda")


def launch(trace):
    inputs = call.inputs()
    if trace:
        inputs["sinks"] = buf
    kc._run_extend(inputs, out=s["out"], lse=lse, options=opts.as_kwargs(), plan=plan.constants())


def timed(trace, n=20):
    launch(trace)
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch(trace)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


t_plain = timed(False)
ref = s["out"].clone()
sys.modules[ext.__name__] = traced
spec.loader.exec_module(traced)
kc._compiled_extend.cache_clear()
t_traced = timed(True)
diff = (s["out"].float() - ref.float()).abs().max().item()
print(f"D {D} {B}x{L} plan {plan}: plain {t_plain:.1f} us (eager launches), traced {t_traced:.1f} us, "
      f"out max diff {diff:.3g}, CTAs {ctas}, items {items}")

x = buf.view(ctas, 4, JM, NE).cpu()
rows = {}  # n_tiles -> list of per-phase durations (cycles)
gaps = []
for c in range(ctas):
    for w in range(4):
        it = x[c, w]
        ok = ~torch.isnan(it[:, 0])
        n = int(ok.sum())
        for j in range(n):
            e = it[j]
            nt = int(e[8]) if not math.isnan(e[8]) else -1
            d = [e[i + 1] - e[i] for i in range(7)]
            nxt = it[j + 1, 0] - e[0] if j + 1 < n else float("nan")
            rows.setdefault(nt, []).append([float(v) for v in d] + [float(nxt)])
print("SM clock cycles from the stamp before (median over items), by the item's key tiles; item: loop top to the "
      "next item's loop top")
print("tiles  count  " + "  ".join(f"{n:>11}" for n in NAMES) + "        item")
for nt in sorted(rows):
    r = torch.tensor(rows[nt])
    med = [torch.nanmedian(r[:, i]).item() for i in range(8)]
    print(f"{nt:5d} {len(r):6d}  " + "  ".join(f"{m:11.0f}" for m in med))
