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
