"""Session 51 (h200.md): session 50's one_wave_tile against FlashInfer on the H200 (its call D, not run then), with
each row's alternative tiles, and split counts other than the rule's powers of two where a request's splits are
the only source of programs (decode 1x32768 and 8x8192: up to one wave of each tile's occupancy,
ONE_WAVE_PROGRAMS_PER_SM). Tiles are splits:block_n:stages (the plan's warps). SET picks the call's rows: a (call
A, the default; call B: a's rows named in ONLY), c and d (beyond a wave: more split counts, the rows where 2
splits and unsplit fill their last wave alike), e (the landed rule there; call E, not run in session 51).
rows_script.py: env, `--warm`."""
import os

import torch
from b12x_inductor.bench import kernels as K
from rows_script import main, v

bf = torch.bfloat16
QW, L70 = K.QWEN2_GQA7, K.LLAMA70_GQA8


SETS = {}
SETS["a"] = [  # (row, variants): the rule's rows first, then the split counts
    (K.Row("decode", 50, 4096, 1, bf), v("1:32:3", "1:64:2")),
    (K.Row("verify", 52, 4096, 4, bf), v("1:32:3", "1:64:2", "1:32:2")),
    (K.Row("decode", 112, 4096, 1, bf), v("1:32:3", "2:32:2")),
    (K.Row("decode", 120, 4096, 1, bf), v("2:32:2", "1:32:3")),
    (K.Row("decode", 128, 4096, 1, bf), v("2:32:3", "1:32:3", "3:32:2")),
    (K.Row("decode", 160, 4096, 1, bf), v("2:32:2", "3:32:2")),
    (K.Row("decode", 256, 4096, 1, bf), v("1:32:3")),
    (K.Row("decode", 144, 4096, 1, bf, QW, "qwen2 gqa7"), v("1:32:3")),
    (K.Row("decode", 256, 4096, 1, bf, QW, "qwen2 gqa7"), v("1:32:3")),
    (K.Row("decode", 128, 4096, 1, bf, L70, "llama3-70b gqa8"), v("1:32:3")),
    *[(K.Row("decode", b, n, 1, bf), []) for b, n in K.DECODE_ROWS if b in (32, 64, 128)],
    *[(K.Row("verify", b, n, 4, bf), []) for b, n in K.VERIFY_ROWS],
    (K.Row("decode", 1, 32768, 1, bf), v("80:32:3", "64:32:2", "96:32:2", "112:32:2", "128:32:2", "128:32:3")),
    (K.Row("decode", 8, 8192, 1, bf), v("10:32:3", "12:32:2", "14:32:2", "16:32:2", "16:32:3")),
    (K.Row("decode", 16, 16384, 1, bf), v("5:32:3", "8:32:2")),
    (K.Row("decode", 24, 4096, 1, bf), v("3:32:3", "4:32:2")),
    (K.Row("decode", 1, 32768, 1, bf, QW, "qwen2 gqa7"), v("160:32:3", "256:32:2")),
    (K.Row("decode", 56, 4096, 1, bf), v("1:32:3", "1:64:2")),
]
SETS["c"] = [
    (K.Row("decode", 160, 4096, 1, bf), v("3:32:3", "4:32:2", "5:32:2", "6:32:2", "2:32:3")),
    (K.Row("decode", 128, 4096, 1, bf), v("4:32:2", "5:32:2", "3:32:3")),
    (K.Row("decode", 256, 4096, 1, bf, QW, "qwen2 gqa7"), v("3:32:2", "2:32:3", "4:32:2")),
    (K.Row("decode", 192, 4096, 1, bf), v("1:32:3", "3:32:2", "2:32:2", "4:32:2")),
    (K.Row("decode", 120, 4096, 1, bf), v("3:32:2", "4:32:2")),
]
SETS["d"] = [
    (K.Row("decode", 136, 4096, 1, bf), v("1:32:3", "2:32:3", "2:32:2")),
    (K.Row("decode", 150, 4096, 1, bf), v("1:32:3", "2:32:3", "2:32:2")),
    (K.Row("decode", 160, 2048, 1, bf), v("1:32:3", "2:32:3")),
    (K.Row("decode", 160, 4096, 1, bf, L70, "llama3-70b gqa8"), v("1:32:3", "2:32:3")),
    (K.Row("verify", 52, 4096, 4, bf), v("2:32:3", "2:64:2", "1:64:3", "4:32:2")),
    (K.Row("verify", 128, 4096, 4, bf), v("1:32:3", "2:32:3", "2:32:2")),
]
SETS["e"] = [  # the landed rule (2:32:3 at 1057-1320) against the old one's tile
    *[(K.Row("decode", b, 4096, 1, bf), v("1:32:3")) for b in (136, 150, 160)],
    (K.Row("decode", 160, 4096, 1, bf, L70, "llama3-70b gqa8"), v("1:32:3")),
    (K.Row("decode", 300, 4096, 1, bf, QW, "qwen2 gqa7"), v("1:32:3")),
]
main(SETS[os.environ.get("SET", "a")], "rows51")
