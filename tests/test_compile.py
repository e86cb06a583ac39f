"""torch.compile: eager equals compiled per plan, fullgraph, no recompiles, the generated code."""

from __future__ import annotations

import re

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
                self.assertExpectedInline(lines, """torch.ops.b12x.paged_attention_decode.default(argN, argN, argN, argN, argN, None, argN, argN, None, None, buf0, buf1, buf2, kv_layout='NHD', causal=True, scale=0.11, window_left=6, softcap=4.0, family='torch', num_splits=1, block_m=0, block_n=0, num_warps=0, num_stages=0)""")
            elif mode == "verify":
                self.assertExpectedInline(lines, """torch.ops.b12x.paged_attention_verify.default(argN, argN, argN, argN, argN, None, argN, argN, None, None, buf0, buf1, buf2, kv_layout='NHD', causal=True, scale=0.11, window_left=6, softcap=4.0, family='torch', num_splits=1, block_m=0, block_n=0, num_warps=0, num_stages=0)""")
            else:
                self.assertExpectedInline(lines, """torch.ops.b12x.paged_attention_extend.default(argN, argN, argN, argN, argN, argN, argN, argN, None, None, buf0, buf1, buf2, kv_layout='NHD', causal=True, scale=0.11, window_left=6, softcap=4.0, family='torch', num_splits=1, block_m=0, block_n=0, num_warps=0, num_stages=0)""")

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
    assert any(f.endswith("lowering/paged_attention.py") for f in cache._source_files())
    assert any(f.endswith("kernels/torch_impl.py") for f in cache._source_files())
    assert any(f.endswith("b12x_inductor/plan.py") for f in cache._source_files())


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
