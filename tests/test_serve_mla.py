"""The serving engine on DeepSeek-V3 (transformers' DeepseekV3ForCausalLM, tiny random-weight configs with the
real 128 + 64 / 128 head dims and a small MoE): its attention absorbed over a paged latent cache
(b12x_inductor/serve/mla.py). One layer's absorbed attention equals the module's own on the same inputs;
served tokens equal transformers' eager greedy `generate` (chunked prefill, decode, prompt-lookup verify),
compiled without graph breaks or recompiles; the pool holds one [pages, page_size, kv_lora_rank + rope] latent
tensor per layer; what the transform does not handle is refused, naming it."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import one_thread
from test_serve_models import _CONFIG, _eager_reference, _record_steps, _requests
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from b12x_inductor.serve import Engine, Request, ServeConfig
from b12x_inductor.serve import mla

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

NOPE, ROPE, VDIM = 128, 64, 128  # DeepSeek-V3's qk_nope_head_dim, qk_rope_head_dim, v_head_dim
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)  # DeepSeek-V3's kind of rope scaling: scaling != 192**-0.5


def _model(rank=64, q_lora_rank=64, interleave=True, yarn=False, layers=2, seed=0, **overrides):
    """A 2-layer DeepSeek-V3 (layer 0 dense, layer 1 MoE of 4 routed experts, 2 a token, 1 shared; more layers
    are MoE layers), fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=rank, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VDIM, max_position_embeddings=256, n_group=1,
        topk_group=1, rope_interleave=interleave, rope_parameters=YARN if yarn else None, initializer_range=0.1,
        **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    assert (model.model.layers[1].self_attn.scaling != (NOPE + ROPE) ** -0.5) == yarn
    return model


# (kv_lora_rank, q_lora_rank, rope_interleave, YaRN): both latent widths (DeepSeek-V3's 512 and a small 64), the
# q_lora_rank and q_proj variants, both rope layouts, with and without rope scaling
_VARIANTS = [(512, 64, True, True), (64, None, False, False), (64, 64, True, False), (512, None, False, True)]


# -- one layer: the absorbed attention equals the module's own --------------------------------------------------
def _info(latent, slots, table, seqlens, cu=None):
    as_t = lambda x, dtype: torch.tensor(x, dtype=dtype)  # noqa: E731
    return dict(layer=True, kv=latent, window=None, slots=as_t(slots, torch.int64), page_table=as_t(table, torch.int32),
                seqlens=as_t(seqlens, torch.int32), cu_seqlens_q=None if cu is None else as_t(cu, torch.int32))


# the module forward's cache keyword: `cache` from transformers 5.24, `past_key_values` before (an unknown keyword
# would be swallowed by its **kwargs, and the steps would attend without the cache)
CACHE_KWARG = "cache" if "cache" in inspect.signature(DeepseekV3Attention.forward).parameters else "past_key_values"


@pytest.mark.parametrize("rank, q_lora_rank, interleave, yarn", _VARIANTS)
def test_absorbed_attention_equals_module(rank, q_lora_rank, interleave, yarn):
    """Layer 1's absorbed forward over a paged latent cache (two requests on scattered pages: a packed prefill
    of 7 and 4 tokens with a padding row, a decode step, a verify step of 3 tokens each) equals
    DeepseekV3Attention.forward (eager, causal, the same three steps over its DynamicCache) on the same fresh
    random hidden states at every position, to 1e-4; the cache rows hold [kv_a_layernorm(c) | rope(k_pe)], the module's cached latents."""
    from transformers import DynamicCache

    model = _model(rank, q_lora_rank, interleave, yarn)
    module, rotary = model.model.layers[1].self_attn, model.model.rotary_emb
    ps, pages = 4, [[5, 2, 9], [0, 7, 3]]  # page tables of requests 0 and 1
    lens = [7 + 1 + 3, 4 + 1 + 3]  # each request: prefill, one decode, a verify of 3
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(1, n, 128, generator=g) for n in lens]

    expected, cached = [], []
    with torch.no_grad():
        for r, chunks in enumerate([(7, 1, 3), (4, 1, 3)]):  # the module's own forward, step by step, causal
            cache, outs, start = DynamicCache(config=model.config), [], 0
            for n in chunks:
                end = start + n
                mask = torch.full((n, end), torch.finfo(torch.float32).min).triu(start + 1)[None, None]
                out, _ = module(x[r][:, start:end], position_embeddings=rotary(x[r], torch.arange(start, end)[None]),
                                attention_mask=mask, **{CACHE_KWARG: cache})
                outs.append(out[0])
                start = end
            expected.append(torch.cat(outs))
            layer = cache.layers[1]
            cached.append(torch.cat([layer.keys[0, 0], layer.values[0, 0]], -1))  # [n, rank + rope]

    latent = torch.zeros(12, ps, rank + ROPE)  # zero-initialized, as the engine's pool
    slot = lambda r, p: pages[r][p // ps] * ps + p % ps  # noqa: E731
    table = [pages[0], pages[1], [0, 0, 0]]  # third row: padding
    got = [[], []]
    steps = [  # (per request: first position, tokens), packed?
        ([(0, 7), (0, 4)], True),
        ([(7, 1), (4, 1)], False),
        ([(8, 3), (5, 3)], False),
    ]
    with torch.no_grad():
        for work, packed in steps:
            seqlens = [start + n for start, n in work] + [0]
            if packed:
                t = 16  # an extend bucket with 5 padding rows
                rows = [x[r][0, s:s + n] for r, (s, n) in enumerate(work)]
                hidden = torch.cat(rows + [torch.zeros(t - 11, 128)])[None]
                positions = [p for s, n in work for p in range(s, s + n)] + [0] * (t - 11)
                slots = [slot(r, p) for r, (s, n) in enumerate(work) for p in range(s, s + n)] + [-1] * (t - 11)
                info = _info(latent, slots, table, seqlens, cu=[0, 7, 11, 11])
                cos_sin = rotary(hidden, torch.tensor(positions)[None])
            else:
                w = work[0][1]
                hidden = torch.stack([x[r][0, s:s + n] for r, (s, n) in enumerate(work)] + [torch.zeros(w, 128)])
                positions = [list(range(s, s + n)) for s, n in work] + [[0] * w]
                slots = [slot(r, p) for r, (s, n) in enumerate(work) for p in range(s, s + n)] + [-1] * w
                info = _info(latent, slots, table, seqlens)
                cos_sin = rotary(hidden, torch.tensor(positions))
            out, weights = mla.absorbed_forward(module, hidden, position_embeddings=cos_sin, attention_mask=None,
                                                b12x_serve=info)
            assert weights is None
            out = out.reshape(-1, 128)
            at = 0 if packed else None
            for r, (s, n) in enumerate(work):
                if packed:
                    got[r].append(out[at:at + n])
                    at += n
                else:
                    got[r].append(out[r * n:(r + 1) * n])
    for r in range(2):
        torch.testing.assert_close(torch.cat(got[r]), expected[r], atol=1e-4, rtol=1e-4)
        rows = latent.view(-1, rank + ROPE)[[slot(r, p) for p in range(lens[r])]]
        torch.testing.assert_close(rows, cached[r], atol=1e-6, rtol=1e-6)


def test_absorbed_weights_are_views_of_kv_b_proj():
    """W_UK and W_UV are views of kv_b_proj.weight (no copy, its dtype): the per-head key rows, then value rows."""
    module = _model(512).model.layers[0].self_attn.to(torch.bfloat16)
    w_uk, w_uv = mla.absorbed_weights(module)
    weight = module.kv_b_proj.weight
    assert w_uk.shape == (4, NOPE, 512) and w_uv.shape == (4, VDIM, 512)
    assert w_uk.dtype == w_uv.dtype == torch.bfloat16
    assert w_uk.untyped_storage().data_ptr() == w_uv.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    per_head = weight.view(4, NOPE + VDIM, 512)
    assert torch.equal(w_uk[2], per_head[2, :NOPE]) and torch.equal(w_uv[3], per_head[3, NOPE:])


# -- the engine against transformers' generate --------------------------------------------------------------------
def test_served_tokens_equal_eager_generate_compiled():
    """DeepSeek-V3's latent width (kv_lora_rank 512), q_lora_rank, interleaved rope and YaRN scaling, compiled
    (regional: one graph per bucket for the dense layer and one shared by the two MoE layers of this 3-layer
    model): tokens equal eager generate's for five requests (chunked prefill of a 40-token prompt with a budget
    of 32, decodes beside prefill chunks, verify steps with accepted drafts); nothing compiles while serving, no
    graph breaks."""
    from torch._dynamo.utils import counters

    model = _model(512, 64, True, True, layers=3)
    requests = _requests()
    expected = _eager_reference(model, requests)
    engine = Engine(model, ServeConfig(**_CONFIG, compile=True))
    assert engine.runner.mla and engine.runner.regional and engine.runner.layer_kinds == 2  # dense, MoE
    counters.clear()
    engine.warmup()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3 * 2  # decode, verify, extend; each the dense layer and the MoE layers (not one per layer)
    steps = _record_steps(engine)
    report = engine.serve(requests)  # under fail_on_recompile
    for r in requests:
        assert r.finished and r.output == expected[tuple(r.prompt)], (r.id, r.output, expected[tuple(r.prompt)])
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert engine.pools_free
    extend = [work for kind, work in steps if kind == "extend"]
    assert any(not sample for work in extend for _, _, sample, _ in work)  # a chunk short of its prompt's end
    assert any(n == 1 for work in extend for _, n, _, _ in work)  # a decode inside an extend step
    assert any(kind == "decode" for kind, _ in steps)
    assert any(kind == "verify" and any(d for *_, d in work) for kind, work in steps)
    assert report.draft_acceptance > 0


@pytest.mark.parametrize("rank, q_lora_rank, interleave, yarn", _VARIANTS[1:])
def test_served_tokens_equal_eager_generate(rank, q_lora_rank, interleave, yarn):
    """The other variants, the engine run eagerly (the same steps and kernels, no compile): tokens equal eager
    generate's, with drafts verified and pages recycled through preemption (a pool of 14 pages)."""
    model = _model(rank, q_lora_rank, interleave, yarn)
    requests = _requests()
    expected = _eager_reference(model, requests)
    engine = Engine(model, ServeConfig(**{**_CONFIG, "num_pages": 14}, compile=False))
    report = engine.serve(requests)
    for r in requests:
        assert r.finished and r.output == expected[tuple(r.prompt)], (r.id, r.output, expected[tuple(r.prompt)])
    assert engine.pools_free and report.draft_acceptance > 0 and report.preemptions > 0


@pytest.mark.parametrize("feature", ["scaling", "interleave"])
def test_each_feature_changes_served_tokens(feature, monkeypatch):
    """The tests above can fail: served with YaRN's mscale dropped from the scale (192 ** -0.5), or with the
    other rope layout, some request's tokens differ from eager generate's."""
    model = _model(64, 64, True, True)
    requests = _requests()
    expected = _eager_reference(model, requests)
    engine = Engine(model, ServeConfig(**_CONFIG, compile=False))
    for layer in model.model.layers:
        if feature == "scaling":
            monkeypatch.setattr(layer.self_attn, "scaling", (NOPE + ROPE) ** -0.5)
    if feature == "interleave":
        monkeypatch.setattr(model.config, "rope_interleave", False)
    engine.serve(requests)
    assert any(r.output != expected[tuple(r.prompt)] for r in requests), feature


# -- the pool is the latent layout -------------------------------------------------------------------------------
def test_pool_is_one_latent_tensor_per_layer():
    """An MLA model's pool: per layer one [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] tensor (576
    for DeepSeek-V3), no per-head K and V; written by serving; the model's weights and parameters unchanged by
    the transform, and `restore_mla` gives it back its own attention (generate's tokens again)."""
    model = _model(512, 64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, ServeConfig(**_CONFIG, compile=False))
    runner = engine.runner
    assert runner.mla and runner.pools == ("full",) and len(runner.kv) == 2
    for latent in runner.kv:
        assert isinstance(latent, torch.Tensor) and latent.shape == (_CONFIG["num_pages"], _CONFIG["page_size"],
                                                                     512 + ROPE)
        assert latent.dtype == torch.float32 and not latent.any()
    assert runner.kv[0].untyped_storage().data_ptr() != runner.kv[1].untyped_storage().data_ptr()
    from b12x_inductor.bench.serve import kv_bytes_per_page  # the serve bench's memory accounting

    assert kv_bytes_per_page(engine) == 2 * _CONFIG["page_size"] * (512 + ROPE) * 4
    requests = [Request(prompt=list(range(1, 12)), max_new_tokens=4)]
    engine.serve(requests)
    for latent in runner.kv:
        used = latent.flatten(0, 1)[:11 + 3]  # the request's pages are the first ones handed out
        assert used.ne(0).any(-1).all()
    assert set(model.state_dict()) == set(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    attn = model.model.layers[0].self_attn
    assert type(attn) is mla.absorbed_class() and type(attn).forward is mla.absorbed_forward
    with pytest.raises(ValueError, match="runs only inside"):
        attn(torch.zeros(1, 1, 128), position_embeddings=None, attention_mask=None)
    mla.restore_mla(model)
    assert type(attn).__name__ == "DeepseekV3Attention"
    model.set_attn_implementation("eager")
    ids = model.generate(torch.tensor([requests[0].prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert ids[0, 11:].tolist() == requests[0].output


def test_non_mla_models_keep_key_and_value_pools():
    from hf_models import make_model

    runner = Engine(make_model("llama"), ServeConfig(**_CONFIG, compile=False)).runner
    assert not runner.mla and all(isinstance(kv, tuple) and len(kv) == 2 for kv in runner.kv)


# -- what the transform does not handle is refused --------------------------------------------------------------
def _refused(model, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, ServeConfig(**_CONFIG, compile=False))
    assert model.config._attn_implementation == "eager"  # the refused model is left as it was
    assert not any(type(m) is mla.absorbed_class() for m in model.modules())


def test_refuses_other_attention_classes():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = AutoConfig.for_model(
        "deepseek_v2", vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE, v_head_dim=VDIM, max_position_embeddings=256, n_group=1, topk_group=1)
    assert mla.is_mla(config)  # by its kv_lora_rank
    _refused(AutoModelForCausalLM.from_config(config, attn_implementation="eager"),
             r"layer 0's attention is DeepseekV2Attention .*handles transformers' DeepseekV3Attention only")

    class Custom(DeepseekV3Attention):
        pass

    model = _model()
    layer = model.model.layers[1]
    custom = Custom(model.config, 1)
    custom.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = custom
    _refused(model, r"layer 1's attention is Custom")


def test_refuses_sliding_windows():
    model = _model(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    _refused(model, r"layer 1 of DeepseekV3Config is a sliding-window layer \(window 8\)")


def test_refuses_latent_widths_the_kernels_do_not_take():
    _refused(_model(96), r"kv_lora_rank 96 \+ qk_rope_head_dim 64 = 160 values")


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # torch on the 0-wide q_a_proj
def test_refuses_q_lora_rank_variants():
    model = _model(q_lora_rank=0)  # transformers builds a 0-wide q_a_proj
    _refused(model, r"q_lora_rank must be None \(q_proj\) or an int >= 1.*got 0")
    model = _model()
    model.model.layers[1].self_attn.q_b_proj = None
    _refused(model, r"layer 1's attention: q_lora_rank = 64 needs q_a_proj, q_a_layernorm and q_b_proj")


def test_refuses_output_attentions():
    model = _model()
    model.config.output_attentions = True
    _refused(model, r"output_attentions must be False")


def test_refuses_unknown_arguments_and_training_at_call():
    """At warmup (its first bucket runs eagerly), an attention keyword the engine does not know, even one that
    comes with a value only at call time, raises naming it; a module in training mode with attention dropout
    raises at its call."""
    model = _model()
    engine = Engine(model, ServeConfig(**_CONFIG, compile=True))
    attn = model.model.layers[1].self_attn
    forward = attn.forward
    attn.forward = lambda *args, **kwargs: forward(*args, **kwargs, rope_deltas=3)
    with pytest.raises(ValueError, match=r"layer 1\): argument 'rope_deltas' is not supported.*rope_deltas=3"):
        engine.warmup()
    attn.forward = lambda *args, **kwargs: forward(*args, **kwargs, output_attentions=True)
    with pytest.raises(ValueError, match=r"layer 1\): output_attentions must be False"):
        engine.warmup()
    attn.forward = forward
    model.train()
    model.config.attention_dropout = attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention dropout must be off.*call model.eval\(\)"):
        engine.warmup()


def test_refuses_eager_experts_under_compile():
    """transformers' "eager" experts loop over the experts a step hits (a data-dependent trip count), which
    torch.compile(fullgraph=True) cannot trace: refused when compiling, served when not."""
    model = _model()
    model.set_experts_implementation("eager")
    with pytest.raises(ValueError, match=r"_experts_implementation is 'eager'.*'grouped_mm'.*compile=False"):
        Engine(model, ServeConfig(**_CONFIG, compile=True))
    assert not any(type(m) is mla.absorbed_class() for m in model.modules())
    requests = _requests()[:2]
    expected = _eager_reference(model, requests)
    Engine(model, ServeConfig(**_CONFIG, compile=False)).serve(requests)
    assert all(r.output == expected[tuple(r.prompt)] for r in requests)
