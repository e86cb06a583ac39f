"""The CuTe DSL family's plans and where select_plan prefers it over Triton (pure functions of the Problem).

Decode/verify: one CTA (decode.py) or work item of a persistent CTA (decode_mma.py) per (request, KV head, split)
with all S x G query rows and a ring of `num_stages` tiles of `block_n` keys. block_m 1 selects the CUDA-core
kernel (decode.py), 16 (MMA_M) the tensor-core one, which takes float8 decode where at most two splits of
MMA_MIN_SPLIT_KEYS keys or more make two items an SM; the split counts are the Triton family's rule with this
family's constants (decode_tile). Extend: 128 query rows (two consumer warpgroups) and a producer warpgroup,
128-key tiles (48 or 32 at D 256), as many stages as shared memory holds (extend_tiles, extend_geometry),
persistent CTAs (one per SM); 192 rows (three consumers) at D 64 where its rounds of CTAs cost less (extend_rows).
Absorbed MLA decode/verify (block_m 64): 64 query rows per CTA, splits for about one CTA per SM (MLA_SPLITS); the
seesaw kernel (mla_seesaw.py, two 64-key tiles, num_warps 8) for 128 query rows or more per request with long
splits (mla_plan), else mla.py (4 stages of 32 keys); a float8 latent cache on mla.py, or on the narrow kernel
(mla_narrow.py, block_m 16: products transposed, 5 stages of 64 keys) where a request has at most 16 query rows;
two splits merge in their cluster (mla_cluster_merge), more in the merge kernel. The choices and the measurements
behind them: benchmarks/results/h200.md, "CuTe DSL kernels", "Session 27", "Session 29", "Session 33",
"Session 34", "Session 36", "Session 38", "Session 55", "Session 56", "Session 57", "Session 66" and "Session 68".
"""

from __future__ import annotations

import dataclasses

from b12x_inductor.kernels.triton.plan import num_splits as triton_num_splits
from b12x_inductor.plan import FP8, Plan, Problem, prev_pow2, split_count, split_scratch_bytes, with_tiles

TILE = dict(block_m=1, block_n=64, num_stages=2, num_warps=4)
MMA_TILE = dict(block_m=16, block_n=128, num_stages=2, num_warps=4)
# decode_tile: decode.py's splits (about four CTAs an SM); decode_mma.py's (two CTAs an SM, at most
# MMA_SPLITS["max_splits"] splits of at least MMA_MIN_SPLIT_KEYS keys each)
CUTE_SPLITS = dict(programs_per_sm=4, max_splits=64)
MMA_MIN_SPLIT_KEYS = 1024
MMA_SPLITS = dict(programs_per_sm=2, max_splits=2, min_split_keys=MMA_MIN_SPLIT_KEYS)
MLA_SEESAW_TILE = dict(block_m=64, block_n=64, num_stages=2, num_warps=8)  # mla_seesaw.py: 2 x 64 keys, TMA
SEESAW_MIN_ROWS = 128  # q_len x heads of a request; fewer (H16) are bound by bytes, where mla.py's ring is faster
SEESAW_MIN_SPLIT_KEYS = 1024  # a split's keys; fewer (H128 1x32768: 512) and mla.py's ring is faster
# extend.py's (block_n, num_stages) per head dim: a 128 x D Q tile and the K/V ring within 227 KB; at D 256 the
# 64 x 256 fp32 P V accumulators (128 registers a thread) leave room for small score tiles only: 48 keys in 3
# stages (64 keys in 2 spilled), or 32 in 4 where pages have TMA boxes of 32 keys but not of 48 (extend_tiles)
EXTEND_TILES = {64: (128, 4), 128: (128, 3), 256: (48, 3)}
# extend.py's query rows per CTA -> num_warps: a producer warpgroup and a consumer warpgroup a 64 rows; 192 rows
# (three consumers of 160 registers, FlashAttention-3's tile at D 64) only up to EXTEND_WIDE_MAX_D
EXTEND_BLOCK_M = 128
EXTEND_ROWS = {EXTEND_BLOCK_M: 12, 192: 16}
EXTEND_WIDE_MAX_D = 64
EXTEND_WIDE_RATE = 1.3  # extend_rows: 192-row tiles' throughput a row against 128-row tiles', D <= 64 (H100)
EXTEND_D256_BOX32 = (32, 4)
MLA_TILE = dict(block_m=64, block_n=32, num_stages=4, num_warps=12)  # mla.py: 64 rows, 4 stages of 32 keys
MLA_SPLITS = dict(programs_per_sm=1, max_splits=128)  # one CTA fits an SM (223-226 KB of shared memory)
MLA_FP8_LAG = 2  # mla.py, float8 cache: tiles in flight while a third is widened, so at least 3 ring stages
# mla_narrow.py: at most 16 query rows a request (S x H), products transposed; 64-key tiles, 2 stages of 16-bit
# rows or 5 of float8 ones (what shared memory holds beside Q and P)
MLA_NARROW_TILE = dict(block_m=16, block_n=64, num_stages=2, num_warps=12)
MLA_NARROW_FP8_STAGES = 5
# mla.py and mla_seesaw.py: 2 to MLA_CLUSTER_SPLITS splits of a row block run as one thread-block cluster and
# merge there through distributed shared memory (no scratch, no merge kernel): mla_cluster_merge. The kernels
# merge clusters of up to 8; the plan takes pairs only (h200.md, "Session 56": 2 splits 1.02-1.07x the merge
# kernel, 4 splits 0.69-0.70x, the clusters of four CTAs of a whole SM each not fitting the GPCs in one wave)
MLA_CLUSTER_SPLITS = 2
# mla_narrow.py merges its splits in their cluster too (mla.py's _cluster_merge on its staged fp32 rows); the plan
# takes pairs (h200.md, "Session 57": float8 H16 64x4096 1.03x the merge kernel on the H100)
MLA_NARROW_CLUSTER_SPLITS = 2


def plan(problem: Problem, **tiles) -> Plan:
    """The family's plan; `tiles` replace its tile choices (plan.family_plan). The MLA kernel always takes V's
    tile from K's (its plans say v_from_k), the others always load V themselves: a v_from_k tile that says
    otherwise raises."""
    mla = problem.v_head_dim != problem.head_dim  # mla.py; it also writes out itself with one split
    if "v_from_k" in tiles and bool(tiles["v_from_k"]) != mla:
        raise ValueError("paged_attention: the cute family's MLA kernel reads V from K's tiles, its other kernels "
                         f"load V themselves; v_from_k={tiles['v_from_k']} is the Triton family's")
    out = with_tiles(problem, _plan(problem), tiles)
    if mla and mla_writes_out(out.num_splits, out.block_m):  # no partials, so no scratch
        out = dataclasses.replace(out, scratch_bytes=0)
    if problem.mode == "extend":
        if EXTEND_ROWS.get(out.block_m) != out.num_warps or not extend_rows_fit(out.block_m, problem.head_dim):
            raise ValueError("paged_attention: the cute family's extend kernel takes (block_m, num_warps) among "
                             f"{sorted(EXTEND_ROWS.items())}, 192 rows at head dims up to {EXTEND_WIDE_MAX_D}; got "
                             f"block_m={out.block_m}, num_warps={out.num_warps}, head_dim={problem.head_dim}")
        return out
    if mla and out.block_m == MLA_NARROW_TILE["block_m"]:
        from b12x_inductor.kernels.cute import mla_narrow_geometry

        rows = problem.q_len * problem.num_q_heads
        if (rows > out.block_m or out.block_n != MLA_NARROW_TILE["block_n"]
                or out.num_warps != MLA_NARROW_TILE["num_warps"]
                or mla_narrow_geometry(fp8=problem.kv_dtype == FP8, stages=out.num_stages) is None):
            raise ValueError("paged_attention: the cute family's narrow MLA kernel (block_m=16) takes at most 16 "
                             "query rows a request (q_len x heads) in 64-key tiles with num_warps=12, and as many "
                             "stages as its shared memory holds (2 for a 16-bit cache, 5 for float8); got "
                             f"{rows} rows, block_n={out.block_n}, num_stages={out.num_stages}, "
                             f"num_warps={out.num_warps}")
        return out
    if mla and problem.kv_dtype == FP8 and (out.num_warps != MLA_TILE["num_warps"]
                                            or out.num_stages <= MLA_FP8_LAG):
        raise ValueError("paged_attention: the cute family's MLA kernel reads a float8 cache with mla.py "
                         f"(num_warps=12) and at least {MLA_FP8_LAG + 1} stages ({MLA_FP8_LAG} tiles load while "
                         f"another is widened); got num_stages={out.num_stages}, num_warps={out.num_warps}")
    if mla and out.num_warps == MLA_SEESAW_TILE["num_warps"]:
        from b12x_inductor.kernels.cute import tma_box

        tile_n, stages = MLA_SEESAW_TILE["block_n"], MLA_SEESAW_TILE["num_stages"]
        if (out.block_n, out.num_stages) != (tile_n, stages) or tma_box(page=problem.page_size, tile_n=tile_n) == 0:
            raise ValueError("paged_attention: the cute family's seesaw MLA kernel (num_warps=8) takes 64-key tiles "
                             "in 2 stages, by TMA (pages of 8 to 256 keys that divide 64 or that 64 divides); got "
                             f"block_n={out.block_n}, num_stages={out.num_stages}, page_size={problem.page_size}")
    return out


def _plan(problem: Problem) -> Plan:
    if problem.v_head_dim != problem.head_dim:  # absorbed MLA decode/verify (mla.py; supports() admits no other)
        return mla_plan(problem)
    if problem.mode == "extend":  # as many stages as shared memory holds
        block_n, stages = extend_tiles(problem.head_dim, problem.page_size)
        rows = extend_rows(problem)
        return Plan(mode="extend", family="cute", num_splits=1, block_m=rows, block_n=block_n,
                    num_warps=EXTEND_ROWS[rows], num_stages=stages, scratch_bytes=0)
    splits, tile = decode_tile(problem)
    # several splits write partials for the merge kernel; one split writes out and lse itself (no scratch)
    return Plan(mode=problem.mode, family="cute", num_splits=splits, **tile,
                scratch_bytes=split_scratch_bytes(problem, splits))


def decode_tile(problem: Problem) -> tuple[int, dict]:
    """(splits, tile) of GQA decode / verify, one CTA or item per (request, KV head, split). Float8 decode at D 64
    or 128 takes the tensor-core kernel (decode_mma.py, MMA_TILE) where at most two splits of MMA_MIN_SPLIT_KEYS
    keys or more bring the items to two an SM: its items (taken in turn by persistent CTAs, two an SM) each pay a
    fixed cost that more, shorter splits multiply. Everything else takes the CUDA-core kernel (decode.py, TILE),
    split for about four CTAs an SM (CUTE_SPLITS). Float8 on the H100 (h200.md, "Session 66"): 32x4096 unsplit 95.7
    us against 106.5 at 4 splits; 16x16384 at 2 splits 185.7 against 191.1 at 8 and 202.0 at 4; 8x8192 on decode.py
    at 8 splits 52.6 against 54.5 for 4 tensor-core splits and 62.4 for decode.py at 16; decode.py also ahead where
    few requests cannot make two tensor-core CTAs an SM (1x2048, 1x8192, 4x4096, 8x2048: 1.02-1.10x the fastest
    tensor-core split count measured)."""
    programs = problem.batch * problem.num_kv_heads
    if problem.mode == "decode" and problem.kv_dtype == FP8 and problem.head_dim <= 128:
        splits = split_count(problem, programs, **MMA_SPLITS)
        two_per_sm = prev_pow2(2 * max(problem.sm_count, 1))
        if programs * splits >= two_per_sm and problem.kv_span // splits >= MMA_MIN_SPLIT_KEYS:
            return splits, MMA_TILE
    return triton_num_splits(problem, programs, **CUTE_SPLITS), TILE


def extend_rows_fit(block_m: int, head_dim: int) -> bool:
    """Whether extend.py takes block_m query rows a CTA at this head dim: a row count of EXTEND_ROWS, 192 rows
    only up to EXTEND_WIDE_MAX_D (a consumer's 160 registers)."""
    return block_m in EXTEND_ROWS and (block_m == EXTEND_BLOCK_M or head_dim <= EXTEND_WIDE_MAX_D)


def extend_rounds(problem: Problem, block_m: int) -> int:
    """Rounds of the persistent extend grid at block_m rows: ceil(items / SMs), items = B x Hq x row tiles of a
    request's new tokens (4D q: S; packed q [T, Hq, D]: T / B, its capacity shared out over its requests, which
    undercounts a bucket that few long requests fill: its lengths are the device's)."""
    per_request = max(problem.q_len // problem.batch, 1) if problem.packed else problem.q_len
    items = problem.batch * problem.num_q_heads * -(-per_request // block_m)
    return -(-items // max(problem.sm_count, 1))


def extend_rows(problem: Problem) -> int:
    """extend.py's query rows a CTA: 192 (three consumer warpgroups) or 128. 192 only at D <= 64 without a
    window, and only where its rounds of CTAs (extend_rounds), each 1.5x as long, cost no more than the 128-row
    grid's at EXTEND_WIDE_RATE, 192 rows' throughput a row against 128's: 1.5 x rounds(192) <= 1.3 x rounds(128).
    The rate is what rounds of equal items measured on an H100 (h200.md, "Session 65"; chunks of 1024 new tokens
    on an 8192-key prefix, Hq 32, so every item sees about the same keys): one request, 2 rounds either way, ran
    1.14x faster on 128 rows (the model: 3 / 2.6 = 1.15x); two requests, 3 rounds against 4, 1.16x faster on 192
    (the model: 5.2 / 4.5 = 1.16x). Full prefills take many rounds of items of every length, where the rule picks
    192: measured 1.09-1.13x at 32x512 and 16x1024, 4D and packed. The static problem cannot tell a full prefill
    from a chunk on a long prefix, so the rule takes the chunk's model, the case where fewer, longer items cost."""
    if not extend_rows_fit(192, problem.head_dim) or problem.window_left >= 0:
        return EXTEND_BLOCK_M
    wide = 192 / EXTEND_BLOCK_M * extend_rounds(problem, 192)
    return 192 if wide <= EXTEND_WIDE_RATE * extend_rounds(problem, EXTEND_BLOCK_M) else EXTEND_BLOCK_M


def extend_tiles(head_dim: int, page: int) -> tuple[int, int]:
    """extend.py's (block_n, num_stages) for the head dim and page size: EXTEND_TILES; at D 256 32 keys in 4
    stages instead of 48 in 3 where the pages go by TMA in 32-key boxes but not in 48-key ones (pages of 32, 64,
    128, 256 keys: a tile without a box gathers by cp.async, which costs the consumers issue slots). Measured
    on Gemma's extend row against the 64 x 2 tile (h200.md, "Session 38"): 48 x 3 1.37x at pages of 16, 32 x 4
    1.12x at pages of 64 (where 48 x 3, by cp.async, was 1.10x)."""
    from b12x_inductor.kernels.cute import tma_box

    block_n, stages = EXTEND_TILES[head_dim]
    if head_dim == 256 and tma_box(page=page, tile_n=block_n) == 0 and tma_box(page=page, tile_n=32) != 0:
        return EXTEND_D256_BOX32
    return block_n, stages


def mla_narrow_tile(problem: Problem) -> dict:
    """The narrow MLA kernel's tile fields for the problem's cache (`tiles` of plan())."""
    return dict(MLA_NARROW_TILE, **({"num_stages": MLA_NARROW_FP8_STAGES} if problem.kv_dtype == FP8 else {}))


def mla_plan(problem: Problem) -> Plan:
    """MLA decode/verify: one CTA per (request, 64 query rows, split); splits bring the CTAs to about one per
    SM. The seesaw kernel (mla_seesaw.py) where it measured faster than mla.py (h200.md, session 29): a
    request's rows fill two row blocks or more (SEESAW_MIN_ROWS: bound by the tensor cores, not by bytes), each
    split spans SEESAW_MIN_SPLIT_KEYS keys or more, and its 64-key tiles go by TMA; mla.py elsewhere (and for
    pages without a box, which it gathers with cp.async). A float8 cache: the narrow kernel (mla_narrow.py, its
    products transposed, K and V widened in registers) where a request has at most 16 query rows (1.25-1.5x
    mla.py at H 16, h200.md, session 36), else mla.py, whose producer widens the loads. The narrow kernel's CTA
    takes a request's rows as one 64-row block does, so the split count is the same. A 16-bit cache stays on the 64-row
    kernels at 16 rows and fewer: the narrow kernel's two 64-key stages ran no faster there (session 36)."""
    from b12x_inductor.kernels.cute import tma_box

    rows = problem.q_len * problem.num_q_heads
    row_blocks = -(-rows // MLA_TILE["block_m"])
    splits = triton_num_splits(problem, problem.batch * row_blocks, **MLA_SPLITS)
    seesaw = (rows >= SEESAW_MIN_ROWS and problem.kv_span // splits >= SEESAW_MIN_SPLIT_KEYS
              and tma_box(page=problem.page_size, tile_n=MLA_SEESAW_TILE["block_n"]) != 0
              and problem.kv_dtype != FP8)  # a float8 cache: mla.py only, whose producer widens the loads
    tile = MLA_SEESAW_TILE if seesaw else MLA_TILE
    if problem.kv_dtype == FP8 and rows <= MLA_NARROW_TILE["block_m"]:
        tile = mla_narrow_tile(problem)
    return Plan(mode=problem.mode, family="cute", num_splits=splits, **tile, v_from_k=True,
                scratch_bytes=split_scratch_bytes(problem, splits))  # plan(): none where the kernel writes out


def mla_writes_out(num_splits: int, block_m: int) -> bool:
    """Whether the MLA split kernel writes out and lse itself (one split, or splits merged in their cluster:
    mla_cluster_merge), so that its plan has no scratch and no merge kernel runs."""
    return num_splits == 1 or mla_cluster_merge(num_splits, block_m)


def mla_cluster_merge(num_splits: int, block_m: int) -> bool:
    """Whether an MLA plan's splits merge inside the split kernel: the 64-row kernels (mla.py, mla_seesaw.py)
    with 2 to MLA_CLUSTER_SPLITS splits, the narrow kernel (mla_narrow.py) with 2 to MLA_NARROW_CLUSTER_SPLITS,
    launch each row block's splits as one cluster, and its CTAs merge the partials through distributed shared
    memory into out and lse (mla.py, `_cluster_merge`); the plan then has no scratch. More splits write partials
    for the Triton merge kernel. Measured on an H100 against the merge kernel: MLA H128 32x4096 (seesaw, 2
    splits) 1.07x, H16 64x4096 (mla.py, 2) 1.02x; H16 32x4096 (mla.py, 4) 0.70x; float8 H16 64x4096
    (mla_narrow.py, 2) 1.03x."""
    most = MLA_CLUSTER_SPLITS if block_m == MLA_TILE["block_m"] else MLA_NARROW_CLUSTER_SPLITS
    return 2 <= num_splits <= most


def measured_faster(problem: Problem) -> bool:
    """Where the CuTe family measured faster than Triton on the H200 (h200.md, "CuTe DSL kernels"; extend at
    D 256: "Session 33"; the float8 latent cache: "Session 34" to "Session 36"): extend, wherever the family
    expresses it (`supports`); absorbed MLA decode/verify (mla.py and mla_seesaw.py with a 16-bit cache; with a
    float8 one mla.py, 2.7-2.9x the Triton kernel at H 128, and mla_narrow.py at H 16, 1.6-2.1x session 34's
    Triton times) with pages whose tiles go by TMA
    (the pages of 64 keys it was measured with; pages of 1 to 7 keys and others without a box stay on Triton,
    unmeasured); and decode from a float8 cache with D = 128 and at most 4 query heads per KV head. Other bf16
    decode and verify stay on Triton (whose products run on tensor cores), as do the decode configurations never
    measured (other head dims, larger groups)."""
    if problem.mode == "extend":
        return True
    if problem.v_head_dim != problem.head_dim:  # MLA (mla.py): measured with pages of 64 keys (TMA boxes)
        from b12x_inductor.kernels.cute import tma_box

        return tma_box(page=problem.page_size, tile_n=MLA_TILE["block_n"]) != 0
    return problem.mode == "decode" and problem.kv_dtype == FP8 and problem.head_dim == 128 and problem.group <= 4
