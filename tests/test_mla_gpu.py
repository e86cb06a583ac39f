"""Absorbed MLA on the GPU (issue 18): `mla_attention` over a [num_pages, page_size, 576] latent cache (one KV
head, keys all 576 values, values the first 512: Dv = 512), bf16 and float8_e4m3fn with descale.

- CUDA-graph replay (decode S=1, verify S=4, packed extend with cu_seqlens_q), 128 and 16 heads, page sizes 1
  and 64: one call captured with a preallocated out; before each replay the lengths, the page table (live pages
  drawn afresh, unused columns pointing at any page, other requests' live ones included), the cache contents
  (every slot no request holds is NaN), the queries, cu_seqlens_q and the descale change in place and out and
  lse are poisoned with NaN; each replay equals the reference (`check_close`, test_triton_kernels' tolerances).
- torch.compile(mode="reduce-overhead", fullgraph=True) of a decode step (mla_write_kv of each request's new
  token, then mla_attention) over steps whose lengths grow and once drop (a new request in a row, with a new
  page-table row), with a padding row: no cudagraph skip, no recompile, outputs equal eager's and the
  reference, the cache written in place bit for bit as eager writes it.
- The serving engine serving DeepSeek-V3 (test_serve_mla's tiny config with DeepSeek-V3's kv_lora_rank 512:
  the 576 / 512 kernels) on CUDA in bf16, compiled with its CUDA graphs: every step is one CUDA-graph replay
  with at most one synchronizing call, and every served token is transformers' eager greedy choice up to bf16
  near-ties (teacher forcing: the rule of test_serve.py's and test_serve_cold_start.py's GPU tests).

Marker `gpu` (skipped without CUDA). Each GPU test has a CPU twin that runs the same body on the CPU (the torch
family with eager "replays"; Dynamo with aot_eager; the engine eagerly, in bf16), so the harness (the redraws
and their NaN bookkeeping, the references, the comparisons, the teacher forcing) is checked in CI.
"""

from __future__ import annotations

import copy

import pytest
import torch

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from tests import helpers
from tests.test_triton_kernels import check_close

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
RANK, ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim: the latent cache's 576 values a token
SCALE = (128 + 64) ** -0.5  # the 192-dim qk head's softmax scale (mla_attention requires one)
CUDA = torch.device("cuda")
CPU = torch.device("cpu")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
one_thread = pytest.fixture(helpers.one_thread)  # the CPU twins (function scope: the GPU tests keep every core)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------
# MLA problems whose every device value can be redrawn in place (the tensors a CUDA graph captured)

def mla_inputs(*, batch=3, q_len=1, heads=16, page_size=64, capacity=256, kv_dtype=BF16, descale=None,
               packed=False, tokens=64, spare_pages=5, device=CPU) -> dict:
    """The tensors of one mla_attention call, allocated once (contents: `redraw`): q_nope [B, S, H, 512] and
    q_pe [B, S, H, 64] (packed: [tokens, H, ..] with cu_seqlens_q [B + 1]), the latent cache [num_pages,
    page_size, 576] of kv_dtype, page_table int32 [B, capacity / page_size], cache_seqlens int32 [B], and for a
    float8 cache k_descale: "scalar" (a 0-dim tensor) or "b" ([B])."""
    max_pages = -(-capacity // page_size)
    num_pages = batch * max_pages + spare_pages
    rows = (tokens,) if packed else (batch, q_len)
    return dict(
        q_nope=torch.zeros(*rows, heads, RANK, dtype=BF16, device=device),
        q_pe=torch.zeros(*rows, heads, ROPE, dtype=BF16, device=device),
        latent=torch.zeros(num_pages, page_size, RANK + ROPE, dtype=kv_dtype, device=device),
        page_table=torch.zeros(batch, max_pages, dtype=torch.int32, device=device),
        cache_seqlens=torch.zeros(batch, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.zeros(batch + 1, dtype=torch.int32, device=device) if packed else None,
        k_descale=None if descale is None else torch.ones({"scalar": (), "b": (batch,)}[descale], device=device),
    )


def redraw(t: dict, gen: torch.Generator, step: int) -> dict:
    """New contents for every tensor of `t`, written in place (the captured addresses stay): lengths (step
    even: request step % B at full capacity; odd: at its least, S = 1 or 4, or its query count when packed),
    packed query counts (at least 3 padding rows past cu_seqlens_q[-1]), a page table whose live columns are
    distinct pages drawn afresh and whose unused columns point at random pages (live pages of other requests
    among them), fresh cache values in every live slot and NaN in every other slot, fresh queries and
    descales. Returns what was drawn, on the host (lens, table, live [num_pages, page_size])."""
    latent, table = t["latent"], t["page_table"]
    num_pages, page_size = latent.shape[:2]
    batch, max_pages = table.shape
    cap = max_pages * page_size
    if t["cu_seqlens_q"] is not None:
        per_request = (t["q_nope"].shape[0] - 3) // batch
        q_lens = torch.randint(1, per_request + 1, (batch,), generator=gen)
        cu = torch.zeros(batch + 1, dtype=torch.int64)
        cu[1:] = q_lens.cumsum(0)
        t["cu_seqlens_q"].copy_(cu.int())
        least = q_lens
    else:
        least = torch.full((batch,), t["q_nope"].shape[1])  # the contract: the new tokens are in the cache
    lens = torch.stack([torch.randint(int(m), cap + 1, (), generator=gen) for m in least])
    lens[step % batch] = cap if step % 2 == 0 else least[step % batch]
    new_table = torch.randint(0, num_pages, (batch, max_pages), generator=gen)  # unused columns: any page
    perm, used = torch.randperm(num_pages, generator=gen), 0
    live = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b in range(batch):
        n = -(-int(lens[b]) // page_size)
        new_table[b, :n] = perm[used:used + n]
        used += n
        j = torch.arange(int(lens[b]))
        live[new_table[b, j // page_size], j % page_size] = True
    values = torch.randn(latent.shape, generator=gen) * (2.0 if latent.dtype == F8 else 1.0)
    latent.copy_(values.masked_fill(~live[..., None], float("nan")).to(latent.dtype))
    table.copy_(new_table.int())
    t["cache_seqlens"].copy_(lens.int())
    for name in ("q_nope", "q_pe"):
        t[name].copy_(torch.randn(t[name].shape, generator=gen).to(BF16))
    if t["k_descale"] is not None:
        t["k_descale"].copy_(torch.rand(t["k_descale"].shape, generator=gen) + 0.5)
    return dict(lens=lens, table=new_table, live=live)


def mla_call(t: dict, out: torch.Tensor):
    """mla_attention of `t` into `out`: (out, lse)."""
    return b12x.mla_attention(t["q_nope"], t["q_pe"], t["latent"], t["page_table"], t["cache_seqlens"],
                              t["cu_seqlens_q"], scale=SCALE, k_descale=t["k_descale"], return_lse=True, out=out)


def mla_reference(t: dict, latent: torch.Tensor | None = None):
    """paged_attention_reference of the call: q = cat(q_nope, q_pe), k_cache = latent.unsqueeze(2), v_cache
    its first 512 values, v_descale = k_descale."""
    latent = t["latent"] if latent is None else latent
    k = latent.unsqueeze(2)
    q = torch.cat([t["q_nope"], t["q_pe"]], dim=-1)
    return paged_attention_reference(q, k, k[..., :RANK], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
                                     scale=SCALE, k_descale=t["k_descale"], v_descale=t["k_descale"])


# ----------------------------------------------------------------------------------------------------------
# 1. CUDA-graph replay

# (id, heads, page_size, kv_dtype, descale): each head count and page size with each cache dtype
REPLAY_CASES = [
    ("h128_p1_fp8", 128, 1, F8, "scalar"),
    ("h16_p64_fp8", 16, 64, F8, "b"),
    ("h128_p64_bf16", 128, 64, BF16, None),
    ("h16_p1_bf16", 16, 1, BF16, None),
]
REPLAY_MODES = {"decode": dict(q_len=1), "verify": dict(q_len=4), "extend_packed": dict(packed=True, tokens=64)}


def check_replays(mode: str, heads: int, page_size: int, kv_dtype, descale, device: torch.device, *,
                  steps: int = 3, seed: int = 0) -> list[dict]:
    """The test's body. CUDA: a first call (compiles the kernels), then that call captured into a
    torch.cuda.CUDAGraph and replayed `steps` times, each after a `redraw` and with out and lse poisoned, each
    compared with the reference. CPU: the same calls run eagerly in the replays' place. Returns the draws."""
    t = mla_inputs(heads=heads, page_size=page_size, kv_dtype=kv_dtype, descale=descale, device=device,
                   **REPLAY_MODES[mode])
    gen = torch.Generator().manual_seed(seed)
    draws = [redraw(t, gen, 0)]
    out = torch.empty(t["q_nope"].shape[:-1] + (RANK,), dtype=BF16, device=device)
    _, lse = mla_call(t, out)  # compiles outside the capture
    _sync(device)
    what = f"{mode} h{heads} p{page_size} {kv_dtype}"
    check_close(out, lse, *mla_reference(t), what=f"{what}: first call")
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, lse = mla_call(t, out)

        def replay():
            graph.replay()
            return lse
    else:
        def replay():
            return mla_call(t, out)[1]

    for step in range(1, steps + 1):
        draws.append(redraw(t, gen, step))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        got_lse = replay()
        _sync(device)
        check_close(out, got_lse, *mla_reference(t), what=f"{what}: replay {step}")
    return draws


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", REPLAY_CASES, ids=[c[0] for c in REPLAY_CASES])
@pytest.mark.parametrize("mode", list(REPLAY_MODES))
def test_gpu_mla_cuda_graph_replay(mode, case):
    """Capture once; change lengths, page tables, cache contents, queries (and cu_seqlens_q, descales) in
    place, poison the outputs, replay, compare with the reference."""
    _, heads, page_size, kv_dtype, descale = case
    plan = kernel_plan(mode, heads, page_size, kv_dtype, descale, CUDA)
    assert plan.family in ("triton", "cute"), f"{mode} {case[0]}: expected a kernel family, got {plan}"
    check_replays(mode, heads, page_size, kv_dtype, descale, CUDA)


def kernel_plan(mode, heads, page_size, kv_dtype, descale, device):
    """The plan select_plan gives the replay test's call (as the op plans it: paged_attention's validation of
    q_nope with q_pe over the latent cache's one-head views)."""
    from b12x_inductor import validate
    from b12x_inductor.plan import select_plan

    t = mla_inputs(heads=heads, page_size=page_size, kv_dtype=kv_dtype, descale=descale, device=device,
                   **REPLAY_MODES[mode])
    k = t["latent"].unsqueeze(2)
    problem = validate.check_paged_attention(
        t["q_nope"], k, k[..., :RANK], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"], kv_layout="NHD",
        causal=True, scale=SCALE, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=t["k_descale"],
        v_descale=t["k_descale"], key_mask=None, q_pe=t["q_pe"], out=None)
    plan = select_plan(problem)
    assert plan.mode == ("extend" if mode == "extend_packed" else mode), plan
    return plan


# The CPU twin checks the harness, not the kernels: the 16-head cases (both cache dtypes and page sizes) keep
# it to a few seconds (the 128-head packed extends take 10 s each on the CPU reference).
TWIN_CASES = [c for c in REPLAY_CASES if c[1] == 16]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", TWIN_CASES, ids=[c[0] for c in TWIN_CASES])
@pytest.mark.parametrize("mode", list(REPLAY_MODES))
def test_cpu_twin_mla_replays(mode, case):
    """The replay test's body on the CPU (the torch family, eager calls in the replays' place); and that its
    redraws do what the GPU test relies on: lengths and page tables change between replays, full-capacity and
    least lengths both occur, unused page-table columns point at other requests' live pages, every slot no
    request holds is NaN, and a NaN in out fails the comparison."""
    _, heads, page_size, kv_dtype, descale = case
    assert kernel_plan(mode, heads, page_size, kv_dtype, descale, CPU).family == "torch"
    draws = check_replays(mode, heads, page_size, kv_dtype, descale, CPU)
    cap = draws[0]["table"].shape[1] * page_size
    for before, after in zip(draws, draws[1:]):
        assert not torch.equal(before["lens"], after["lens"]) and not torch.equal(before["table"], after["table"])
    assert any(int(d["lens"].max()) == cap for d in draws)
    assert any(int(d["lens"].min()) <= REPLAY_MODES[mode].get("q_len", 20) for d in draws)
    shared = 0
    for d in draws:
        for b in range(len(d["lens"])):
            n = -(-int(d["lens"][b]) // page_size)
            live_pages = set(d["table"][:b, :].flatten().tolist()) | set(d["table"][b + 1:, :].flatten().tolist())
            shared += len(set(d["table"][b, n:].tolist()) & live_pages)
        assert not d["live"].all()  # some slot is NaN
    assert shared > 0

    t = mla_inputs(heads=heads, page_size=page_size, kv_dtype=kv_dtype, descale=descale, **REPLAY_MODES[mode])
    drawn = redraw(t, torch.Generator().manual_seed(1), 0)
    values = t["latent"].float()
    assert values[~drawn["live"]].isnan().all() and values[drawn["live"]].isfinite().all()
    out = torch.empty(t["q_nope"].shape[:-1] + (RANK,), dtype=BF16)
    _, lse = mla_call(t, out)
    ref = mla_reference(t)
    check_close(out, lse, *ref, what="unpoisoned")
    out.view(-1)[7] = float("nan")
    with pytest.raises(AssertionError, match="out max error"):
        check_close(out, lse, *ref, what="poisoned")


# ----------------------------------------------------------------------------------------------------------
# 2. reduce-overhead compile of write-then-attend

# (id, heads, page_size, kv_dtype)
DECODE_CASES = [("h128_p64_bf16", 128, 64, BF16), ("h16_p1_fp8", 16, 1, F8)]


def _decode_step(cache: torch.Tensor):
    """A decode step over `cache` (a closure, as a model holds its cache): write each request's new token's
    latent, attend over the cache with it."""
    def step(ckv, kpe, slots, q_nope, q_pe, page_table, seqlens, descale):
        b12x.mla_write_kv(ckv, kpe, cache, slots, scale=descale)
        return b12x.mla_attention(q_nope, q_pe, cache, page_table, seqlens, scale=SCALE, k_descale=descale,
                                  return_lse=True)
    return step


def run_decode_loop(heads: int, page_size: int, kv_dtype, device: torch.device, compile_kwargs: dict, *,
                    steps: int = 6, seed: int = 0, capacity: int = 192) -> dict:
    """The compile test's body: 3 requests and a padding row (slot -1, length 0) decode `steps` tokens through
    `torch.compile(_decode_step(latent), fullgraph=True, **compile_kwargs)` under error_on_recompile; the same
    steps run eagerly over a copy of the cache. Before step 3 row 1 takes a new request (a shorter length, its
    pages in reverse order, fresh latents). Every slot not holding a token is NaN before each step (the new
    tokens' slots too: a read before the write would show). Each step: compiled out and lse equal eager's and
    the reference's (check_close), the two caches equal bit for bit. Returns the counters' inductor and stats
    dicts and the lengths of each step. `capacity`: the keys a request's page-table row holds."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(seed)
    batch, requests = 4, 3
    max_pages = capacity // page_size
    num_pages = batch * max_pages + 3
    table = torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages)
    lens = [int(torch.randint(20, capacity - steps - 20, (), generator=gen)) for _ in range(requests)] + [0]
    fp8 = kv_dtype == F8
    descale = torch.tensor(0.75, device=device) if fp8 else None

    def live_slots():
        live = torch.zeros(num_pages, page_size, dtype=torch.bool)
        for b in range(requests):
            j = torch.arange(lens[b])
            live[table[b, j // page_size], j % page_size] = True
        return live

    values = torch.randn(num_pages, page_size, RANK + ROPE, generator=gen) * (2.0 if fp8 else 1.0)
    latent = values.masked_fill(~live_slots()[..., None], float("nan")).to(kv_dtype).to(device)
    eager_cache = latent.clone()
    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.mark_static_address(latent)  # written in place by the CUDA graphs: its address stays
    compiled = torch.compile(_decode_step(latent), fullgraph=True, **compile_kwargs)
    eager = _decode_step(eager_cache)
    seen = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(steps):
            if i == 3:  # row 1: a new request, shorter, on its pages in reverse order, fresh latents
                table[1] = table[1].flip(0)
                lens[1] = int(torch.randint(1, 16, (), generator=gen))
                host = eager_cache.cpu().float()
                fresh = torch.randn(host.shape, generator=gen)
                j = torch.arange(lens[1])
                page, off = table[1, j // page_size], j % page_size
                host[page, off] = fresh[page, off]
                host = host.masked_fill(~live_slots()[..., None], float("nan")).to(kv_dtype)
                latent.copy_(host)
                eager_cache.copy_(host)
            pos = torch.tensor(lens[:requests])
            slots = table[torch.arange(requests), pos // page_size] * page_size + pos % page_size
            slots = torch.cat([slots, torch.tensor([-1])])  # the padding row writes nothing
            for b in range(requests):
                lens[b] += 1
            seen.append(list(lens))
            args = [torch.randn(batch, RANK, generator=gen), torch.randn(batch, ROPE, generator=gen), slots,
                    torch.randn(batch, 1, heads, RANK, generator=gen),
                    torch.randn(batch, 1, heads, ROPE, generator=gen), table.int(),
                    torch.tensor(lens, dtype=torch.int32)]
            args = [a.to(BF16) if a.is_floating_point() else a for a in args]
            args = [a.to(device) for a in args] + [descale]
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out, lse = compiled(*args)
            out, lse = out.clone(), lse.clone()  # cudagraph outputs: overwritten by the next replay
            eager_out, eager_lse = eager(*args)
            _sync(device)
            what = f"decode step {i} h{heads} p{page_size} {kv_dtype}"
            assert torch.equal(latent.view(torch.uint8), eager_cache.view(torch.uint8)), f"{what}: caches differ"
            check_close(out, lse, eager_out.float().cpu(), eager_lse.float().cpu(), what=f"{what} vs eager")
            t = dict(q_nope=args[3], q_pe=args[4], page_table=args[5], cache_seqlens=args[6], cu_seqlens_q=None,
                     k_descale=descale)
            check_close(out, lse, *mla_reference(t, eager_cache), what=f"{what} vs reference")
            assert torch.isneginf(lse[requests]).all() and (out[requests] == 0).all(), f"{what}: padding row"
    values = eager_cache.float().cpu()
    live = live_slots()
    assert values[live].isfinite().all() and values[~live].isnan().all()
    return dict(inductor=dict(counters["inductor"]), stats=dict(counters["stats"]), lens=seen)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_gpu_mla_compile_reduce_overhead_no_skip_no_recompile(case):
    _, heads, page_size, kv_dtype = case
    result = run_decode_loop(heads, page_size, kv_dtype, CUDA, dict(mode="reduce-overhead"))
    assert not result["inductor"].get("cudagraph_skips"), result["inductor"]
    assert result["stats"].get("unique_graphs") == 1, result["stats"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_dtype", [(128, BF16), (16, F8)], ids=["h128", "h16_fp8_narrow"])
def test_gpu_mla_compile_reduce_overhead_cluster_pair(heads, kv_dtype, monkeypatch, request):
    """The decode loop where the plan splits each row block's keys in two (rows of 512 keys): with the CuTe
    family, a cluster pair that merges in shared memory (plan.mla_cluster_merge: no scratch, no merge kernel);
    no cudagraph skip, one graph. 128 heads: mla.py; 16 heads over a float8 cache: the narrow kernel (its pairs
    taken even where MLA_NARROW_CLUSTER_SPLITS says otherwise)."""
    from b12x_inductor import ops, validate
    from b12x_inductor.kernels.cute import plan as cute_plan
    from b12x_inductor.plan import select_plan

    monkeypatch.setattr(cute_plan, "MLA_NARROW_CLUSTER_SPLITS", max(2, cute_plan.MLA_NARROW_CLUSTER_SPLITS))
    # plans are cached (the op's plan_for, Inductor's FX graphs with the plan's literals): none made before the
    # patch may serve it, nor one made under it outlive it
    ops.plan_for.cache_clear()
    request.addfinalizer(ops.plan_for.cache_clear)
    monkeypatch.setattr("torch._inductor.config.fx_graph_cache", False)
    page_size, capacity = 64, 512
    q = torch.zeros(4, 1, heads, RANK + ROPE, dtype=BF16, device=CUDA)
    k = torch.zeros(4 * capacity // page_size + 3, page_size, 1, RANK + ROPE, dtype=kv_dtype, device=CUDA)
    problem = validate.check_paged_attention(
        q[..., :RANK], k, k[..., :RANK], torch.zeros(4, capacity // page_size, dtype=torch.int32, device=CUDA),
        torch.zeros(4, dtype=torch.int32, device=CUDA), None, kv_layout="NHD", causal=True, scale=SCALE,
        window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None, v_descale=None, key_mask=None,
        q_pe=q[..., RANK:], out=None)
    plan = select_plan(problem)
    assert plan.num_splits == 2, plan
    if plan.family == "cute":
        assert plan.scratch_bytes == 0 and plan.block_m == (16 if kv_dtype == F8 else 64), plan
    result = run_decode_loop(heads, page_size, kv_dtype, CUDA, dict(mode="reduce-overhead"), capacity=capacity)
    assert not result["inductor"].get("cudagraph_skips"), result["inductor"]
    assert result["stats"].get("unique_graphs") == 1, result["stats"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_cpu_twin_mla_decode_loop(case):
    """The compile test's body on the CPU, traced by Dynamo and AOTAutograd (aot_eager: the write
    functionalized before the attention of the same graph) under error_on_recompile: one graph, eager's
    outputs, the caches bit for bit; the lengths grow by one a step and drop once."""
    _, heads, page_size, kv_dtype = case
    result = run_decode_loop(heads, page_size, kv_dtype, CPU, dict(backend="aot_eager"))
    assert result["stats"].get("unique_graphs") == 1, result["stats"]
    lens = result["lens"]
    assert all(after[0] == before[0] + 1 for before, after in zip(lens, lens[1:]))
    assert lens[3][1] < lens[2][1] and all(row[3] == 0 for row in lens)


# ----------------------------------------------------------------------------------------------------------
# 3. The serving engine on DeepSeek-V3 over the latent cache, CUDA graphs

def check_served_tokens(device: torch.device, dtype: torch.dtype, *, compile: bool) -> dict:
    """The serving test's body: test_serve_mla's 3-layer DeepSeek-V3 with kv_lora_rank 512 (576 / 512
    latent cache), q_lora_rank 64, interleaved rope and YaRN, moved to `device` and `dtype`, served through
    test_serve_models' workload and config (chunked prefill, decode, verify with prompt-lookup drafts).
    Every routed expert is taken (top_k = n_routed_experts): the router's top-k is a discontinuity where a
    rounding difference can swap an expert (see test_gpu_models.continuous_moe), the MoE is still run. Every
    served token is the eager model's greedy choice up to bf16 near-ties, by teacher forcing (the served
    sequence through the unchanged model, attn_implementation "eager": the chosen token's logit at most 5 %
    of the largest logit magnitude below the top). With compile on CUDA: the engine is regional with CUDA
    graphs, every bucket is one captured graph that serving replays (the forward is never called), at most
    one synchronizing call per step, one Dynamo graph per bucket and layer kind, none compiled while serving,
    no graph breaks."""
    from test_serve_mla import _model
    from test_serve_models import _CONFIG, _record_steps, _requests
    from torch._dynamo.utils import counters

    from b12x_inductor.serve import Engine, ServeConfig

    model = _model(512, 64, True, True, layers=3)
    experts = model.config.n_routed_experts
    moe = [layer.mlp for layer in model.model.layers if type(layer.mlp).__name__ == "DeepseekV3MoE"]
    assert len(moe) == 2
    for mlp in moe:  # the router's k (transformers keeps it on the gate; on the MoE module in some versions)
        holders = [m for m in (mlp, getattr(mlp, "gate", None)) if hasattr(m, "top_k")]
        assert holders, "DeepseekV3MoE: no top_k found on the module or its gate"
        for m in holders:
            m.top_k = experts
    model.config.num_experts_per_tok = experts
    model = model.to(device, dtype)
    reference = copy.deepcopy(model)  # transformers' own attention ("eager"), before the engine absorbs it
    requests = _requests()
    engine = Engine(model, ServeConfig(**_CONFIG, compile=compile))
    runner = engine.runner
    assert runner.mla and runner.kv[0].shape[-1] == RANK + ROPE and runner.kv[0].dtype == dtype
    assert runner.cuda_graphs == (device.type == "cuda") and runner.regional == compile
    cuda_graphs = compile and device.type == "cuda"  # regional on CUDA: the runner captures each step
    counters.clear()
    engine.warmup()
    graphs = counters["stats"]["unique_graphs"]
    if compile:
        assert graphs == len(runner.buckets) * runner.layer_kinds, (graphs, runner.buckets, runner.layer_kinds)
    steps = _record_steps(engine)
    if cuda_graphs:
        assert sorted(runner._graphs) == sorted(runner.buckets)

        def refuse(*args):
            raise AssertionError("a step ran the forward instead of replaying its CUDA graph")

        runner.forward = refuse
        report, syncs = helpers.serve_counting_syncs(engine, requests)
        assert 0 < len(syncs) <= report.steps, [str(w.message) for w in syncs[:3]]
    else:
        report = engine.serve(requests)
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    assert engine.pools_free
    kinds = {kind for kind, _ in steps}
    assert {"verify", "extend"} <= kinds, kinds  # (decode steps: when no request has a draft, token-dependent)
    for r in requests:
        assert r.finished and len(r.output) == r.max_new_tokens, (r.id, r.output)
        gap, tie = near_tie_gaps(reference, r.prompt, r.output, device)
        assert (gap <= tie).all(), (r.id, gap.tolist())  # bf16 near-ties only
    return dict(report=report, reference=reference, requests=requests, kinds=kinds)


def near_tie_gaps(reference, prompt: list[int], output: list[int], device: torch.device):
    """Teacher forcing, as test_serve.py's GPU test: (how far each output token's logit sits below the top
    logit of the reference at its position, the near-tie allowance there: 5 % of the largest logit magnitude)."""
    ids = torch.tensor([list(prompt) + list(output)], device=device)
    with torch.no_grad():
        logits = reference(ids).logits[0, len(prompt) - 1:-1].float()  # the logits that chose each output
    chosen = logits.gather(1, torch.tensor(output, device=device)[:, None])[:, 0]
    return logits.max(1).values - chosen, 0.05 * logits.abs().max(1).values


@pytest.mark.gpu
@needs_cuda
def test_gpu_serve_mla_cuda_graphs_bf16():
    check_served_tokens(CUDA, BF16, compile=True)


@pytest.mark.usefixtures("one_thread")
def test_cpu_twin_serve_mla_bf16():
    """The serving test's body on the CPU, eagerly (no compile, no CUDA graphs), in bf16; and the teacher
    forcing can fail: a served token replaced by the reference's least likely one breaks the near-tie rule."""
    result = check_served_tokens(CPU, BF16, compile=False)
    assert result["kinds"] == {"decode", "verify", "extend"} and result["report"].draft_acceptance > 0
    r = result["requests"][0]
    ids = torch.tensor([r.prompt])
    with torch.no_grad():
        worst = int(result["reference"](ids).logits[0, -1].argmin())
    gap, tie = near_tie_gaps(result["reference"], r.prompt, [worst] + r.output[1:], CPU)
    assert gap[0] > tie[0], (gap[0], tie[0])
