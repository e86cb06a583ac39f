"""Compiles the kernels of fixed configurations for sm_90a on this machine (no GPU needed) and writes their PTX,
normalized (debug sections, .loc/.file lines and comments dropped), one file each, with a hash per file:
how a refactor that should not change the generated code is checked without device time.

    python benchmarks/kernel_ptx.py OUT_DIR [--family cute|triton]   (cute: needs nvidia-cutlass-dsl)
    git stash; python benchmarks/kernel_ptx.py /tmp/before; git stash pop; python benchmarks/kernel_ptx.py /tmp/after
    diff -r /tmp/before /tmp/after

CuTe: each configuration compiles in its own process (the DSL names its PTX dump by kernel class, not by
configuration). Triton: through kernels/triton/_compile_only.py.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def normalize(ptx: str) -> str:
    ptx = re.split(r"\n\s*\.section\s*\.debug", ptx)[0]
    lines = [re.sub(r"//.*$", "", line) for line in ptx.splitlines()
             if not re.match(r"\s*(\.loc|\.file|//)", line)]
    return "\n".join(lines)


def cute_configs():
    import torch

    f8, bf, fp = torch.float8_e4m3fn, torch.bfloat16, torch.float16
    # split: (d, s, g, hkv, page, splits, block_m, tile_n, stages, warps, q, kv, causal, window, softcap, sm_count)
    # extend: (d, g, hq, batch, s, page, packed, tile_n, stages, q, causal, window, softcap, sm_count, block_m)
    # (the keys of kernels/cute/__init__.py's _compiled, _compiled_extend and _compiled_mla)
    return [
        ("split", (128, 1, 4, 8, 16, 8, 1, 64, 2, 4, bf, bf, False, False, False, 132)),
        ("split", (64, 1, 4, 8, 16, 8, 1, 64, 2, 4, bf, bf, False, True, True, 132)),
        ("split", (128, 1, 4, 8, 16, 8, 16, 128, 2, 4, bf, f8, False, False, False, 132)),
        ("split", (128, 1, 4, 8, 64, 8, 16, 128, 2, 4, fp, f8, False, True, False, 132)),
        ("split", (128, 4, 4, 8, 16, 8, 1, 64, 2, 4, fp, f8, True, True, False, 132)),
        ("split", (256, 2, 8, 2, 5, 4, 1, 64, 2, 4, bf, bf, True, False, True, 132)),
        ("extend", (128, 4, 32, 4, 1024, 16, False, 128, 3, bf, True, False, False, 132, 128)),
        ("extend", (64, 4, 32, 4, 2048, 64, True, 128, 4, bf, True, True, True, 132, 128)),
        ("extend", (128, 1, 8, 2, 300, 1, True, 128, 3, fp, False, False, False, 132, 128)),
        # mla: (s, hq, page, splits, tile_n, stages, q, causal, softcap, kv, warps: 12 mla.py, 8 mla_seesaw.py,
        # block_m: 64, or 16 mla_narrow.py, cluster: a pair of splits merged in the cluster)
        ("mla", (1, 128, 64, 2, 32, 4, bf, False, False, bf, 12, 64, False)),
        ("mla", (4, 16, 1, 1, 32, 4, bf, True, True, bf, 12, 64, False)),
        ("mla", (1, 128, 64, 2, 64, 2, bf, False, False, bf, 8, 64, False)),
        ("mla", (4, 16, 16, 1, 64, 2, fp, True, True, fp, 8, 64, False)),
        ("mla", (1, 16, 64, 4, 32, 4, bf, False, True, f8, 12, 64, False)),
        ("mla", (1, 16, 64, 4, 64, 2, bf, False, False, bf, 12, 16, False)),
        ("mla", (2, 8, 1, 1, 64, 2, fp, True, True, fp, 12, 16, False)),
        ("mla", (1, 16, 64, 4, 64, 5, bf, False, False, f8, 12, 16, False)),
        ("mla", (1, 16, 16, 1, 64, 5, fp, False, True, f8, 12, 16, False)),
        # D 256 extend (Gemma's): 48-key tiles in 3 stages at pages of 16, 32 x 4 at pages of 64 (plan.extend_tiles)
        ("extend", (256, 2, 16, 4, 4096, 16, False, 48, 3, bf, True, False, False, 132, 128)),
        ("extend", (256, 2, 16, 2, 700, 64, True, 32, 4, bf, True, True, True, 132, 128)),
        # MLA splits merged in a cluster pair (plan.mla_cluster_merge): the narrow kernel (float8), mla.py
        ("mla", (1, 16, 64, 2, 64, 5, bf, False, False, f8, 12, 16, True)),
        ("mla", (1, 128, 64, 2, 32, 4, bf, False, False, bf, 12, 64, True)),
    ]


def _cute_one(index: int) -> None:
    """In a worker process: compile configuration `index` for sm_90a (its PTX lands in CUTE_DSL_DUMP_DIR)."""
    import cutlass.cute as cute

    compile_ = cute.compile
    cute.compile = lambda *a, **k: compile_(*a, options="--gpu-arch sm_90a", **k)
    from b12x_inductor.kernels import cute as ck

    kind, key = cute_configs()[index]
    {"split": ck._compiled, "extend": ck._compiled_extend, "mla": ck._compiled_mla}[kind](key)


def cute_ptx(out: Path) -> None:
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(len(cute_configs())):
            dump = Path(tmp) / str(i)
            dump.mkdir()
            env = dict(os.environ, CUTE_DSL_DISABLE_FILE_CACHING="1", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump))
            procs.append((i, dump, subprocess.Popen([sys.executable, __file__, "--cute-worker", str(i)], env=env,
                                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        for i, dump, proc in procs:
            log = proc.communicate()[0].decode(errors="replace")
            files = sorted(dump.glob("*.ptx"))
            if proc.returncode or not files:
                raise SystemExit(f"cute configuration {i} did not compile:\n{log[-3000:]}")
            _write(out, f"cute_{i}_{cute_configs()[i][0]}", files[0].read_text())


def triton_ptx(out: Path) -> None:
    import torch

    from b12x_inductor.kernels import Options
    from b12x_inductor.kernels.triton import _compile_only
    from b12x_inductor.kernels.triton import plan as triton_plan
    from b12x_inductor.plan import Problem

    for q_len, packed in ((1, False), (4, False), (200, False), (300, True)):
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            p = Problem(batch=4, q_len=q_len, packed=packed, num_q_heads=32, num_kv_heads=8, head_dim=128,
                        page_size=16, max_pages=64, q_dtype=torch.bfloat16, kv_dtype=kv, kv_layout="NHD",
                        device_type="cuda", sm_count=132, capability=(9, 0))
            for w, cap in ((-1, 0.0), (127, 30.0)):
                opts = Options(kv_layout="NHD", causal=True, scale=0.088, window_left=w, softcap=cap)
                for k in _compile_only.precompile_for(p, triton_plan.plan(p), opts, 90):
                    _write(out, f"triton_{p.mode}_q{q_len}_{str(kv)[6:]}_w{w}_{k.name}", k.asm["ptx"])


def _write(out: Path, name: str, ptx: str) -> None:
    text = normalize(ptx)
    (out / f"{name}.ptx").write_text(text)
    print(f"{name} {hashlib.sha1(text.encode()).hexdigest()[:12]} {text.count(chr(10))} lines", flush=True)


def _check_tree() -> None:
    """The kernels compiled must be this tree's: `b12x_inductor.kernels` comes from the editable install, which
    follows the last `pip install -e` (a CI worktree's, say), not the working directory."""
    import b12x_inductor.kernels as kernels

    where = Path(kernels.__file__).resolve()
    if ROOT not in where.parents:
        raise SystemExit(f"kernel_ptx: b12x_inductor.kernels is imported from {where}, not from {ROOT}; "
                         f"run `pip install -e {ROOT}` first")


def main() -> None:
    _check_tree()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--family", choices=("cute", "triton", "both"), default="both")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.family in ("triton", "both"):
        triton_ptx(out)
    if args.family in ("cute", "both"):
        cute_ptx(out)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) == 3 and sys.argv[1] == "--cute-worker":
        _cute_one(int(sys.argv[2]))
    else:
        main()
