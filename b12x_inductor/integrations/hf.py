"""Hugging Face transformers integration: `attn_implementation="b12x"` and `B12xCache`.

    import b12x_inductor.integrations.hf as b12x_hf
    b12x_hf.register()                      # once; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="b12x", dtype=torch.bfloat16)
    out = model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=64)
    # or a paged cache:
    cache = B12xCache(model.config, max_batch_size=8, max_cache_len=4096, device="cuda", dtype=torch.bfloat16)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)  # 5.24: cache=

Transformers is imported only here (and in the tests). Tested with transformers 5.17.0 and 5.24.0.
Importing this module registers "b12x". A B12xCache needs attn_implementation="b12x". A fresh cache per
generate call does not recompile; reusing one (after `cache.reset()`) also keeps CUDA graphs from being
re-recorded for new addresses. Greedy and sampling work; beam search does not (B12xCache does not
reorder requests). The plan follows the query length: decode for one new token, verify for 2-16 (drafts
of assisted generation, and prompts that short), extend for longer prefills.

What the attention honors: causal layers and sliding-window layers (transformers' `layer_types` /
`sliding_window`, mixed in one model), logit softcap (Gemma 2), attention sinks (`s_aux`, gpt-oss), any
`scaling` (Gemma's query_pre_attn_scalar), left padding; prefill, decode and assisted-generation verify.
Tested against eager attention with tiny Llama, Mistral, Gemma 2, Gemma 3, gpt-oss and sliding Qwen2 models.
What b12x cannot express fails at the first call with a ValueError that says what to use instead: an
arbitrary 4D attention mask, right padding or holes in the padding mask, mask patterns other than causal
and causal sliding window (bidirectional, chunked, image-token groups), non-causal layers, attention
arguments it does not honor (the harmless ones are listed in `HARMLESS_KWARGS`), output_attentions=True,
head_dim outside 64/96/128/192/256, dropout in training mode.

transformers' own sliding-window static layers keep their offset as a Python int, so a compiled generate
over them needs `CompileConfig(dynamic=None)` (it compiles the decode step twice; `dynamic=False` hits the
recompile limit, for SDPA and eager too), and transformers refuses assisted generation over them. A
`B12xCache` keeps all its state on the device: one compiled decode step, and assisted generation works.

How the pieces meet (the public surface other code may rely on):
- `register()` adds the attention function `b12x_attention` under the name "b12x" to transformers'
  `AttentionInterface`, and its mask function `b12x_mask` to `AttentionMaskInterface`.
- The mask function turns the 2D padding mask into a small int32 "metadata mask" of shape [1, G, 3, Bp]
  (Bp = B rounded up to a multiple of 4): row 0 = kv_start (first non-pad position of each request; left
  padding only), row 1 = the request's cache length after this forward (q_offset + q_length), row 2 = b
  (the one-page-per-request page table of a StaticCache, so that no layer builds one), both counted from
  kv_offset; each row contiguous and 16-byte aligned, as the kernels read them. G = 1 for a causal layer,
  window + 1 for a sliding-window one: the window is a static size of the mask, checked against the
  layer's `sliding_window`. Transformers passes 4D masks through untouched, so it reaches the attention
  function inside the compiled region with a fixed shape. See `metadata_mask` / `unpack_metadata`; the
  pattern itself is recognised by `pattern_window`.
- With transformers' StaticCache, attention receives the whole [B, Hkv, max_cache_len, D] buffers (a
  sliding layer's [B, Hkv, window, D] ring, or the longer blocks it returns while filling) and reads them in
  place as an HND paged cache: one page per request (page_size = the buffer's length, page_table =
  arange(B)[:, None]); page table, cache_seqlens and kv_start come from the metadata mask.
- With `B12xCache`, each layer's `update` writes the new keys/values into its page pool with `write_kv`,
  advances its device-side lengths and hands the layer to attention: through the `kwargs` dict of
  `cache.update` where transformers passes it on to attention (5.24), and through a table keyed by
  `module.layer_idx` that the attention call pops (what 5.17 uses). Attention then reads the pool with
  the cache's page table and the layer's lengths (kv_start still comes from the metadata mask). Its
  sliding-window layers keep only the pages their window can still see (see hf_cache.py).
"""

from __future__ import annotations

from b12x_inductor.integrations.hf_attention import (  # noqa: F401
    ATTN_NAME,
    HARMLESS_KWARGS,
    b12x_attention,
    b12x_mask,
    metadata_mask,
    pattern_window,
    register,
    unpack_metadata,
)
from b12x_inductor.integrations.hf_cache import B12xCache, B12xLayer  # noqa: F401

__all__ = ["ATTN_NAME", "HARMLESS_KWARGS", "register", "b12x_attention", "b12x_mask", "metadata_mask",
           "pattern_window", "unpack_metadata", "B12xCache", "B12xLayer"]

register()
