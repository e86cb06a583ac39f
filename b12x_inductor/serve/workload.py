"""Random-weight model configs and synthetic workloads (no downloads): for the demo, tests and benchmarks."""

from __future__ import annotations

import random

from b12x_inductor.serve.scheduler import Request


def llama_config(size: str = "tiny", **overrides):
    """A transformers LlamaConfig: "tiny" (2 layers, hidden 128, head_dim 64, vocab 512: CPU tests and demo),
    "small" (8 layers, hidden 1024, ~0.2B) or "1b" (Llama-3.2-1B shapes: 16 layers, hidden 2048, 32 / 8
    heads of 64, vocab 128256, tied embeddings, ~1.2B)."""
    from transformers import LlamaConfig

    shapes = {
        "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64),
        "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                   rope_theta=500000.0),
    }
    if size not in shapes:
        raise ValueError(f"llama_config: size must be one of {sorted(shapes)}; got {size!r}")
    kw = dict(max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(shapes[size])
    kw.update(overrides)
    return LlamaConfig(**kw)


def gpt_oss_config(size: str = "tiny", **overrides):
    """A transformers GptOssConfig, layers alternating sliding-window (with attention sinks, as every gpt-oss
    layer has) and full attention: "tiny" (2 layers, hidden 128, 4 / 2 heads of 64, window 16, 4 experts
    top 2, vocab 512: CPU) or "20b" (gpt-oss-20b's shapes in 4 of its 24 layers: hidden 2880, 64 query / 8 KV
    heads of 64, window 128, 32 experts top 4, vocab 201088)."""
    from transformers import GptOssConfig

    shapes = {
        "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096),
        "20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                    num_local_experts=32, num_experts_per_tok=4),
    }
    if size not in shapes:
        raise ValueError(f"gpt_oss_config: size must be one of {sorted(shapes)}; got {size!r}")
    kw = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(shapes[size])
    kw.update(overrides)
    kw.setdefault("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(kw["num_hidden_layers"])])
    return GptOssConfig(**kw)


def random_model(config, *, dtype=None, device="cpu", seed: int = 0):
    """A randomly initialised causal LM for `config`, in eval mode; attention sinks (gpt-oss) are drawn from
    N(0, 1), so that they change the attention's output."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialise in place: a 1B model on a GPU in a second, not on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 1.0)
    return model.eval()


def synthetic_requests(num: int, *, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int,
                       rate: float = float("inf"), seed: int = 0) -> list[Request]:
    """`num` requests with prompt and output lengths uniform in the given (min, max) ranges. Prompts are
    random phrases from a small phrase book, so they repeat n-grams as text does. Arrivals: a Poisson
    process of `rate` requests/s (all at 0 when infinite)."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 8))] for _ in range(64)]
    out, t = [], 0.0
    for _ in range(num):
        n = rng.randint(*prompt_lens)
        prompt: list[int] = []
        while len(prompt) < n:
            prompt += phrases[rng.randrange(len(phrases))] if rng.random() < 0.7 else [rng.randrange(vocab)]
        out.append(Request(prompt=prompt[:n], max_new_tokens=rng.randint(*output_lens), arrival=t))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return out
