"""Decode and verify: split-KV attention with GQA packing, then a merge of the splits.

Stage 1 (`split_kernel`), grid (B * Hkv * M-tiles, num_splits): one program takes request b, KV head h and
one partition of the visible key range. Its BLOCK_M query rows are the S new tokens x G = Hq / Hkv query
heads of that KV head (row r: token r // G, head h * G + r % G), so each KV tile is read once for all of
them and both products go through `tl.dot`. The partition is sized on the device from the live length,
so the same compiled kernel serves every length. With num_splits == 1 it writes out and lse directly;
otherwise it writes each split's normalized partial output (in out's dtype) and log2-sum-exp (fp32) into the
scratch and stage 2 (`merge_kernel`, grid (B * S * Hq, DV column blocks): `merge_launch`) combines them with the
sink.

Key j of request b lives at page page_table[b, j // PAGE] offset j % PAGE; the page id is widened to 64 bits
before it is multiplied by the cache's page stride. The split kernel reads each tile's page ids one iteration
ahead, so its K / V copies hang on no load of their own iteration and num_stages - 1 buffers of them stay in
flight (kernels/triton/plan.py says which tiles take two). NHD and HND differ only in the strides passed.

q and k have head dim D (BLOCK_D columns, plus BLOCK_DPE from column BLOCK_D on for D = 576: q's first BLOCK_D
columns at Q, the rest at QPE, which is q_pe or Q + BLOCK_D), v, out and the partials the value head dim DV
(BLOCK_DV columns): DV differs from D for MLA (192 / 128, 576 / 512).

The math both kernels share (one tile of the online softmax, the clamped key range, the epilogue) is in
common.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from b12x_inductor.plan import next_pow2

from .common import LN2, NEG_BIG, RUNTIME_ARGS, finish, live_range, present, q_rows, sink_logit, tile, tile_ids


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def split_kernel(
    Q, QPE, K, V, PT, SEQLENS, KV_START, SINKS, KDS, VDS, KM, OUT, LSE, PART_O, PART_L,
    stride_qb, stride_qs, stride_qh, stride_peb, stride_pes, stride_peh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_ptb,
    kds_b, kds_h, vds_b, vds_h, km_b, km_s, km_j,
    has_kv_start, has_sinks, has_kds, has_vds,
    window_left, sm_scale, softcap, max_pages, num_pages,
    S: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, M_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, BLOCK_DPE: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mt = pid % M_TILES
    bh = pid // M_TILES
    h = bh % HKV
    b = bh // HKV
    HQ: tl.constexpr = HKV * G

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S * G
    # Decode: every row is token 0, and a row past the group (masked) takes the group's last head. No division by
    # G there: with it, the 32-key tiles took 108-113 registers at every group but 8 (G 4 on two buffers, the
    # other groups on either) instead of 64-70 (benchmarks/results/sm90_kernel_resources_triton36_s49.md), fewer
    # programs an SM than one_wave_tile's occupancies assume.
    if S == 1:
        tok = tl.zeros([BLOCK_M], tl.int32)
        hq = h * G + tl.minimum(rows, G - 1)
    else:
        tok = rows // G
        hq = h * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV

    q_ptr = Q + b.to(tl.int64) * stride_qb + tok.to(tl.int64) * stride_qs + hq.to(tl.int64) * stride_qh
    pe_ptr = QPE + b.to(tl.int64) * stride_peb + tok.to(tl.int64) * stride_pes + hq.to(tl.int64) * stride_peh
    q, q_pe, offs_pe, pe_ok = q_rows(q_ptr, pe_ptr, row_ok, offs_d, d_ok, D, BLOCK_D, BLOCK_DPE, DOT)

    length, start = live_range(SEQLENS, KV_START, has_kv_start, b, max_pages, PAGE)
    limit = length - S + tok  # causal limit of each row
    lo = start
    if USE_WINDOW:
        lo = tl.maximum(lo, length - S + mt * BLOCK_M // G - window_left)
    first = lo  # no row of this program sees a key before it (a slot there may hold anything)
    hi = length
    if CAUSAL:
        hi = tl.minimum(hi, length - S + tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, S - 1) + 1)
    # Whole pages per tile (one page id read per page): the range start rounded down to the alignment makes
    # every split start at a page or tile boundary; the tiles neither load nor see the keys before `first` that
    # this brings in. Not for float8 caches (their 128-key tiles ran 7-14 % slower so) nor pages of one key
    # (nothing to share; MLA's H 16 decode ran 5-6 % slower so): h200.md, "Session 40".
    PAGE_ALIGNED: tl.constexpr = (((PAGE % BLOCK_N == 0) or (BLOCK_N % PAGE == 0)) and PAGE > 1
                                  and not K.dtype.element_ty.is_fp8())
    if PAGE_ALIGNED:
        ALIGN: tl.constexpr = min(PAGE, BLOCK_N)
        lo = lo // ALIGN * ALIGN
    span = tl.maximum(hi - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)

    # Absent optional tensors come as valid dummy pointers with zero strides and a zero flag that masks their
    # loads (a dummy may be an output no program has written yet).
    k_scale = sm_scale * tl.load(KDS + b * kds_b + h * kds_h, mask=present(has_kds, h), other=1.0)
    v_scale = tl.load(VDS + b * vds_b + h * vds_h, mask=present(has_vds, h), other=1.0)

    k_head = K + h.to(tl.int64) * stride_kh
    v_head = V + h.to(tl.int64) * stride_vh
    pt_row = PT + b.to(tl.int64) * stride_ptb
    km_rows = KM + b.to(tl.int64) * km_b + tl.minimum(tok, S - 1).to(tl.int64) * km_s  # key-mask row of each row

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # The next tile's page ids are read a tile ahead: the K / V addresses hang on a loop-carried value, not on a
    # load of the same iteration, so Triton's pipeliner takes their loads for direct and buffers them.
    ids = tile_ids(pt_row, s_lo, s_hi, num_pages, BLOCK_N, PAGE, PAGE_ALIGNED)
    for j0 in range(s_lo, s_hi, BLOCK_N):
        ids_next = tile_ids(pt_row, j0 + BLOCK_N, s_hi, num_pages, BLOCK_N, PAGE, PAGE_ALIGNED)
        acc, m_i, l_i = tile(acc, m_i, l_i, q, q_pe, j0, s_hi, first, limit, k_head, v_head, pt_row, num_pages,
                              stride_kp, stride_ko, stride_vp, stride_vo, offs_d, d_ok, offs_pe, pe_ok, offs_dv, dv_ok,
                              k_scale, softcap, window_left, km_rows, km_j,
                              BLOCK_N, PAGE, False, False, True, CAUSAL, USE_WINDOW, USE_SOFTCAP, DOT, HAS_KEY_MASK,
                              BLOCK_DPE, V_FROM_K, PAGE_ALIGNED, ids)
        ids = ids_next

    seen = l_i > 0.0
    safe_l = tl.where(seen, l_i, 1.0)
    out_row = (b * S + tok).to(tl.int64) * HQ + hq
    if NUM_SPLITS == 1:
        o, lse = finish(acc, m_i, l_i, sink_logit(SINKS, hq, has_sinks), v_scale)  # hq < Hq on every row
        tl.store(OUT + out_row[:, None] * DV + offs_dv[None, :], o.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(LSE + out_row, lse, mask=row_ok)
    else:
        part = out_row * NUM_SPLITS + split
        o = tl.where(seen[:, None], acc * (v_scale / safe_l)[:, None], 0.0)
        tl.store(PART_O + part[:, None] * DV + offs_dv[None, :], o.to(PART_O.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(PART_L + part, tl.where(seen, m_i + tl.log2(safe_l), float("-inf")), mask=row_ok)


MERGE_MIN_PROGRAMS = 1024  # about 8 merge programs an SM: fewer rows take their columns in narrower blocks
MERGE_MIN_BLOCK = 64
# splits whose loads a merge program issues before it adds any of them: the loop over the splits is unrolled by
# min(splits, MERGE_UNROLL) in Triton (tl.range's loop_unroll_factor), not left to ptxas, which unrolled it fully
# at 64 splits of 64 columns but not at 128 splits, nor at 64 of 128 columns, where each split then waited out
# its own loads (h200.md, "Session 53"); 64 splits' loads fit in 64 registers
MERGE_UNROLL = 64
# From MERGE_TILE_SPLITS splits on (the plans' 128: few rows, one long request), a program loads all splits of
# MERGE_TILE_ELEMS // splits columns at once (TILE) in MERGE_TILE_WARPS warps: faster than the loop there at
# every row count measured, slower at 64 splits and fewer (h200.md, "Session 54")
MERGE_TILE_SPLITS = 128
MERGE_TILE_ELEMS = 4096
MERGE_TILE_WARPS = 2


def merge_launch(rows: int, hq: int, dv: int, splits: int) -> tuple[tuple[int, int], dict]:
    """(grid, compile-time arguments and launch options) of the merge kernel, one place for both families'
    launches. `rows` is B * S * Hq; the splits' partials are [row, split, DV] in out's dtype and LSEs [row, split]
    fp32 (split_partials); the merge adds them in fp32.

    Below MERGE_TILE_SPLITS splits, a program merges one row's splits over BLOCK_DV of its DV columns, one split
    at a time (a BLOCK_DV vector of partials in registers, whatever the split count). BLOCK_DV is the whole row
    where there are rows enough for MERGE_MIN_PROGRAMS programs, else it halves until there are (down to
    MERGE_MIN_BLOCK columns), so one long request's few rows still spread over many SMs; a warp takes 128
    columns (4 a thread). The loop over the splits is unrolled UNROLL = min(splits, MERGE_UNROLL) times, so that
    many splits' loads are in flight. From MERGE_TILE_SPLITS on (TILE), a program loads the [splits, BLOCK_DV]
    tile of all splits at once, BLOCK_DV = MERGE_TILE_ELEMS // splits (at least 16) columns."""
    splits_p2 = next_pow2(splits)
    tile = splits >= MERGE_TILE_SPLITS
    if tile:
        block_dv = min(next_pow2(dv), max(16, MERGE_TILE_ELEMS // splits_p2))
        unroll, warps, stages = 1, MERGE_TILE_WARPS, 1
    else:
        block_dv = next_pow2(dv)
        while block_dv > MERGE_MIN_BLOCK and rows * -(-dv // block_dv) < MERGE_MIN_PROGRAMS:
            block_dv //= 2
        unroll, warps, stages = min(splits, MERGE_UNROLL), max(1, min(4, block_dv // 128)), 2
    return (rows, -(-dv // block_dv)), dict(HQ=hq, DV=dv, BLOCK_DV=block_dv, NUM_SPLITS=splits, SPLITS_P2=splits_p2,
                                            UNROLL=unroll, TILE=tile, num_warps=warps, num_stages=stages)


@triton.jit(do_not_specialize=["SINKS", "has_sinks"])
def merge_kernel(
    PART_O, PART_L, SINKS, OUT, LSE, has_sinks,
    HQ: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
    UNROLL: tl.constexpr, TILE: tl.constexpr,
):
    """out[row] = the splits' partials weighted by exp2(lse_s - m) over their sum plus the sink's exp2(sink - m)
    (m: the largest of the LSEs and the sink), lse[row] its log (natural). A row no split saw (every LSE -inf):
    zeros and -inf. Without TILE the partials are added one split at a time (no reduction crosses threads); with
    TILE the program loads all splits' BLOCK_DV columns as one [SPLITS_P2, BLOCK_DV] tile and sums it."""
    row = tl.program_id(0).to(tl.int64)  # (b * S + token) * Hq + head
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < DV
    lse_row = PART_L + row * NUM_SPLITS
    lse_s = tl.load(lse_row + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    seen = m > float("-inf")
    sink = sink_logit(SINKS, row % HQ, has_sinks)
    m = tl.maximum(tl.where(seen, m, 0.0), sink)
    denom = tl.exp2(sink - m)
    if TILE:
        w = tl.exp2(lse_s - m)  # 0 for a split that saw no key (its partial is zeros) and past NUM_SPLITS
        denom += tl.sum(w, 0)
        part = tl.load(PART_O + (row * NUM_SPLITS + offs_s)[:, None] * DV + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(part * w[:, None], 0)
    else:
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for s in tl.range(0, NUM_SPLITS, loop_unroll_factor=UNROLL):
            w = tl.exp2(tl.load(lse_row + s) - m)  # 0 for a split that saw no key (its partial is zeros)
            denom += w
            acc += w * tl.load(PART_O + (row * NUM_SPLITS + s) * DV + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    denom = tl.where(seen, denom, 1.0)
    tl.store(OUT + row * DV + offs_d, tl.where(seen, acc / denom, 0.0).to(OUT.dtype.element_ty), mask=d_ok)
    if tl.program_id(1) == 0:
        tl.store(LSE + row, tl.where(seen, (m + tl.log2(denom)) * LN2, float("-inf")))
