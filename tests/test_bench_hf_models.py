"""`python -m b12x_inductor.bench hf --model gpt-oss|gemma3`: the harness on CPU (`--tiny`), its options, the
merged tables of several models, the eager peer's chunked prefill (transformers' eager, in query chunks) and the
counter of CUDA graph recordings."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from b12x_inductor.bench import hf as bench  # noqa: E402


def test_model_options_and_defaults():
    args = bench.parse_args([])
    assert (args.model, args.out, args.new_tokens, args.peer) == ("llama", "benchmarks/results/hf.json", 128, None)
    gpt = bench.parse_args(["--model", "gpt-oss"])
    assert (gpt.out, gpt.new_tokens, gpt.batches, gpt.prompts) == (
        "benchmarks/results/hf_gpt_oss.json", 64, [1, 8, 32], [512, 3072])
    assert bench.parse_args(["--model", "gemma3", "--new-tokens", "16"]).new_tokens == 16
    assert bench.parse_args(["--model", "all"]).out == "benchmarks/results/hf_all.json"
    assert [bench.MODELS[m].peer for m in ("llama", "gpt-oss", "gemma3")] == ["sdpa", "eager", "sdpa"]
    for name in ("gpt-oss", "gemma3"):
        spec = bench.MODELS[name]
        assert spec.sliding and max(bench.parse_args([]).prompts) > spec.config["sliding_window"]
        assert spec.tiny["sliding_window"] < bench.parse_args(["--tiny"]).prompts[0]


def test_shapes_of_the_benchmarked_configs():
    """The configs build the shapes the docstring names (config objects only: no weights)."""
    gpt = bench._classes("gpt_oss")[0](**bench.GPT_OSS_20B)
    assert (gpt.head_dim, gpt.num_attention_heads, gpt.num_key_value_heads, gpt.hidden_size) == (64, 64, 8, 2880)
    assert gpt.layer_types == ["sliding_attention", "full_attention"] * 2 and gpt.sliding_window == 128
    assert (gpt.num_local_experts, gpt.num_experts_per_tok) == (8, 4)
    gemma = bench._classes("gemma3")[0](**bench.GEMMA3_4B)
    assert gemma.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and gemma.sliding_window == 1024
    assert (gemma.head_dim, gemma.query_pre_attn_scalar, gemma.num_attention_heads) == (256, 256, 8)


def _padded(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_chunked_eager_equals_eager(monkeypatch):
    """The eager peer: with a score budget small enough that a prefill runs in several query chunks, logits and
    greedy static-cache tokens equal transformers' eager on a tiny gpt-oss (sinks, window layers, padding)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    model = bench.build_model(bench.TINY_GPT_OSS, torch.device("cpu"), torch.float32, arch="gpt_oss")
    assert any(float(m.sinks.detach().abs().max()) > 0.5 for m in model.modules() if hasattr(m, "sinks"))
    eager, chunks = modeling_gpt_oss.eager_attention_forward, []

    def counting(module, query, *args, **kwargs):
        chunks.append(query.shape[2])
        return eager(module, query, *args, **kwargs)

    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", counting)
    ids, mask = _padded(3, 20, seed=1)
    logits, tokens = {}, {}
    # rows = 2048 // (3 * 4 * 20 * 4) = 2 queries per chunk at the window layer's 20 keys
    name = bench.register_chunked_eager(score_bytes=2048)
    for impl in ("eager", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask).logits
        tokens[impl] = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5,
                                      cache_implementation="static", max_cache_len=32, disable_compile=True)
    assert 2 in chunks and 1 in chunks  # prefill chunks of 2 queries (20 keys), 1 (32), and decode steps
    torch.testing.assert_close(logits[name], logits["eager"], rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens[name], tokens["eager"])


def test_chunked_eager_splits_queries_and_mask_rows(monkeypatch):
    """A prefill of 7 queries with room for 3 per chunk calls eager on 3 + 3 + 1 queries with their mask rows;
    a decode step (1 query) calls it once, unchanged."""
    calls = []

    def fake_eager(module, query, key, value, mask, **kwargs):
        calls.append((query.shape[2], None if mask is None else tuple(mask.shape)))
        return query.transpose(1, 2) * 2, "weights"

    class Module(torch.nn.Module):
        pass

    monkeypatch.setattr(sys.modules[__name__], "eager_attention_forward", fake_eager, raising=False)
    q, k = torch.randn(1, 2, 7, 4), torch.randn(1, 1, 10, 4)
    mask = torch.zeros(1, 1, 7, 10)
    out, weights = bench.chunked_eager_attention(Module(), q, k, k, mask, score_bytes=3 * 2 * 10 * 4)
    assert calls == [(3, (1, 1, 3, 10)), (3, (1, 1, 3, 10)), (1, (1, 1, 1, 10))] and weights is None
    torch.testing.assert_close(out, q.transpose(1, 2) * 2)
    calls.clear()
    assert bench.chunked_eager_attention(Module(), q[:, :, :1], k, k, None, score_bytes=80)[1] == "weights"
    assert calls == [(1, None)]


@pytest.mark.parametrize("model,peer,paged", [("gpt-oss", "eager", True), ("gemma3", "sdpa", False)])
def test_tiny_run_through_main(model, peer, paged, tmp_path, capsys):
    """`--tiny --model gpt-oss|gemma3` on CPU: every column runs compiled generate on a tiny model with window
    layers shorter than the prompt; the table names the peer; the JSON keeps the rows' model and config."""
    out = tmp_path / "hf.json"
    bench.main(["--tiny", "--model", model, "--out", str(out)] + (["--paged"] if paged else []))
    result = json.loads(out.read_text())
    lines = result["markdown"].splitlines()
    impls = [peer, "b12x"] + (["b12x-paged"] if paged else [])
    assert lines[0] == ("| batch | prompt | live max / cache | " + " | ".join(f"{i} tok/s" for i in impls) + " | "
                        + " | ".join(f"{i} / {peer}" for i in impls[1:]) + " |"), lines
    assert lines[2].startswith("| 2 | 24 | 28 / 64 | ") and lines[2].endswith("x |"), lines
    assert bench.MODELS[model].title in lines[-1]
    assert lines[0] in capsys.readouterr().out
    assert result["impls"] == impls and result["model_name"] == model and result["peer"] == peer
    (row,) = result["rows"]
    assert row["model"] == model and row[peer]["tokens_per_s"] > 0
    assert all(row[f"{i}_speedup"] > 0 for i in impls[1:])
    assert result["model"] == {"tiny": bench.MODELS[model].tiny}


def _result(tmp_path, name, model, peer, batch, peer_tps, b12x_tps):
    row = dict(batch=batch, prompt=512, new_tokens=64, max_cache_len=4096, live_max=576,
               b12x=dict(tokens_per_s=b12x_tps), b12x_speedup=b12x_tps / peer_tps, **{peer: dict(tokens_per_s=peer_tps)})
    result = dict(impls=[peer, "b12x"], rows=[row], env=dict(device="H200", torch="t", transformers="x", date="d"))
    if model is not None:  # None: a run from before --model (Llama, no model fields)
        row["model"] = model
        result.update(model_name=model, peer=peer, title=bench.MODELS[model].title)
    (tmp_path / name).write_text(json.dumps(result))
    return str(tmp_path / name)


def test_merge_runs_of_one_and_of_several_models(tmp_path):
    one = bench.merge([_result(tmp_path, "g32.json", "gpt-oss", "eager", 32, 100.0, 200.0),
                       _result(tmp_path, "g8.json", "gpt-oss", "eager", 8, 50.0, 80.0)])
    table = bench.markdown(one).splitlines()
    assert table[0] == "| batch | prompt | live max / cache | eager tok/s | b12x tok/s | b12x / eager |"
    assert table[2:4] == ["| 8 | 512 | 576 / 4096 | 50.0 | 80.0 | 1.60x |",
                          "| 32 | 512 | 576 / 4096 | 100.0 | 200.0 | 2.00x |"], table
    both = bench.merge([_result(tmp_path, "g.json", "gpt-oss", "eager", 8, 50.0, 80.0),
                        _result(tmp_path, "l.json", None, "sdpa", 1, 10.0, 12.5)])
    assert set(both["models"]) == {"gpt-oss", "llama"}
    table = bench.markdown(both).splitlines()
    assert table[0] == f"gpt-oss: {bench.MODELS['gpt-oss'].title}"
    assert table[4] == "| 8 | 512 | 576 / 4096 | 50.0 | 80.0 | 1.60x |"
    assert table[6] == f"llama: {bench.MODELS['llama'].title}"
    assert table[8] == "| batch | prompt | live max / cache | sdpa tok/s | b12x tok/s | b12x / sdpa |"
    assert table[10] == "| 1 | 512 | 576 / 4096 | 10.0 | 12.5 | 1.25x |"
    with pytest.raises(SystemExit, match="gpt-oss with different implementations"):
        bench.merge([_result(tmp_path, "a.json", "gpt-oss", "eager", 8, 1.0, 2.0),
                     _result(tmp_path, "b.json", "gpt-oss", "sdpa", 8, 1.0, 2.0)])


def test_cudagraph_counter_counts_and_restores(monkeypatch):
    """The counter wraps CUDA graph trees' record_function / run_eager while active and restores them after
    (here around stand-ins, as this machine has no CUDA); off CUDA it counts nothing (None)."""
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager as manager

    monkeypatch.setattr(manager, "record_function", lambda self, inputs, fid: ("recorded", fid))
    monkeypatch.setattr(manager, "run_eager", lambda self, inputs, fid: ("eager", fid))
    stand_ins = manager.record_function, manager.run_eager
    with bench.CudagraphCounter(torch.device("cuda")) as counter:
        assert manager.record_function(None, [], 7) == ("recorded", 7)
        manager.run_eager(None, [], 1)
        manager.run_eager(None, [], 2)
    assert (counter.records, counter.warmups) == (1, 2)
    assert (manager.record_function, manager.run_eager) == stand_ins
    with bench.CudagraphCounter(torch.device("cpu")) as cpu:
        pass
    assert (cpu.records, cpu.warmups) == (None, None)


def test_substituted_column_compiles_its_own_graph():
    """sdpa+enable (attn_implementation="sdpa" under the substitution) and sdpa share the model and an equal
    compile config but for the backend: each gets its own decode graph (the pass is no Dynamo guard), the
    substituted one reports a substitution per layer, and switching back compiles nothing."""
    from torch._dynamo.utils import counters

    model = bench.build_model(bench.TINY, torch.device("cpu"), torch.float32)
    ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    runners = {impl: bench.Runner(model, impl, 2, 32, cpu) for impl in ("sdpa", bench.SUBSTITUTED)}
    assert bench.attn_name(bench.SUBSTITUTED) == "sdpa"
    backend = runners[bench.SUBSTITUTED].config.backend
    assert isinstance(backend, bench.SubstitutingInductor) and runners[bench.SUBSTITUTED].config.mode is None
    assert runners["sdpa"].config.backend == "inductor"
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False):
        for impl in ("sdpa", bench.SUBSTITUTED, "sdpa", bench.SUBSTITUTED):
            runners[impl](ids, 3)
    torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    decisions = backend.decisions
    assert decisions and len(decisions) == model.config.num_hidden_layers, decisions
    assert all(d.startswith("substituted") for d in decisions), decisions


def test_substituted_column_options_and_refusal():
    args = bench.parse_args(["--tiny", "--substituted"])
    assert args.substituted and not bench.parse_args(["--tiny"]).substituted
    with pytest.raises(SystemExit, match="sdpa\\+enable runs attn_implementation=\"sdpa\", which gpt-oss refuses"):
        bench.run_model(bench.parse_args(["--tiny", "--model", "gpt-oss", "--substituted"]), "gpt-oss")
