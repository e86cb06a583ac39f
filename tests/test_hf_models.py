"""attn_implementation="b12x" on today's open model families (tests/hf_models.py): sliding-window layers,
logit softcap, attention sinks, Gemma's query_pre_attn_scalar, mixed layer types, left padding.

Every model is a tiny random-weight one built here (window 8, shorter than every prompt). Greedy tokens
must equal transformers' eager attention (which gpt-oss and Gemma 2 need: they refuse sdpa), and so must
the logits of every step, so that a dropped feature shows even where it would not flip a token.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.configuration_utils import CompileConfig  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    or_masks,
    padding_mask_function,
    sliding_window_causal_mask_function,
)

import b12x_inductor  # noqa: E402
from b12x_inductor.integrations import hf  # noqa: E402
from b12x_inductor.integrations.hf_attention import pattern_window  # noqa: E402
from hf_models import ARCHS, WINDOW, cache_kwarg, layer_types, make_model  # noqa: E402

NEW_TOKENS = 16  # prompt 12 + 16 > the 24 positions a window layer keeps below: its pages are reused


def prompts(batch: int, seed: int, length: int = 12):
    """Random prompts; rows 1 and 2 of a batch of 4 left-padded (3 and 7 pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch >= 3:
        mask[1, :3] = 0
        mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


def paged_cache(model, batch: int, **kw):
    """A B12xCache whose window layers cycle through ceil((8 - 1 + 16) / 4) = 6 pages of 4 per request."""
    kw = {"max_cache_len": 64, "page_size": 4, "window_slack": 16, "dtype": model.dtype, **kw}
    return hf.B12xCache(model.config, max_batch_size=batch, **kw)


def generate(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    kw.setdefault("disable_compile", True)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=kw.pop("new", NEW_TOKENS),
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits)


def assert_same(got, want):
    (tokens, logits), (want_tokens, want_logits) = got, want
    torch.testing.assert_close(tokens, want_tokens, rtol=0, atol=0)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


@pytest.fixture
def spy(monkeypatch):
    """The window_left, softcap and sinks of every paged_attention call (so a test also proves b12x ran)."""
    calls = []
    real = b12x_inductor.paged_attention

    def counting(q, *args, **kwargs):
        calls.append((tuple(q.shape), kwargs.get("window_left", -1), kwargs.get("softcap", 0.0),
                      kwargs.get("sinks") is not None))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(b12x_inductor, "paged_attention", counting)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("cache", ["static", "b12x"])
def test_tokens_and_logits_equal_eager(arch, batch, cache, spy):
    model = make_model(arch)
    ids, mask = prompts(batch, seed=batch)
    want = generate(model, "eager", ids, mask, cache_implementation="static")
    assert not spy
    kw = dict(cache_implementation="static") if cache == "static" else cache_kwarg(model, paged_cache(model, batch))
    assert_same(generate(model, "b12x", ids, mask, **kw), want)
    kinds = layer_types(model)
    windows = {w for _, w, _, _ in spy}
    assert windows == {-1 if k == "full_attention" else WINDOW - 1 for k in kinds}, (windows, kinds)
    assert {s for *_, s in spy} == {arch == "gpt_oss"}  # sinks reach the op
    assert {c for _, _, c, _ in spy} == {2.0 if arch == "gemma2" else 0.0}
    assert len(spy) == len(kinds) * NEW_TOKENS


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text", "gpt_oss"])
def test_long_prefill_gathers_the_window(arch, spy):
    """A 40-token prefill (extend plan, longer than the 24 positions a window layer keeps) on a left-padded
    batch: the window layers of a B12xCache attend to a gathered block and keep only their last pages."""
    model = make_model(arch)
    ids, mask = prompts(4, seed=11, length=40)
    want = generate(model, "eager", ids, mask, cache_implementation="static", new=8)
    assert_same(generate(model, "b12x", ids, mask, cache_implementation="static", new=8), want)
    paged = paged_cache(model, 4)
    assert_same(generate(model, "b12x", ids, mask, **cache_kwarg(model, paged), new=8), want)
    window = paged.layers[layer_types(model).index("sliding_attention")]
    assert window.keys.shape[0] == 4 * 6 and window.window_tokens == 24
    assert (4, 40 + WINDOW - 1, 2, 64) == (4, 40 + WINDOW - 1, *window.keys.shape[2:])


def test_window_layers_hold_only_their_pages():
    model = make_model("gpt_oss")
    paged = paged_cache(model, 2, max_cache_len=256)
    full, window = paged.layers[1], paged.layers[0]
    assert (window.is_sliding, full.is_sliding) == (True, False)
    assert full.keys.shape == (2 * 64, 4, 2, 64) and window.keys.shape == (2 * 6, 4, 2, 64)
    assert paged.window_page_table[1, :8].tolist() == [6, 7, 8, 9, 10, 11, 6, 7]  # request 1 cycles its 6
    assert paged.kv_bytes() == (128 + 12) * 2 * (4 * 2 * 64 * 4)  # pages x (keys, values) x page bytes
    roomy = paged_cache(model, 2, max_cache_len=16)  # a window layer needing as many pages as a full one
    assert roomy.layers[0].window_tokens is None and roomy.layers[0].keys.shape == roomy.layers[1].keys.shape


def test_crop_past_the_kept_window_raises():
    model = make_model("mistral")
    paged = paged_cache(model, 1)
    layer = paged.layers[0]
    layer.cache_seqlens.fill_(40)
    layer.written.fill_(40)
    layer.crop(-17)  # 24 kept - 8 + 1: the new last token's window is still there
    assert int(layer.cache_seqlens[0]) == 23
    layer.crop(0)  # transformers >= 5.24: every draft accepted
    assert int(layer.cache_seqlens[0]) == 23
    with pytest.raises(ValueError, match=r"cannot crop 18 tokens back .* at most 17"):
        layer.crop(-1)


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text", "gpt_oss", "gemma2"])
def test_assisted_generation_through_b12x_cache(arch, spy):
    """Assisted generation: drafts checked in one verify forward on the window layers' reused pages.
    (transformers refuses assisted generation over its own static cache once a layer has a window.)"""
    model, draft = make_model(arch), make_model(arch, seed=1)
    draft.set_attn_implementation("b12x")
    ids, mask = prompts(1, seed=5, length=20)
    want = generate(model, "eager", ids, mask, cache_implementation="static")[0]
    got, _ = generate(model, "b12x", ids, mask, assistant_model=draft, **cache_kwarg(model, paged_cache(model, 1)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert any(2 <= shape[1] <= 16 for shape, *_ in spy), spy


def _compile_config(dynamic):
    config = CompileConfig(fullgraph=True, dynamic=dynamic)
    config._compile_all_devices = True  # generate compiles on CUDA only, unless told
    return config


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text"])
def test_compiled_b12x_cache_no_graph_break_no_recompile(arch):
    """fullgraph decode step over a B12xCache; a second generate with other prompts compiles nothing."""
    from torch._dynamo.utils import counters

    model = make_model(arch)
    paged = paged_cache(model, 4)
    torch._dynamo.reset()
    counters.clear()
    try:
        for step in range(2):
            ids, mask = prompts(4, seed=20 + step)
            want = generate(model, "eager", ids, mask, cache_implementation="static")
            paged.reset()
            torch.compiler.set_stance("fail_on_recompile" if step else "default")
            got = generate(model, "b12x", ids, mask, **cache_kwarg(model, paged), compile_config=_compile_config(False),
                           disable_compile=False)
            torch.compiler.set_stance("default")
            assert_same(got, want)
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_static_cache_window_layers():
    """transformers' own sliding-window static layers keep a Python int offset, so generate needs
    dynamic=None there (SDPA and eager too): the decode step compiles twice, fullgraph, and gives eager's
    tokens."""
    from torch._dynamo.utils import counters

    model = make_model("gpt_oss")
    ids, mask = prompts(4, seed=3)
    want = generate(model, "eager", ids, mask, cache_implementation="static")
    torch._dynamo.reset()
    counters.clear()
    got = generate(model, "b12x", ids, mask, cache_implementation="static", compile_config=_compile_config(None),
                   disable_compile=False)
    assert_same(got, want)
    assert 1 <= counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_mask_patterns():
    assert pattern_window(causal_mask_function, None) is None
    assert pattern_window(sliding_window_causal_mask_function(128), 128) == 128
    refused = [
        (sliding_window_causal_mask_function(128), 64),  # a window other than the one transformers names
        (sliding_window_causal_mask_function(128), None),
        (causal_mask_function, 128),
        (chunked_causal_mask_function(8, torch.zeros(2, dtype=torch.long)), 8),
        (bidirectional_mask_function, None),
        (or_masks(causal_mask_function, bidirectional_mask_function), None),  # image tokens see each other
        (and_masks(causal_mask_function, padding_mask_function(torch.ones(2, 4, dtype=torch.bool))), None),
    ]
    for fn, local in refused:
        with pytest.raises(ValueError, match=r"another mask pattern.*eager"):
            pattern_window(fn, local)


def test_bidirectional_model_fails_at_first_call():
    model = make_model("gemma3_text", use_bidirectional_attention=True)
    ids, mask = prompts(1, seed=6)
    with pytest.raises(ValueError, match=r"non-causal attention"):
        generate(model, "b12x", ids, mask, cache_implementation="static")
    model.set_attn_implementation("b12x")
    with pytest.raises(ValueError, match=r"another mask pattern"):  # the model's own masks: bidirectional windows
        model(ids, attention_mask=mask)


def test_attention_arguments_are_honored_or_refused(monkeypatch):
    """Every keyword transformers passes is honored or in HARMLESS_KWARGS; anything else is refused."""
    from b12x_inductor.integrations import hf_attention

    seen = set()
    real = hf_attention.b12x_attention

    def recording(module, q, k, v, mask, **kwargs):
        seen.update(kwargs)
        return real(module, q, k, v, mask, **kwargs)

    transformers.AttentionInterface.register("b12x", recording)
    try:
        for arch in ARCHS:
            model = make_model(arch)
            ids, mask = prompts(1, seed=1)
            generate(model, "b12x", ids, mask, cache_implementation="static", new=2)
        honored = {"dropout", "scaling", "sliding_window", "softcap", "s_aux", "is_causal", "output_attentions"}
        assert seen <= honored | set(hf_attention.HARMLESS_KWARGS), seen - honored - set(hf_attention.HARMLESS_KWARGS)
        assert {"s_aux", "softcap", "sliding_window", "scaling"} <= seen

        def extra(module, q, k, v, mask, **kwargs):
            return real(module, q, k, v, mask, **kwargs, head_mask=torch.ones(1))

        transformers.AttentionInterface.register("b12x", extra)
        with pytest.raises(ValueError, match=r"cannot honor: \['head_mask'\]"):
            generate(make_model("llama"), "b12x", *prompts(1, seed=1), cache_implementation="static", new=2)
        model = make_model("llama")
        model.set_attn_implementation("b12x")
        hf.register()
        with pytest.raises(ValueError, match=r"output_attentions=True"):
            model(prompts(1, seed=1)[0], output_attentions=True)
    finally:
        hf.register()


def test_sinks_not_passed_are_refused(monkeypatch):
    """A layer holding attention sinks that does not hand them to attention is refused, not run without."""
    from b12x_inductor.integrations import hf_attention

    real = hf_attention.b12x_attention
    transformers.AttentionInterface.register("b12x", lambda *a, s_aux=None, **kw: real(*a, **kw))
    try:
        with pytest.raises(ValueError, match=r"attention sinks \(module.sinks\) but passed no s_aux"):
            generate(make_model("gpt_oss"), "b12x", *prompts(1, seed=1), cache_implementation="static", new=2)
    finally:
        hf.register()


def test_window_mask_for_a_full_layer_is_refused():
    """A layer whose sliding_window disagrees with its mask (a model passing the wrong mask) is refused."""
    model = make_model("gpt_oss")
    model.model.layers[1].self_attn.sliding_window = WINDOW  # a full layer claiming a window
    ids, mask = prompts(1, seed=1)
    with pytest.raises(ValueError, match=r"sliding_window=8 but its mask is for causal attention"):
        generate(model, "b12x", ids, mask, cache_implementation="static", new=2)


def _triton_interpreter_worker():
    """Runs in a subprocess with TRITON_INTERPRET=1: the Triton family forced on CPU, so the kernels see
    exactly the tensors the integration hands them (cycled window pages, gathered window blocks, sinks,
    softcap), in the verify, extend and decode plans."""
    import json

    from helpers import force_triton_family

    seen = force_triton_family()
    results = {}
    for arch in ("gpt_oss", "gemma2"):
        model = make_model(arch)
        for length in (12, 24):  # a verify- and an extend-plan prefill, then decode
            ids, mask = prompts(4, seed=3, length=length)
            want = generate(model, "eager", ids, mask, cache_implementation="static", new=3)
            for cache in ("static", "b12x"):
                kw = (dict(cache_implementation="static") if cache == "static"
                      else cache_kwarg(model, paged_cache(model, 4, page_size=2, window_slack=16)))
                got = generate(model, "b12x", ids, mask, new=3, **kw)
                results[f"{arch}-{cache}-{length}"] = bool((got[0] == want[0]).all()) and bool(
                    torch.allclose(got[1], want[1], rtol=1e-4, atol=1e-4))
    print(json.dumps(dict(results=results, seen=sorted(seen))), flush=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check for CPU machines; the GPU tests run the kernels")
def test_triton_kernels_see_the_integration_tensors():
    from helpers import interpreter_worker_report

    report = interpreter_worker_report(__file__)
    assert all(report["results"].values()), report
    assert {"decode:triton", "verify:triton", "extend:triton"} <= set(report["seen"]), report


if __name__ == "__main__" and "--triton-interpreter-worker" in __import__("sys").argv:
    import sys as _sys

    _sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    _triton_interpreter_worker()
