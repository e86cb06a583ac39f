"""Session 45: one-wave 16-row tiles. Rows of the bench on other sizes via run_row; the plan, main's plan as a
variant (2 splits on 32 keys), the one-wave tile forced (1:64:3), and FlashInfer, in one process."""
import json, os, sys, time
import torch
from b12x_inductor.bench import kernels as K

S = K.DEFAULT_SHAPE
L70, QW = K.LLAMA70_GQA8, K.QWEN2_GQA7
bf = torch.bfloat16
rows = []
for b in (16, 20, 21, 24, 28, 32, 44, 48, 50, 52, 56, 60, 64):
    rows.append(K.Row("decode", b, 4096, 1, bf))
for b in (24, 52, 56):
    rows.append(K.Row("verify", b, 4096, 4, bf))
rows += [K.Row("decode", 48, 4096, 1, bf, QW, "qwen2 gqa7"), K.Row("decode", 104, 4096, 1, bf, QW, "qwen2 gqa7"),
         K.Row("decode", 24, 4096, 1, bf, L70, "llama3-70b gqa8"), K.Row("decode", 52, 4096, 1, bf, L70, "llama3-70b gqa8"),
         K.Row("decode", 24, 8192, 1, bf), K.Row("decode", 52, 2048, 1, bf)]
if os.environ.get("NOFA3"):
    _pf = K.peers_for
    K.peers_for = lambda *a: [p for p in _pf(*a) if not p[0].endswith("fa3")]
if os.environ.get("ONLY"):
    rows = [r for r in rows if r.label in os.environ["ONLY"].split(",")]
peers = set(p for p in os.environ.get("PEERS", "flashinfer").split(",") if p)
if "--warm" in sys.argv:
    K.warm_peers(rows)
    sys.exit(0)
variants = [("", tuple(int(y) for y in v.split(":"))) for v in os.environ.get("VARIANTS", "4:32:3:0,2:32:3:0,1:32:3:0,1:64:3:0").split(",") if v]
bw, _ = K.copy_bandwidth()
K.log(f"copy bandwidth {bw:.2f} TB/s")
res = [K.run_row(r, peers, variants, bw) for r in rows]
out = os.environ.get("OUT", "/tmp")
json.dump(dict(copy_bandwidth_tbps=bw, rows=res), open(os.path.join(out, f"rows45d_{os.environ.get('TAG','x')}.json"), "w"), indent=1)
