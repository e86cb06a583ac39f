"""Session 50 (h200.md): with the split kernel's S = 1 rows free of G, which tile of the 16-row D 128 decode
tile makes one wave at 400 to 2048 programs (B x Hkv) on the H200: the plan, each row's variants
(splits:block_n:stages:warps, warps 0 = the plan's) and FlashInfer in one process, through
b12x_inductor.bench.kernels.run_row (the bench's inputs, reference check and CUDA-graph timing).
Env: ROWS (final: the plan as committed and the bench's decode / verify grid), PEERS (default flashinfer; empty for none), ONLY (row labels, comma-separated), NOFA3 (leave FlashInfer's fa3
backend out), OUT, TAG. `--warm` builds FlashInfer's JIT modules for the rows and exits."""
import json, os, sys
import torch
from b12x_inductor.bench import kernels as K

bf = torch.bfloat16
QW, L70 = K.QWEN2_GQA7, K.LLAMA70_GQA8


def v(*specs):
    return [tuple(int(x) for x in s.split(":")) + (0,) for s in specs]


ROWS = [  # (row, variants)
    (K.Row("decode", 50, 4096, 1, bf), v("1:32:3", "2:32:3", "1:32:4", "1:64:2")),
    (K.Row("verify", 52, 4096, 4, bf), v("1:32:3", "2:32:3", "1:32:4", "1:64:3")),
    (K.Row("decode", 64, 2048, 1, bf), v("1:32:3", "2:32:2")),
    (K.Row("decode", 88, 4096, 1, bf), v("1:32:3", "1:32:2")),
    (K.Row("decode", 96, 4096, 1, bf), v("1:32:3", "1:32:2")),
    (K.Row("decode", 104, 4096, 1, bf), v("1:32:3", "1:32:2")),
    (K.Row("decode", 112, 4096, 1, bf), v("1:32:2", "2:32:2", "2:32:3")),
    (K.Row("decode", 120, 4096, 1, bf), v("1:32:3", "1:32:2", "2:32:2", "2:32:3")),
    (K.Row("decode", 128, 4096, 1, bf), v("1:32:3", "1:32:2", "2:32:2", "2:32:3", "3:32:2", "4:32:2", "2:64:3")),
    (K.Row("decode", 128, 1024, 1, bf), v("1:32:3", "1:32:2", "2:32:2", "4:32:2")),
    (K.Row("decode", 160, 4096, 1, bf), v("1:32:3", "1:32:2", "2:32:2", "3:32:2")),
    (K.Row("decode", 192, 4096, 1, bf), v("1:32:3", "1:32:2", "2:32:2")),
    (K.Row("decode", 256, 4096, 1, bf), v("1:32:3", "1:32:2", "2:32:2")),
    (K.Row("decode", 256, 4096, 1, bf, QW, "qwen2 gqa7"), v("1:32:3", "2:32:2")),
    (K.Row("decode", 128, 4096, 1, bf, L70, "llama3-70b gqa8"), v("1:32:3", "2:32:2")),
]
FINAL = [  # ROWS=final: the plan as committed against the variants it chose between, and the bench's grid rows
    (K.Row("decode", 50, 4096, 1, bf), v("1:32:3", "1:64:2")),
    (K.Row("verify", 52, 4096, 4, bf), v("1:32:3")),
    (K.Row("decode", 72, 4096, 1, bf), v("1:32:2")),
    (K.Row("decode", 80, 4096, 1, bf), v("1:32:2")),
    (K.Row("decode", 96, 4096, 1, bf), v("1:32:3")),
    (K.Row("decode", 112, 4096, 1, bf), v("1:32:3")),
    (K.Row("decode", 120, 4096, 1, bf), v("2:32:2", "1:32:3")),
    (K.Row("decode", 128, 4096, 1, bf), v("2:32:3", "1:32:3")),
    (K.Row("decode", 160, 4096, 1, bf), v("2:32:2")),
    (K.Row("decode", 256, 4096, 1, bf), v("1:32:3")),
    (K.Row("decode", 144, 4096, 1, bf, QW, "qwen2 gqa7"), v("1:32:2")),
    (K.Row("decode", 256, 4096, 1, bf, QW, "qwen2 gqa7"), v("1:32:3")),
    (K.Row("decode", 128, 4096, 1, bf, L70, "llama3-70b gqa8"), v("1:32:3")),
    *[(K.Row("decode", b, n, 1, bf), v("1:32:3") if (b, n) == (128, 1024) else []) for b, n in K.DECODE_ROWS],
    *[(K.Row("verify", b, n, 4, bf), []) for b, n in K.VERIFY_ROWS],
]
if os.environ.get("ROWS") == "final":
    ROWS = FINAL
if os.environ.get("NOFA3"):
    _peers_for = K.peers_for
    K.peers_for = lambda *a: [p for p in _peers_for(*a) if not p[0].endswith("fa3")]
if os.environ.get("ONLY"):
    ROWS = [(r, vs) for r, vs in ROWS if r.label in os.environ["ONLY"].split(",")]
peers = set(p for p in os.environ.get("PEERS", "flashinfer").split(",") if p)
if "--warm" in sys.argv:
    K.warm_peers([r for r, _ in ROWS])
    sys.exit(0)
bw, _ = K.copy_bandwidth()
name = torch.cuda.get_device_name() if K.DEVICE == "cuda" else "cpu"
K.log(f"copy bandwidth {bw:.2f} TB/s; {name}")
res = [K.run_row(r, peers, [("", x) for x in vs], bw) for r, vs in ROWS]
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"rows50_{os.environ.get('TAG', 'x')}.json"), "w") as f:
    json.dump(dict(copy_bandwidth_tbps=bw, device=name, rows=res), f, indent=1)
