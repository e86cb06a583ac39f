"""The Triton family compiles for every GPU target select_plan sends it to, on a machine with no GPU.

Only the H200 (sm90) runs the kernels (tests/test_triton_kernels.py -m gpu). Here CI compiles them for sm80
(A100), sm89 (L40 / RTX 40), sm90 (H100 / H200), sm100 (B200) and sm120 (RTX 50 / DGX Spark) with
kernels/triton/_compile_only.py (`triton.compile` for a `GPUTarget`; no kernel is loaded or run), and
checks that each kernel's shared memory fits the target's per-block limit.

The configurations come from the plans themselves: select_plan over a grid of Problems (decode, verify and
extend, 4-D and packed q; head dims 64-256, and MLA's (D, Dv) = (192, 128) and (576, 512); bf16 and fp16 q
with the cache in q's dtype or float8; NHD page 16, NHD page 64 and HND page 1; group sizes 1-8; and four
feature sets: causal, non-causal, sliding window, softcap) on a GPU of each capability, keeping those that
take the Triton family (so no float8 for sm80). That grid reaches about 70 distinct (tile, head dim, cache
dtype) kernels per target, each a 1-5 s compile (about 6 min for all five targets on two cores), so each
target compiles a representative set instead: the fewest Problems (greedy cover) that together reach every
tile configuration the plans emit (kernel, block_m, block_n, num_warps, num_stages, and whether the tile is
MLA's 576 wide, and whether V is read from K's tile: 21 decode/verify tiles and 3 extend tiles on sm90 (the
16-row 64-key one-buffer tile beyond one wave among them), 20 and 3 on sm100; 16 and 3 on sm89 / sm120, where MLA
takes no 64-row tile; 11 and 3 on sm80, whose plans have no float8 and so no 128-key tile), both split-KV with
its merge kernel and no split, every head-dim pair, every (q, cache) dtype pair the target allows, every
layout / page size, packed q and every feature set: 24 Problems on sm90, 23 on sm100, 19 on sm89 / sm120, 14
on sm80, 99 plans (plus their merge kernels) in all, spread over the CPU cores (about 70 s on two, from a cold
Triton cache).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

import pytest
import torch

F8 = torch.float8_e4m3fn
# (compute capability, SM count, dynamic shared memory per block that a kernel may opt in to, bytes)
TARGETS = {80: ((8, 0), 108, 166912), 89: ((8, 9), 142, 101376), 90: ((9, 0), 132, 232448),
           100: ((10, 0), 148, 232448), 120: ((12, 0), 170, 101376)}
OPTIONS = [dict(kv_layout="", causal=True, scale=0.088, window_left=-1, softcap=0.0),
           dict(kv_layout="", causal=False, scale=0.088, window_left=-1, softcap=0.0),
           dict(kv_layout="", causal=True, scale=0.088, window_left=127, softcap=0.0),
           dict(kv_layout="", causal=True, scale=0.088, window_left=-1, softcap=30.0)]


def _grid(capability, sm_count):
    """(Problem, options index) of the grid, for a GPU of this capability."""
    from b12x_inductor.plan import HEAD_DIMS, Problem

    shapes = [(1, 1, False, 2048), (8, 1, False, 512), (128, 1, False, 64), (8, 4, False, 512),
              (64, 16, False, 128), (56, 1, False, 256), (4, 4096, False, 256), (1, 16384, True, 1024),
              (2, 64, False, 64)]
    heads = [(32, 8), (8, 8), (64, 8), (8, 1)]
    dtypes = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, F8),
              (torch.float16, F8)]
    layouts = [("NHD", 16), ("HND", 1), ("NHD", 64)]
    for i, (b, s, packed, m) in enumerate(shapes):
        for j, d in enumerate(HEAD_DIMS):
            for hq, hkv in heads:
                for qd, kd in dtypes:
                    for layout, ps in layouts:
                        p = Problem(batch=b, q_len=s, packed=packed, max_pages=m, num_q_heads=hq,
                                    num_kv_heads=hkv, head_dim=d, page_size=ps, q_dtype=qd, kv_dtype=kd,
                                    kv_layout=layout, device_type="cuda", sm_count=sm_count,
                                    capability=capability)
                        yield p, (i + j) % len(OPTIONS)
    # MLA: value head dims that differ from the key's (DeepSeek-V3 non-absorbed 192 / 128, absorbed 576 / 512
    # with one KV head, its V apart or k_cache's first 512 columns), whose plans take the tiles of max(D, Dv)
    for i, (b, s, packed, m) in enumerate(shapes):
        for j, (d, dv, heads_mla) in enumerate(((192, 128, [(16, 16), (32, 8)]), (576, 512, [(16, 1), (128, 1)]))):
            for hq, hkv in heads_mla:
                for qd, kd in dtypes:
                    for layout, ps in layouts:
                        for v_in_k in (False, True) if d == 576 else (False,):
                            p = Problem(batch=b, q_len=s, packed=packed, max_pages=m, num_q_heads=hq,
                                        num_kv_heads=hkv, head_dim=d, v_head_dim=dv, page_size=ps, q_dtype=qd,
                                        kv_dtype=kd, kv_layout=layout, device_type="cuda", sm_count=sm_count,
                                        capability=capability, v_in_k=v_in_k)
                            yield p, (i + j) % len(OPTIONS)


def _facets(problem, plan, opt):
    kernel = "extend" if plan.mode == "extend" else "split"
    latent = max(problem.head_dim, problem.v_head_dim) > 256  # MLA's 576-wide tiles need their own compile
    return {("tile", kernel, plan.block_m, plan.block_n, plan.num_warps, plan.num_stages, latent, plan.v_from_k),
            ("splits", kernel, plan.num_splits > 1), ("d", problem.head_dim, problem.v_head_dim),
            ("dtype", problem.q_dtype, problem.kv_dtype), ("layout", problem.kv_layout, problem.page_size),
            ("packed", problem.packed), ("options", opt)}


def representative(cc):
    """The target's Problems to compile: a greedy cover of the facets of every Triton plan of the grid.
    Returns (chosen [(problem, plan, options index)], every facet the grid's plans have)."""
    from b12x_inductor.plan import select_plan

    capability, sm_count, _ = TARGETS[cc]
    candidates = []
    for problem, opt in _grid(capability, sm_count):
        plan = select_plan(problem)
        if plan.family == "triton":
            candidates.append((problem, plan, opt, _facets(problem, plan, opt)))
    every = set().union(*(c[3] for c in candidates))
    left, chosen = set(every), []
    while left:
        best = max(candidates, key=lambda c: len(c[3] & left))
        chosen.append(best[:3])
        left -= best[3]
    return chosen, every


def _compile(cc, problem, plan, opt):
    """In a worker process: [(kernel name, shared bytes, cubin bytes)] of one plan compiled for cc."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from b12x_inductor.kernels import Options
    from b12x_inductor.kernels.triton import _compile_only

    options = Options(**dict(OPTIONS[opt], kv_layout=problem.kv_layout))
    kernels = _compile_only.precompile_for(problem, plan, options, cc)
    return [(k.name, k.metadata.shared, len(k.asm["cubin"])) for k in kernels]


@pytest.fixture(scope="module")
def compiled():
    jobs = {(cc, i): item for cc in TARGETS for i, item in enumerate(representative(cc)[0])}
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA/TRITON_INTERPRET state inherited
    results = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 8)),
                                                mp_context=ctx) as pool:
        futures = {key: pool.submit(_compile, key[0], *item) for key, item in jobs.items()}
        for key, future in futures.items():
            try:
                results[key] = future.result()
            except Exception as exc:  # noqa: BLE001 - reported per target below
                results[key] = exc
    return jobs, results


def test_representative_sets_cover_every_plan_facet():
    """The cover is complete and small; float8 appears exactly where the family takes it (sm89+)."""
    for cc in TARGETS:
        chosen, every = representative(cc)
        tiles = {f for f in every if f[0] == "tile"}
        expected = {80: 14, 89: 19, 90: 24, 100: 23, 120: 19}[cc]
        assert len(tiles) == expected and len(chosen) <= 24, (cc, len(tiles), len(chosen))
        has_fp8 = any(f[0] == "dtype" and f[2] == F8 for f in every)
        assert has_fp8 == (cc >= 89), cc


@pytest.mark.parametrize("cc", list(TARGETS))
def test_plans_compile_for_target(compiled, cc):
    jobs, results = compiled
    limit = TARGETS[cc][2]
    failures = []
    for (target, i), (problem, plan, opt) in jobs.items():
        if target != cc:
            continue
        what = (f"sm{cc} {plan.mode} D={problem.head_dim} Dv={problem.v_head_dim} "
                f"{problem.q_dtype}/{problem.kv_dtype} "
                f"{problem.kv_layout} p={problem.page_size} m={plan.block_m} n={plan.block_n} "
                f"w={plan.num_warps} st={plan.num_stages} splits={plan.num_splits} options={OPTIONS[opt]}")
        res = results[(target, i)]
        if isinstance(res, Exception):
            failures.append(f"{what}: {type(res).__name__}: {str(res)[:300]}")
            continue
        assert len(res) == (1 if plan.mode == "extend" or plan.num_splits == 1 else 2), what
        for name, shared, cubin in res:
            if cubin == 0 or shared > limit:
                failures.append(f"{what}: {name} cubin={cubin} B shared={shared} B (limit {limit})")
    assert not failures, "\n".join(failures)


def _decode_usage(kv_dtype):
    """resource_usage of the H200 decode 8x8192 plan's split kernel, compiled for sm90 (in a worker process)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from b12x_inductor.kernels import Options
    from b12x_inductor.kernels.triton import _compile_only
    from b12x_inductor.plan import Problem, family_plan

    problem = Problem(batch=8, q_len=1, packed=False, max_pages=512, num_q_heads=32, num_kv_heads=8, head_dim=128,
                      page_size=16, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, kv_layout="NHD", device_type="cuda",
                      sm_count=132, capability=(9, 0))
    options = Options(**dict(OPTIONS[0], kv_layout="NHD"))
    kernels = _compile_only.precompile_for(problem, family_plan(problem, "triton"), options, 90)
    return _compile_only.resource_usage(kernels[0])


def _merge_global_loads(rows, splits):
    """The global loads in the sm90 PTX of the merge kernel at (rows, splits), DV 512, bf16 partials (in a
    worker process), its UNROLL and TILE, and its stack bytes a thread (spills)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from b12x_inductor.kernels.triton import _compile_only, decode

    _, meta = decode.merge_launch(rows, 16, 512, splits)
    tune = {k: meta.pop(k) for k in ("num_warps", "num_stages")}
    kernel = _compile_only.compile_kernel(
        decode.merge_kernel, (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32, 0),
        meta, tune, 90)
    stack = _compile_only.resource_usage(kernel)["stack"]
    return kernel.asm["ptx"].count("ld.global"), meta["UNROLL"], meta["TILE"], stack


def test_merge_issues_many_splits_loads_together():
    """Below 128 splits the merge's loop over the splits is unrolled in Triton, so UNROLL splits' LSE and partial
    loads are in the PTX ahead of ptxas: ptxas left the plain loop rolled at 128 splits and at 64 splits of 128
    columns (4 loads in its SASS: each split waited out its own; MLA H16 1x32768 doubled, h200.md "Session
    53"), and unrolled it fully at 64 splits of 64 columns. From 128 splits on, the TILE form loads all splits'
    columns as one tile (no loop); neither form spills."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        for rows, splits in ((256, 64), (4, 100), (512, 8), (16, 128)):
            loads, unroll, tile, stack = pool.submit(_merge_global_loads, rows, splits).result()
            assert stack == 0, (rows, splits, stack)
            if splits >= 128:
                assert tile and unroll == 1 and loads >= 2, (rows, splits, loads)
            else:
                assert not tile and unroll == min(splits, 64) and loads >= 2 * unroll, (rows, splits, loads, unroll)


def test_compile_only_specializes_as_the_jit_does():
    """The compile-only path specializes pointers as 16-byte aligned and ints by divisibility, as the JIT does on
    the GPU: the bf16 decode plan's gathered loads then vectorize (cp.async stages in shared memory) and it
    does not spill. Compiled without those attributes the same kernel used 255 registers and spilled 328
    bytes a thread (Triton 3.6), which is not what the H200 runs."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        use = pool.submit(_decode_usage, torch.bfloat16).result()
    assert use["stack"] == 0 and 0 < use["registers"] <= 200, use
    assert use["shared"] > 32 * 1024, use  # two 64-key K/V stages staged through shared memory


def test_direct_launch_passes_every_step_its_constexprs_in_order():
    """Every kernel launch the plans emit (split, merge, extend: the sm90 representative set) has its runtime
    arguments first and its constexprs after them, so a direct launch (kernels/triton/__init__.py, `_Step.launch`)
    passes them positionally in the kernel's order; checked on the kernels' signatures, no GPU needed."""
    from b12x_inductor.kernels import Options
    from b12x_inductor.kernels import triton as triton_kernels
    from b12x_inductor.kernels.triton import _compile_only

    seen = set()
    for problem, plan, opt in representative(90)[0]:
        options = Options(**dict(OPTIONS[opt], kv_layout=problem.kv_layout))
        launch, operands = triton_kernels.warmup_launch(problem, options)
        for step in triton_kernels._steps(launch, plan, options):
            args = step.args(operands)
            tail = _compile_only.constexpr_tail(step.kernel, len(args), step.kwargs)  # raises if out of order
            assert tail and all(p.is_constexpr for p in step.kernel.params[len(args):]), step.kernel.fn.__name__
            seen.add(step.kernel.fn.__name__)
    assert seen == {"split_kernel", "merge_kernel", "extend_kernel"}, seen


def test_direct_launch_refuses_a_constexpr_among_the_positional_arguments():
    import triton
    import triton.language as tl

    from b12x_inductor.kernels.triton import _compile_only

    @triton.jit
    def kernel(x, N: tl.constexpr, y):
        pass

    assert _compile_only.constexpr_tail(kernel, 1, dict(N=4, y=1, num_warps=4)) == ("N", "y")
    with pytest.raises(TypeError, match="runtime arguments first"):  # N, a constexpr, among the positional ones
        _compile_only.constexpr_tail(kernel, 2, dict(y=1, num_warps=4))
    with pytest.raises(TypeError, match="runtime arguments first"):  # N missing from the keywords
        _compile_only.constexpr_tail(kernel, 1, dict(y=1))
