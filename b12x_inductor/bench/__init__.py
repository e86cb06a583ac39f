"""Benchmarks: `python -m b12x_inductor.bench [SUITE] [options]`.

Suites (one module each in this package):
- kernels (default): decode / verify / extend against FlashInfer, SDPA and FlexAttention
- mla: absorbed multi-head latent attention (DeepSeek-V3's 576-wide latent cache) against FlashInfer's MLA
  wrapper (fa2, fa3)
- hf: transformers static-cache generate() with b12x against SDPA or eager (Llama, gpt-oss and Gemma 3 shapes)
- gptfast: a gpt-fast-style decode loop with and without automatic substitution
- serve: the serving loop against transformers' own batching
"""

SUITES = ("kernels", "mla", "hf", "gptfast", "serve")


def device_tag(name: str) -> str:
    """The default --tag of a suite's result files for a device named `name` (torch.cuda.get_device_name(), or
    "cpu" for a dry run): "h200" or "h100" for those GPUs, else the name in lower case with runs of other
    characters than letters and digits as "-". A run on one GPU then never overwrites another's results."""
    import re

    low = name.lower()
    for gpu in ("h200", "h100"):
        if gpu in low:
            return gpu
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "device"


def parse_sizes(text: str, option: str = "--sizes") -> list[tuple[int, int]]:
    """'BxL[,BxL...]' as [(B, L), ...] (empty text: []); anything else raises a ValueError naming the option."""
    sizes = []
    for size in (x for x in text.split(",") if x):
        parts = size.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{option}: expected BxL[,BxL...] with positive integers, e.g. 2x128; got {text!r}")
        sizes.append((int(parts[0]), int(parts[1])))
    return sizes
