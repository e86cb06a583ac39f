"""The shared body of the sNN_rows.py scripts (s49_rows.py, s50_rows.py, s51_rows.py): times each row's plan, its
variants (splits:block_n:stages:warps, warps 0 = the plan's; `v` writes them from "splits:block_n:stages") and the
peers in one process through b12x_inductor.bench.kernels.run_row (the bench's inputs, reference check and
CUDA-graph timing), and writes `{OUT}/{stem}_{TAG}.json`. Env: PEERS (default flashinfer; empty for none), ONLY
(row labels, comma-separated), NOFA3 (leave FlashInfer's fa3 backend out), OUT, TAG. `--warm` builds FlashInfer's
JIT modules for the rows and exits."""
import json, os, sys
import torch
from b12x_inductor.bench import kernels as K


def v(*specs):
    """Variant tuples from "splits:block_n:stages" strings, with the plan's warps (0)."""
    return [tuple(int(x) for x in s.split(":")) + (0,) for s in specs]


def main(rows, stem):
    """`rows`: [(Row, [variant tuple, ...])]."""
    if os.environ.get("NOFA3"):
        peers_for = K.peers_for
        K.peers_for = lambda *a: [p for p in peers_for(*a) if not p[0].endswith("fa3")]
    if os.environ.get("ONLY"):
        rows = [(r, vs) for r, vs in rows if r.label in os.environ["ONLY"].split(",")]
    peers = set(p for p in os.environ.get("PEERS", "flashinfer").split(",") if p)
    if "--warm" in sys.argv:
        K.warm_peers([r for r, _ in rows])
        sys.exit(0)
    bw, _ = K.copy_bandwidth()
    name = torch.cuda.get_device_name() if K.DEVICE == "cuda" else "cpu"
    K.log(f"copy bandwidth {bw:.2f} TB/s; {name}")
    res = []
    for r, vs in rows:  # the JSON is rewritten after each row: a run cut short keeps the rows it timed
        res.append(K.run_row(r, peers, [("", v) for v in vs], bw))
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"{stem}_{os.environ.get('TAG', 'x')}.json"), "w") as f:
            json.dump(dict(copy_bandwidth_tbps=bw, device=name, rows=res), f, indent=1)
