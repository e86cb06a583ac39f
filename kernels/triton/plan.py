"""The Triton family's plans: tiles and split counts, a pure function of the Problem (select_plan's rule for
this family; the tiles were measured on the H200, benchmarks/results/h200.md, "Kernels").

Decode/verify are bound by the KV bytes: split-KV programs (B x Hkv x M-tiles x splits) should number about 4 per SM
(every decode and verify row of the H200 sweep was fastest there, h200.md, "Session 26"), the split count a power of
two (uneven splits and part waves cost) and at most 128 (one request with 4 KV heads, Qwen2-7B's, needs 128 to reach
4 per SM), each split at least 256 of the keys a query can see (the capacity, or a sliding window's keys:
Problem.kv_span). Two-buffer tiles of which an sm90 SM holds at most two programs (float8 tiles, by registers; D 128
tiles above 16 rows, by shared memory) aim at 2 per SM instead: at 4 their programs made two waves (1.0-1.15x faster
on every row measured, h200.md, "Session 43"). float8 caches take 128-key tiles (half the bytes per key). The split
kernel reads a tile's page ids one tile ahead, so Triton's pipeliner buffers K and V: num_stages - 1 buffers. With
one (2 stages) a tile's copies start only after the previous tile's products have read the buffer; with two (3
stages) they run under those products. Two buffers are the rule: 16 query rows a KV head at D 128 on 32-key tiles
(38 KB of shared memory and 70-94 registers on sm90: 5 programs an SM; on sm90 / sm100 its splits, keys and buffers
are chosen for one wave of programs: one_wave_tile), 32 and 64 rows on 64-key tiles, 128 rows on 32-key tiles;
D 192 / 256 (Gemma's 256) at 16 rows on 16-key tiles (41 KB at 256); D <= 64 (gpt-oss) at every row count on 64-key
tiles; float8 tiles up to 32 rows on their 128-key (64 above D 128) tiles, and above 32 rows at D <= 128 on sm90 /
sm100 (64-key tiles at D 64; sm89 / sm120 spill registers there, so they keep one buffer). The 16-row D 192 / 256 tile's
splits aim at 2 per SM too (half the splits of the 4-per-SM rule): 1.005-1.023x on every D 256 decode row measured
(1x32768 to 32x4096, groups 2 and 4; an H100, h200.md, "Session 71"; D 192 not measured).
Against one buffer: D 128 decode and verify at 16 rows 0-4 % faster in one process (level across processes), gpt-oss's
full-layer verify 10 % (h200.md, "Session 42"); 32-128 rows (Llama-3-70B's group of 8 at S = 4 / 8 / 16) 1.12-1.39x,
float8 1.03-1.24x (h200.md, "Session 43"; the earlier sessions' stage counts, 3 or 4, bought no second buffer while
the K / V addresses hung on a page-id load of the same iteration). D 192 / 256 above 16 rows keep one buffer (not
measured with two). Extend: 128 x 128 tiles for D <= 128; above, 128 x 64 with 8 warps on sm90 / sm100 (197 KB of
shared memory at D 256), 64 x 32 with 4 warps elsewhere.

The tiles follow the wider of the two head dims, max(D, Dv) (D for plain GQA). Above 256 (MLA's absorbed D = 576 /
Dv = 512, whose accumulator alone is 512 fp32 columns a row) decode/verify take V's tile from K's (v_from_k: one
load instead of two, where v_cache is k_cache's first Dv columns and K's first column block is exactly Dv wide,
`v_from_k_fits`: MLA's 576 / 512 view; faster on every MLA row), and 64 query rows with 8 warps and 64-key tiles
where a KV head has at least 64 rows (H >= 64 decode, H = 16 verify S >= 4), else 16 rows with 4 warps and 32-key
tiles. A 64-row program (a 64 x 512 fp32 accumulator, 221 KB of shared memory) is one per SM, so its splits aim at 1
program per SM, and only sm90 / sm100 (227 KB a block) take it: sm80, sm89 and sm120 keep 16 rows (56 KB). The
16-row tile's splits aim at 2 programs per SM: each split also writes a 16 x 512 partial. On sm90 / sm100 it
takes two K buffers (3 stages, 93 KB: two still fit an SM) where V comes from K's tile and the cache is bf16 / fp16:
11-14 % faster on MLA's H 16 decode rows at pages of one key, the Triton plan's pages on the H200 (h200.md, "Session
42"); the other GPUs fit one such program an SM. MLA splits stay at most 64 (MLA_MAX_SPLITS). Where v_cache is a
separate tensor, V is loaded on its own and the wide tile takes 32 keys (213 KB). Measured with `python -m
b12x_inductor.bench mla --variants ...` (h200.md, "MLA"). Extend takes 32 x 16 with 8 warps and loads V itself
(neither measured yet).
"""

from __future__ import annotations

from b12x_inductor.plan import FP8, Plan, Problem, next_pow2, prev_pow2, split_count, split_scratch_bytes, with_tiles

SPLIT_RULE = dict(programs_per_sm=4, min_split_keys=256, max_splits=128)
MLA_WIDE_ROWS = 64  # MLA decode/verify: query rows of the wide tile (one program per SM)
MLA_PROGRAMS_PER_SM = 2  # MLA's 16-row tile: each split also writes 16 x 512 partials
MLA_WIDE_PROGRAMS_PER_SM = 1
MLA_WIDE_MAJORS = (9, 10)  # its 221 KB of shared memory (bf16, sm90) fit the 227 KB a block has on sm90/sm100
WIDE_EXTEND_MAJORS = (9, 10)  # extend above D 128 (Gemma's 256): the 128 x 64 tile needs sm90 / sm100's 227 KB
FP8_WIDE_MAJORS = (9, 10)  # float8 tiles above 32 rows take two buffers here (elsewhere they spill registers)
ONE_WAVE_MAJORS = (9, 10)  # one_wave_tile's occupancies (programs an SM by tile) hold on sm90 / sm100
# programs of the 16-row D 128 decode tile an sm90 SM holds, by the (block_n, num_stages, split) one_wave_tile
# weighs: the fewer of what its registers (64-96 a thread at every group, Triton 3.6) and its shared memory allow,
# at the group of 8 (94-96 registers on two 32-key buffers: 5; six at the other groups, by shared memory, where one
# buffer still ran faster at 704 and 768 programs; h200.md, "Session 50")
ONE_WAVE_PROGRAMS_PER_SM = {(64, 3, False): 3, (32, 3, False): 5, (32, 3, True): 5, (32, 2, True): 8,
                            (32, 2, False): 7}
MLA_MAX_SPLITS = 64  # MLA decode/verify: 128 splits make two waves of one-per-SM programs at H128 1x32768


def num_splits(problem: Problem, programs: int, programs_per_sm: int = SPLIT_RULE["programs_per_sm"],
               max_splits: int = SPLIT_RULE["max_splits"]) -> int:
    """Split-KV partitions for `programs` programs per split (the CuTe family uses the same rule, with the
    constants it was measured with: kernels/cute/plan.py, CUTE_SPLITS)."""
    return split_count(problem, programs, **{**SPLIT_RULE, "programs_per_sm": programs_per_sm,
                                             "max_splits": max_splits})


def v_from_k_fits(problem: Problem) -> bool:
    """Whether the kernels can take V's tile from K's: v_cache is k_cache's first Dv columns (Problem.v_in_k)
    and K's first column block is those Dv columns exactly (v_is_first_block)."""
    from . import v_is_first_block

    return problem.v_in_k and v_is_first_block(problem.head_dim, problem.v_head_dim)


def plan(problem: Problem, **tiles) -> Plan:
    """The family's plan; `tiles` replace its tile choices (plan.family_plan). v_from_k=True where the
    problem does not fit it (v_from_k_fits) raises: V would be read from the wrong columns."""
    if tiles.get("v_from_k") and not v_from_k_fits(problem):
        raise ValueError(f"paged_attention: v_from_k needs v_cache to be k_cache's first Dv columns, Dv the "
                         f"width of K's first column block (MLA's 576 / 512 view); got {problem}")
    return with_tiles(problem, _plan(problem), tiles)


def _plan(problem: Problem) -> Plan:
    mode, d = problem.mode, max(problem.head_dim, problem.v_head_dim)
    fp8 = problem.kv_dtype == FP8
    if d > 256:  # MLA's latent head dims
        if mode == "extend":
            return Plan(mode=mode, family="triton", num_splits=1, block_m=32, block_n=16, num_warps=8,
                        num_stages=2, scratch_bytes=0)
        rows = problem.q_len * problem.group
        vk = v_from_k_fits(problem)
        wide = rows >= MLA_WIDE_ROWS and problem.capability[0] in MLA_WIDE_MAJORS
        block_m = MLA_WIDE_ROWS if wide else 16
        m_tiles = -(-rows // block_m)
        splits = num_splits(problem, problem.batch * problem.num_kv_heads * m_tiles,
                            MLA_WIDE_PROGRAMS_PER_SM if wide else MLA_PROGRAMS_PER_SM, MLA_MAX_SPLITS)
        # the 16-row bf16 / fp16 tile on sm90 / sm100: two K buffers (93 KB, still 2 programs an SM)
        stages = 3 if not wide and vk and not fp8 and problem.capability[0] in MLA_WIDE_MAJORS else 2
        return Plan(mode=mode, family="triton", num_splits=splits, block_m=block_m,
                    block_n=64 if wide and vk else 32, num_warps=8 if wide else 4, num_stages=stages,
                    scratch_bytes=split_scratch_bytes(problem, splits), v_from_k=vk)
    if mode == "extend":
        if d <= 128:
            return Plan(mode=mode, family="triton", num_splits=1, block_m=128, block_n=128, num_warps=8,
                        num_stages=3, scratch_bytes=0)
        if problem.capability[0] in WIDE_EXTEND_MAJORS:  # 128 x 64, 8 warps: 197 KB of shared memory
            return Plan(mode=mode, family="triton", num_splits=1, block_m=128, block_n=64, num_warps=8,
                        num_stages=2, scratch_bytes=0)
        return Plan(mode=mode, family="triton", num_splits=1, block_m=64, block_n=32, num_warps=4, num_stages=2,
                    scratch_bytes=0)
    rows = problem.q_len * problem.group  # query rows packed per KV head
    block_m = min(max(16, next_pow2(rows)), 64 if d > 128 else 128)
    m_tiles = -(-rows // block_m)
    block_n = (128 if fp8 else 64) if d <= 128 else (64 if fp8 else 32)
    stages = 2  # one K / V buffer: a tile's copies start once the previous tile's products have read it
    # two buffers (3 stages): the next tile's copies run under this tile's products
    if fp8:  # above 32 rows only at D <= 128 on sm90 / sm100 (measured on sm90; sm89 / sm120 spill there)
        if block_m <= 32 or (d <= 128 and problem.capability[0] in FP8_WIDE_MAJORS):
            stages = 3
            if d <= 64 and block_m >= 64:
                block_n = 64
    elif d <= 64:  # gpt-oss: every row count
        stages = 3
    elif d <= 128:  # GQA at D 128: 32-key tiles at 16 and 128 rows a KV head, 64-key ones at 32 and 64
        block_n, stages = (64 if block_m in (32, 64) else 32), 3
    elif block_m == 16:  # D 192 / 256 (Gemma's 256) up to 16 rows
        block_n, stages = 16, 3
    programs = problem.batch * problem.num_kv_heads * m_tiles
    one_wave = one_wave_tile(problem, programs, block_m, stages)
    if one_wave:  # the 16-row D 128 tile on sm90 / sm100: splits and keys for one wave
        splits, block_n, stages = one_wave
        return Plan(mode=mode, family="triton", num_splits=splits, block_m=block_m, block_n=block_n, num_warps=4,
                    num_stages=stages, scratch_bytes=split_scratch_bytes(problem, splits))
    # two-buffer tiles of which an sm90 SM holds at most two programs (registers or shared memory): their splits
    # aim at two an SM, so that the programs make one wave where they can; so does the 16-row D 192 / 256 tile,
    # whose splits each write partials twice D 128's width (fewer splits, less to write and merge)
    two_per_sm = stages == 3 and (fp8 or (64 < d <= 128 and block_m >= 32) or d > 128)
    splits = num_splits(problem, programs, 2 if two_per_sm else SPLIT_RULE["programs_per_sm"])
    return Plan(mode=mode, family="triton", num_splits=splits, block_m=block_m, block_n=block_n,
                num_warps=4 if block_m <= 32 else 8, num_stages=stages,
                scratch_bytes=split_scratch_bytes(problem, splits))


def one_wave_tile(problem: Problem, programs: int, block_m: int, stages: int) -> tuple[int, int, int] | None:
    """(splits, block_n, num_stages) of the 16-row bf16 / fp16 D 128 tile on sm90 / sm100, chosen for one wave of
    programs (None for every other tile: the split rule's). An SM holds ONE_WAVE_PROGRAMS_PER_SM of its programs; a
    second, part wave of a few programs an SM reads its bytes at a fraction of the bandwidth (decode 24x4096 at 4
    splits 1.4x and 52x4096 at 2 splits 1.3x slower than in one wave; h200.md, "Session 45"). By B x Hkv
    (`programs`), on 132 SMs:
    - below the two-an-SM target (256): 32-key tiles, two buffers, the split rule's count halved until five
      programs an SM hold them all;
    - 256 to 396 (three an SM): unsplit on 64-key tiles with two buffers, no merge;
    - 397 to 511: the split rule's count (2) on one buffer (2 stages), halved until eight an SM hold them;
    - 512 to 660 (five an SM): unsplit on two buffers;
    - 661 to 924 (seven an SM): unsplit on one buffer, the tile that makes one wave there;
    - from 925, more than one wave whichever tile: unsplit on 64-key tiles with one buffer, half the 32-key
      tiles' iterations a program.
    Below 925, one buffer only where it makes one wave: unsplit on two buffers ran 1.04-1.08x faster than on one
    at 544-640 programs (H200; h200.md, "Session 50"). From 925, 64 keys on one buffer ran 1.04-1.06x faster than
    the best of 2 splits on one or two 32-key buffers and unsplit on two, which fill their last wave alike, at
    960, 1024, 1280, 1536 and 2048 programs on the H100 (group 4; h200.md, "Session 66"). On the H200, which has
    not run the 64-key one-buffer tile, 2 splits had run 1.03-1.05x faster than unsplit on two 32-key buffers at
    1088-1280 programs (h200.md, "Session 51"), where the H100 ran them 0.96x.
    Verify rows (S > 1) take the same tiles; their kernels' registers vary more with the group (64-113 on the
    32-key tiles; benchmarks/results/sm90_kernel_resources_triton36_s49.md)."""
    if not (block_m == 16 and stages == 3 and problem.kv_dtype != FP8
            and 64 < max(problem.head_dim, problem.v_head_dim) <= 128 and problem.capability[0] in ONE_WAVE_MAJORS):
        return None
    sms = max(problem.sm_count, 1)
    two_per_sm = prev_pow2(2 * sms)  # the split rule's two-an-SM target

    def cap(block_n: int, num_stages: int, splits: int) -> int:  # programs of this tile one wave holds
        return ONE_WAVE_PROGRAMS_PER_SM[(block_n, num_stages, splits > 1)] * sms

    if two_per_sm <= programs <= cap(64, 3, 1):
        return 1, 64, 3
    splits = num_splits(problem, programs)
    if splits > 1:  # below the split rule's four-an-SM target
        num_stages = 3 if programs < two_per_sm else 2
        while splits > 1 and programs * splits > cap(32, num_stages, splits):
            splits //= 2
        return splits, 32, num_stages if splits > 1 else 3
    if programs <= cap(32, 3, 1):
        return 1, 32, 3
    if programs <= cap(32, 2, 1):
        return 1, 32, 2
    return 1, 64, 2
