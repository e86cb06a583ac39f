"""The Triton family's plans: tiles and split counts, a pure function of the Problem (select_plan's rule for
this family; the tiles were measured on the H200, benchmarks/results/h200.md, "Kernels").

Decode/verify are bound by the KV bytes: split-KV programs (B x Hkv x M-tiles x splits) should number about
8 per SM, the split count a power of two (uneven splits and part waves cost), each split at least 256 keys
of capacity. float8 caches take 128-key tiles (half the bytes per key). Extend: 128 x 128 tiles for D <= 128,
64 x 32 above.

The tiles follow the wider of the two head dims, max(D, Dv) (D for plain GQA). Above 256 (MLA's absorbed
D = 576 / Dv = 512, whose accumulator alone is 512 fp32 columns a row) decode/verify take 16 query rows by
16 keys with 4 warps and extend 32 x 16 with 8 warps. Not yet measured on a GPU. The spills that made these
the choice were measured on compiles without the JIT's alignment specialization; compiled as the GPU
compiles them (kernels/triton/_compile_only.py, Triton 3.6, sm90), larger tiles do not spill either:
- decode 16 x 32 with 4 warps (SGLang's Triton MLA decode tile);
- decode 32 x 16 with 8 warps (half the KV re-reads at 128 heads);
- extend 32 x 32 with 8 warps.
Which is fastest awaits `python -m b12x_inductor.bench mla --variants ...` on the H200
(benchmarks/results/h200.md, "Registers and shared memory as the GPU compiles them").
"""

from __future__ import annotations

from b12x_inductor.plan import FP8, Plan, Problem, next_pow2, split_count, split_scratch_bytes, with_tiles

SPLIT_RULE = dict(programs_per_sm=8, min_split_keys=256, max_splits=64)


def num_splits(problem: Problem, programs: int) -> int:
    """Split-KV partitions for `programs` programs per split (the CuTe family uses the same rule)."""
    return split_count(problem, programs, **SPLIT_RULE)


def plan(problem: Problem, **tiles) -> Plan:
    """The family's plan; `tiles` replace its tile choices (plan.family_plan)."""
    return with_tiles(problem, _plan(problem), tiles)


def _plan(problem: Problem) -> Plan:
    mode, d = problem.mode, max(problem.head_dim, problem.v_head_dim)
    fp8 = problem.kv_dtype == FP8
    if d > 256:  # MLA's latent head dims
        if mode == "extend":
            return Plan(mode=mode, family="triton", num_splits=1, block_m=32, block_n=16, num_warps=8,
                        num_stages=2, scratch_bytes=0)
        block_m = 16
        m_tiles = -(-problem.q_len * problem.group // block_m)
        splits = num_splits(problem, problem.batch * problem.num_kv_heads * m_tiles)
        return Plan(mode=mode, family="triton", num_splits=splits, block_m=block_m, block_n=16, num_warps=4,
                    num_stages=2, scratch_bytes=split_scratch_bytes(problem, splits))
    if mode == "extend":
        if d <= 128:
            return Plan(mode=mode, family="triton", num_splits=1, block_m=128, block_n=128, num_warps=8,
                        num_stages=3, scratch_bytes=0)
        return Plan(mode=mode, family="triton", num_splits=1, block_m=64, block_n=32, num_warps=4, num_stages=2,
                    scratch_bytes=0)
    rows = problem.q_len * problem.group  # query rows packed per KV head
    block_m = min(max(16, next_pow2(rows)), 64 if d > 128 else 128)
    m_tiles = -(-rows // block_m)
    block_n = (128 if fp8 else 64) if d <= 128 else (64 if fp8 else 32)
    splits = num_splits(problem, problem.batch * problem.num_kv_heads * m_tiles)
    return Plan(mode=mode, family="triton", num_splits=splits, block_m=block_m, block_n=block_n,
                num_warps=4 if block_m <= 32 else 8, num_stages=2, scratch_bytes=split_scratch_bytes(problem, splits))
