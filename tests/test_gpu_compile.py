"""The lowering on this torch; on CUDA, the compiled op under CUDA graphs with the cache written in place."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from tests.helpers import make_problem

class DecodeLayer(torch.nn.Module):
    """A decode step over a paged cache held as module buffers."""

    def __init__(self, k_cache, v_cache):
        super().__init__()
        self.register_buffer("k_cache", k_cache)
        self.register_buffer("v_cache", v_cache)

    def forward(self, q, k, v, slots, page_table, lens):
        b12x.write_kv(k, v, self.k_cache, self.v_cache, slots)
        return b12x.paged_attention(q, self.k_cache, self.v_cache, page_table, lens) * 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("static", ["buffer", "mark_static_address"])
def test_reduce_overhead_keeps_cudagraphs_and_is_correct(static):
    torch._dynamo.reset()
    counters.clear()
    args = make_problem(batch=4, q_len=1, hq=32, hkv=8, d=128, page_size=16, max_pages=32, dtype=torch.bfloat16,
                        device="cuda", seed=0)
    page_size = 16
    if static == "buffer":
        layer = DecodeLayer(args["k_cache"], args["v_cache"])
        step = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        caches = lambda: (layer.k_cache, layer.v_cache)  # noqa: E731
    else:
        k_cache, v_cache = args["k_cache"], args["v_cache"]
        torch._dynamo.mark_static_address(k_cache)
        torch._dynamo.mark_static_address(v_cache)

        @torch.compile(mode="reduce-overhead", fullgraph=True)
        def step(q, k, v, slots, page_table, lens):
            b12x.write_kv(k, v, k_cache, v_cache, slots)
            return b12x.paged_attention(q, k_cache, v_cache, page_table, lens) * 1.0

        caches = lambda: (k_cache, v_cache)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    for i in range(6):
        page_table = args["page_table"][torch.randperm(4, generator=gen)].contiguous()
        lens = torch.randint(1, 32 * page_size, (4,), generator=gen).int().cuda()
        pos = lens.long() - 1
        slots = page_table.gather(1, (pos // page_size)[:, None]).squeeze(1).long() * page_size + pos % page_size
        q = torch.randn(4, 1, 32, 128, generator=gen).bfloat16().cuda()
        k, v = (torch.randn(4, 8, 128, generator=gen).bfloat16().cuda() for _ in range(2))
        with torch.compiler.set_stance("fail_on_recompile") if i else torch.compiler.set_stance("default"):
            out = step(q, k, v, slots, page_table, lens).clone()
        k_cache, v_cache = caches()
        ref = paged_attention_reference(q, k_cache, v_cache, page_table, lens)[0]
        torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
        # the new token landed in the cache in place
        page, off = slots // page_size, slots % page_size
        assert torch.equal(k_cache[page, off], k)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_lowering_registered_for_this_torch():
    from b12x_inductor.lowering import _inductor
    import torch._inductor.lowering as L

    table = getattr(L, "user_lowerings", None) or L.lowerings
    assert torch.ops.b12x.paged_attention.default in table
    print("torch", torch.__version__, "lowering table:", "user_lowerings" if hasattr(L, "user_lowerings") else "lowerings")
    assert _inductor.static_int is not None
