"""Extend (prefill and chunked prefill): FlashAttention-2-style tiles over the paged cache.

Grid (Hq, tiles): program (hq, t) takes BLOCK_M consecutive new tokens of one request and one query head
and walks the visible keys in BLOCK_N tiles with an online softmax. The key range of a tile splits into a
masked head (kv_start, window), an unmasked middle (every key visible to every row) and a masked tail (the
causal diagonal), so the middle, which holds most of the work, computes no masks.

4D q [B, S, Hq, D]: tile t is request t % B, row tile cdiv(S, BLOCK_M) - 1 - t // B: the longest (last) row
tiles of every request run first, the shortest last (less of a tail under a causal mask).
Packed q [T, Hq, D]: the grid is fixed by the capacity, cdiv(T, BLOCK_M) + B tiles, and each program maps
its tile to a request on the device from cu_seqlens_q (a prefix sum of the per-request tile counts); the
programs left over write zeros and lse = -inf into the padding rows past cu_seqlens_q[-1].

q and k have head dim D (BLOCK_D columns, plus BLOCK_DPE from column BLOCK_D on for D = 576: q's first BLOCK_D
columns at Q, the rest at QPE, which is q_pe or Q + BLOCK_D), v and out the value head dim DV (BLOCK_DV
columns).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import NEG_BIG, RUNTIME_ARGS, finish, live_range, present, q_rows, sink_logit, tile, tile_ids


@triton.jit(do_not_specialize=["CU"] + RUNTIME_ARGS)
def extend_kernel(
    Q, QPE, K, V, PT, SEQLENS, CU, KV_START, SINKS, KDS, VDS, KM, OUT, LSE,
    stride_qb, stride_qs, stride_qh, stride_peb, stride_pes, stride_peh,
    stride_kp, stride_ko, stride_kh,
    stride_vp, stride_vo, stride_vh,
    stride_ptb,
    kds_b, kds_h, vds_b, vds_h, km_b, km_s, km_j,
    has_kv_start, has_sinks, has_kds, has_vds,
    window_left, sm_scale, softcap, max_pages, num_pages,
    B: tl.constexpr, S: tl.constexpr, B_P2: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PACKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, BLOCK_DPE: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr,
):
    hq = tl.program_id(0)
    t = tl.program_id(1)
    h = hq // G
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV

    if PACKED:
        idx = tl.arange(0, B_P2)
        in_batch = idx < B
        # cu_seqlens_q clamped to [0, T]: request b's rows [c_lo, max(c_lo, c_hi)) stay inside q and out
        c_lo = tl.minimum(tl.maximum(tl.load(CU + idx, mask=in_batch, other=0), 0), S)
        c_hi = tl.minimum(tl.maximum(tl.load(CU + idx + 1, mask=in_batch, other=0), 0), S)
        n_req = tl.maximum(c_hi - c_lo, 0)
        tiles = tl.cdiv(n_req, BLOCK_M)
        cum = tl.cumsum(tiles, 0)  # inclusive
        total = tl.sum(tiles, 0)
        b = tl.minimum(tl.sum((cum <= t).to(tl.int32), 0), B - 1)
        sel = idx == b
        mt = t - tl.sum(tl.where(sel, cum - tiles, 0), 0)
        q0 = tl.sum(tl.where(sel, c_lo, 0), 0)
        n_b = tl.sum(tl.where(sel, n_req, 0), 0)
        is_pad = t >= total
        row0 = q0.to(tl.int64)
        end = tl.minimum(tl.maximum(tl.load(CU + B), 0), S)
    else:
        # longest first across the batch: every request's last row tile (the most keys under a causal mask)
        # before any request's second-to-last, so the last programs to start are the shortest
        tiles_per_req: tl.constexpr = (S + BLOCK_M - 1) // BLOCK_M
        b = t % B
        mt = tiles_per_req - 1 - t // B
        n_b = S
        is_pad: tl.constexpr = False
        total = 0
        row0 = b.to(tl.int64) * S
        end = 0

    if is_pad:
        # Padding rows past cu_seqlens_q[-1] (packed q only): zeros and lse = -inf.
        pad = end + (t - total) * BLOCK_M + offs_m
        pad_ok = pad < S
        pad64 = pad.to(tl.int64) * HQ + hq
        tl.store(OUT + pad64[:, None] * DV + offs_dv[None, :], tl.zeros([BLOCK_M, BLOCK_DV], tl.float32).to(
            OUT.dtype.element_ty), mask=pad_ok[:, None] & dv_ok[None, :])
        tl.store(LSE + pad64, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=pad_ok)
    else:
        rows = mt * BLOCK_M + offs_m
        row_ok = rows < n_b
        if PACKED:
            q_ptr = Q + (row0 + rows) * stride_qs + hq.to(tl.int64) * stride_qh
            pe_ptr = QPE + (row0 + rows) * stride_pes + hq.to(tl.int64) * stride_peh
        else:
            q_ptr = Q + b.to(tl.int64) * stride_qb + rows.to(tl.int64) * stride_qs + hq.to(tl.int64) * stride_qh
            pe_ptr = QPE + b.to(tl.int64) * stride_peb + rows.to(tl.int64) * stride_pes + hq.to(tl.int64) * stride_peh
        q, q_pe, offs_pe, pe_ok = q_rows(q_ptr, pe_ptr, row_ok, offs_d, d_ok, D, BLOCK_D, BLOCK_DPE, DOT)

        length, start = live_range(SEQLENS, KV_START, has_kv_start, b, max_pages, PAGE)
        limit = length - n_b + rows
        c_min = length - n_b + mt * BLOCK_M
        c_max = length - n_b + tl.minimum(mt * BLOCK_M + BLOCK_M, n_b) - 1
        lo = start
        full_lo = start
        if USE_WINDOW:
            lo = tl.maximum(lo, c_min - window_left)
            full_lo = tl.maximum(full_lo, c_max - window_left)
        hi = length
        full_hi = length
        if CAUSAL:
            hi = tl.minimum(hi, c_max + 1)
            full_hi = tl.minimum(full_hi, c_min + 1)
        n_pre = tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N)
        u0 = lo + n_pre * BLOCK_N
        u1 = u0 + tl.maximum(full_hi - u0, 0) // BLOCK_N * BLOCK_N

        k_scale = sm_scale * tl.load(KDS + b * kds_b + h * kds_h, mask=present(has_kds, h), other=1.0)
        v_scale = tl.load(VDS + b * vds_b + h * vds_h, mask=present(has_vds, h), other=1.0)
        k_head = K + h.to(tl.int64) * stride_kh
        v_head = V + h.to(tl.int64) * stride_vh
        pt_row = PT + b.to(tl.int64) * stride_ptb
        km_rows = KM + b.to(tl.int64) * km_b + tl.minimum(rows, S - 1).to(tl.int64) * km_s  # 4-D q only
        EVEN_D: tl.constexpr = BLOCK_D + BLOCK_DPE == D
        EVEN_DV: tl.constexpr = BLOCK_DV == DV

        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for j0 in range(lo, tl.minimum(u0, hi), BLOCK_N):
            acc, m_i, l_i = tile(acc, m_i, l_i, q, q_pe, j0, hi, start, limit, k_head, v_head, pt_row, num_pages,
                                  stride_kp, stride_ko, stride_vp, stride_vo, offs_d, d_ok, offs_pe, pe_ok, offs_dv,
                                  dv_ok, k_scale, softcap, window_left, km_rows, km_j,
                                  BLOCK_N, PAGE, EVEN_D, EVEN_DV, True, CAUSAL, USE_WINDOW, USE_SOFTCAP, DOT,
                                  HAS_KEY_MASK, BLOCK_DPE, V_FROM_K, False,
                                  tile_ids(pt_row, j0, hi, num_pages, BLOCK_N, PAGE, False))
        for j0 in range(u0, u1, BLOCK_N):
            acc, m_i, l_i = tile(acc, m_i, l_i, q, q_pe, j0, hi, start, limit, k_head, v_head, pt_row, num_pages,
                                  stride_kp, stride_ko, stride_vp, stride_vo, offs_d, d_ok, offs_pe, pe_ok, offs_dv,
                                  dv_ok, k_scale, softcap, window_left, km_rows, km_j,
                                  BLOCK_N, PAGE, EVEN_D, EVEN_DV, False, CAUSAL, USE_WINDOW, USE_SOFTCAP, DOT,
                                  HAS_KEY_MASK, BLOCK_DPE, V_FROM_K, False, 0)
        for j0 in range(tl.maximum(u1, lo), hi, BLOCK_N):
            acc, m_i, l_i = tile(acc, m_i, l_i, q, q_pe, j0, hi, start, limit, k_head, v_head, pt_row, num_pages,
                                  stride_kp, stride_ko, stride_vp, stride_vo, offs_d, d_ok, offs_pe, pe_ok, offs_dv,
                                  dv_ok, k_scale, softcap, window_left, km_rows, km_j,
                                  BLOCK_N, PAGE, EVEN_D, EVEN_DV, True, CAUSAL, USE_WINDOW, USE_SOFTCAP, DOT,
                                  HAS_KEY_MASK, BLOCK_DPE, V_FROM_K, False,
                                  tile_ids(pt_row, j0, hi, num_pages, BLOCK_N, PAGE, False))

        o, lse = finish(acc, m_i, l_i, sink_logit(SINKS, hq, has_sinks), v_scale)
        out_row = (row0 + rows) * HQ + hq
        tl.store(OUT + out_row[:, None] * DV + offs_dv[None, :], o.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(LSE + out_row, lse, mask=row_ok)
