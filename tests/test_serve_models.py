"""The serving engine on today's open model families (tiny random-weight models of tests/hf_models.py: sliding
windows shorter than the prompts, Gemma 2's logit softcap and query_pre_attn_scalar, gpt-oss's random
attention sinks): served tokens equal transformers' eager greedy `generate`, compiled without graph breaks or
recompiles; every attention argument transformers passes is honored or refused, never dropped."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import one_thread
from hf_models import ARCHS, WINDOW, layer_types, make_model

from b12x_inductor.serve import Engine, Request, ServeConfig
from b12x_inductor.serve import runner as runner_mod
from b12x_inductor.serve.runner import HARMLESS_KWARGS, HONORED_KWARGS, attention_arguments


_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


# (prompt length, new tokens): 40 > token_budget (chunked prefill), 5 requests > max_batch (some wait), every
# sequence longer than the window of 8; with _requests(seed=1) prompt lookup gets drafts accepted on every arch
_WORKLOAD = [(40, 6), (6, 40), (23, 8), (31, 5), (14, 30)]
_CONFIG = dict(num_pages=40, page_size=4, max_batch=4, token_budget=32, max_model_len=64, num_draft=2,
               decode_buckets=(4,), extend_buckets=(32,))


def _requests(seed=1):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i, (n, m) in enumerate(_WORKLOAD):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        if i % 2 == 0:  # repeated phrases give prompt lookup something to find
            prompt = (prompt[:max(1, n // 3)] * 4)[:n]
        reqs.append(Request(prompt=prompt, max_new_tokens=m))
    return reqs


def _eager_reference(model, requests) -> dict[tuple[int, ...], list[int]]:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    out = {}
    for r in requests:
        ids = ref.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        out[tuple(r.prompt)] = ids[0, len(r.prompt):].tolist()
    return out


def _record_steps(engine) -> list:
    """Wraps the engine's runner so that each step's (kind, [(start, tokens, sample, drafts)]) is recorded."""
    steps, run = [], engine.runner.run

    def recording(step):
        steps.append((step.kind, [(w.start, len(w.tokens), w.sample, w.num_draft) for w in step.work]))
        return run(step)

    engine.runner.run = recording
    return steps


# Compiled for every arch: three buckets, one Inductor compile of a decoder layer per bucket and layer kind.
@pytest.mark.parametrize("arch", ARCHS)
def test_served_tokens_equal_eager_generate(arch):
    from torch._dynamo.utils import counters

    model = make_model(arch)
    if arch != "llama":
        assert "sliding_attention" in layer_types(model)
    requests = _requests()
    assert all(len(r.prompt) + r.max_new_tokens > 2 * WINDOW for r in requests)
    expected = _eager_reference(model, requests)
    engine = Engine(model, ServeConfig(**_CONFIG, compile=True))
    assert not engine.runner.cuda_graphs
    counters.clear()
    engine.warmup()
    graphs = counters["stats"]["unique_graphs"]
    # regional compile (the default): one graph per bucket and layer kind (full layers, window layers)
    assert engine.runner.regional and graphs == 3 * engine.runner.layer_kinds == 3 * len(set(layer_types(model)))
    steps = _record_steps(engine)
    report = engine.serve(requests)  # under fail_on_recompile
    for r in requests:
        assert r.finished and r.output == expected[tuple(r.prompt)], (arch, r.id, r.output, expected[tuple(r.prompt)])
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled while serving
    assert not counters["graph_break"]
    assert engine.pools_free
    # the workload exercised what it claims: chunked prefill, prefill chunks beside decodes, verify with drafts
    extend = [work for kind, work in steps if kind == "extend"]
    assert any(not sample for work in extend for _, _, sample, _ in work)  # a chunk short of its prompt's end
    assert any(n == 1 for work in extend for _, n, _, _ in work)  # a decode inside an extend step
    assert any(kind == "verify" and any(d for *_, d in work) for kind, work in steps)
    assert report.draft_acceptance > 0  # accepted drafts: verify rows past the first are used


_LONG = [(40, 20), (6, 50), (23, 30), (14, 40)]  # sequences of 53..60 positions: 7x the window


@pytest.mark.parametrize("arch", ["gpt_oss", "mistral"])  # window and full pools; a window pool alone
def test_window_pages_recycled(arch):
    """Window layers' pages that fall out of the window go back to their pool: with a window pool of 11 pages
    (what one request's 32-token chunk and its window need) four requests that grow to 7x the window are
    served, compiled, with tokens equal to eager generate and nothing recompiled; each request holds at most
    ceil((window - 1 + step tokens) / page_size) + 1 window pages."""
    from torch._dynamo.utils import counters

    model = make_model(arch)
    g = torch.Generator().manual_seed(3)
    requests = [Request(prompt=torch.randint(1, 256, (n,), generator=g).tolist(), max_new_tokens=m)  # no pad id 0
                for n, m in _LONG]
    expected = _eager_reference(model, requests)
    config = ServeConfig(**{**_CONFIG, "num_pages": 48}, window_num_pages=11)
    assert config.window_pages_per_request(WINDOW) == 11
    engine = Engine(model, config)
    assert engine.runner.pools == (("full", "window") if arch == "gpt_oss" else ("window",))
    assert engine.runner.kv[0][0].shape[0] == 11 and (arch == "mistral") == (engine.pages is None)
    counters.clear()
    engine.warmup()
    graphs = counters["stats"]["unique_graphs"]
    held, run = [], engine.runner.run

    def checking(step):
        for w in step.work:
            r = w.request
            assert len(r.window_pages) <= -(-(WINDOW - 1 + len(w.tokens)) // 4) + 1, (r.id, w.start)
            held.append((r.window_base, len(r.window_pages)))
        return run(step)

    engine.runner.run = checking
    report = engine.serve(requests)
    for r in requests:
        assert r.finished and r.output == expected[tuple(r.prompt)], (arch, r.id, r.output, expected[tuple(r.prompt)])
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert engine.pools_free and report.output_tokens == sum(m for _, m in _LONG)
    assert all(-(-len(r.tokens) // 4) > 11 for r in requests)  # unrecycled, 11 pages would not hold one of them
    assert max(base for base, _ in held) >= 10  # columns freed while sequences grew
    assert engine.window_pages.peak_used <= 11
    if engine.pages is not None:
        assert engine.pages.peak_used > 2 * engine.window_pages.peak_used


def test_window_pages_not_recycled_when_off():
    """recycle_window_pages=False: one pool for every layer (the layout of a model without windows), tokens
    still equal eager generate's."""
    model = make_model("gemma3_text")
    requests = _requests()[:3]
    expected = _eager_reference(model, requests)
    engine = Engine(model, ServeConfig(**_CONFIG, compile=False, recycle_window_pages=False))
    assert engine.runner.pools == ("full",) and engine.window_pages is None and engine.runner.window is None
    engine.serve(requests)
    for r in requests:
        assert r.output == expected[tuple(r.prompt)] and r.window_pages == []
    assert engine.pools_free


# What each arch's models would lose if the engine dropped one attention feature: (arch, feature, the
# paged_attention arguments without it).
_DROPPED = {
    "window": dict(window_left=-1), "sinks": dict(sinks=None), "softcap": dict(softcap=0.0),
    "scaling": dict(scale=None),
}
_FEATURES = [("mistral", "window"), ("qwen2", "window"), ("gemma2", "window"), ("gemma2", "softcap"),
             ("gemma2", "scaling"), ("gemma3_text", "window"), ("gemma3_text", "scaling"), ("gpt_oss", "window"),
             ("gpt_oss", "sinks")]


@pytest.mark.parametrize("arch, feature", _FEATURES)
def test_each_feature_changes_served_tokens(arch, feature, monkeypatch):
    """The test above can fail: served without one feature (the engine run eagerly, that argument of
    paged_attention dropped), some request's tokens differ from eager generate's."""
    honored = runner_mod.attention_arguments
    monkeypatch.setattr(runner_mod, "attention_arguments",
                        lambda *args: {**honored(*args), **_DROPPED[feature]})
    model = make_model(arch)
    requests = _requests()
    expected = _eager_reference(model, requests)
    Engine(model, ServeConfig(**_CONFIG, compile=False)).serve(requests)
    assert any(r.output != expected[tuple(r.prompt)] for r in requests), (arch, feature)


# -- every attention argument is honored or refused ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_receives_only_known_arguments(arch, monkeypatch):
    """Every keyword transformers hands the engine's attention (over all layers and step kinds) is one the
    engine honors or knows to be harmless. A new keyword, even one passed as None, fails here until it is
    classified in runner.py."""
    seen = {}
    attention = runner_mod._attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        for name, val in kwargs.items():
            seen.setdefault(name, set()).add(type(val).__name__)
        return attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(runner_mod, "_attention", spy)
    engine = Engine(make_model(arch), ServeConfig(**_CONFIG, compile=False))
    engine.serve(_requests()[:2])
    assert seen and set(seen) <= set(HONORED_KWARGS) | set(HARMLESS_KWARGS), seen
    assert {"b12x_serve", "scaling"} <= set(seen)
    if arch != "llama":
        assert seen["sliding_window"] >= {"int"}
    if arch == "gpt_oss":
        assert seen["s_aux"] == {"Parameter"}  # module.sinks
    if arch == "gemma2":
        assert seen["softcap"] == {"float"}


def test_unknown_attention_argument_refused_at_warmup():
    """A keyword the engine does not know, injected into a model's attention call, raises at warmup (before
    any compile) naming the argument."""
    model = make_model("llama")
    attn = model.model.layers[1].self_attn
    forward = attn.forward
    attn.forward = lambda *args, **kwargs: forward(*args, **kwargs, rope_deltas=3)
    engine = Engine(model, ServeConfig(**_CONFIG, compile=True))
    with pytest.raises(ValueError, match=r"layer 1\).*'rope_deltas'.*rope_deltas=3"):
        engine.warmup()
    attn.forward = lambda *args, **kwargs: forward(*args, **kwargs, rope_deltas=None)  # None: nothing to drop
    Engine(model, ServeConfig(**_CONFIG, compile=False)).warmup()


class _Attn(torch.nn.Module):
    layer_idx = 0


def _call(window=None, mask=None, module=None, hq=4, **kwargs):
    q, k = torch.zeros(1, hq, 3, 64), torch.zeros(1, 2, 3, 64)
    return attention_arguments(module or _Attn(), q, k, k.clone(), mask, kwargs, window)


def test_attention_arguments_honored():
    sinks = torch.randn(4, dtype=torch.bfloat16)
    got = _call(window=8, scaling=0.2, sliding_window=8, softcap=30.0, s_aux=sinks, dropout=0.0, use_cache=False,
                position_ids=torch.arange(3), output_attentions=False, is_causal=True, cu_seq_lens_q=None)
    assert got["scale"] == 0.2 and got["window_left"] == 7 and got["softcap"] == 30.0
    assert got["sinks"].dtype == torch.float32 and torch.equal(got["sinks"], sinks.float())
    assert _call() == dict(scale=None, window_left=-1, softcap=0.0, sinks=None)


@pytest.mark.parametrize("case, match", [
    (dict(dropout=0.1), r"dropout must be 0.*got dropout=0.1"),
    (dict(output_attentions=True), r"output_attentions must be False"),
    (dict(is_causal=False), r"is_causal must be True"),
    (dict(cu_seq_lens_q=torch.zeros(2)), r"'cu_seq_lens_q' is not supported.*tensor of shape \[2\]"),
    (dict(sliding_window=8), r"sliding_window must be None.*got 8"),
    (dict(window=8), r"sliding_window must be 8.*got None"),
    (dict(window=8, sliding_window=4), r"sliding_window must be 8.*got 4"),
    (dict(s_aux=torch.zeros(2)), r"s_aux .* shape \[4\].*shape \[2\]"),
    (dict(softcap=-1.0), r"softcap must be None or a number >= 0"),
    (dict(mask=torch.zeros(1, 1, 3, 3)), r"attention_mask must be None"),
])
def test_attention_arguments_refused(case, match):
    with pytest.raises(ValueError, match=match):
        _call(**case)


def test_missing_sinks_refused():
    module = _Attn()
    module.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"s_aux must be the module's attention sinks.*got None"):
        _call(module=module)


# -- models the engine cannot serve are refused at Engine(...) ----------------------------------------------------
def _refused(model, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, ServeConfig(**_CONFIG, compile=False))
    assert model.config._attn_implementation == "eager"  # the refused model is left as it was


def test_engine_refuses_head_dim():
    _refused(make_model("llama", head_dim=16), r"head_dim must be one of \(64, 96, 128, 192, 256\).*got 16.*"
                                               r"generate")


def test_engine_refuses_chunked_attention():
    model = make_model("llama")
    model.config.attention_chunk_size = 4
    _refused(model, r"attention_chunk_size must be None.*got 4")


def test_engine_refuses_layer_type():
    model = make_model("gemma3_text")
    model.config.layer_types = ["sliding_attention", "chunked_attention", "sliding_attention"]
    _refused(model, r"layer 1 .* 'chunked_attention'.*\('full_attention', 'sliding_attention'\)")


def test_engine_refuses_bidirectional():
    model = make_model("gemma3_text")
    model.config.use_bidirectional_attention = True
    _refused(model, r"must be causal.*use_bidirectional_attention=True")
    model = make_model("llama")
    model.config.is_causal = False
    _refused(model, r"must be causal.*is_causal=False")
    model = make_model("llama")
    model.model.layers[0].self_attn.is_causal = False
    _refused(model, r"LlamaAttention \(layer 0\) has is_causal False")


# -- the serving benchmark's gpt-oss-shaped model -----------------------------------------------------------------
def test_bench_serve_gpt_oss_tiny(tmp_path):
    """`python -m b12x_inductor.bench serve --model gpt-oss` runs (its tiny CPU form, eagerly) and reports
    throughput and the KV pools' peak use, with window pages recycled and without."""
    import json

    from b12x_inductor.bench import serve as bench

    out = tmp_path / "serve.json"
    bench.main(["--tiny", "--model", "gpt-oss", "--no-compile", "--requests", "3", "--num-draft", "2",
                "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["meta"]["model"] == "gpt-oss"
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"b12x", "b12x+lookup", "b12x-keep-window"}
    for row in rows.values():
        assert row["throughput_tok_s"] > 0 and row["output_tokens"] > 0
        assert 0 < row["kv_peak_gib"] <= row["kv_pool_gib"] and row["kv_peak_pages"] > 0
    kept = rows["b12x-keep-window"]
    assert not kept["recycle_window_pages"] and kept["kv_peak_window_pages"] == 0
    assert "100% of outputs equal b12x's" in kept["notes"]
    for name in ("b12x", "b12x+lookup"):  # recycled: a window pool of its own, fewer window pages held
        assert rows[name]["recycle_window_pages"]
        assert 0 < rows[name]["kv_peak_window_pages"] < rows[name]["kv_peak_pages"]
        assert rows[name]["kv_pool_gib"] <= kept["kv_pool_gib"] and rows[name]["kv_peak_gib"] < kept["kv_peak_gib"]
    config = bench.gpt_oss_config("20b")  # the H200 model: gpt-oss-20b's attention shapes
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.sliding_window) == (
        64, 64, 8, 128)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
