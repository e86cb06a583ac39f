"""transformers integration: attn_implementation="b12x" and B12xCache against SDPA with a static cache.

Tiny random-weight Llama / Qwen2 models built here (no downloads). Greedy tokens must equal SDPA's.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.cache_utils import StaticLayer  # noqa: E402
from transformers.generation.configuration_utils import CompileConfig  # noqa: E402

import b12x_inductor  # noqa: E402
from b12x_inductor.integrations import hf  # noqa: E402
from hf_models import cache_kwarg  # noqa: E402,F401  (test_gpu_models imports it from here too)

NEW_TOKENS = 6
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.1)
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def make_model(arch="llama", dtype=torch.float32, seed=0, **overrides):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval().to(dtype)
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch, seed, length=12):
    """Random prompts; row 1 and 2 of a batch of 4 left-padded (3 and 7 pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch >= 3:
        mask[1, :3] = 0
        mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    kw.setdefault("disable_compile", True)
    kw.setdefault("max_new_tokens", NEW_TOKENS)
    return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def sdpa_tokens(model, ids, mask):
    return generate(model, "sdpa", ids, mask, cache_implementation="static")


def new_b12x_cache(model, batch, **kw):
    kw = {"max_cache_len": 64, "page_size": 16, "dtype": model.dtype, **kw}
    return hf.B12xCache(model.config, max_batch_size=batch, **kw)


@pytest.fixture
def spy(monkeypatch):
    """Counts paged_attention calls, so that a test also proves b12x ran."""
    calls = []
    real = b12x_inductor.paged_attention

    def counting(q, k_cache, v_cache, page_table, cache_seqlens, *args, kv_start=None, **kwargs):
        # the kernels read page-table rows, lengths and starts with unit stride
        assert page_table.stride(-1) == 1 and cache_seqlens.is_contiguous(), (page_table.stride(), cache_seqlens)
        assert kv_start is None or kv_start.is_contiguous(), kv_start.stride()
        assert all(t.data_ptr() % 16 == 0 for t in (page_table, cache_seqlens, kv_start) if t is not None)
        calls.append(tuple(q.shape))
        return real(q, k_cache, v_cache, page_table, cache_seqlens, *args, kv_start=kv_start, **kwargs)

    monkeypatch.setattr(b12x_inductor, "paged_attention", counting)
    return calls


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("cache", ["static", "b12x"])
def test_greedy_tokens_equal_sdpa(arch, batch, cache, spy):
    model = make_model(arch)
    ids, mask = prompts(batch, seed=batch)
    want = sdpa_tokens(model, ids, mask)
    assert not spy
    if cache == "static":
        got = generate(model, "b12x", ids, mask, cache_implementation="static")
    else:  # one spare request row, and the pages shuffled: the page table is what places each token
        paged = new_b12x_cache(model, batch + 1)
        pages = paged.page_table.numel()
        paged.page_table.copy_(torch.randperm(pages, generator=torch.Generator().manual_seed(batch)).view(
            batch + 1, -1))
        got = generate(model, "b12x", ids, mask, **cache_kwarg(model, paged))
        lengths = torch.tensor([12 + NEW_TOKENS - 1] * batch + [0]).int()
        torch.testing.assert_close(paged.layers[0].cache_seqlens, lengths)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    layers = model.config.num_hidden_layers
    assert spy[0] == (batch, 12, 4, 64) and spy[layers] == (batch, 1, 4, 64), spy  # prefill then decode
    assert len(spy) == layers * NEW_TOKENS, len(spy)  # one prefill and NEW_TOKENS - 1 decode forwards


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("qwen2", torch.float16)])
def test_half_precision_tokens_equal_sdpa(arch, dtype):
    model = make_model(arch, dtype=dtype)
    ids, mask = prompts(4, seed=4)
    want = sdpa_tokens(model, ids, mask)
    torch.testing.assert_close(generate(model, "b12x", ids, mask, cache_implementation="static"), want)
    got = generate(model, "b12x", ids, mask, **cache_kwarg(model, new_b12x_cache(model, 4)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_layer_routes_through_update_kwargs_or_layer_table():
    """transformers >= 5.24 hands the kwargs of cache.update to attention; older versions get the layer
    through a table keyed by layer_idx, consumed by the attention call that follows. A table entry whose
    pools are not the attention's keys is stale (a forward that failed in between) and ignored."""
    from b12x_inductor.integrations import hf_cache

    model = make_model("llama")
    paged = new_b12x_cache(model, 2)
    layer, module = paged.layers[1], model.model.layers[1].self_attn
    shared = {}
    hf_cache.route(layer, {"kwargs": shared})
    assert hf_cache.routed_layer(module, layer.keys, shared) is layer and not hf_cache._ROUTES
    hf_cache.route(layer, {"kwargs": {}})  # a copied dict: the table still carries the layer
    assert hf_cache.routed_layer(module, layer.keys, {}) is layer and not hf_cache._ROUTES
    hf_cache.route(layer, {})
    assert hf_cache.routed_layer(module, layer.keys, {}) is layer
    assert hf_cache.routed_layer(module, layer.keys, {}) is None  # consumed
    hf_cache.route(layer, {})
    assert hf_cache.routed_layer(module, layer.keys.clone(), {}) is None and not hf_cache._ROUTES  # stale
    with pytest.raises(ValueError, match="mixing caches"):
        hf_cache.routed_layer(module, torch.zeros(2, 2, 64, 64), {hf_cache.ROUTE_KEY: layer})


def test_prefill_through_extend_plan_and_long_prompt(spy):
    """A prompt longer than 16 tokens takes the extend plan (q [B, S > 16, Hq, D])."""
    model = make_model("llama")
    ids, mask = prompts(4, seed=7, length=40)
    want = sdpa_tokens(model, ids, mask)
    problem = b12x_inductor.Problem(batch=4, q_len=40, packed=False, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                    page_size=64, max_pages=1, q_dtype=torch.float32, kv_dtype=torch.float32,
                                    kv_layout="HND", device_type="cpu")
    assert b12x_inductor.select_plan(problem).mode == "extend"
    torch.testing.assert_close(generate(model, "b12x", ids, mask, cache_implementation="static"), want)
    got = generate(model, "b12x", ids, mask, **cache_kwarg(model, new_b12x_cache(model, 4)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert spy.count((4, 40, 4, 64)) == 2 * model.config.num_hidden_layers  # the two prefills


def test_from_pretrained_and_set_attn_implementation(tmp_path):
    model = make_model("qwen2")
    model.save_pretrained(tmp_path)
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path, attn_implementation="b12x")
    assert loaded.config._attn_implementation == "b12x"
    ids, mask = prompts(1, seed=3)
    want = sdpa_tokens(model, ids, mask)
    got = loaded.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                          cache_implementation="static", disable_compile=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cache", ["static", "b12x"])
def test_assisted_generation_checks_drafts_through_verify(cache, spy):
    """Assisted generation: the target model checks the draft tokens in one forward (verify plan)."""
    if cache == "static" and not hasattr(StaticLayer, "crop"):  # e.g. 5.17: no assisted generate with it
        pytest.skip("this transformers version cannot crop a StaticCache")
    model, draft = make_model("llama"), make_model("llama", seed=1, num_hidden_layers=1)
    ids, mask = prompts(1, seed=5, length=20)
    want = sdpa_tokens(model, ids, mask)
    draft.set_attn_implementation("b12x")
    kw = dict(cache_implementation="static") if cache == "static" else cache_kwarg(model, new_b12x_cache(model, 1))
    got = generate(model, "b12x", ids, mask, assistant_model=draft, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    verify = [shape for shape in spy if 2 <= shape[1] <= 16]
    assert verify and spy[0][1] == 20, spy  # draft checks, after an extend-plan prefill


def _triton_interpreter_worker():
    """Runs in a subprocess with TRITON_INTERPRET=1: the Triton family forced on CPU (fp32 products), so the
    kernels see exactly the tensors the integration hands them (views, strides, offsets)."""
    import json

    from helpers import force_triton_family

    seen = force_triton_family()
    results = {}
    model = make_model("llama", num_hidden_layers=1)
    for cache, length in (("static", 20), ("b12x", 12)):  # an extend- and a verify-plan prefill, then decode
        ids, mask = prompts(4, seed=3, length=length)
        want = generate(model, "sdpa", ids, mask, cache_implementation="static", max_new_tokens=2)
        kw = dict(cache_implementation="static") if cache == "static" else cache_kwarg(model, new_b12x_cache(model, 4))
        results[f"{cache}-{length}"] = bool((generate(model, "b12x", ids, mask, max_new_tokens=2, **kw) == want).all())
    print(json.dumps(dict(results=results, seen=sorted(seen))), flush=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check for CPU machines; the GPU tests run the kernels")
def test_triton_kernels_see_the_integration_tensors():
    """The Triton kernels (interpreted on CPU) give SDPA's tokens through both caches, in every mode."""
    from helpers import interpreter_worker_report

    report = interpreter_worker_report(__file__)
    assert all(report["results"].values()), report
    assert {"decode:triton", "verify:triton", "extend:triton"} <= set(report["seen"]), report


def _compile_config(backend="inductor"):
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    config._compile_all_devices = True  # generate compiles on CUDA only, unless told
    return config


@pytest.mark.parametrize("cache", ["static", "b12x"])
def test_compiled_generate_no_graph_break_no_recompile(cache):
    """fullgraph decode step; three generate calls with different prompts of one bucket compile once."""
    from torch._dynamo.utils import counters

    model = make_model("llama", num_hidden_layers=1)
    model.set_attn_implementation("b12x")
    paged = new_b12x_cache(model, 4)
    torch._dynamo.reset()
    counters.clear()
    try:
        for step in range(3):
            ids, mask = prompts(4, seed=10 + step)
            want = sdpa_tokens(model, ids, mask)
            kw = dict(cache_implementation="static") if cache == "static" else cache_kwarg(model, paged)
            paged.reset()
            torch.compiler.set_stance("fail_on_recompile" if step else "default")
            got = generate(model, "b12x", ids, mask, compile_config=_compile_config(), disable_compile=False, **kw)
            torch.compiler.set_stance("default")
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_float8_pool_close_to_bf16_pool():
    """A float8_e4m3fn pool (with a scale) gives logits close to a bf16 pool's; generate runs."""
    model = make_model("llama", dtype=torch.bfloat16)
    model.set_attn_implementation("b12x")
    ids, mask = prompts(4, seed=5)
    logits = {}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        paged = new_b12x_cache(model, 4, kv_dtype=kv_dtype, k_scale=0.5, v_scale=0.25)
        with torch.no_grad():
            logits[kv_dtype] = model(ids, attention_mask=mask, **cache_kwarg(model, paged)).logits.float()
    err = (logits[torch.float8_e4m3fn] - logits[torch.bfloat16]).norm() / logits[torch.bfloat16].norm()
    assert 0 < err < 0.1, err  # about 0.05 here (e4m3 rounding); nonzero: the pool really is float8
    fp8 = new_b12x_cache(model, 4, kv_dtype=torch.float8_e4m3fn)
    out = generate(model, "b12x", ids, mask, **cache_kwarg(model, fp8))
    assert out.shape == (4, 12 + NEW_TOKENS)


def test_unsupported_head_dim_fails_at_first_call():
    model = make_model("llama", hidden_size=128, num_attention_heads=8, head_dim=16)
    ids, mask = prompts(1, seed=1)
    with pytest.raises(ValueError, match=r"head_dim must be one of .* got 16.*sdpa"):
        generate(model, "b12x", ids, mask, cache_implementation="static")


def test_arbitrary_4d_mask_fails_with_a_clear_message():
    model = make_model("llama")
    model.set_attn_implementation("b12x")
    ids, _ = prompts(1, seed=2)
    mask4d = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"custom attention mask.*4D.*sdpa"):
        model(ids, attention_mask=mask4d)


def test_right_padding_fails_with_a_clear_message():
    model = make_model("llama")
    ids, mask = prompts(2, seed=4)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match=r"left-padding mask"):
        generate(model, "b12x", ids, mask, cache_implementation="static")


def test_b12x_cache_overflow_and_batch_fail_with_a_clear_message():
    model = make_model("llama")
    ids, mask = prompts(2, seed=8)
    with pytest.raises(ValueError, match=r"exceeds max_batch_size 1"):
        generate(model, "b12x", ids, mask, **cache_kwarg(model, new_b12x_cache(model, 1)))
    with pytest.raises(ValueError, match=r"exceed max_cache_len 16"):
        generate(model, "b12x", ids, mask, **cache_kwarg(model, new_b12x_cache(model, 2, max_cache_len=16)))


def test_chunked_attention_fails_with_a_clear_message():
    """A mask pattern b12x cannot express (here chunked attention, as Llama 4's) fails at the first call."""
    from transformers.masking_utils import chunked_causal_mask_function

    with pytest.raises(ValueError, match=r"another mask pattern.*sdpa"):
        hf.b12x_mask(1, 4, 4, mask_function=chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long)),
                     local_size=2)


def assert_greedy_equal(model, ids, mask, want, got, name, ulps=4, peer="sdpa"):
    """Greedy tokens `got` equal the `peer` attention's `want`, except at a near-tie: where, at the first
    differing position of a row, the peer's own recomputed logits put both tokens within `ulps` units of
    rounding of the model dtype of its top logit (bf16 rounding can flip such a tie, between two or more
    candidates; the peer's compiled generate and its eager recompute may disagree too); the rest of such a
    row is not compared."""
    model.set_attn_implementation(peer)
    for row in range(want.shape[0]):
        diff = (got[row] != want[row]).nonzero()
        if not len(diff):
            continue
        pos = int(diff[0])
        row_mask = torch.cat([mask[row], mask.new_ones(pos - mask.shape[1])])[None]
        position_ids = (row_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(want[row:row + 1, :pos], attention_mask=row_mask, position_ids=position_ids).logits
        last = logits[0, -1].float()
        top = float(last.max())
        tie = ulps * torch.finfo(model.dtype).eps * abs(top)
        a, b = int(got[row, pos]), int(want[row, pos])
        below = (top - float(last[a]), top - float(last[b]))
        assert max(below) <= tie, (
            f"{name}: row {row} differs from {peer} at position {pos}: got {a}, {peer} {b}; under {peer}'s "
            f"logits they sit {below[0]:.4f} and {below[1]:.4f} below its top {top:.4f} (near-tie {tie:.4f}; "
            f"top-3 {last.topk(3).indices.tolist()})")


@pytest.mark.gpu
def test_gpu_llama_1b_bf16_tokens_equal_sdpa():
    """A Llama-3.2-1B-shaped random-weight model in bf16 on CUDA, generate compiled with reduce-overhead:
    b12x over the static cache and over a B12xCache give SDPA's greedy tokens (left-padded batch of 4)."""
    from torch._dynamo.utils import counters

    from b12x_inductor.bench.hf import LLAMA_1B, build_model

    model = build_model(LLAMA_1B, torch.device("cuda"), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, LLAMA_1B["vocab_size"], (4, 200), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    mask[2, :130] = 0
    ids, mask = ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    kw = dict(max_new_tokens=24, compile_config=config, disable_compile=False)
    want = generate(model, "sdpa", ids, mask, cache_implementation="static", max_cache_len=512, **kw)
    counters.clear()
    got = {"static": generate(model, "b12x", ids, mask, cache_implementation="static", max_cache_len=512, **kw)}
    paged = hf.B12xCache(model.config, max_batch_size=4, max_cache_len=512, device="cuda", dtype=torch.bfloat16)
    got["b12x"] = generate(model, "b12x", ids, mask, **cache_kwarg(model, paged), **kw)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, tokens in got.items():
        assert_greedy_equal(model, ids, mask, want, tokens, name)


@pytest.mark.gpu
def test_gpu_float8_pool_under_reduce_overhead():
    """A float8_e4m3fn B12xCache under generate's reduce-overhead compile on CUDA: CUDA graphs kept, and
    logits close to a bf16 pool's (the CPU test's bound)."""
    from torch._dynamo.utils import counters

    model = make_model("llama", dtype=torch.bfloat16).cuda()
    model.set_attn_implementation("b12x")
    ids, mask = (t.cuda() for t in prompts(4, seed=5, length=40))
    logits = {}
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        paged = new_b12x_cache(model, 4, kv_dtype=kv_dtype, k_scale=0.5, v_scale=0.25, device="cuda")
        with torch.no_grad():
            logits[kv_dtype] = model(ids, attention_mask=mask, **cache_kwarg(model, paged)).logits.float()
    err = (logits[torch.float8_e4m3fn] - logits[torch.bfloat16]).norm() / logits[torch.bfloat16].norm()
    assert 0 < err < 0.1, err
    counters.clear()
    paged = new_b12x_cache(model, 4, kv_dtype=torch.float8_e4m3fn, device="cuda")
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    out = generate(model, "b12x", ids, mask, compile_config=config, disable_compile=False, max_new_tokens=8,
                   **cache_kwarg(model, paged))
    assert out.shape == (4, 48)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_bench_hf_arguments_and_table(tmp_path):
    """The `python -m b12x_inductor.bench hf` harness: options and the merged markdown table (its timed
    runs need CUDA; `--tiny` runs them on CPU)."""
    from b12x_inductor.bench import hf as bench

    args = bench.parse_args(["--quick", "--out", str(tmp_path / "x.json")])
    assert (args.batches, args.prompts, args.new_tokens, args.max_cache_len) == ([8], [512, 3072], 32, 4096)
    assert bench.parse_args([]).batches == [1, 8, 32]
    tiny = bench.parse_args(["--tiny"])
    assert tiny.prompts[0] + tiny.new_tokens <= tiny.max_cache_len

    def run_json(name, batch, sdpa, b12x):
        row = dict(batch=batch, prompt=512, new_tokens=32, max_cache_len=4096, live_max=544,
                   sdpa=dict(tokens_per_s=sdpa), b12x=dict(tokens_per_s=b12x), b12x_speedup=b12x / sdpa)
        result = dict(impls=["sdpa", "b12x"], rows=[row], env=dict(device="H200", torch="t", transformers="x",
                                                                     date="d"))
        (tmp_path / name).write_text(bench.json.dumps(result))
        return str(tmp_path / name)

    paths = [run_json("b32.json", 32, 100.0, 150.0), run_json("b1.json", 1, 10.0, 12.5)]
    table = bench.markdown(bench.merge(paths)).splitlines()
    assert table[2] == "| 1 | 512 | 544 / 4096 | 10.0 | 12.5 | 1.25x |", table
    assert table[3] == "| 32 | 512 | 544 / 4096 | 100.0 | 150.0 | 1.50x |", table


if __name__ == "__main__" and "--triton-interpreter-worker" in __import__("sys").argv:
    _triton_interpreter_worker()
