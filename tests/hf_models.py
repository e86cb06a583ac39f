"""Tiny random-weight transformers models of today's open families, built locally (no downloads).

`make_model(arch)` returns an fp32 causal LM in eval mode whose attention uses every feature of its family
with a window shorter than the test prompts: Llama (the control: plain causal), Mistral (a sliding window on
every layer), Gemma 2 (window and full layers, logit softcap 2, query_pre_attn_scalar 8 != head_dim), Gemma 3 text
(window and full layers), gpt-oss (window and full layers, attention sinks drawn at random, a small MoE) and
Qwen2 with `use_sliding_window=True` (one full layer, then window layers).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 8  # shorter than every test prompt, so the window decides what each query sees
COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=512, initializer_range=0.1)
# Gemma ties its embeddings and scales them by sqrt(hidden): with small random weights its greedy token then
# follows the input token whatever attention does. Untied and larger weights make attention decide tokens.
_GEMMA = dict(initializer_range=0.3, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(num_hidden_layers=2),
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW),
    "gemma2": dict(num_hidden_layers=2, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                   final_logit_softcapping=30.0, query_pre_attn_scalar=8, **_GEMMA),
    "gemma3_text": dict(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=8, **_GEMMA,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gpt_oss": dict(num_hidden_layers=2, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"]),
    "qwen2": dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
ARCHS = list(FAMILIES)


def make_config(arch: str, **overrides):
    return AutoConfig.for_model(arch, **{**COMMON, **FAMILIES[arch], **overrides})


def make_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """An eval-mode random-weight causal LM of `arch` (see FAMILIES); gpt-oss's sinks are drawn from N(0, 1)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks") and isinstance(module.sinks, torch.Tensor):
                module.sinks.normal_(0.0, 1.0)
    model = model.eval().to(dtype)
    model.generation_config.pad_token_id = 0
    return model


def layer_types(model) -> list[str]:
    from b12x_inductor.integrations.hf_cache import layer_windows

    return layer_windows(model.config.get_text_config(decoder=True))[0]


def cache_kwarg(model, cache) -> dict:
    """generate's name for a user cache: `cache` in newer transformers (5.24), `past_key_values` before."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}
