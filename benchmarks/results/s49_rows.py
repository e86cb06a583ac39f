"""Sessions 46-49 (h200.md): one_wave_tile's one-buffer rule above three programs an SM (s49_one_buffer_rule.patch,
whose kernel change landed in session 50 and whose rule above 528 programs did not), timed through
b12x_inductor.bench.kernels.run_row (the bench's inputs, reference check and CUDA-graph timing): the plan, each row's
variants (splits:block_n:stages:warps, warps 0 = the plan's) and FlashInfer in one process, with the group-of-7 rows
(Qwen2-7B), and bench rows whose decode kernels the patch's S = 1 rows change. Env and `--warm`: rows_script.py.
Run in session 50 (h200.md, "Session 50", call B)."""
import torch
from b12x_inductor.bench import kernels as K
from rows_script import main

bf = torch.bfloat16
QW, L70 = K.QWEN2_GQA7, K.LLAMA70_GQA8
TWO, ONE, SPLIT2 = (1, 32, 3, 0), (1, 32, 2, 0), (2, 32, 2, 0)
ROWS = [  # (row, variants)
    *[(K.Row("decode", b, 4096, 1, bf), [TWO]) for b in (50, 56)],
    (K.Row("decode", 64, 4096, 1, bf), [SPLIT2, ONE]),
    *[(K.Row("decode", b, 4096, 1, bf), [TWO]) for b in (68, 72, 80, 112)],
    (K.Row("decode", 128, 4096, 1, bf), [ONE]),
    (K.Row("verify", 52, 4096, 4, bf), [TWO]),
    (K.Row("verify", 72, 4096, 4, bf), [TWO]),
    (K.Row("decode", 144, 4096, 1, bf, QW, "qwen2 gqa7"), [TWO, SPLIT2]),
    (K.Row("decode", 104, 4096, 1, bf, QW, "qwen2 gqa7"), [TWO]),
    (K.Row("decode", 72, 4096, 1, bf, L70, "llama3-70b gqa8"), [TWO]),
    # the bench's rows whose decode kernels the S = 1 rows change (registers), plan only
    (K.Row("decode", 1, 32768, 1, bf), []),
    (K.Row("decode", 8, 8192, 1, bf), []),
    (K.Row("decode", 32, 4096, 1, bf), []),
    (K.Row("decode", 32, 4096, 1, bf, QW, "qwen2 gqa7"), []),
    (K.Row("decode", 32, 4096, 1, torch.float8_e4m3fn), []),
]
main(ROWS, "rows49")
