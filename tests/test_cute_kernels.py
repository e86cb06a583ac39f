"""The CuTe DSL family (decode, verify and extend on Hopper) against the reference, and where select_plan
picks it.

CPU (CI): the family's `supports` table, its plan, and the rule that select_plan picks it only where it is
installed, the GPU is one it was verified on and it measured faster than Triton.

GPU (`gpu` marker; skipped without CUDA or without nvidia-cutlass-dsl): every feature against the reference
through the family's plan, CUDA-graph capture and replay with the outputs poisoned and the lengths and page
tables changed between replays, and torch.compile(mode="reduce-overhead") over changing lengths with no
cudagraph skip and no recompile, with select_plan picking the family.
"""

from __future__ import annotations

import inspect
import zlib

import pytest
import torch

from tests.helpers import replay_with_new_lengths, run_family
from tests.test_triton_kernels import F8, check_close, check_compiled_steps, make_inputs
from tests.test_triton_kernels import GPU_CASES as TRITON_GPU_CASES

BASE = dict(batch=8, q_len=1, packed=False, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
            max_pages=512, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD", device_type="cuda",
            sm_count=132, capability=(9, 0))


def _problem(**kw):
    from b12x_inductor.plan import Problem

    return Problem(**{**BASE, **kw})


def test_cute_supports_table():
    from b12x_inductor.kernels import cute

    assert cute.supports(_problem())
    assert cute.supports(_problem(kv_dtype=F8, head_dim=64, kv_layout="HND", page_size=1))
    assert cute.supports(_problem(q_len=4))  # verify, 16 rows
    assert not cute.supports(_problem(q_len=8))  # 32 rows per KV head
    assert cute.supports(_problem(q_len=64))  # extend: 4D and packed q, D 64/128/256, the cache in q's dtype
    assert cute.supports(_problem(q_len=64, packed=True, head_dim=64, kv_layout="HND", page_size=3))
    assert not cute.supports(_problem(q_len=64, kv_dtype=F8))
    assert cute.supports(_problem(q_len=64, head_dim=256))
    assert not cute.supports(_problem(q_len=64, head_dim=192))
    assert not cute.supports(_problem(head_dim=96))
    assert not cute.supports(_problem(capability=(8, 0)))
    assert not cute.supports(_problem(device_type="cpu"))
    assert not cute.supports(_problem(q_dtype=torch.float32, kv_dtype=torch.float32))


def test_cute_family_plan_scratch_only_for_splits():
    """Several splits write partials into the plan's scratch; one split writes out and lse itself: no scratch."""
    from b12x_inductor.plan import family_plan, split_scratch_bytes

    p = _problem(batch=128, max_pages=64)
    plan = family_plan(p, "cute")
    assert plan.family == "cute" and plan.block_m == 1 and plan.block_n == 64 and plan.num_splits == 1
    assert plan.scratch_bytes == split_scratch_bytes(p, 1) == 0
    few = _problem(batch=2, max_pages=512)
    split = family_plan(few, "cute")
    assert split.num_splits > 1 and split.scratch_bytes == split_scratch_bytes(few, split.num_splits) > 0
    assert family_plan(p, "cute", num_splits=2).scratch_bytes > 0 == family_plan(p, "cute", num_splits=1).scratch_bytes
    assert family_plan(_problem(kv_dtype=F8), "cute").num_stages == 2
    extend = family_plan(_problem(q_len=64), "cute")
    assert (extend.mode, extend.num_splits, extend.block_m, extend.num_warps, extend.scratch_bytes) == (
        "extend", 1, 128, 12, 0)


def test_cute_extend_plans_fit_shared_memory():
    from b12x_inductor.kernels.cute import EXTEND_HEAD_DIMS, SMEM_LIMIT, extend_geometry
    from b12x_inductor.plan import family_plan

    for d in EXTEND_HEAD_DIMS:
        for packed in (False, True):
            plan = family_plan(_problem(q_len=300, packed=packed, head_dim=d), "cute")
            geo = extend_geometry(d=d, tile_n=plan.block_n, stages=plan.num_stages)
            assert geo is not None and geo["smem_bytes"] <= SMEM_LIMIT, (d, plan)
    assert extend_geometry(d=128, tile_n=128, stages=4) is None  # 32 KB Q + 4 x 64 KB K/V > 227 KB
    assert extend_geometry(d=256, tile_n=64, stages=3) is None  # 64 KB Q + 3 x 64 KB K/V > 227 KB
    assert extend_geometry(d=256, tile_n=128, stages=2) is None


def test_cute_extend_192_rows_at_d64_only():
    """The 192-row extend tile (three consumer warpgroups, 16 warps) fits shared memory at D 64 with the plan's
    key tiles; the plan refuses it above D 64 (its 160 registers a consumer thread) and with another warp count
    (100 new tokens: the rule's own choice is 128 rows, so each override is its own)."""
    from b12x_inductor.kernels.cute import extend_geometry
    from b12x_inductor.plan import family_plan

    wide = family_plan(_problem(q_len=100, head_dim=64), "cute", block_m=192, num_warps=16)
    assert (wide.block_m, wide.num_warps) == (192, 16)
    assert extend_geometry(d=64, tile_n=wide.block_n, stages=wide.num_stages, block_m=192) is not None
    assert extend_geometry(d=128, tile_n=128, stages=2, block_m=192) is None
    for d, tiles in ((128, dict(block_m=192, num_warps=16)), (64, dict(block_m=192)), (64, dict(num_warps=16)),
                     (64, dict(block_m=256, num_warps=20))):
        with pytest.raises(ValueError, match="extend kernel takes .block_m, num_warps. among"):
            family_plan(_problem(q_len=100, head_dim=d), "cute", **tiles)


def test_cute_extend_rows_rule():
    """extend_rows: 192 rows at D 64 without a window where 1.5x its rounds of persistent CTAs (132 SMs) are at
    most 1.3x the 128-row grid's (packed q: its capacity over its requests), else 128; the plan follows it."""
    from b12x_inductor.kernels.cute import plan as cute_plan
    from b12x_inductor.plan import family_plan

    # rounds at (128, 192) rows: (32, 24) at 16x1024 and 32x512, (4, 3) at 2x1024, (32, 22) at 8x2048
    wide = [dict(batch=16, q_len=1024), dict(batch=32, q_len=512), dict(batch=2, q_len=1024),
            dict(batch=8, q_len=2048), dict(batch=16, q_len=16384, packed=True), dict(batch=2, q_len=2048, packed=True)]
    # (2, 2) at 1x1024 (the chunk of 1024 new tokens that measured 1.14x faster on 128 rows), (1, 1) at 1x2048 with
    # 8 heads; (16, 16) at packed 8192 over 64 requests (128 new tokens each); no 192 with a window or at D 128
    narrow = [dict(batch=1, q_len=1024), dict(batch=1, q_len=2048, num_q_heads=8, num_kv_heads=1),
              dict(batch=64, q_len=8192, packed=True), dict(batch=4, q_len=4096, window_left=127),
              dict(batch=4, q_len=4096, head_dim=128)]
    for rows, cases in ((192, wide), (128, narrow)):
        for kw in cases:
            problem = _problem(**dict(dict(head_dim=64), **kw))
            assert cute_plan.extend_rows(problem) == rows == family_plan(problem, "cute").block_m, kw
    assert [cute_plan.extend_rounds(_problem(batch=1, q_len=1024, head_dim=64), m) for m in (128, 192)] == [2, 2]
    plan = family_plan(_problem(batch=8, q_len=2048, head_dim=64), "cute")
    assert (plan.block_m, plan.num_warps, plan.block_n, plan.num_stages) == (192, 16, 128, 4)


def test_cute_decode_tile_two_ctas_an_sm():
    """decode_tile: float8 decode at D <= 128 on the tensor-core kernel where at most two splits of 1024 keys or
    more bring B x Hkv to two CTAs an SM (256 of 132 SMs), else the CUDA-core kernel split for about four an SM:
    the eleven float8 rows measured both ways (Hq 32, Hkv 8, page 16), each the faster configuration there."""
    from b12x_inductor.kernels.cute import plan as cute_plan

    rows = {(32, 4096): (1, 16), (64, 2048): (1, 16), (128, 1024): (1, 16), (64, 1024): (1, 16),
            (16, 16384): (2, 16),  # 128 KV heads: two splits make 256 CTAs
            (8, 8192): (8, 1),  # would need 4 tensor-core splits; the CUDA-core kernel at 512 CTAs
            (1, 32768): (64, 1), (1, 8192): (32, 1), (8, 2048): (8, 1), (4, 4096): (16, 1), (1, 2048): (8, 1)}
    for (batch, length), want in rows.items():
        p = _problem(batch=batch, max_pages=length // 16, kv_dtype=F8)  # BASE: Hq 32, Hkv 8, pages of 16
        splits, tile = cute_plan.decode_tile(p)
        assert (splits, tile["block_m"]) == want, (batch, length, splits, tile)
    # 16 requests of 1024 keys: a second split would leave 512 keys a split, and 128 CTAs are below two an SM
    few_keys = _problem(batch=16, max_pages=64, kv_dtype=F8)
    assert cute_plan.decode_tile(few_keys)[1] is cute_plan.TILE
    for kw in (dict(), dict(q_len=4), dict(head_dim=256)):  # bf16, float8 verify, float8 D 256: CUDA cores
        p = _problem(**{**dict(batch=32, max_pages=256, kv_dtype=F8 if kw else torch.bfloat16), **kw})
        assert cute_plan.decode_tile(p)[1] is cute_plan.TILE, kw


def test_cute_tma_box_follows_the_page_geometry():
    from b12x_inductor.kernels.cute import tma_box

    # (page, tile_n) -> keys per TMA box; 0: every tile by cp.async
    table = {(16, 128): 16, (64, 128): 64, (128, 128): 128, (256, 128): 128, (256, 64): 64, (8, 64): 8,
             (1, 128): 0, (5, 128): 0, (48, 128): 0, (24, 64): 0, (192, 128): 0, (4, 64): 0}
    assert {k: tma_box(page=k[0], tile_n=k[1]) for k in table} == table


def test_select_plan_picks_cute_only_where_installed_and_faster(monkeypatch):
    from b12x_inductor import plan as plan_mod
    from b12x_inductor.kernels import cute
    from b12x_inductor.kernels.cute import plan as cute_plan

    extend = [_problem(q_len=300), _problem(q_len=300, packed=True, head_dim=64)]
    faster = [p for p in (_problem(), _problem(kv_dtype=F8), _problem(q_len=4), _problem(batch=1, max_pages=2048),
                          *extend) if cute_plan.measured_faster(p)]
    assert all(p in faster for p in extend)  # extend is routed wherever the family expresses it
    monkeypatch.setattr(cute, "available", lambda: False)
    for p in faster:
        assert plan_mod.select_plan(p).family == "triton"
    monkeypatch.setattr(cute, "available", lambda: True)
    for p in faster:
        assert plan_mod.select_plan(p).family == "cute"
    # never where it does not apply, installed or not
    assert plan_mod.select_plan(_problem(q_len=64, kv_dtype=F8)).family == "triton"
    assert plan_mod.select_plan(_problem(capability=(8, 0))).family == "triton"  # CuTe: sm90 only
    assert plan_mod.select_plan(_problem(capability=(10, 0), kv_dtype=F8)).family == "triton"
    assert plan_mod.select_plan(_problem(head_dim=96)).family == "triton"


# ----------------------------------------------------------------------------------------------------------
# GPU

def _cute_ready():
    if not torch.cuda.is_available():
        return False
    from b12x_inductor.kernels import cute

    return cute.available()


needs_cute = pytest.mark.skipif(not _cute_ready(), reason="needs CUDA and nvidia-cutlass-dsl")

def _cute_case(kw):
    """Whether a Triton decode/verify GPU case is one the CuTe family expresses (D 64/128/256, <= 16 rows, no
    key mask)."""
    from b12x_inductor.kernels.cute import DECODE_HEAD_DIMS as HEAD_DIMS, MAX_ROWS

    q_len = kw.get("q_len", 1)
    return (not kw.get("packed") and q_len <= 16 and kw["d"] in HEAD_DIMS
            and q_len * kw["hq"] // kw["hkv"] <= MAX_ROWS and not kw.get("key_mask"))


def _cute_extend_case(kw):
    """Whether a Triton extend GPU case is one the CuTe family expresses (D 64/128/256, the cache in q's dtype, no
    key mask)."""
    from b12x_inductor.kernels.cute import EXTEND_HEAD_DIMS

    return ((kw.get("packed") or kw.get("q_len", 1) > 16) and kw["d"] in EXTEND_HEAD_DIMS
            and kw.get("kv_dtype") in (None, kw.get("dtype", torch.bfloat16)) and not kw.get("key_mask"))


# (name, make_inputs kwargs, options): the Triton family's decode/verify cases the CuTe family expresses, and
# six more (a group of 1, float8 with D=256 and every feature, verify with G=8, three with NaN-filled unused slots)
GPU_CASES = [(c[0], c[1], c[2] if len(c) > 2 else {}) for c in TRITON_GPU_CASES if _cute_case(c[1])] + [
    ("decode_g1_d64", dict(batch=2, hq=8, hkv=8, d=64, page_size=16, lens=[129, 64]), {}),
    ("decode_fp8_d256_features", dict(batch=2, hq=16, hkv=2, d=256, page_size=16, lens=[500, 70], kv_dtype=F8,
                                      descale="bh", kv_start=True, sinks=True), dict(window_left=50, softcap=8.0)),
    ("verify_fp8_s2_g8", dict(batch=2, q_len=2, hq=16, hkv=2, d=128, page_size=16, lens=[300, 40], kv_dtype=F8,
                              descale="bh"), {}),
    # TMA tiles (float8 D 128 and 16-bit D 64 rows are 128 bytes) next to cp.async ones (partial tiles; ranges
    # that kv_start or a window start off a box), with NaN in every cache slot no request may read
    ("decode_fp8_p64_nan_unused", dict(batch=3, hq=16, hkv=4, d=128, page_size=64, lens=[1000, 333, 64],
                                       kv_dtype=F8, descale="b", nan_unused=True), {}),
    ("verify_d64_kv_start_window_nan_unused", dict(batch=2, q_len=3, hq=8, hkv=2, d=64, page_size=16,
                                                   lens=[700, 90], kv_start=True, nan_unused=True),
     dict(window_left=300)),
    # float8 TMA tiles of ranges that start on a box past key 0 (kv_start 256 and 48) and at key 0: the page ids
    # the split kernels read beside the length, for a range from key 0 (decode.py `_guess_pages`), serve only
    # the last request; the others' ids before kv_start point at NaN slots
    ("decode_fp8_kv_start_on_boxes_nan_unused", dict(batch=3, hq=16, hkv=4, d=128, page_size=16,
                                                     lens=[1500, 700, 130], kv_dtype=F8, descale="bh",
                                                     kv_start=[256, 48, 0], nan_unused=True), {}),
]


# extend: the Triton family's extend cases the CuTe family expresses, and five more (a prefix of cached keys
# with G = 8 and several row tiles, pages of 64 and 256 keys, packed fp16 non-causal with page size 1 and G = 1,
# every feature at D=128)
EXTEND_CASES = [(c[0], c[1], c[2] if len(c) > 2 else {}) for c in TRITON_GPU_CASES if _cute_extend_case(c[1])] + [
    ("extend_prefix_g8", dict(batch=2, q_len=300, hq=32, hkv=4, d=128, page_size=16, lens=[300, 1000],
                              nan_unused=True), {}),
    # TMA boxes of a whole page (64 keys) and of half or a quarter of one (256 keys); slots past each length
    # and before kv_start are NaN: TMA takes only tiles of the request's keys, cp.async copies visible ones
    ("extend_page64_window", dict(batch=3, hq=8, hkv=2, d=128, page_size=64, packed=True, lens=[700, 300, 1000],
                                  q_lens=[300, 300, 200], kv_start=True, nan_unused=True), dict(window_left=333)),
    ("extend_page256_d64", dict(batch=2, q_len=260, hq=8, hkv=4, d=64, page_size=256, lens=[600, 1300],
                                nan_unused=True), {}),
    ("extend_packed_fp16_noncausal_p1", dict(batch=3, hq=4, hkv=4, d=64, page_size=1, packed=True,
                                             lens=[129, 500, 200], q_lens=[129, 1, 200], dtype=torch.float16),
     dict(causal=False)),
    ("extend_packed_features", dict(batch=2, hq=16, hkv=2, d=128, page_size=16, packed=True, lens=[700, 260],
                                    q_lens=[390, 200], kv_start=True, sinks=True, nan_unused=True),
     dict(window_left=150, softcap=30.0, scale=0.07)),
    # D 256 (Gemma's): a cached prefix with G = 2 (pages of 16: 48-key tiles by TMA); every feature with pages of
    # 64 keys (32-key tiles by TMA; the n48_stages3 variant gathers its 48-key tiles by cp.async)
    ("extend_d256_g2_prefix", dict(batch=2, q_len=300, hq=8, hkv=4, d=256, page_size=16, lens=[300, 700],
                                   nan_unused=True), {}),
    ("extend_packed_d256_features", dict(batch=2, hq=4, hkv=2, d=256, page_size=64, packed=True, lens=[700, 260],
                                         q_lens=[300, 200], kv_start=True, sinks=True, nan_unused=True),
     dict(window_left=150, softcap=30.0, scale=0.05)),
    # D 64 (gpt-oss's) with every feature, G = 8, several row tiles of 128 or 192 and partial ones (pages of 16:
    # 128-key tiles by TMA)
    ("extend_packed_d64_g8_features", dict(batch=3, hq=16, hkv=2, d=64, page_size=16, packed=True,
                                           lens=[900, 333, 640], q_lens=[500, 333, 1], kv_start=True, sinks=True,
                                           nan_unused=True), dict(window_left=200, softcap=20.0)),
    # the same at 4D q: row tiles end on a request's last row (450 rows: 4 of 128 from row -62, 3 of 192 from -126)
    ("extend_4d_d64_g8_features", dict(batch=2, q_len=450, hq=16, hkv=2, d=64, page_size=16, lens=[450, 1200],
                                       kv_start=True, sinks=True, nan_unused=True),
     dict(window_left=200, softcap=20.0)),
    # packed q over 40 requests (the tile map takes 32 a round: two rounds), of 0 to 300 new tokens (partial
    # tiles from row -127 on, requests without rows), and padding rows past cu_seqlens_q[-1]
    ("extend_packed_40_requests", dict(batch=40, hq=8, hkv=2, d=128, page_size=16, packed=True,
                                       lens=[300 + (97 * b) % 400 for b in range(40)],
                                       q_lens=[(0, 1, 129, 300, 64, 255, 128, 17)[b % 8] for b in range(40)],
                                       sinks=True, nan_unused=True), {}),
]
EXTEND_VARIANTS = {"plan": {}, "stages2": dict(num_stages=2), "n64_stages4": dict(block_n=64, num_stages=4),
                   "n48_stages3": dict(block_n=48, num_stages=3),  # D 256 only
                   "m192": dict(block_m=192, num_warps=16)}  # three consumer warpgroups: D 64 only


def _skip_unfit_extend_variant(kw, variant):
    """Skips a variant whose tiles the head dim's shared memory cannot hold (D 256 takes 48 or 32 keys), and the
    48-key variant below D 256."""
    from b12x_inductor.kernels.cute import extend_geometry
    from b12x_inductor.kernels.cute.plan import extend_tiles

    if variant == "n48_stages3" and kw["d"] != 256:
        pytest.skip("48-key tiles are D 256's")
    if variant == "m192" and kw["d"] != 64:
        pytest.skip("192-row tiles are D 64's")
    page = kw.get("page_size", inspect.signature(make_inputs).parameters["page_size"].default)
    block_n, stages = extend_tiles(kw["d"], page)
    tiles = EXTEND_VARIANTS[variant]
    if extend_geometry(d=kw["d"], tile_n=tiles.get("block_n", block_n), stages=tiles.get("num_stages", stages),
                       block_m=tiles.get("block_m", 128)) is None:
        pytest.skip(f"{variant} does not fit shared memory at D {kw['d']}")


def _reference(t, options):
    from b12x_inductor.kernels.reference import paged_attention_reference

    return paged_attention_reference(**t, **options)


# the family's two kernels: CUDA-core products (decode.py) and tensor-core products (decode_mma.py, D <= 128)
VARIANTS = {"cudacore": {}, "tensorcore": dict(block_m=16), "tensorcore_n128": dict(block_m=16, block_n=128)}


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name,kw,options", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_cute_matches_reference(name, kw, options, variant):
    if VARIANTS[variant] and kw["d"] > 128:
        pytest.skip("the tensor-core kernel takes D <= 128")
    options = dict(options, kv_layout=kw.get("kv_layout", "NHD"))
    t = make_inputs(**kw, device="cuda", seed=zlib.crc32(name.encode()) % 1000)
    out, lse, plan, _ = run_family(t, options, "cute", overrides=VARIANTS[variant])
    torch.cuda.synchronize()
    assert plan.family == "cute"
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan}")


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant,sms", [(v, 0) for v in VARIANTS] + [("tensorcore", 1)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, F8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "verify"])
def test_gpu_cute_cuda_graph_replay(q_len, kv_dtype, variant, sms, monkeypatch):
    """Capture once; poison the outputs, change lengths and page tables in place, replay, compare. sms 1: the
    persistent tensor-core kernel on 2 CTAs (as on one SM), so each replay's CTAs take many items, of other key
    counts than at capture."""
    _few_ctas(monkeypatch, sms)
    kw = dict(batch=3, q_len=q_len, hq=16, hkv=4, d=128, page_size=16, lens=[500, 260, 70], spare_pages=4,
              kv_dtype=kv_dtype, descale="bh" if kv_dtype == F8 else None)
    t = make_inputs(**kw, device="cuda", seed=7)
    options = dict(kv_layout="NHD")
    out, lse, plan, call = run_family(t, options, "cute", overrides=VARIANTS[variant])  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay_with_new_lengths(graph, t, out, lse, lambda step: check_close(
        out, lse, *_reference(t, options), what=f"cute q_len {q_len} replay {step}"), scratch=call.scratch)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant,sms", [("tensorcore", 1), ("tensorcore_n128", 3)])
@pytest.mark.parametrize("name,kw,options", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_cute_decode_mma_persistent_ctas_take_many_items(name, kw, options, variant, sms, monkeypatch):
    """The persistent tensor-core kernel as on a GPU of 1 and 3 SMs (2 and 6 CTAs): every CTA takes many
    (split, KV head, request) items in turn, its ring loading each next item's first tiles under the current
    one's last, items without keys (requests of length 0, splits past a request's end) among them."""
    if kw["d"] > 128:
        pytest.skip("the tensor-core kernel takes D <= 128")
    _few_ctas(monkeypatch, sms)
    options = dict(options, kv_layout=kw.get("kv_layout", "NHD"))
    t = make_inputs(**kw, device="cuda", seed=zlib.crc32(name.encode()) % 1000 + sms)
    out, lse, plan, _ = run_family(t, options, "cute", overrides=VARIANTS[variant])
    torch.cuda.synchronize()
    assert plan.family == "cute" and plan.block_m == 16
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan} sms={sms}")


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant", ["cudacore", "tensorcore"])
def test_gpu_cute_compile_reduce_overhead_no_skip_no_recompile(monkeypatch, variant):
    """With select_plan picking the CuTe family: compiled decode over changing lengths, no recompile, no skip."""
    import torch._dynamo

    import b12x_inductor as b12x
    from b12x_inductor import ops, validate
    from b12x_inductor.kernels.cute import plan as cute_plan

    monkeypatch.setattr(cute_plan, "measured_faster", lambda problem: True)
    monkeypatch.setattr(cute_plan, "TILE", {**cute_plan.TILE, **VARIANTS[variant]})
    ops.plan_for.cache_clear()
    t = make_inputs(batch=4, hq=32, hkv=8, d=128, page_size=16, lens=[300, 200, 100, 50], spare_pages=8,
                    device="cuda", seed=11, kv_dtype=F8, descale="bh")

    def step(q, k, v, pt, lens, kds, vds):
        out, lse = b12x.paged_attention(q, k, v, pt, lens, k_descale=kds, v_descale=vds, return_lse=True)
        return out * 2.0, lse

    try:
        gen = torch.Generator().manual_seed(5)
        cap = t["page_table"].shape[1] * 16
        check_compiled_steps(
            step, t, ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "k_descale", "v_descale"),
            lambda i: t["cache_seqlens"].copy_(torch.randint(1, cap + 1, (4,), generator=gen).int()),
            lambda: _reference(t, dict(kv_layout="NHD")), steps=5, what="compiled")
        problem = validate.check_paged_attention(
            t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], None, kv_layout="NHD",
            causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0,
            k_descale=t["k_descale"], v_descale=t["v_descale"], out=None)
        assert ops.plan_for(problem).family == "cute"
        assert ops.plan_for(problem).block_m == {"cudacore": 1, "tensorcore": 16}[variant]
    finally:
        ops.plan_for.cache_clear()
        torch._dynamo.reset()



def test_cute_rejects_unaligned_cache_rows_with_a_clear_error():
    """cp.async moves 16-byte chunks: a cache view whose rows do not start on 16 bytes is refused by name."""
    from b12x_inductor.kernels.cute import _check_aligned

    cache = torch.zeros(4, 16, 2, 65, dtype=torch.bfloat16)[..., 1:]  # rows start 2 bytes in
    with pytest.raises(ValueError, match=r"needs k_cache with 16-byte aligned rows .* got data_ptr % 16 = 2"):
        _check_aligned("k_cache", cache, 64)
    _check_aligned("v_cache", torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), 64)


def test_cute_mla_rejects_an_unaligned_out_with_one_split():
    """With one split the MLA kernels store out's rows 16 bytes at a time: an out whose rows do not start on 16
    bytes is refused by name before anything compiles or launches (with several splits the merge kernel
    writes out, and it takes any)."""
    pytest.importorskip("cuda.bindings.driver")
    from b12x_inductor.kernels.cute import _run_mla

    k_cache = torch.zeros(2, 64, 1, 576, dtype=torch.bfloat16)
    tensors = dict(q=torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16), k_cache=k_cache, v_cache=k_cache[..., :512],
                   page_table=torch.zeros(1, 2, dtype=torch.int32), cache_seqlens=torch.ones(1, dtype=torch.int32),
                   kv_start=None, sinks=None, k_descale=None, v_descale=None, q_pe=None)
    out = torch.zeros(1 * 16 * 512 + 1, dtype=torch.bfloat16)[1:].view(1, 1, 16, 512)  # rows start 2 bytes in
    lse = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match=r"needs out with 16-byte aligned rows .* got data_ptr % 16 = 2"):
        _run_mla(tensors, out=out, lse=lse, scratch=None, options=dict(kv_layout="NHD", softcap=0.0),
                 plan=dict(num_splits=1, block_m=64))


def test_cute_extend_rejects_an_unaligned_out():
    """The extend kernel stores out's rows in 8-byte writes and takes rows on 16 bytes, as q's: an out whose rows
    do not start on 16 bytes is refused by name before anything compiles or launches."""
    pytest.importorskip("cuda.bindings.driver")
    from b12x_inductor.kernels.cute import _run_extend

    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    tensors = dict(q=torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16), k_cache=cache, v_cache=cache,
                   page_table=torch.zeros(1, 2, dtype=torch.int32), cache_seqlens=torch.full((1,), 8, dtype=torch.int32),
                   cu_seqlens_q=None, kv_start=None, sinks=None, k_descale=None, v_descale=None)
    out = torch.zeros(8 * 4 * 128 + 4, dtype=torch.bfloat16)[4:].view(1, 8, 4, 128)  # rows start 8 bytes in
    with pytest.raises(ValueError, match=r"needs out with 16-byte aligned rows .* got data_ptr % 16 = 8"):
        _run_extend(tensors, out=out, lse=torch.zeros(1, 8, 4), options=dict(kv_layout="NHD"), plan={})


@pytest.mark.parametrize("which", ["q_pe_pointer", "q_pe_stride", "q_stride"])
def test_cute_mla_rejects_an_unaligned_query_part(which):
    """The MLA kernels copy the query's rows in 16-byte chunks from q (columns 0..511) and q_pe (512..575): a part
    whose rows do not start on 16 bytes is refused by name before anything compiles or launches."""
    pytest.importorskip("cuda.bindings.driver")
    from b12x_inductor.kernels.cute import _run_mla

    k_cache = torch.zeros(2, 64, 1, 576, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16)
    q_pe = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    if which == "q_pe_pointer":
        q_pe = torch.zeros(16 * 64 + 1, dtype=torch.bfloat16)[1:].view(1, 1, 16, 64)
    elif which == "q_pe_stride":
        q_pe = torch.zeros(1, 1, 16, 68, dtype=torch.bfloat16)[..., :64]
    else:
        q = torch.zeros(1, 1, 16, 516, dtype=torch.bfloat16)[..., :512]
    tensors = dict(q=q, q_pe=q_pe, k_cache=k_cache, v_cache=k_cache[..., :512],
                   page_table=torch.zeros(1, 2, dtype=torch.int32), cache_seqlens=torch.ones(1, dtype=torch.int32),
                   kv_start=None, sinks=None, k_descale=None, v_descale=None)
    name = "q" if which == "q_stride" else "q_pe"
    with pytest.raises(ValueError, match=rf"needs {name} with 16-byte aligned rows"):
        _run_mla(tensors, out=torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16), lse=torch.zeros(1, 1, 16),
                 scratch=None, options=dict(kv_layout="NHD", softcap=0.0), plan=dict(num_splits=1))


def test_cute_geometry_fits_every_supported_problem():
    """The plan's tile fits the kernel (threads, shared memory) for every head dim, dtype and row count the
    family supports; larger tiles that do not fit are refused rather than launched."""
    from b12x_inductor.kernels.cute import DECODE_HEAD_DIMS as HEAD_DIMS, MAX_ROWS, geometry

    for d in HEAD_DIMS:
        for bits in (8, 16):
            for rows in range(1, MAX_ROWS + 1):
                assert geometry(d=d, rows=rows, kv_bits=bits, tile_n=64, stages=2, num_warps=4) is not None
    assert geometry(d=256, rows=4, kv_bits=16, tile_n=128, stages=2, num_warps=4) is None  # > 227 KB
    assert geometry(d=64, rows=4, kv_bits=8, tile_n=64, stages=2, num_warps=8) is None  # 8 parts of 4 chunks


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant", list(EXTEND_VARIANTS))
@pytest.mark.parametrize("name,kw,options", EXTEND_CASES, ids=[c[0] for c in EXTEND_CASES])
def test_gpu_cute_extend_matches_reference(name, kw, options, variant):
    _skip_unfit_extend_variant(kw, variant)
    options = dict(options, kv_layout=kw.get("kv_layout", "NHD"))
    t = make_inputs(**kw, device="cuda", seed=zlib.crc32(name.encode()) % 1000)
    out, lse, plan, _ = run_family(t, options, "cute", overrides=EXTEND_VARIANTS[variant])
    torch.cuda.synchronize()
    assert plan.family == "cute" and plan.mode == "extend"
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan}")


def _few_ctas(monkeypatch, ctas: int) -> None:
    """The persistent kernels run as if the GPU had `ctas` SMs: their CTAs (extend: one per SM; the tensor-core
    split kernel: two) then take many work items each, so the ring, its barrier phases and the GEMM turns run
    on across items (0: the GPU's own count)."""
    from b12x_inductor.kernels import cute

    if ctas:
        real = cute.device_facts
        monkeypatch.setattr(cute, "device_facts", lambda device: (ctas, real(device)[1]))


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("ctas", [1, 5])
@pytest.mark.parametrize("variant", ["plan", "n64_stages4", "m192"])
@pytest.mark.parametrize("name,kw,options", EXTEND_CASES, ids=[c[0] for c in EXTEND_CASES])
def test_gpu_cute_extend_persistent_ctas_take_many_items(name, kw, options, variant, ctas, monkeypatch):
    """The persistent extend kernel with 1 and 5 CTAs: every CTA takes many (query head, row tile) items in
    turn, so its ring holds earlier items' tiles, its barriers run many phases and Q is issued ahead into rows
    the previous item just read."""
    _skip_unfit_extend_variant(kw, variant)
    _few_ctas(monkeypatch, ctas)
    options = dict(options, kv_layout=kw.get("kv_layout", "NHD"))
    t = make_inputs(**kw, device="cuda", seed=zlib.crc32(name.encode()) % 1000 + ctas)
    out, lse, plan, _ = run_family(t, options, "cute", overrides=EXTEND_VARIANTS[variant])
    torch.cuda.synchronize()
    assert plan.family == "cute" and plan.mode == "extend"
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan} ctas={ctas}")


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("ctas", [0, 1, 5])
@pytest.mark.parametrize("packed,d", [(False, 128), (True, 64), (False, 256)],
                         ids=["4d_d128", "packed_d64", "4d_d256"])
def test_gpu_cute_extend_row_tiles_without_keys(packed, d, ctas, monkeypatch):
    """Row tiles that see no key (kv_start past their causal limit) between tiles that do, in every order within a
    CTA's items: an item stays open until the next one's first softmax (its last P V issued with that item's
    first S, or alone where that item has no key tile), and after an item of no key the next one issues its
    first S with a product on its own first tile that no store reads; the rows of no key must come out as zeros
    and lse = -inf, the others as the reference's. Slots before each kv_start are NaN."""
    _few_ctas(monkeypatch, ctas)
    lens, q_lens, starts = [800, 300, 700, 420], [300, 300, 130, 300], [700, 0, 660, 0]
    kw = dict(batch=4, hq=8, hkv=2, d=d, page_size=16, lens=lens, kv_start=starts, sinks=True, nan_unused=True)
    kw.update(dict(packed=True, q_lens=q_lens) if packed else dict(q_len=300))
    t = make_inputs(**kw, device="cuda", seed=11 + ctas + d)
    options = dict(kv_layout="NHD", causal=True, window_left=-1, softcap=0.0)
    ref_out, ref_lse = _reference(t, options)
    assert torch.isinf(ref_lse).any() and not torch.isinf(ref_lse).all()  # rows of no key, and rows of keys
    out, lse, plan, _ = run_family(t, options, "cute")
    torch.cuda.synchronize()
    assert plan.family == "cute" and plan.mode == "extend"
    check_close(out, lse, ref_out, ref_lse, what=f"rows without keys {plan} ctas={ctas}")


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("ctas", [0, 3])
def test_gpu_cute_extend_cuda_graph_replay(ctas, monkeypatch):
    """Packed extend: capture once; poison the outputs, change lengths and page tables in place, replay (with
    the GPU's CTAs, and with 3 that take many items each)."""
    _few_ctas(monkeypatch, ctas)
    kw = dict(batch=3, hq=16, hkv=4, d=128, page_size=16, packed=True, lens=[500, 260, 150], q_lens=[150, 0, 140],
              spare_pages=4)
    t = make_inputs(**kw, device="cuda", seed=8)
    options = dict(kv_layout="NHD")
    out, lse, plan, call = run_family(t, options, "cute")  # compiles before capture
    assert plan.mode == "extend"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay_with_new_lengths(graph, t, out, lse, lambda step: check_close(
        out, lse, *_reference(t, options), what=f"cute extend replay {step}"), min_len=150, scratch=call.scratch)


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("ctas", [0, 3])
def test_gpu_cute_extend_192_rows_cuda_graph_replay(ctas, monkeypatch):
    """The 192-row tile (4D q, D 64, 2048 new tokens a request, sinks): capture once; poison the outputs, change
    lengths and page tables in place, replay (with the GPU's CTAs, and with 3 that take many items each)."""
    _few_ctas(monkeypatch, ctas)
    kw = dict(batch=2, q_len=2048, hq=8, hkv=2, d=64, page_size=16, lens=[2048, 3000], sinks=True, spare_pages=4)
    t = make_inputs(**kw, device="cuda", seed=9)
    options = dict(kv_layout="NHD")
    out, lse, plan, call = run_family(t, options, "cute", overrides=EXTEND_VARIANTS["m192"])  # compiles first
    assert (plan.mode, plan.block_m, plan.num_warps) == ("extend", 192, 16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay_with_new_lengths(graph, t, out, lse, lambda step: check_close(
        out, lse, *_reference(t, options), what=f"cute extend 192 rows replay {step}"), min_len=2048,
        scratch=call.scratch)


@pytest.mark.gpu
@needs_cute
def test_gpu_cute_extend_192_rows_compile_reduce_overhead_no_skip_no_recompile(monkeypatch):
    """With select_plan picking the CuTe family for extend: compiled 4D prefill at D 64 (the 192-row plan) over
    changing lengths and page tables, no recompile, no cudagraph skip."""
    import torch._dynamo

    import b12x_inductor as b12x
    from b12x_inductor import ops, validate
    from b12x_inductor.kernels.cute import plan as cute_plan

    monkeypatch.setattr(cute_plan, "measured_faster", lambda problem: True)
    ops.plan_for.cache_clear()
    # 16 heads: 352 items of 192 rows take fewer rounds of the GPU's CTAs than 512 of 128 (extend_rows)
    t = make_inputs(batch=2, q_len=2048, hq=16, hkv=4, d=64, page_size=16, lens=[2048, 2500], spare_pages=4,
                    device="cuda", seed=13)

    def step(q, k, v, pt, lens):
        out, lse = b12x.paged_attention(q, k, v, pt, lens, return_lse=True)
        return out * 2.0, lse

    try:
        gen = torch.Generator().manual_seed(6)
        cap = t["page_table"].shape[1] * 16

        def change(i):
            t["cache_seqlens"].copy_(torch.randint(2048, cap + 1, (2,), generator=gen).int())
            perm = torch.randperm(t["k_cache"].shape[0], generator=gen)[: t["page_table"].numel()]
            t["page_table"].copy_(perm.reshape(t["page_table"].shape).int())

        check_compiled_steps(step, t, ("q", "k_cache", "v_cache", "page_table", "cache_seqlens"), change,
                             lambda: _reference(t, dict(kv_layout="NHD")), steps=3, what="compiled 192-row extend")
        problem = validate.check_paged_attention(
            t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], None, kv_layout="NHD",
            causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None,
            v_descale=None, out=None)
        assert ops.plan_for(problem).block_m == 192, ops.plan_for(problem)
    finally:
        ops.plan_for.cache_clear()
        torch._dynamo.reset()


@pytest.mark.gpu
@needs_cute
def test_gpu_cute_extend_compile_reduce_overhead_no_skip_no_recompile(monkeypatch):
    """With select_plan picking the CuTe family for extend: compiled packed prefill over changing new-token
    counts and lengths, no recompile, no cudagraph skip."""
    import torch._dynamo

    import b12x_inductor as b12x
    from b12x_inductor import ops, validate
    from b12x_inductor.kernels.cute import plan as cute_plan

    monkeypatch.setattr(cute_plan, "measured_faster", lambda problem: True)
    ops.plan_for.cache_clear()
    t = make_inputs(batch=2, hq=16, hkv=4, d=128, page_size=16, packed=True, lens=[400, 300], q_lens=[200, 100],
                    spare_pages=4, device="cuda", seed=12)

    def step(q, k, v, pt, lens, cu):
        out, lse = b12x.paged_attention(q, k, v, pt, lens, cu, return_lse=True)
        return out * 2.0, lse

    try:
        gen = torch.Generator().manual_seed(6)
        cap = t["page_table"].shape[1] * 16

        def change(i):
            new = torch.randint(0, 150, (2,), generator=gen)
            cu = torch.zeros(3, dtype=torch.int32)
            cu[1:] = torch.cumsum(new, 0)
            t["cu_seqlens_q"].copy_(cu)
            t["cache_seqlens"].copy_((new + torch.randint(0, cap - 150, (2,), generator=gen)).int())

        check_compiled_steps(step, t, ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q"),
                             change, lambda: _reference(t, dict(kv_layout="NHD")), steps=4, what="compiled extend")
        problem = validate.check_paged_attention(
            t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
            kv_layout="NHD", causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0,
            k_descale=None, v_descale=None, out=None)
        assert (ops.plan_for(problem).family, ops.plan_for(problem).mode) == ("cute", "extend")
    finally:
        ops.plan_for.cache_clear()
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------
# Absorbed MLA decode/verify (mla.py): D 576, Dv 512, one KV head, V the first 512 columns of K

MLA = dict(hkv=1, d=576, dv=512, v_view=True)


def test_cute_mla_supports_and_plans(monkeypatch):
    """The MLA kernels take absorbed MLA decode/verify with a 16-bit cache in q's dtype, V a view of K, no window;
    their plans keep 64 rows per CTA (the seesaw kernel's two 64-key tiles or mla.py's 4 stages of 32 keys), or
    with a float8 cache and at most 16 rows a request the narrow kernel's 16, and write scratch only when they
    split."""
    from b12x_inductor.kernels import cute
    from b12x_inductor.kernels.cute import SMEM_LIMIT, mla_geometry, mla_narrow_geometry
    from b12x_inductor.plan import family_plan, split_scratch_bytes

    mla = dict(num_q_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512, v_in_k=True, page_size=64,
               max_pages=64)
    assert cute.supports(_problem(**mla))
    assert cute.supports(_problem(**{**mla, "q_len": 16, "num_q_heads": 16, "kv_layout": "HND", "page_size": 1}))
    assert not cute.supports(_problem(**{**mla, "v_in_k": False}))  # V read from K's tiles only
    assert cute.supports(_problem(**mla, kv_dtype=F8))  # float8 latent: mla.py, widened by its producer
    assert cute.supports(_problem(**{**mla, "q_dtype": torch.float16}, kv_dtype=F8))
    assert not cute.supports(_problem(**mla, window_left=128))
    assert not cute.supports(_problem(**mla, q_len=17))  # extend: Triton
    assert not cute.supports(_problem(**mla, key_mask=True))
    assert not cute.supports(_problem(**{**mla, "head_dim": 192, "v_head_dim": 128, "num_kv_heads": 8}))
    seesaw, ring = (64, 2, 8), (32, 4, 12)
    # the seesaw kernel for 128 rows or more per request and splits of 1024 keys or more, mla.py's ring elsewhere
    for kw, tile in ((dict(batch=32), seesaw), (dict(batch=128, max_pages=32), seesaw),
                     (dict(batch=32, q_len=4), seesaw), (dict(batch=1, max_pages=512), ring),  # 64 splits of 512
                     (dict(batch=32, q_len=4, num_q_heads=16), ring), (dict(batch=64, num_q_heads=16), ring)):
        p = _problem(**{**mla, **kw})
        plan = family_plan(p, "cute")
        assert (plan.block_m, (plan.block_n, plan.num_stages, plan.num_warps)) == (64, tile), (kw, plan)
        cluster = plan.num_splits == 2  # the splits merge in their cluster: no scratch
        assert plan.scratch_bytes == (0 if cluster else split_scratch_bytes(p, plan.num_splits)), plan
        row_blocks = -(-(p.q_len * p.num_q_heads) // 64)
        assert p.batch * row_blocks * plan.num_splits <= 2 * 132 or plan.num_splits == 1, plan
    assert family_plan(_problem(**{**mla, "batch": 128, "max_pages": 32}), "cute").scratch_bytes == 0  # 1 split
    # 2 splits merge in their cluster (no scratch), the 64-row kernels' and the narrow kernel's; more in the
    # Triton merge kernel, from scratch
    from b12x_inductor.kernels.cute import plan as cute_plan

    p, p16 = _problem(**{**mla, "batch": 2}), _problem(**{**mla, "batch": 2, "num_q_heads": 16})
    narrow = dict(block_m=16, block_n=64, num_stages=2, num_warps=12)
    for prob, tiles, cluster in ((p, dict(num_splits=2), True), (p, dict(num_splits=3), False),
                                 (p, dict(num_splits=8), False), (p, dict(num_splits=2, block_n=64, num_stages=2,
                                                                          num_warps=8), True),
                                 (p16, dict(narrow, num_splits=2), True),
                                 (p16, dict(narrow, num_splits=3), False)):
        plan = family_plan(prob, "cute", **tiles)
        assert plan.scratch_bytes == (0 if cluster else split_scratch_bytes(prob, plan.num_splits)), (tiles, plan)
    with monkeypatch.context() as m:  # the narrow kernel's clusters, where the constant takes them
        m.setattr(cute_plan, "MLA_NARROW_CLUSTER_SPLITS", 3)
        for splits, cluster in ((2, True), (3, True), (4, False)):
            plan = family_plan(p16, "cute", **dict(narrow, num_splits=splits))
            assert plan.scratch_bytes == (0 if cluster else split_scratch_bytes(p16, splits)), (splits, plan)
        assert family_plan(p, "cute", num_splits=3).scratch_bytes > 0  # the 64-row kernels keep their pairs
    for page, tile in ((1, ring), (48, ring), (8, seesaw), (16, seesaw), (256, seesaw)):  # seesaw: 64-key boxes
        plan = family_plan(_problem(**{**mla, "batch": 32, "page_size": page, "max_pages": 4096 // page}), "cute")
        assert (plan.block_n, plan.num_stages, plan.num_warps) == tile, (page, plan)
    with pytest.raises(ValueError, match="seesaw MLA kernel"):
        family_plan(_problem(**{**mla, "page_size": 1}), "cute", block_n=64, num_stages=2, num_warps=8)
    with pytest.raises(ValueError, match="seesaw MLA kernel"):
        family_plan(_problem(**{**mla, "batch": 32}), "cute", block_n=32, num_stages=4)  # the seesaw's warps
    # a float8 cache: the narrow kernel (mla_narrow.py) for 16 rows a request or fewer, at every page size;
    # mla.py's ring above
    narrow = (64, 5, 12)
    for kw, tile in ((dict(batch=32), ring), (dict(batch=1, max_pages=512), ring),
                     (dict(q_len=2, num_q_heads=16), ring), (dict(batch=64, num_q_heads=16), narrow), (dict(page_size=1, num_q_heads=16), narrow),
                     (dict(q_len=2, num_q_heads=8), narrow), (dict(num_q_heads=4), narrow)):
        plan = family_plan(_problem(**{**mla, **kw}, kv_dtype=F8), "cute")
        assert ((plan.block_n, plan.num_stages, plan.num_warps)) == tile, (kw, plan)
        assert plan.block_m == (16 if tile == narrow else 64) and plan.v_from_k, plan
    # the narrow kernel on request, a 16-bit cache: 2 stages; more rows, other tiles or stages that do not fit raise
    plan = family_plan(_problem(**{**mla, "num_q_heads": 16}), "cute", block_m=16, block_n=64, num_stages=2)
    assert (plan.block_m, plan.block_n, plan.num_stages, plan.num_warps) == (16, 64, 2, 12), plan
    for kw, tiles in ((dict(num_q_heads=32), dict(block_m=16, block_n=64, num_stages=2)),
                      (dict(num_q_heads=16), dict(block_m=16, block_n=32, num_stages=2)),
                      (dict(num_q_heads=16), dict(block_m=16, block_n=64, num_stages=3))):
        with pytest.raises(ValueError, match="narrow MLA kernel"):
            family_plan(_problem(**{**mla, **kw}), "cute", **tiles)
    with pytest.raises(ValueError, match="narrow MLA kernel"):
        family_plan(_problem(**{**mla, "num_q_heads": 16}, kv_dtype=F8), "cute", num_stages=6)
    assert mla_narrow_geometry(fp8=True, stages=5)["smem_bytes"] <= SMEM_LIMIT
    assert mla_narrow_geometry(fp8=True, stages=6) is None and mla_narrow_geometry(fp8=False, stages=3) is None
    for tiles in (dict(num_warps=8, block_n=64, num_stages=2), dict(num_stages=2)):  # seesaw; too few stages
        with pytest.raises(ValueError, match="float8 cache"):
            family_plan(_problem(**mla, kv_dtype=F8), "cute", **tiles)
    for tile_n, stages in ((32, 4), (64, 2)):
        assert mla_geometry(tile_n=tile_n, stages=stages)["smem_bytes"] <= SMEM_LIMIT
    assert mla_geometry(tile_n=64, stages=3) is None and mla_geometry(tile_n=32, stages=5) is None


def _cute_mla_case(kw, options):
    """Whether a Triton GPU case is one mla.py expresses (absorbed MLA decode/verify, a 16-bit or float8 cache, no
    window)."""
    return (kw["d"] == 576 and kw.get("v_view") and not kw.get("packed") and kw.get("q_len", 1) <= 16
            and kw.get("kv_dtype") in (None, kw.get("dtype", torch.bfloat16), F8) and not kw.get("key_mask")
            and options.get("window_left", -1) < 0)


# the Triton family's MLA decode/verify cases the kernel expresses, and more: 2 query rows of 128 heads with
# kv_start (ranges starting inside a tile: cp.async), sinks, softcap and pages of 128 keys (TMA boxes of 32);
# an fp16 HND cache with pages of 16; one long request over many splits; an empty request and page size 1 (no
# TMA) non-causal; 8 drafts of 16 heads (two row blocks whose causal limits differ). Unused slots are NaN.
MLA_CASES = [(c[0], c[1], c[2] if len(c) > 2 else {}) for c in TRITON_GPU_CASES
             if _cute_mla_case(c[1], c[2] if len(c) > 2 else {})] + [
    ("mla_verify_s2_h128_features_p128", dict(MLA, batch=3, q_len=2, hq=128, page_size=128, lens=[700, 9, 130],
                                              kv_start=True, sinks=True, nan_unused=True),
     dict(softcap=20.0, scale=0.05)),
    ("mla_decode_h16_hnd_fp16_p16", dict(MLA, batch=2, hq=16, page_size=16, lens=[333, 1000], kv_layout="HND",
                                         dtype=torch.float16, nan_unused=True), {}),
    ("mla_decode_h128_1x8000", dict(MLA, batch=1, hq=128, page_size=64, lens=[8000], nan_unused=True), {}),
    ("mla_decode_h64_empty_p1", dict(MLA, batch=3, hq=64, page_size=1, lens=[0, 45, 300], sinks=True,
                                     nan_unused=True), dict(causal=False)),
    ("mla_verify_s8_h16_kv_start", dict(MLA, batch=2, q_len=8, hq=16, page_size=64, lens=[600, 70], kv_start=True,
                                        nan_unused=True), {}),
    # a float8 latent cache (mla.py's producer widens it to fp16; per-request and scalar descales, K's and V's
    # apart): 16 heads with every feature and a request whose keys all lie below kv_start; 4 drafts of 128 heads
    # (8 row blocks) from an fp16 q with pages of 1; the query in two tensors with [B, 1] descales
    ("mla_decode_h16_fp8_features", dict(MLA, batch=3, hq=16, page_size=64, lens=[3000, 3, 333], kv_dtype=F8,
                                         descale="b", kv_start=True, sinks=True, nan_unused=True),
     dict(softcap=20.0)),
    ("mla_verify_s4_h128_fp8_fp16_p1", dict(MLA, batch=2, q_len=4, hq=128, page_size=1, lens=[300, 77],
                                            kv_dtype=F8, dtype=torch.float16, descale="scalar", nan_unused=True), {}),
    ("mla_decode_h16_fp8_split_q_p16", dict(MLA, batch=2, hq=16, page_size=16, lens=[1000, 45], kv_dtype=F8,
                                            descale="bh", split_q=True, nan_unused=True), {}),
    # at most 16 rows a request (the narrow kernel's): a 2-key request, kv_start, sinks and softcap with pages of
    # one key (cp.async); 2 drafts of 8 heads (causal across the 16 columns) with pages of 128; 3 drafts of 4 heads
    # (12 of the 16 columns) from a float8 cache and an fp16 q, with kv_start
    ("mla_decode_h16_features_p1", dict(MLA, batch=3, hq=16, page_size=1, lens=[2, 45, 700], kv_start=True,
                                        sinks=True, nan_unused=True), dict(softcap=20.0, scale=0.05)),
    ("mla_verify_s2_h8_p128", dict(MLA, batch=2, q_len=2, hq=8, page_size=128, lens=[900, 3], nan_unused=True), {}),
    ("mla_verify_s3_h4_fp8_fp16", dict(MLA, batch=2, q_len=3, hq=4, page_size=16, lens=[260, 64], kv_dtype=F8,
                                       dtype=torch.float16, descale="scalar", kv_start=True, nan_unused=True), {}),
    # pages of 256 keys (issue 18's largest page size): a tile is part of one page (TMA boxes of a whole tile), a
    # request's last page part full; a 16-bit cache at 128 heads, and a float8 one at 16 heads with kv_start
    ("mla_decode_h128_p256", dict(MLA, batch=2, hq=128, page_size=256, lens=[1500, 7], nan_unused=True), {}),
    ("mla_decode_h16_fp8_p256", dict(MLA, batch=2, hq=16, page_size=256, lens=[3000, 300], kv_dtype=F8,
                                     descale="b", kv_start=True, nan_unused=True), {}),
]
# the plan (kernels/cute/plan.py's mla_plan); one split (the kernel writes out and lse itself, sink folded in);
# 2 splits (merged in their cluster: plan.mla_cluster_merge); 3 (uneven ranges; partials and the Triton merge
# kernel), and 3 merged in a cluster (the plan's constants raised: `_cluster_merge` takes up to 8, the plan pairs
# only); each kernel asked for: the seesaw kernel (mla_seesaw.py, pages with 64-key TMA boxes only; also with 2
# splits), mla.py's ring of 32-key tiles, and the narrow kernel (mla_narrow.py, at most 16 query rows a request;
# its stages follow the cache: `_mla_overrides`), with 3 splits, with one, and with 2 and 3 merged in their
# cluster
MLA_VARIANTS = {"plan": {}, "one_split": dict(num_splits=1), "splits2": dict(num_splits=2),
                "splits3": dict(num_splits=3), "cluster3": dict(num_splits=3),
                "seesaw": dict(block_n=64, num_stages=2, num_warps=8),
                "seesaw_splits2": dict(block_n=64, num_stages=2, num_warps=8, num_splits=2),
                "ring32": dict(block_n=32, num_stages=4, num_warps=12, block_m=64),
                "narrow": dict(block_m=16, num_splits=3), "narrow_one_split": dict(block_m=16, num_splits=1),
                "narrow_pair": dict(block_m=16, num_splits=2), "narrow_cluster3": dict(block_m=16, num_splits=3)}
# the plan constants (kernels/cute/plan.py) each cluster variant sets, so that its splits merge in their cluster
# whatever the plan takes
MLA_CLUSTER_PATCH = {"cluster3": dict(MLA_CLUSTER_SPLITS=8, MLA_NARROW_CLUSTER_SPLITS=8),
                     "narrow_pair": dict(MLA_NARROW_CLUSTER_SPLITS=2),
                     "narrow_cluster3": dict(MLA_NARROW_CLUSTER_SPLITS=8)}


def _patch_cluster_constants(monkeypatch, variant):
    """Sets the plan constants of a cluster variant (MLA_CLUSTER_PATCH) for this test; others unchanged."""
    from b12x_inductor.kernels.cute import plan as cute_plan

    for constant, value in MLA_CLUSTER_PATCH.get(variant, {}).items():
        monkeypatch.setattr(cute_plan, constant, value)


def _mla_overrides(variant, kw):
    """The variant's plan fields for a case, or None where its kernel cannot run the case (a skip)."""
    from b12x_inductor.kernels.cute.plan import MLA_NARROW_FP8_STAGES, MLA_NARROW_TILE

    over = dict(MLA_VARIANTS[variant])
    if variant.startswith("narrow"):
        if kw.get("q_len", 1) * kw["hq"] > MLA_NARROW_TILE["block_m"]:
            return None
        over = dict(MLA_NARROW_TILE, **over)
        if kw.get("kv_dtype") == F8:
            over["num_stages"] = MLA_NARROW_FP8_STAGES
    return over


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
@pytest.mark.parametrize("name,kw,options", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_gpu_cute_mla_matches_reference(name, kw, options, variant, monkeypatch):
    from b12x_inductor.kernels.cute import tma_box

    _patch_cluster_constants(monkeypatch, variant)
    if variant.startswith("seesaw") and not tma_box(page=kw["page_size"], tile_n=64):
        pytest.skip("the seesaw kernel loads by TMA only (pages of 8 to 256 keys that divide 64 or that 64 divides)")
    if variant.startswith("seesaw") and kw.get("kv_dtype") == F8:
        pytest.skip("a float8 cache runs on mla.py or mla_narrow.py")
    overrides = _mla_overrides(variant, kw)
    if overrides is None:
        pytest.skip("the narrow kernel takes at most 16 query rows a request")
    options = dict(options, kv_layout=kw.get("kv_layout", "NHD"))
    t = make_inputs(**kw, device="cuda", seed=zlib.crc32(name.encode()) % 1000)
    out, lse, plan, _ = run_family(t, options, "cute", overrides=overrides)
    torch.cuda.synchronize()
    assert plan.family == "cute" and plan.block_m == overrides.get("block_m", plan.block_m), plan
    assert variant not in MLA_CLUSTER_PATCH or plan.scratch_bytes == 0, plan  # merged in the cluster
    check_close(out, lse, *_reference(t, options), what=f"{name} {plan}")


@pytest.mark.gpu
@needs_cute
@pytest.mark.parametrize("variant", ["plan", "one_split", "splits2", "seesaw", "seesaw_splits2", "narrow",
                                     "narrow_one_split", "narrow_pair"])
@pytest.mark.parametrize("q_len,heads,split_q,fp8", [(1, 128, False, False), (4, 16, False, False),
                                                    (1, 128, True, False), (4, 16, True, False), (1, 16, False, True),
                                                    (4, 128, True, True), (1, 16, True, False), (2, 8, True, True)],
                         ids=["decode_h128", "verify_h16", "decode_h128_split_q", "verify_h16_split_q",
                              "decode_h16_fp8", "verify_h128_split_q_fp8", "decode_h16_split_q",
                              "verify_h8_split_q_fp8"])
def test_gpu_cute_mla_cuda_graph_replay(q_len, heads, split_q, fp8, variant, monkeypatch):
    """Capture once; poison the outputs, change lengths and page tables in place, replay, compare (split_q: the
    query as q and q_pe, read in place; fp8: a float8 cache with per-request descales)."""
    _patch_cluster_constants(monkeypatch, variant)
    if fp8 and variant.startswith("seesaw"):
        pytest.skip("a float8 cache runs on mla.py or mla_narrow.py")
    kw = dict(MLA, batch=3, q_len=q_len, hq=heads, page_size=64, lens=[500, 260, 70], spare_pages=4,
              split_q=split_q, **(dict(kv_dtype=F8, descale="b") if fp8 else {}))
    overrides = _mla_overrides(variant, kw)
    if overrides is None:
        pytest.skip("the narrow kernel takes at most 16 query rows a request")
    t = make_inputs(**kw, device="cuda", seed=13)
    options = dict(kv_layout="NHD")
    out, lse, plan, call = run_family(t, options, "cute", overrides=overrides)
    torch.cuda.synchronize()
    assert plan.block_m == overrides.get("block_m", plan.block_m)
    assert variant not in MLA_CLUSTER_PATCH or plan.scratch_bytes == 0, plan  # merged in the cluster
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay_with_new_lengths(graph, t, out, lse, lambda step: check_close(
        out, lse, *_reference(t, options), what=f"cute mla q_len {q_len} h{heads} {variant} replay {step}"),
        page_size=64, scratch=call.scratch)
