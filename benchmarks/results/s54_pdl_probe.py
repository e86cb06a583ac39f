"""Session 54 probe: (1) where the time of a split-KV call goes (per-kernel durations and the gaps between them in
a graph replay), (2) the merge kernel launched with programmatic dependent launch (PDL: griddepcontrol.wait at its
start, launch_pdl=True), alone ('pdl') and with the Triton split kernel triggering its dependents early
('pdl+trig'), (3) the pre-session-52 tile merge where a row has >= 128 splits ('tile'). Each variant's output is
compared bit for bit with the landed path's. Run in session 54 on 6e62b5c (the merge's loop form at every split
count; h100_pdl_probe_s54.log): `python3 s54_pdl_probe.py gqa`, then with CuTe `... mla gqa fp8`."""
import importlib.util, math, os, re, statistics, sys, pathlib
import torch
from b12x_inductor.kernels.triton import decode
from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm

src = pathlib.Path(decode.__file__).read_text().replace("from .common import", "from b12x_inductor.kernels.triton.common import")


def variant_module(name, merge_wait, split_trigger):
    s = src
    if merge_wait:
        s = s.replace('    row = tl.program_id(0).to(tl.int64)  # (b * S + token) * Hq + head\n',
                      '    tl.extra.cuda.gdc_wait()\n    row = tl.program_id(0).to(tl.int64)  # (b * S + token) * Hq + head\n', 1)
        assert "gdc_wait" in s
    if split_trigger:
        s = s.replace('    pid = tl.program_id(0)\n    split = tl.program_id(1)\n',
                      '    tl.extra.cuda.gdc_launch_dependents()\n    pid = tl.program_id(0)\n    split = tl.program_id(1)\n', 1)
        assert "gdc_launch_dependents" in s
    path = f"/tmp/pdl_{name}.py"
    pathlib.Path(path).write_text(s)
    spec = importlib.util.spec_from_file_location(f"pdl_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ORIG = (decode.split_kernel, decode.merge_kernel, decode.merge_launch)
PDL = variant_module("w", True, False)
TRIG = variant_module("wt", True, True)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s54_merge_prof as prof  # noqa: E402  (old_merge: the tile merge)


def use(variant):
    decode.split_kernel, decode.merge_kernel, decode.merge_launch = ORIG
    if variant in ("pdl", "pdl+trig"):
        mod = PDL if variant == "pdl" else TRIG
        decode.merge_kernel = mod.merge_kernel
        if variant == "pdl+trig":
            decode.split_kernel = mod.split_kernel

        def launch(rows, hq, dv, splits):
            grid, meta = ORIG[2](rows, hq, dv, splits)
            return grid, dict(meta, launch_pdl=True)
        decode.merge_launch = launch
    elif variant == "tile":
        def launch(rows, hq, dv, splits):
            grid, meta = ORIG[2](rows, hq, dv, splits)
            if splits < 128:
                return grid, meta
            sp2 = 1 << (splits - 1).bit_length()
            bdv = min(1 << (dv - 1).bit_length(), max(16, 4096 // sp2))
            meta = {k: v for k, v in meta.items() if k != "UNROLL"}
            decode.merge_kernel = prof.old_merge
            return (rows, -(-dv // bdv)), dict(meta, BLOCK_DV=bdv, num_warps=4, num_stages=1)
        decode.merge_launch = launch


def timeline(call):
    """(kernel-busy us, span us) per call: one graph of 20 calls, profiled over 5 replays."""
    from torch.profiler import profile, ProfilerActivity
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            call()
    g.replay(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    ev = sorted([(e.time_range.start, e.time_range.end, e.name[:24]) for e in p.events() if e.device_type.name == "CUDA"])
    busy = sum(e - s for s, e, _ in ev)
    names = {}
    for s, e, n in ev:
        names.setdefault(n, []).append(e - s)
    gaps = [b[0] - a[1] for a, b in zip(ev, ev[1:]) if b[0] - a[1] < 50]
    return busy / 100, statistics.median(gaps) if gaps else 0, {n: round(statistics.median(v), 2) for n, v in names.items()}


def run(label, sets, make, variants):
    base_out = None
    res = []
    for v in variants:
        use(v)
        try:
            calls, outs = zip(*[make(s) for s in sets])
            for c in calls:
                c()
            torch.cuda.synchronize()
            us, method = bk.time_graph(list(calls))
            o = outs[0]() if callable(outs[0]) else outs[0]
            o = o.clone()
            if base_out is None:
                base_out = o
                same = "base"
            else:
                same = "same" if torch.equal(o, base_out) else f"DIFF {(o.float() - base_out.float()).abs().max().item():.3g}"
            extra = ""
            if v in ("base", "pdl"):
                busy, gap, names = timeline(calls[0])
                extra = f" [busy {busy:.1f} gap {gap:.2f} {names}]"
            res.append(f"{v} {us:.2f}us {same}{extra}")
        except Exception as e:
            res.append(f"{v} ERROR {type(e).__name__}: {str(e)[:200]}")
    use("base")
    print(f"[{label}] " + "; ".join(res), flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "mla" in sys.argv:
        for b, L, h in [(1, 32768, 16), (1, 32768, 128), (32, 4096, 128), (32, 4096, 16)]:
            nsets = max(2, math.ceil(2 * bm.L2_BYTES / (b * L * bm.WIDTH * 2)))
            sets = [bm.make_set(b, L, 1, h, torch.bfloat16, 17 * i + b) for i in range(nsets)]
            run(f"mla H{h} {b}x{L}", sets, bm.b12x_call, ["base", "pdl", "tile"] if L == 32768 and h == 16 else ["base", "pdl"])
            del sets; torch.cuda.empty_cache()
    if "gqa" in sys.argv:
        rows = [(bk.DEFAULT_SHAPE, 1, 32768, torch.bfloat16), (bk.DEFAULT_SHAPE, 8, 8192, torch.bfloat16),
                (bk.QWEN2_GQA7, 1, 32768, torch.bfloat16), (bk.DEFAULT_SHAPE, 32, 4096, torch.bfloat16)]
        if "fp8" in sys.argv:
            rows = [(bk.DEFAULT_SHAPE, 1, 32768, torch.float8_e4m3fn), (bk.DEFAULT_SHAPE, 8, 8192, torch.float8_e4m3fn)]
        for shape, b, L, dt in rows:
            nsets = max(2, math.ceil(2 * 60e6 / (b * L * shape.hkv * shape.d * 2 * dt.itemsize)))
            sets = [bk.make_set(shape, "decode", b, L, 1, dt, 17 * i + b) for i in range(nsets)]
            mk = lambda s: bk.b12x_call(s, shape, "decode")
            vs = ["base", "pdl", "pdl+trig"] + (["tile"] if shape is bk.QWEN2_GQA7 and L == 32768 else [])
            run(f"gqa hq{shape.hq}/{shape.hkv} {b}x{L} {dt}", sets, mk, vs)
            del sets; torch.cuda.empty_cache()
