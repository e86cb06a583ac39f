"""Session 73 A/B, for a GPU session: the narrow MLA kernel's epilogue staging of s73_narrow_stage.patch (8-byte
writes of the float8 column pairs into rows skewed by 4 words every 32 columns, 16-byte chunk reads) against
main's single-word writes. One process per version, alternating: the MLA float8 rows at H 16 that run the narrow
kernel and the bf16 rows of issue 18's ratio, each the plan, timed as `bench mla` times them (CUDA graphs, sets
larger than L2, median, output checked against the reference first). Prints one "## <tag>" line a run.

    mkdir -p .device/s73/old .device/s73/new && cp kernels/cute/mla.py kernels/cute/mla_narrow.py .device/s73/old/
    git apply benchmarks/results/s73_narrow_stage.patch && cp kernels/cute/mla.py kernels/cute/mla_narrow.py \
        .device/s73/new/ && git apply -R benchmarks/results/s73_narrow_stage.patch
    # on the device (carry .device/s73; CUTE_DSL_DISABLE_FILE_CACHING=1):
    for v in new old new old; do cp .device/s73/$v/*.py kernels/cute/; python3 benchmarks/results/s73_mla_stage_ab.py $v; done
"""
import sys

import torch

from b12x_inductor.bench import kernels as bk
from b12x_inductor.bench import mla as bm

F8, BF16 = torch.float8_e4m3fn, torch.bfloat16
ROWS = [(32, 4096, F8), (64, 4096, F8), (128, 2048, F8), (1, 32768, F8), (8, 8192, F8), (32, 4096, BF16),
        (64, 4096, BF16), (128, 2048, BF16)]


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "?"
    bw, _ = bk.copy_bandwidth()
    out = []
    for batch, length, dtype in ROWS:
        r = bm.run_row("decode", batch, length, 1, 16, dtype, set(), [], bw)
        e = r["impls"]["b12x"]
        out.append(f"{str(dtype)[6:]} {batch}x{length} {e.get('us', float('nan')):.1f}" + ("" if "us" in e else
                                                                                         f" {e}"))
    print(f"## {tag} copy {bw:.2f} TB/s | " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
