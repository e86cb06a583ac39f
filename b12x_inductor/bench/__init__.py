"""Benchmarks: `python -m b12x_inductor.bench [SUITE] [options]`.

Suites (one module each in this package):
- kernels (default): decode / verify / extend against FlashInfer, SDPA and FlexAttention
- hf: transformers static-cache generate() with b12x against SDPA or eager (Llama, gpt-oss and Gemma 3 shapes)
- gptfast: a gpt-fast-style decode loop with and without automatic substitution
- serve: the serving loop against transformers' own batching
"""

SUITES = ("kernels", "hf", "gptfast", "serve")
