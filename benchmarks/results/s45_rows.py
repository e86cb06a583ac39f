"""Session 45 (h200.md): the bench's rows on other batch sizes, timed through b12x_inductor.bench.kernels.run_row (the
bench's inputs, reference check and CUDA-graph timing): the plan, variants (splits:block_n:stages:warps) and peers in
one process. SET=b is call B's row set, SET=d calls D and E's. Env: PEERS (default flashinfer; empty for none),
VARIANTS, ONLY (row labels, comma-separated), NOFA3 (leave FlashInfer's fa3 backend out), OUT, TAG.
`--warm` builds FlashInfer's JIT modules for the rows and exits."""
import json, os, sys
import torch
from b12x_inductor.bench import kernels as K

L70, QW = K.LLAMA70_GQA8, K.QWEN2_GQA7
bf = torch.bfloat16
SET = os.environ.get("SET", "d")
if SET == "b":
    decode_b, verify_b, default_variants = (24, 32, 36, 40, 44, 48, 52), (32, 40, 48), "2:32:3:0,1:64:3:0"
    extra = [K.Row("decode", 32, 1024, 1, bf), K.Row("decode", 32, 2048, 1, bf), K.Row("decode", 32, 8192, 1, bf),
             K.Row("decode", 32, 4096, 1, bf, L70, "llama3-70b gqa8"),
             K.Row("decode", 48, 4096, 1, bf, L70, "llama3-70b gqa8"),
             K.Row("decode", 64, 4096, 1, bf, QW, "qwen2 gqa7"), K.Row("decode", 80, 4096, 1, bf, QW, "qwen2 gqa7"),
             K.Row("decode", 32, 4096, 1, bf, K.Shape(page=64), "page64")]
else:
    decode_b, verify_b = (16, 20, 21, 24, 28, 32, 44, 48, 50, 52, 56, 60, 64), (24, 52, 56)
    default_variants = "4:32:3:0,2:32:3:0,1:32:3:0,1:64:3:0"
    extra = [K.Row("decode", 48, 4096, 1, bf, QW, "qwen2 gqa7"), K.Row("decode", 104, 4096, 1, bf, QW, "qwen2 gqa7"),
             K.Row("decode", 24, 4096, 1, bf, L70, "llama3-70b gqa8"),
             K.Row("decode", 52, 4096, 1, bf, L70, "llama3-70b gqa8"),
             K.Row("decode", 24, 8192, 1, bf), K.Row("decode", 52, 2048, 1, bf)]
rows = [K.Row("decode", b, 4096, 1, bf) for b in decode_b] + [K.Row("verify", b, 4096, 4, bf) for b in verify_b]
rows += extra
if os.environ.get("NOFA3"):
    _peers_for = K.peers_for
    K.peers_for = lambda *a: [p for p in _peers_for(*a) if not p[0].endswith("fa3")]
if os.environ.get("ONLY"):
    rows = [r for r in rows if r.label in os.environ["ONLY"].split(",")]
peers = set(p for p in os.environ.get("PEERS", "flashinfer").split(",") if p)
if "--warm" in sys.argv:
    K.warm_peers(rows)
    sys.exit(0)
variants = [("", tuple(int(y) for y in v.split(":"))) for v in os.environ.get("VARIANTS", default_variants).split(",")
            if v]
bw, _ = K.copy_bandwidth()
K.log(f"copy bandwidth {bw:.2f} TB/s")
res = [K.run_row(r, peers, variants, bw) for r in rows]
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"rows45{SET}_{os.environ.get('TAG', 'x')}.json"), "w") as f:
    json.dump(dict(copy_bandwidth_tbps=bw, rows=res), f, indent=1)
