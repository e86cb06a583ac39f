"""Decode and verify in CuTe DSL on the tensor cores (mma.sync m16n8k16), same contract as decode.py.

Persistent: at most two CTAs an SM (`ctas`, the split rule's target), CTA c taking the work items c, c + ctas,
... in turn, an item being decode.py's CTA (one split of one KV head of one request). The ring runs on across a
CTA's items: its loads stay NS - 1 tiles ahead of the products, so the next item's first tiles (items without
keys skipped) are loaded under the current item's last, and an item's start (its length, page ids and first
tiles) is not on the products' path, as it is for a CTA that takes one item (at 512 and 1024 such CTAs float8
decode had run 6 and 10 % slower than at 256 on the same bytes; h200.md, "Session 66"). Its query elements are
read one item ahead too, into registers, and become A fragments at its start (`_read_q`). The warps' partial
outputs of the live rows are merged beside the ring (storage.mma_storage).

The query rows of one KV head (at most 16: S x G) fill one m16 tile; each of the CTA's warps takes its own
16 or 32 keys of every tile and keeps its own online softmax, so warps meet only at the one barrier that
hands over a stage (decode.py's loaders, TMA or cp.async, and swizzled ring) and at each item's end, where the
warps' partial results are merged in shared memory. Per warp and tile: S = Q K^T (KW/8 n-tiles x D/16 k-steps),
masks and softmax on the accumulator fragments, O += P V (D/8 n-tiles x KW/16 k-steps). The products of a float8
(or fp16) cache run in fp16, of a bf16 cache in bf16, always accumulating in fp32.

A float8 tile is read in 16-byte (or 8-byte) pieces and widened in registers, the head dim permuted so that
each thread's bytes of a row are contiguous; a permutation of the reduced dim (K's and Q's alike) leaves
S = Q K^T unchanged, one of the output columns (V's and O's alike) is undone where O is stored:
- S: thread (g, t) reads D / 4 bytes of key row n, physical columns (D/4) t + 4 ks + 2 h + e for k-step ks,
  register h and element e: one cvt per half-word, no byte moves. Q's A registers take the same columns.
- O += P V: thread (g, t) reads D / 8 bytes (value columns (D/8) g + nt for n-tile nt) of each of its key rows
  2t + 8h and + 1 of a k-step, pairs the two rows byte by byte (prmt) and widens the pairs. Output column j of
  n-tile nt is value column (D/8) j + nt (`_merge_warps`).
A piece never crosses a 16-byte chunk, so the ring's swizzle (chunk c of key r at c ^ (r & swizzle)) moves
whole pieces: K's chunk (D/64) t + i of row gq (mod 8 with the key base), V's piece g of rows 2t + 8h (+ 1).

Fragment layouts (PTX ISA, mma.m16n8k16, g = lane // 4, t = lane % 4): A registers (row g, cols 2t..2t+1),
(row g+8, same), (row g, cols 2t+8..), (row g+8, cols 2t+8..); B registers (k 2t..2t+1, n g), (k 2t+8.., n g);
C (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1). The accumulators of two S n-tiles are the A registers of
P for the P V step.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint16, Uint32, const_expr

from b12x_inductor.kernels.cute import mma_geometry
from b12x_inductor.kernels.cute.common import NEG_BIG, PageRow, logit, ring_slot, scales, visible_range
from b12x_inductor.kernels.cute.decode import SplitKernel
from b12x_inductor.kernels.cute.softmax import RESCALE_LOG2
from b12x_inductor.kernels.cute.softmax import moved as _moved
from b12x_inductor.kernels.cute.ptx import e4m3x4_to_f16x4 as _e4m3x4_to_f16x4
from b12x_inductor.kernels.cute.ptx import mma_m16n8k16 as _mma
from b12x_inductor.kernels.cute.ptx import pack2 as _pack2
from b12x_inductor.kernels.cute.ptx import prmt as _prmt
from b12x_inductor.kernels.cute.plan import MMA_SPLITS


class MmaSplitKernel(SplitKernel):
    """The tensor-core split kernel for one set of compile-time constants."""

    GEOMETRY = staticmethod(mma_geometry)

    def __init__(self, **constants):
        super().__init__(**constants)
        self.fp8 = self.kv_dtype.width == 8
        assert self.sm_count > 0, "the persistent tensor-core kernel sizes its grid by the SM count"
        self.ctas = MMA_SPLITS["programs_per_sm"] * self.sm_count  # persistent CTAs, the split rule's two an SM
        self.bf16_ops = (not self.fp8) and self.q_dtype is cutlass.BFloat16

    @cute.kernel
    def kernel(
        self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, kds_ptr: cute.Pointer, vds_ptr: cute.Pointer,
        part_o_ptr: cute.Pointer, part_l_ptr: cute.Pointer, sinks_ptr: cute.Pointer, batch: Int32,
        q_sb: Int64, q_ss: Int64, q_sh: Int64, k_sp: Int64, k_so: Int64, k_sh: Int64,
        v_sp: Int64, v_so: Int64, v_sh: Int64, pt_sb: Int64,
        kds_b: Int32, kds_h: Int32, vds_b: Int32, vds_h: Int32,
        has_kv_start: Int32, has_kds: Int32, has_vds: Int32, has_sinks: Int32,
        window_left: Int32, sm_scale: Float32, softcap: Float32, cap: Int32, num_pages: Int32, tma_k, m_k, tma_v,
        m_v,
    ):
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)  # kernels/cute/storage.py: mma_storage
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        gq = lane // 4  # fragment row group
        tq = lane % 4  # fragment column pair
        TILE_N = const_expr(self.tile_n)
        WARPS = const_expr(self.warps)
        D = const_expr(self.d)
        S = const_expr(self.s)
        G = const_expr(self.g)
        R = const_expr(self.rows)
        VEC = const_expr(self.vec)
        NS = const_expr(self.stages)
        KSTEPS = const_expr(D // 16)
        NTILES = const_expr(D // 8)
        KW = const_expr(self.keys_per_warp)  # keys of each tile per warp: KW / 8 S n-tiles, KW / 16 P V k-steps
        BF = const_expr(self.bf16_ops)

        # ---- shared memory: the K/V ring, the warps' partial outputs and row stats (storage.mma_storage) ----
        ring_raw, sK, sV, tiles = self._ring(storage, tidx, tma_k, m_k, tma_v, m_v)
        if const_expr(self.fp8):  # 32-bit words: K's 16-byte chunks, V's pieces of D / 8 bytes (the docstring)
            words = cute.recast_ptr(ring_raw, dtype=Uint32)
            wk = cute.make_tensor(words, cute.make_layout((NS, TILE_N, D // 16, 4),
                                                          stride=(TILE_N * D // 4, D // 4, 4, 1)))
            wv = cute.make_tensor(words + NS * TILE_N * D // 4,
                                  cute.make_layout((NS, TILE_N, 8, D // 32), stride=(TILE_N * D // 4, D // 4,
                                                                                     D // 32, 1)))
        else:
            k32 = cute.make_tensor(cute.recast_ptr(ring_raw, dtype=Uint32), cute.make_layout((1 << 24,)))
            v16 = cute.make_tensor(cute.recast_ptr(ring_raw, dtype=Uint16), cute.make_layout((1 << 24,)))
        sM = storage.row_max.get_tensor(cute.make_layout((WARPS, 16), stride=(16, 1)))
        sL = storage.row_sum.get_tensor(cute.make_layout((WARPS, 16), stride=(16, 1)))

        items = batch * (self.hkv * self.num_splits)  # work items k, each a (split, KV head, request): `_item`
        src = (pt_ptr, pt_sb, num_pages, k_ptr, v_ptr, k_sh, v_sh, k_sp, k_so, v_sp, v_so, sK, sV, tiles, tidx)
        rng = (seqlens_ptr, kv_start_ptr, has_kv_start, window_left, cap)

        # ---- the loads run NS - 1 ring tiles ahead of the products, across this CTA's items: the next tile to
        # load is tile pt of item pk, whose range [ps_lo, ps_hi) has pn tiles (items without keys skipped: pk >=
        # items once none is left), its page ids `ppages` read a tile ahead (`_tile_pages`) ----
        pk, ps_lo, ps_hi, pn = self._loaded_item(cta, items, rng)
        pt = Int32(0)
        ppages = self._item_pages(src, pk, ps_lo, ps_hi)
        for st in cutlass.range_constexpr(NS - 1):
            if pk < items:
                self._load(src, pk, ps_lo + pt * TILE_N, ps_hi, Int32(st), ppages)
                pk, pt, ps_lo, ps_hi, pn = self._advance(pk, pt, ps_lo, ps_hi, pn, items, rng)
                ppages = self._item_pages(src, pk, ps_lo + pt * TILE_N, ps_hi)
            self._commit()

        # ---- q rows: each item's elements read one item ahead (`_read_q`), so their loads are not on the
        # products' path; at an item's start they become its A fragments (registers), zero past the R live rows
        q_src = (q_ptr, q_sb, q_ss, q_sh)
        q_raw = cute.make_rmem_tensor((KSTEPS, 4, 2), self.q_dtype)
        self._read_q(q_src, cta, q_raw, gq, tq)
        used = Int32(0)  # ring tiles consumed: tile it of the current item is ring tile used
        for k in cutlass.range(cta, items, self.ctas, unroll=1):
            split, h, b = self._item(k)
            length, start, s_lo, s_hi, n_tiles = self._split_range(seqlens_ptr, kv_start_ptr, has_kv_start,
                                                                   window_left, split, b, cap)
            k_scale, v_scale = scales(kds_ptr, vds_ptr, has_kds, has_vds, kds_b, kds_h, vds_b, vds_h, sm_scale, b, h)
            qa = cute.make_rmem_tensor((KSTEPS, 4), Uint32)
            for ks in cutlass.range_constexpr(KSTEPS):
                for reg in cutlass.range_constexpr(4):
                    qa[ks, reg] = _pack2(Float32(q_raw[ks, reg, 0]), Float32(q_raw[ks, reg, 1]), bf16=BF)
            if k + self.ctas < items:
                self._read_q(q_src, k + self.ctas, q_raw, gq, tq)

            acc = cute.make_rmem_tensor((NTILES, 4), Float32)
            for nt in cutlass.range_constexpr(NTILES):
                for c in cutlass.range_constexpr(4):
                    acc[nt, c] = Float32(0.0)
            m_run = cute.make_rmem_tensor((2,), Float32)
            l_run = cute.make_rmem_tensor((2,), Float32)
            for i in cutlass.range_constexpr(2):
                m_run[i] = Float32(NEG_BIG)
                l_run[i] = Float32(0.0)
            # the keys rows gq and gq + 8 see, from their causal limits
            lo0, hi0 = visible_range(s_hi, start, length - S + cutlass.min(gq, R - 1) // G, window_left,
                                     self.causal, self.use_window)
            lo1, hi1 = visible_range(s_hi, start, length - S + cutlass.min(gq + 8, R - 1) // G, window_left,
                                     self.causal, self.use_window)
            # keys every row sees, [full_lo, full_hi): a tile inside needs no mask (the first row's causal limit,
            # the last row's window edge)
            full_lo = start
            if const_expr(self.use_window):
                full_lo = cutlass.max(start, length - 1 - window_left)
            full_hi = s_hi
            if const_expr(self.causal):
                full_hi = cutlass.min(s_hi, length - S + 1)

            for it in cutlass.range(n_tiles, unroll=1):
                stage = ring_slot(used, NS)[0]
                self._wait(used, tiles)
                if pk < items:  # ring tile used + NS - 1, into the stage ring tile used - 1 left
                    self._load(src, pk, ps_lo + pt * TILE_N, ps_hi, ring_slot(used + NS - 1, NS)[0], ppages)
                    pk, pt, ps_lo, ps_hi, pn = self._advance(pk, pt, ps_lo, ps_hi, pn, items, rng)
                    ppages = self._item_pages(src, pk, ps_lo + pt * TILE_N, ps_hi)
                self._commit()
                tile_lo = s_lo + it * TILE_N
                key0 = warp * KW  # this warp's keys of the tile
                kbase = stage * (TILE_N * D)
                vbase = NS * TILE_N * D + stage * (TILE_N * D)

                # S = Q K^T: two n-tiles of 8 keys
                sacc = cute.make_rmem_tensor((KW // 8, 4), Float32)
                for t in cutlass.range_constexpr(KW // 8):
                    for c in cutlass.range_constexpr(4):
                        sacc[t, c] = Float32(0.0)
                    n = key0 + 8 * t + gq
                    sw = n & self.swizzle
                    if const_expr(self.fp8):
                        kx = cute.make_rmem_tensor((D // 64, 4), Uint32)  # this thread's D / 4 bytes of row n
                        for i in cutlass.range_constexpr(D // 64):
                            cute.autovec_copy(wk[stage, n, ((D // 64) * tq + i) ^ sw, None], kx[i, None])
                    for ks in cutlass.range_constexpr(KSTEPS):
                        bregs = cute.make_rmem_tensor((2,), Uint32)
                        if const_expr(self.fp8):
                            bregs[0], bregs[1] = _e4m3x4_to_f16x4(kx[ks // 4, ks % 4])
                        else:
                            for half in cutlass.range_constexpr(2):
                                kc = ks * 16 + 2 * tq + 8 * half  # the k-step's column
                                e = kbase + n * D + (((kc // VEC) ^ sw) * VEC) + kc % VEC
                                bregs[half] = k32[e // 2]
                        out4 = _mma(qa[ks, 0], qa[ks, 1], qa[ks, 2], qa[ks, 3], bregs[0], bregs[1],
                                    sacc[t, 0], sacc[t, 1], sacc[t, 2], sacc[t, 3], bf16=BF)
                        for c in cutlass.range_constexpr(4):
                            sacc[t, c] = out4[c]

                # scale, masks (on a tile past [full_lo, full_hi): a branch uniform over the CTA) and the online
                # softmax of rows gq (c 0, 1) and gq + 8 (c 2, 3)
                for t in cutlass.range_constexpr(KW // 8):
                    for c in cutlass.range_constexpr(4):
                        sacc[t, c] = logit(sacc[t, c], k_scale, softcap, self.use_softcap)
                if (tile_lo < full_lo) | (tile_lo + TILE_N > full_hi):
                    for t in cutlass.range_constexpr(KW // 8):
                        for c in cutlass.range_constexpr(4):
                            j = tile_lo + key0 + 8 * t + 2 * tq + c % 2
                            lo, hi = (lo0, hi0) if c < 2 else (lo1, hi1)  # c: compile-time
                            sacc[t, c] = sacc[t, c] if (j >= lo) & (j < hi) else Float32(-math.inf)
                alpha = cute.make_rmem_tensor((2,), Float32)
                for i in cutlass.range_constexpr(2):
                    t_max = Float32(NEG_BIG)
                    for t in cutlass.range_constexpr(KW // 8):
                        t_max = cutlass.max(t_max, cutlass.max(sacc[t, 2 * i], sacc[t, 2 * i + 1]))
                    t_max = cutlass.max(t_max, cute.arch.shuffle_sync_bfly(t_max, offset=1))
                    t_max = cutlass.max(t_max, cute.arch.shuffle_sync_bfly(t_max, offset=2))
                    m_new = cutlass.max(m_run[i], t_max)
                    # the running max moves only by more than RESCALE_LOG2 (P up to 2^8, exact in fp32 and in 16 bits
                    # as any P; O and the sum stay relative to one max): alpha is then exactly 1 on most tiles
                    m_new = m_new if m_new > m_run[i] + Float32(RESCALE_LOG2) else m_run[i]
                    alpha[i] = cute.arch.exp2(m_run[i] - m_new)
                    m_run[i] = m_new
                    psum = Float32(0.0)
                    for t in cutlass.range_constexpr(KW // 8):
                        for c in cutlass.range_constexpr(2):
                            p = cute.arch.exp2(sacc[t, 2 * i + c] - m_new)
                            sacc[t, 2 * i + c] = p
                            psum = psum + p
                    l_run[i] = l_run[i] * alpha[i] + psum
                if _moved(alpha):  # warp-uniform: a warp whose rows' maxima stayed skips rescaling O
                    for i in cutlass.range_constexpr(2):
                        for nt in cutlass.range_constexpr(NTILES):
                            acc[nt, 2 * i] = acc[nt, 2 * i] * alpha[i]
                            acc[nt, 2 * i + 1] = acc[nt, 2 * i + 1] * alpha[i]

                # O += P V: P's A registers from the two S n-tiles, V's B registers two keys at a time
                for kk in cutlass.range_constexpr(KW // 16):
                    pa0 = _pack2(sacc[2 * kk, 0], sacc[2 * kk, 1], bf16=BF)
                    pa1 = _pack2(sacc[2 * kk, 2], sacc[2 * kk, 3], bf16=BF)
                    pa2 = _pack2(sacc[2 * kk + 1, 0], sacc[2 * kk + 1, 1], bf16=BF)
                    pa3 = _pack2(sacc[2 * kk + 1, 2], sacc[2 * kk + 1, 3], bf16=BF)
                    if const_expr(self.fp8):
                        vb = cute.make_rmem_tensor((NTILES, 2), Uint32)  # the B registers of every n-tile
                        vx = cute.make_rmem_tensor((2, 2, D // 32), Uint32)  # (h, key 2t + 8h or + 1, word)
                        for half in cutlass.range_constexpr(2):
                            for kr in cutlass.range_constexpr(2):
                                key = key0 + 16 * kk + 8 * half + 2 * tq + kr
                                piece = gq ^ ((key & self.swizzle) * (128 // D))  # pieces of D / 8 bytes
                                cute.autovec_copy(wv[stage, key, piece, None], vx[half, kr, None])
                        for w in cutlass.range_constexpr(D // 32):  # word w: n-tiles 4 w .. 4 w + 3
                            for half in cutlass.range_constexpr(2):
                                lo = _prmt(vx[half, 0, w], vx[half, 1, w], 0x5140)
                                hi = _prmt(vx[half, 0, w], vx[half, 1, w], 0x7362)
                                vb[4 * w, half], vb[4 * w + 1, half] = _e4m3x4_to_f16x4(lo)
                                vb[4 * w + 2, half], vb[4 * w + 3, half] = _e4m3x4_to_f16x4(hi)
                    for nt in cutlass.range_constexpr(NTILES):
                        col = nt * 8 + gq
                        bregs = cute.make_rmem_tensor((2,), Uint32)
                        for half in cutlass.range_constexpr(2):
                            if const_expr(self.fp8):
                                bregs[half] = vb[nt, half]
                            else:
                                ka = key0 + 16 * kk + 2 * tq + 8 * half
                                kb = ka + 1
                                ea = vbase + ka * D + (((col // VEC) ^ (ka & self.swizzle)) * VEC) + col % VEC
                                eb = vbase + kb * D + (((col // VEC) ^ (kb & self.swizzle)) * VEC) + col % VEC
                                bregs[half] = Uint32(v16[ea]) | (Uint32(v16[eb]) << 16)
                        out4 = _mma(pa0, pa1, pa2, pa3, bregs[0], bregs[1], acc[nt, 0], acc[nt, 1], acc[nt, 2],
                                    acc[nt, 3], bf16=BF)
                        for c in cutlass.range_constexpr(4):
                            acc[nt, c] = out4[c]
                used = used + 1

            self._merge_warps(acc, m_run, l_run, sM, sL, storage.partials.data_ptr(), part_o_ptr, part_l_ptr,
                              sinks_ptr, has_sinks, v_scale, tidx, b, h, split)
            cute.arch.barrier()  # the epilogue's reads of sM, sL and the partials done before the next item's writes

    def _grid(self, batch: Int32):
        """The launch grid: persistent, at most `ctas` CTAs (two an SM), CTA c taking items c, c + ctas, ..."""
        return (cutlass.min(batch * (self.hkv * self.num_splits), self.ctas), 1, 1)

    def _item(self, k):
        """(split, KV head, request) of work item k, in the order of the grid (split, KV head, request) it
        replaces."""
        return k % self.num_splits, (k // self.num_splits) % self.hkv, k // (self.num_splits * self.hkv)

    @cute.jit
    def _loaded_item(self, k: Int32, items: Int32, rng):
        """(k', s_lo, s_hi, n_tiles): of this CTA's items k, k + ctas, ..., the first with keys to load and its
        range (`_split_range`), or k' >= items where none is left (its range then loads nothing)."""
        s_lo = Int32(0)
        s_hi = Int32(0)
        n = Int32(0)
        if k < items:
            split, _, b = self._item(k)
            _, _, s_lo, s_hi, n = self._split_range(*rng[:4], split, b, rng[4])
        while (k < items) & (n == 0):
            k = k + self.ctas
            if k < items:
                split, _, b = self._item(k)
                _, _, s_lo, s_hi, n = self._split_range(*rng[:4], split, b, rng[4])
        return k, s_lo, s_hi, n

    @cute.jit
    def _advance(self, pk: Int32, pt: Int32, ps_lo: Int32, ps_hi: Int32, pn: Int32, items: Int32, rng):
        """The load cursor (item pk, its tile pt of pn, its range [ps_lo, ps_hi)) one tile on, into the next item
        with keys after its last tile."""
        pt = pt + 1
        if pt == pn:
            pk, ps_lo, ps_hi, pn = self._loaded_item(pk + self.ctas, items, rng)
            pt = Int32(0)
        return pk, pt, ps_lo, ps_hi, pn

    @cute.jit
    def _read_q(self, q_src, k: Int32, q_raw: cute.Tensor, gq: Int32, tq: Int32):
        """Item k's query elements of this thread's A fragments into q_raw (k-step, register, element), zeros
        past the R live rows (q_src: `kernel`'s q pointer and strides)."""
        q_ptr, q_sb, q_ss, q_sh = q_src
        D = const_expr(self.d)
        G = const_expr(self.g)
        R = const_expr(self.rows)
        _, h, b = self._item(k)
        q_rows = cute.make_tensor(q_ptr, cute.make_layout((1 << 30,)))
        for ks in cutlass.range_constexpr(D // 16):
            for reg in cutlass.range_constexpr(4):
                r = gq + 8 * (reg % 2)
                col = ks * 16 + 2 * tq + 8 * (reg // 2)
                if const_expr(self.fp8):  # the float8 tile's column order (the docstring)
                    col = (D // 4) * tq + 4 * ks + 2 * (reg // 2)
                q_raw[ks, reg, 0] = q_raw.element_type(0.0)
                q_raw[ks, reg, 1] = q_raw.element_type(0.0)
                if r < R:
                    off = Int64(b) * q_sb + Int64(r // G) * q_ss + Int64(h * G + r % G) * q_sh + Int64(col)
                    q_raw[ks, reg, 0] = q_rows[off]
                    q_raw[ks, reg, 1] = q_rows[off + 1]

    @cute.jit
    def _item_pages(self, src, pk: Int32, tile_lo: Int32, s_hi: Int32):
        """`_tile_pages` of item pk's tile from tile_lo (src: `kernel`'s load sources)."""
        pt_ptr, pt_sb, num_pages = src[:3]
        _, _, b = self._item(pk)
        return self._tile_pages(PageRow(pt_ptr, pt_sb, b, num_pages), tile_lo, s_hi, src[14])

    @cute.jit
    def _load(self, src, pk: Int32, tile_lo: Int32, s_hi: Int32, stage: Int32, pages: Int32):
        """Loads item pk's tile from tile_lo into `stage` (`_fill`; src: `kernel`'s load sources)."""
        pt_ptr, pt_sb, num_pages, k_ptr, v_ptr, k_sh, v_sh, k_sp, k_so, v_sp, v_so, sK, sV, tiles, tidx = src
        _, h, b = self._item(pk)
        pt_row, k_base, v_base, atom = self._sources(pt_ptr, pt_sb, num_pages, k_ptr, v_ptr, k_sh, v_sh, b, h)
        self._fill(k_base, v_base, pt_row, sK, sV, atom, tile_lo, s_hi, stage, tidx, h, k_sp, k_so, v_sp, v_so, tiles,
                   pages)

    @cute.jit
    def _merge_warps(self, acc: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, sM: cute.Tensor,
                     sL: cute.Tensor, partials: cute.Pointer, part_o_ptr: cute.Pointer, part_l_ptr: cute.Pointer,
                     sinks_ptr: cute.Pointer, has_sinks: Int32, v_scale: Float32, tidx: Int32, b: Int32, h: Int32,
                     split: Int32):
        """The split's epilogue: the warps' row stats and partial outputs merged through shared memory (the
        live rows' partial outputs in `partials`, beside the ring) and each row's elements written by `_emit`."""
        warp = tidx // 32
        lane = tidx % 32
        gq = lane // 4
        tq = lane % 4
        THREADS = const_expr(self.threads)
        WARPS = const_expr(self.warps)
        D = const_expr(self.d)
        R = const_expr(self.rows)
        NTILES = const_expr(D // 8)
        for i in cutlass.range_constexpr(2):
            l_tot = l_run[i]
            l_tot = l_tot + cute.arch.shuffle_sync_bfly(l_tot, offset=1)
            l_tot = l_tot + cute.arch.shuffle_sync_bfly(l_tot, offset=2)
            if tq == 0:
                sM[warp, gq + 8 * i] = m_run[i]
                sL[warp, gq + 8 * i] = l_tot
        red = cute.make_tensor(partials, cute.make_layout((WARPS, R, D), stride=(R * D, D, 1)))  # live rows
        for nt in cutlass.range_constexpr(NTILES):
            for c in cutlass.range_constexpr(4):
                j = 2 * tq + c % 2  # the fragment's column of n-tile nt: value column (D/8) j + nt for fp8
                col = NTILES * j + nt if const_expr(self.fp8) else nt * 8 + j
                if const_expr(8 * (c // 2) < R):  # (rows gq + 8 are all dead where R <= 8)
                    if gq + 8 * (c // 2) < R:
                        red[warp, gq + 8 * (c // 2), col] = acc[nt, c]
        cute.arch.barrier()
        part_o = cute.make_tensor(part_o_ptr, cute.make_layout((1 << 30,)))
        part_l = cute.make_tensor(part_l_ptr, cute.make_layout((1 << 30,)))
        for i in cutlass.range_constexpr((R * D + THREADS - 1) // THREADS):
            e = tidx + i * THREADS
            if e < R * D:
                r = e // D
                col = e % D
                m = Float32(NEG_BIG)
                for w in cutlass.range_constexpr(WARPS):
                    m = cutlass.max(m, sM[w, r])
                total = Float32(0.0)
                l_r = Float32(0.0)
                for w in cutlass.range_constexpr(WARPS):
                    f = cute.arch.exp2(sM[w, r] - m)
                    total = total + red[w, r, col] * f
                    l_r = l_r + sL[w, r] * f
                self._emit(part_o, part_l, sinks_ptr, has_sinks, v_scale, b, h, split, r, col, total, m, l_r)
