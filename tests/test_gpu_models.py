"""GPU: greedy tokens of attn_implementation="b12x" on today's open-model shapes equal the best attention
transformers offers for them: a gpt-oss-20b-shaped model (4 layers: window 128 / full, sinks, head_dim 64, 64
query / 8 KV heads) against "eager" and a Gemma-3-4B-shaped one (6 layers: 5 window 1024 : 1 full, head_dim
256) against "sdpa". They are the models of `python -m b12x_inductor.bench hf` (random weights, bf16), gpt-oss's
with every expert routed to (see `continuous_moe`). A left-padded batch of 4 with prompts longer than the window
(one row with fewer real tokens than the window: pads inside it); b12x over transformers' static cache and over a
B12xCache, generate compiled with fullgraph and reduce-overhead (dynamic=None, as sliding-window static caches
need; the peer compiled alike); no graph breaks and no CUDA graph skips; the near-tie rule of
test_hf.assert_greedy_equal. Marker
`gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import assert_greedy_equal, cache_kwarg, generate  # noqa: E402

from b12x_inductor.bench import hf as bench  # noqa: E402
from b12x_inductor.integrations import hf  # noqa: E402

NEW_TOKENS = 24
# prompt length, left pads of the 4 rows, max_cache_len; the last row's real tokens are fewer than the window
CASES = {"gpt-oss": (300, (0, 50, 130, 190), 384), "gemma3": (1200, (0, 60, 150, 1100), 1280)}


def continuous_moe(config: dict) -> dict:
    """`config` with every expert routed to (gpt-oss; others unchanged). The router's top-k is a discontinuity:
    a bf16 rounding difference anywhere before it, whichever attention made it, can swap an expert and move a
    hidden state by far more than rounding, and the near-tie rule no longer tells a wrong attention from that
    (on the tiny gpt-oss in bf16 on CPU, top-2 of 4 experts: logits 5.7% from fp32 under eager itself; all 4:
    2.0%, b12x 1.9%). With every expert taken the MoE is continuous; the attention is the benchmarked one."""
    if "num_local_experts" not in config:
        return config
    return dict(config, num_experts_per_tok=config["num_local_experts"])


def check_tokens_equal_peer(name, device, dtype, config, case, monkeypatch):
    """The test's body: `config` of model `name` on `device` (the GPU test: the benchmarked config on CUDA in
    bf16; a CPU dry run can pass the tiny config and a short case)."""
    from torch._dynamo.utils import counters

    spec = bench.MODELS[name]
    length, pads, max_cache_len = case
    window = config["sliding_window"]
    assert length - max(pads) < window < length - min(pads)  # rows longer than the window, one shorter
    model = bench.build_model(config, device, dtype, arch=spec.arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config["vocab_size"], (4, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    ids, mask = ids.masked_fill(mask == 0, 0).to(device), mask.to(device)
    # earlier tests' graphs of generate's compiled forward count against its recompile limit
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)
    config = bench.compile_config(device, sliding=True)
    assert config.dynamic is None and config.fullgraph
    assert config.mode == ("reduce-overhead" if device.type == "cuda" else "default")
    kw = dict(max_new_tokens=NEW_TOKENS, compile_config=config, disable_compile=False)
    want = generate(model, spec.peer, ids, mask, cache_implementation="static", max_cache_len=max_cache_len, **kw)
    counters.clear()
    got = {"static": generate(model, "b12x", ids, mask, cache_implementation="static", max_cache_len=max_cache_len,
                              **kw)}
    paged = hf.B12xCache(model.config, max_batch_size=4, max_cache_len=max_cache_len, device=device, dtype=dtype)
    got["b12x"] = generate(model, "b12x", ids, mask, **cache_kwarg(model, paged), **kw)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for cache, tokens in got.items():
        assert tokens.shape == (4, length + NEW_TOKENS)
        assert_greedy_equal(model, ids, mask, want, tokens, f"{name} {cache}", peer=spec.peer)
    return got, want


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_model_tokens_equal_peer(name, monkeypatch):
    config = continuous_moe(bench.MODELS[name].config)
    check_tokens_equal_peer(name, torch.device("cuda"), torch.bfloat16, config, CASES[name], monkeypatch)
