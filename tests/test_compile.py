"""torch.compile: eager equals compiled per plan, fullgraph, no recompiles, the generated code."""

from __future__ import annotations

import re
from pathlib import Path

import expecttest
import pytest
import torch
import torch._dynamo.testing
from torch._inductor.utils import run_and_get_code

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from b12x_inductor.lowering import cache
from tests.helpers import make_problem

MODES = {
    "decode": dict(q_len=1),
    "verify": dict(q_len=4),
    "extend": dict(q_len=20, max_pages=10),
    "packed": dict(q_len=12, packed=True, max_pages=6),
}
OPTS = dict(window_left=6, sinks=None, softcap=4.0, scale=0.11)


def attend(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start, sinks):
    out, lse = b12x.paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start=kv_start,
                                    sinks=sinks, window_left=6, softcap=4.0, scale=0.11, return_lse=True)
    return out * 2, lse


def _inputs(mode, seed, **kw):
    args = make_problem(hq=8, hkv=2, d=64, page_size=3, seed=seed, **{"max_pages": 8, **MODES[mode], **kw})
    b = args["page_table"].shape[0]
    extra = (torch.minimum(args["cache_seqlens"], torch.tensor(2)).int(), torch.randn(8))
    return (*args.values(), *extra)


@pytest.mark.parametrize("mode", list(MODES))
def test_eager_equals_compiled_without_recompiles(mode):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=False)
    for step in range(3):  # new lengths, page tables and data each step, same shapes
        inputs = _inputs(mode, seed=step)
        eager = attend(*inputs)
        with torch.compiler.set_stance("fail_on_recompile") if step else torch.compiler.set_stance("default"):
            got = compiled(*inputs)
        torch.testing.assert_close(got[0], eager[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], eager[1], atol=1e-5, rtol=1e-5)
        ref = paged_attention_reference(*inputs[:6], kv_start=inputs[6], sinks=inputs[7], window_left=6,
                                        softcap=4.0, scale=0.11)[0]
        torch.testing.assert_close(got[0], ref * 2, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1


def test_one_compile_per_shape_bucket():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    for batch in (2, 3, 2, 3, 4):  # automatic dynamic would make B symbolic: the lowering specializes it
        inputs = _inputs("decode", seed=batch, batch=batch)
        torch.testing.assert_close(compiled(*inputs)[0], attend(*inputs)[0], atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 3


def _call_lines(code: str, needle: str) -> str:
    """The generated lines that contain needle, with graph-input names (whose order varies across torch
    versions) written as argN."""
    return "\n".join(re.sub(r"arg\d+_1", "argN", line.strip()) for line in code.splitlines() if needle in line)


class TestGeneratedCode(expecttest.TestCase):
    def test_entry_op_with_plan_constants(self):
        torch._dynamo.reset()
        for mode in ("decode", "verify", "packed"):
            inputs = _inputs(mode, seed=1)
            _, (code,) = run_and_get_code(torch.compile(attend, fullgraph=True, dynamic=False), *inputs)
            lines = _call_lines(code, "torch.ops.b12x.")
            if mode == "decode":
                self.assertExpectedInline(lines, """torch.ops.b12x.paged_attention_decode.default(argN, argN, argN, argN, argN, None, argN, argN, None, None, None, None, buf0, buf1, buf2, kv_layout='NHD', causal=True, scale=0.11, window_left=6, softcap=4.0, family='torch', num_splits=1, block_m=0, block_n=0, num_warps=0, num_stages=0, v_from_k=False)""")
            elif mode == "verify":
                self.assertExpectedInline(lines, """torch.ops.b12x.paged_attention_verify.default(argN, argN, argN, argN, argN, None, argN, argN, None, None, None, None, buf0, buf1, buf2, kv_layout='NHD', causal=True, scale=0.11, window_left=6, softcap=4.0, family='torch', num_splits=1, block_m=0, block_n=0, num_warps=0, num_stages=0, v_from_k=False)""")
            else:
                self.assertExpectedInline(lines, """torch.ops.b12x.paged_attention_extend.default(argN, argN, argN, argN, argN, argN, argN, argN, None, None, None, None, buf0, buf1, buf2, kv_layout='NHD', causal=True, scale=0.11, window_left=6, softcap=4.0, family='torch', num_splits=1, block_m=0, block_n=0, num_warps=0, num_stages=0, v_from_k=False)""")

    def test_write_kv_updates_the_cache_in_place(self):
        torch._dynamo.reset()

        def step(k, v, k_cache, v_cache, slots, q, page_table, lens):
            b12x.write_kv(k, v, k_cache, v_cache, slots)
            return b12x.paged_attention(q, k_cache, v_cache, page_table, lens)

        args = make_problem(batch=2, q_len=1, seed=3)
        q, k_cache, v_cache, page_table, lens = (args[n] for n in ("q", "k_cache", "v_cache", "page_table",
                                                                   "cache_seqlens"))
        k, v = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
        slot = (page_table[:, 0].long() * 4 + 1)
        ek, ev = k_cache.clone(), v_cache.clone()
        expected = step(k, v, ek, ev, slot, q, page_table, lens)
        out, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), k, v, k_cache, v_cache, slot, q,
                                        page_table, lens)
        torch.testing.assert_close(out, expected)
        assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)  # the caller's cache was written
        self.assertExpectedInline(_call_lines(code, "write_kv"), """\
# Topologically Sorted Source Nodes: [write_kv], Original ATen: [b12x.write_kv]
torch.ops.b12x.write_kv.default(argN, argN, argN, argN, argN, kv_layout='NHD', k_scale=None, v_scale=None)""")
        for copy in ("clone", ".copy_(", "aten.copy"):
            assert copy not in code, f"generated code copies the cache: {copy}"


def test_graph_cache_key_covers_project_sources():
    import torch._inductor.config as config

    passes = config.post_grad_custom_pre_pass
    passes = passes if isinstance(passes, (list, tuple)) else [passes]
    assert cache.GRAPH_PASS in passes
    uuid = cache.GRAPH_PASS.uuid()
    assert uuid.startswith("b12x-") and len(uuid) > 40
    files = set(cache._source_files())
    roots = [Path(b12x.__file__).parent, Path(cache.__file__).parent, Path(cache.__file__).parent.parent / "kernels"]
    every = {str(f.resolve()) for root in roots for f in root.rglob("*.py")}
    assert every <= files, sorted(every - files)  # every source of the package, the triton/ and cute/ kernels too
    assert any(f.endswith("lowering/paged_attention.py") for f in files)
    assert any(f.endswith("kernels/torch_impl.py") for f in files)
    assert any(f.endswith("b12x_inductor/plan.py") for f in files)


def test_editing_a_source_changes_the_graph_cache_key(tmp_path, monkeypatch):
    """One changed byte in any hashed file changes GRAPH_PASS.uuid(), and that uuid is in Inductor's FX graph
    cache key: the same graph hits the cache under one uuid and misses under another."""
    copies = []
    for i, f in enumerate(sorted(cache._source_files())):
        copy = tmp_path / f"{i}_{Path(f).name}"
        copy.write_bytes(Path(f).read_bytes())
        copies.append(copy)

    def uuid_of(files):
        monkeypatch.setattr(cache, "_source_files", lambda: tuple(str(c) for c in files))
        cache.source_hash.cache_clear()
        cache._inductor.get_hash_for_files.cache_clear()  # torch's helper caches by path (files do not change in a process)
        return cache.GRAPH_PASS.uuid()

    try:
        original = uuid_of(copies)
        for target in (next(c for c in copies if c.name.endswith("_plan.py")), copies[-1]):
            data = target.read_bytes()
            target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one byte of one file
            assert uuid_of(copies) != original, target.name
            target.write_bytes(data)
            assert uuid_of(copies) == original
        assert uuid_of(copies[:-1]) != original  # a file removed from the package
    finally:
        monkeypatch.undo()
        cache.source_hash.cache_clear()
        cache._inductor.get_hash_for_files.cache_clear()

    import torch._inductor.config as config
    from torch._dynamo.utils import counters

    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, seed=22)

    def misses_and_hits():
        torch._dynamo.reset()
        counters.clear()
        with config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
            torch.compile(b12x.paged_attention, fullgraph=True, dynamic=False)(**args)
        return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]

    import uuid

    def edit_sources():  # a source hash that no earlier run has seen
        monkeypatch.setattr(cache, "source_hash", lambda h=f"edited-{uuid.uuid4().hex}": h)

    edit_sources()
    assert misses_and_hits() == (1, 0)
    assert misses_and_hits() == (0, 1)  # same sources: served from the cache
    edit_sources()
    assert misses_and_hits() == (1, 0)  # edited sources: compiled again


def test_out_argument_is_written_in_place_when_compiled():
    torch._dynamo.reset()
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, seed=21)

    def step(out, **kw):
        b12x.paged_attention(**kw, out=out)
        return out.sum()

    out = torch.full_like(args["q"], float("nan"))
    _, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), out, **args)
    torch.testing.assert_close(out, paged_attention_reference(**args)[0], atol=2e-5, rtol=2e-5)
    call = _call_lines(code, "paged_attention_decode")
    assert call.count("argN") == 6 and ", argN, buf" in call, call  # the caller's out is the entry op's out: no copy
    assert "clone" not in code and "copy_" not in code
