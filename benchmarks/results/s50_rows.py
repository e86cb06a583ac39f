"""Session 50 (h200.md): with the split kernel's S = 1 rows free of G, which tile of the 16-row D 128 decode tile
makes one wave at 400 to 2048 programs (B x Hkv) on the H200: the plan, each row's variants and FlashInfer in one
process (rows_script.py: its env, PEERS, ONLY, NOFA3, OUT, TAG, and `--warm`). ROWS=final: the plan as committed
against the tiles it chose between, and the bench's decode / verify grid."""
import os

import torch
from b12x_inductor.bench import kernels as K
from rows_script import main, v

bf = torch.bfloat16
QW, L70 = K.QWEN2_GQA7, K.LLAMA70_GQA8


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
main(ROWS, "rows50")
