"""Extend (prefill, chunked prefill) in CuTe DSL on Hopper: warp-specialized, with wgmma.

A work item is BM consecutive new tokens of one request and one query head (the plan's block_m: 128, or 192 at
D <= 64 as FlashAttention-3's tile there); items are ordered as the Triton extend kernel's grid (Hq, tiles) (same
three key ranges, same masks). Its tile map differs from the Triton kernel's in one way: a request's row tiles
end on its last row, so the one partial tile (a request's new-token count not a multiple of BM) holds its first
rows, which see the fewest keys, where the Triton kernel's holds its last, which see the most (a tile's first row
r0 may be negative: the rows below 0 read zeros and are not stored), and its order is longest first: every
request's last row tile, then every request's second-to-last, and so on (for packed q, with its requests' row
counts from cu_seqlens_q on the device). The kernel is
persistent: min(items, SMs) CTAs of a producer warpgroup and NC = BM / 64 consumer warpgroups (one CTA fits an
SM), CTA c taking one item per round of CTAs items, in snake order (`_item`: round r's items run forward for
even r and backward for odd r, so the CTA that takes a round's longest item takes the next round's shortest; a
partial last round runs forward). The K/V ring, its barrier phases and the consumers' GEMM turns run on across
a CTA's items, so the producer loads the next item's first tiles while the consumers finish the last one. The
producer loads each item's Q by TMA (`_load_q`), a whole item ahead into the second of two Q tiles where shared
memory holds two (D 64), else into the one tile as soon as each consumer warpgroup's last S = Q K^T of the item
before is done (its Q-empty mbarrier, before its last softmax). Each consumer maps the next item's tile to its
request (for packed q, from cu_seqlens_q) and reads that request's live length (and kv_start) an item ahead, so
no load of the item's start waits at its first tile. At D <= 128 an item stays
open past its end (`overlap`): its last P V is issued with the next item's first S in one GEMM turn, and its rows
are stored once the next item's first softmax is done, so no product runs alone at an item's boundary (at D 256
the 64 x 256 accumulators leave no registers for it: an item closes at its end):

- warpgroup 0, the producer (after setmaxnreg 64 registers, 32 beside three consumers), loads each item's Q
  (per consumer warpgroup 64 rows, one TMA box per 64 head-dim elements, completing that consumer's Q-full
  mbarrier) and each BN-key tile into a STAGES-deep ring of shared-memory buffers, first K, then V, and never
  waits on its own loads, only on a stage's `empty` (or a Q tile's Q-empty) mbarrier before reusing it: each
  copy completes the stage's K-full or V-full mbarrier when it lands.
  - By TMA where the page geometry allows (`tma_box` in __init__.py: pages of a multiple of 8 keys that
    divide the tile or that the tile divides): one tensor map per cache over (slot, d, KV head, page), one
    box per page (or tile-sized part of a page) and 64 head-dim elements, written in the 128-byte swizzle
    the wgmma reads; mbarrier expect-tx counts the bytes. A tile goes by TMA when it starts on a box and all
    its keys are the request's (below its length, so finite even past the causal or window limit): tiles
    start on a box boundary wherever the keys that rounding down adds are at or past kv_start.
  - By cp.async otherwise (the last, partial tile; page sizes without a box; windows with kv_start): 16-byte
    chunks, key j at page page_table[b, j // PAGE], slot j % PAGE (page id widened to 64 bits), each
    thread's arrival landing with its copies (cp.async.mbarrier.arrive). Rows past the visible range copy the
    last visible key (finite values the consumers mask to P = 0), so nothing stale, uninitialized or NaN is
    ever multiplied. About 14 instructions per copy (unsigned key and page math, byte strides, 8 in flight;
    4 beside three consumers, which in 32 registers spill none).
  With cp.async for every tile the producer's instructions (about 450 per tile and warp) took issue slots
  from the consumers on each SM sub-partition: TMA took 1x16384 from 461 to 551 TFLOP/s (h200.md).
- warpgroups 1 .. NC, the consumers (224 registers, 160 for three), own 64 query rows each. Per tile j: wait for
  the P V of tile j - 2, rescale O to tile j - 1's max and convert its P to 16 bits, release tile j - 2's stage;
  wait for K of tile j and V of tile j - 1, fence the cp.async (generic-proxy) writes for the tensor cores
  (fence.proxy.async); issue S = Q K^T (wgmma, Q and K from shared memory) and O += P V of tile j - 1 (wgmma, P
  from registers, V read N-major); wait for S only, then softcap, the masks (kv_start, causal, window; only on
  tiles at the ends of the range) and the online softmax on the accumulator fragments while P V runs. The wait for
  P V sits at the top of the next iteration: placed after the softmax in the same block, ptxas scheduled it ahead
  of the exponentials (SASS: WARPGROUP.DEPBAR.LE gsb0, 0x0 before the MUFU.EX2), serializing them with the
  product.
- the consumers take turns issuing their GEMMs, in a ring (named barriers NC + 1 .. 2 NC; 1 .. NC are their Q
  loads'), as FlashAttention-3's ping-pong: one warpgroup's softmax runs while another's products occupy the
  tensor cores.
- each consumer's output leaves from registers (`_store_half`): lanes trade one pair of columns per two column
  groups so that each store writes 8 contiguous bytes, 8 rows x 32 bytes per warp instruction (out's rows
  start on 16 bytes, which `_run_extend` checks). Staged through shared memory, it would hold the Q rows the
  next item's Q is loaded into.

Shared-memory tiles use the 128-byte swizzle wgmma reads: a tile of rows x D (Q, K or V; row = token or key)
is stored as D / 64 slabs of rows x 128 bytes, 16-byte chunk c of row r at chunk position c ^ (r % 8). The
cp.async writes compute that address directly, TMA writes it through the tensor map's 128-byte swizzle (each
box starts on a 1024-byte boundary); the MMAs read the same bytes through CuTe's layouts
(`sm90_utils.make_smem_layout_a/b`, whose swizzle acts on byte addresses).

The accumulator fragment of an m64nN wgmma holds, per thread, elements ((2, 2, N / 8)): two adjacent columns,
rows r and r + 8, and N / 8 column groups of 8; converted to 16-bit, the S fragment of 16 keys is exactly
the A register fragment of the P V product's k-step, so P never leaves registers.

Packed q: the items are fixed by the capacity (cdiv(T, BM) + B tiles a head); each item's tile is mapped to a
request on the device from cu_seqlens_q (a warp reads 32 requests' rows a round, `_tile_map`), and the items left
over write zeros and lse = -inf into the padding rows. Packed tiles run longest first as 4D ones do: in request
order, the snake order left CTAs far apart in work (benchmarks/results/h200.md, "Session 59").

What limits it (benchmarks/results/h200.md, "CuTe DSL extend", "Session 33", "Session 35", "Session 61"): 419-593
TFLOP/s at D 128, page 16, with TMA; the short prefills keep a cost per item (fitted on an H100 over 64x256,
32x512 and 16x1024: about 3.1 us of a CTA an item besides its key tiles at D 128 and 2.1 at D 64, against 1.4
and 1.2 for SDPA's), and the static item order leaves some imbalance between CTAs (the plain order c, c + CTAs,
... computes to up to 3.1 % over the mean at 1x16384 and 4x4096, the snake order to 0.1-0.3 %). Before TMA
(405-461), Nsight Compute had each consumer warpgroup spending about half its time in the softmax, most of it
issuing MUFU.EX2 (the SFU is shared with the other warpgroup's softmax on the same SM sub-partition).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from b12x_inductor.kernels.cute import EXTEND_BLOCK_M, extend_geometry, tma, tma_box
from b12x_inductor.kernels.cute.common import (LN2, LOG2E, NEG_BIG, PageRow, empty_barrier, full_barrier,
                                               live_range, ring_slot, scales)
from b12x_inductor.kernels.cute.ptx import mbarrier_arrive_if, pack2
from b12x_inductor.kernels.cute.softmax import RESCALE_LOG2, online_softmax
from b12x_inductor.kernels.cute.softmax import moved as _moved
from b12x_inductor.kernels.cute.softmax import scale_rows as _scale_rows

# (producer, consumer) registers after setmaxnreg by consumer warpgroups: 128 x 64 + 256 x 216 and
# 128 x 32 + 384 x 160 fit the 65536 of an SM (three consumers, as FlashAttention-3's 192-row tile at D 64)
REGS = {2: (64, 216), 3: (32, 160)}


class ExtendKernel:
    """The extend kernel for one set of compile-time constants (see `extend_geometry` in __init__.py)."""

    def __init__(self, *, d: int, g: int, hq: int, batch: int, s: int, page: int, packed: bool, tile_n: int,
                 stages: int, q_dtype, causal: bool, use_window: bool, use_softcap: bool, sm_count: int,
                 block_m: int = EXTEND_BLOCK_M):
        self.d, self.g, self.hq, self.batch, self.s, self.page, self.packed = d, g, hq, batch, s, page, packed
        self.tile_n, self.stages, self.dtype = tile_n, stages, q_dtype
        self.causal, self.use_window, self.use_softcap = causal, use_window, use_softcap
        geo = extend_geometry(d=d, tile_n=tile_n, stages=stages, block_m=block_m)
        assert geo is not None, "the plan's tile does not fit this kernel (kernels/cute/__init__.py: extend_geometry)"
        self.__dict__.update(geo)  # with `storage`, the kernel's shared memory (kernels/cute/storage.py)
        # block_m query rows a CTA, 64 a consumer warpgroup; barriers 1 .. NC are the consumers' Q loads, NC + 1 ..
        # 2 NC their turns to issue GEMMs
        self.nc = block_m // 64
        self.threads = 128 * (1 + self.nc)
        self.turn_bar = 1 + self.nc
        self.block_m = block_m
        self.row_tiles = -(-s // block_m)  # a request's row tiles (4D q), at most (packed q)
        self.tiles = (self.row_tiles + batch) if packed else batch * self.row_tiles
        # 4D q: a request's row tiles end on its last row, so the one partial tile (S not a multiple of block_m)
        # is its first, which sees the fewest keys: its row tile j holds rows j x block_m - pad .. (rows below 0
        # are not loaded, computed on zeros and not stored). Packed q: the same, with each request's own pad
        # (_tile_map, on the device).
        self.pad = 0 if packed else self.row_tiles * block_m - s
        self.items = hq * self.tiles  # work items: (query head, row tile), item = hq + Hq x tile
        self.ctas = min(self.items, sm_count) if sm_count > 0 else self.items  # persistent: one CTA per SM
        self.box = tma_box(page=page, tile_n=tile_n)
        # an item's last P V issued with the next item's first S, its epilogue after the next item's first softmax
        # (the consumer loop's "open item"); not at D 256, whose 64 x 256 accumulators leave no registers for it
        self.overlap = d <= 128

    @cute.jit
    def __call__(
        self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, cu_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, sinks_ptr: cute.Pointer,
        kds_ptr: cute.Pointer, vds_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer,
        q_sb: Int64, q_ss: Int64, q_sh: Int64, k_sp: Int64, k_so: Int64, k_sh: Int64,
        v_sp: Int64, v_so: Int64, v_sh: Int64, pt_sb: Int64,
        kds_b: Int32, kds_h: Int32, vds_b: Int32, vds_h: Int32,
        has_kv_start: Int32, has_sinks: Int32, has_kds: Int32, has_vds: Int32,
        window_left: Int32, sm_scale: Float32, softcap: Float32, k_pages: Int32, v_pages: Int32, max_pages: Int32,
        stream,
    ):
        # Q by TMA: q as rows (token, d, query head, request) in boxes of 64 rows x 128 bytes; packed q is one
        # request of its capacity's rows (its request stride unused but a valid 16-byte multiple)
        q_rows_sb = q_ss * self.s if const_expr(self.packed) else q_sb
        tma_q, m_q = tma.cache_tma(q_ptr, Int32(1 if self.packed else self.batch), q_rows_sb, q_ss, q_sh,
                                   page=self.s, d=self.d, hkv=self.hq, box=64)
        tma_k, m_k, tma_v, m_v = None, None, None, None
        if const_expr(self.box != 0):
            geo = dict(page=self.page, d=self.d, hkv=self.hq // self.g, box=self.box)
            tma_k, m_k = tma.cache_tma(k_ptr, k_pages, k_sp, k_so, k_sh, **geo)
            tma_v, m_v = tma.cache_tma(v_ptr, v_pages, v_sp, v_so, v_sh, **geo)
        self.kernel(
            k_ptr, v_ptr, pt_ptr, seqlens_ptr, cu_ptr, kv_start_ptr, sinks_ptr, kds_ptr, vds_ptr, out_ptr,
            lse_ptr, k_sp, k_so, k_sh, v_sp, v_so, v_sh, pt_sb, kds_b, kds_h, vds_b, vds_h,
            has_kv_start, has_sinks, has_kds, has_vds, window_left, sm_scale, softcap, max_pages * self.page,
            k_pages, tma_k, m_k, tma_v, m_v, tma_q, m_q,
        ).launch(grid=(self.ctas, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream,
                 min_blocks_per_mp=1)

    @cute.jit
    def _item(self, k: Int32, cta: Int32):
        """The work item CTA `cta` takes in its round r = k // CTAs (k = cta + r x CTAs: the CTA's items in grid
        order): round r holds items r x CTAs .. r x CTAs + CTAs - 1, taken in CTA order for even r and in reverse
        for odd r (snake order: with items ordered longest first, the CTAs that took a round's longer items take
        the next round's shorter ones). A last round with fewer items than CTAs goes in CTA order, so every CTA
        takes the items of the grid order's count, and k past the items stays past them."""
        r = k // self.ctas
        flip = (r % 2 == 1) & (r != self.items // self.ctas)
        return k + Int32(flip) * (self.ctas - 1 - 2 * cta)

    def _round(self, k: Int32, cta: Int32):
        """The round of CTA cta's k-th grid slot (k = cta + round x CTAs): the count of its items before it, and
        so of its Q loads before it, producer and consumers alike (padding items, which load no Q, are a suffix
        of a CTA's items)."""
        return (k - cta) // self.ctas

    @cute.jit
    def _tile_map(self, cu_ptr: cute.Pointer, t: Int32):
        """(b, r0, n_b, row0, pad_from): tile t's request, the tile's first row in the request (below 0 where the
        request's rows do not fill its tiles: a request's tiles end on its last row), the request's new-token
        count, its first row in q/out, and for packed q the first padding row this tile writes (-1 for a real
        tile). Longest first: every request's last row tile (the most keys under a causal mask) before any
        request's second-to-last, and so on, in request order within each level (4D q: request t % B, as the
        Triton kernel; packed q: the requests with that many tiles, found on the device)."""
        b = Int32(0)
        r0 = Int32(0)
        n_b = Int32(self.s)
        row0 = Int64(0)
        pad_from = Int32(-1)
        if const_expr(self.packed):
            # the warp maps the tile together (every caller passes the same t across the warp), 32 requests a
            # round, lane l holding request c x 32 + l (`_lane_request`). Tile t is the t-th of the order
            # (level d, request): level d holds, in request order, the tile d from the end of every request of
            # more than d row tiles. Below level d lie F(d) = sum_i min(tiles_i, d) tiles (`_tiles_below`), so
            # t's level is the last d with F(d) <= t: a binary search over [0, cdiv(T, BM)], then a ballot per
            # round finds the request that holds the (t - F(d))-th tile of the level.
            cu = cute.make_tensor(cu_ptr, cute.make_layout((self.batch + 1,)))
            lane = cute.arch.lane_idx()
            d_max = const_expr(self.row_tiles)
            # branch-free: every lane takes every shuffle and ballot
            real_tiles = self._tiles_below(cu, lane, Int32(d_max))
            lo = Int32(0)  # F(lo) <= t < F(hi) (for t < real_tiles)
            hi = Int32(d_max)
            f_lo = Int32(0)
            for _ in cutlass.range_constexpr(max(1, (d_max - 1).bit_length())):
                mid = (lo + hi) // 2  # lo once hi = lo + 1 (F(lo) <= t: nothing changes)
                f_mid = self._tiles_below(cu, lane, mid)
                go = Int32(f_mid <= t)
                lo = lo + go * (mid - lo)
                f_lo = f_lo + go * (f_mid - f_lo)
                hi = hi + (1 - go) * (mid - hi)
            idx = t - f_lo  # the tile's place in level lo
            for c in cutlass.range_constexpr(-(-self.batch // 32)):
                c_lo, n_i, tiles_i = self._lane_request(cu, c, lane)
                deep = tiles_i > lo
                has = Uint32(cute.arch.vote_ballot_sync(deep))
                rank = Int32(cute.arch.popc(has & cute.arch.lanemask_lt()))
                hit = Uint32(cute.arch.vote_ballot_sync(deep & (rank == idx)))
                src = Int32(31) - Int32(cute.arch.clz(hit))  # -1 where no lane hits
                got_n = cute.arch.shuffle_sync(n_i, src & 31)
                got_lo = cute.arch.shuffle_sync(c_lo, src & 31)
                found = Int32(hit != 0)
                b = b + found * (c * 32 + src - b)
                n_b = n_b + found * (got_n - n_b)
                row0 = row0 + Int64(found * got_lo)
                idx = idx - Int32(cute.arch.popc(has))
            r0 = n_b - (lo + 1) * self.block_m
            if t >= real_tiles:
                end = cutlass.min(cutlass.max(Int32(cu[self.batch]), Int32(0)), Int32(self.s))
                pad_from = end + (t - real_tiles) * self.block_m
                r0 = Int32(0)
        else:
            b = t % self.batch
            r0 = (self.row_tiles - 1 - t // self.batch) * self.block_m - self.pad
            row0 = Int64(b) * self.s
        return b, r0, n_b, row0, pad_from

    @cute.jit
    def _lane_request(self, cu: cute.Tensor, c: int, lane: Int32):
        """(c_lo, n_i, tiles_i) of packed q's request i = c x 32 + lane: its first row, its new-token count and
        its row tiles from cu_seqlens_q clamped to [0, T] (as the Triton kernel: rows [c_lo, max(c_lo, c_hi))
        stay in q and out); 0 tiles past the batch."""
        i = c * 32 + lane
        ii = cutlass.min(i, Int32(self.batch - 1))
        c_lo = cutlass.min(cutlass.max(Int32(cu[ii]), Int32(0)), Int32(self.s))
        c_hi = cutlass.min(cutlass.max(Int32(cu[ii + 1]), Int32(0)), Int32(self.s))
        n_i = cutlass.max(c_hi - c_lo, Int32(0))
        tiles_i = Int32(i < self.batch) * ((n_i + self.block_m - 1) // self.block_m)
        return c_lo, n_i, tiles_i

    @cute.jit
    def _tiles_below(self, cu: cute.Tensor, lane: Int32, d: Int32):
        """F(d) = sum over packed q's requests of min(row tiles, d), on every lane of the warp: the tiles of
        the levels below d in `_tile_map`'s order."""
        acc = Int32(0)
        for c in cutlass.range_constexpr(-(-self.batch // 32)):
            acc = acc + cutlass.min(self._lane_request(cu, c, lane)[2], d)
        for sh in cutlass.range_constexpr(5):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1 << sh)
        # every lane holds the sum; taken from lane 0, ptxas knows it is the warp's (uniform) value: from the
        # butterfly alone, the consumers' branches on the tile map were divergent paths to ptxas, which then
        # serialized their wgmma (C7520)
        return cute.arch.shuffle_sync(acc, 0)

    @cute.jit
    def _key_range(self, length: Int32, start: Int32, r0: Int32, n_b: Int32, window_left: Int32):
        """(lo, hi, full_lo, full_hi, n_tiles): the keys the row tile from row r0 (below 0: rows the tile does
        not hold) sees of a request of live length `length` and first visible key `start` (common.live_range,
        read on the device as the Triton extend kernel reads them) and n_b new tokens: the tile's key range
        [lo, hi) (lo on a TMA box boundary where the keys that adds are the request's), the range
        [full_lo, full_hi) every row of the tile sees whole, and the range's BN-key tile count."""
        c_min = length - n_b + cutlass.max(r0, Int32(0))
        c_max = length - n_b + cutlass.min(r0 + self.block_m, n_b) - 1
        lo = start
        full_lo = start
        if const_expr(self.use_window):
            lo = cutlass.max(lo, c_min - window_left)
            full_lo = cutlass.max(full_lo, c_max - window_left)
        if const_expr(self.box != 0):
            # tiles start on a box boundary (a whole number of TMA boxes) where the keys below lo are still
            # visible keys of the request (finite; the masks drop them)
            lo_box = lo - lo % self.box
            if lo_box >= start:
                lo = lo_box
        hi = length
        full_hi = length
        if const_expr(self.causal):
            hi = cutlass.min(hi, c_max + 1)
            full_hi = cutlass.min(full_hi, c_min + 1)
        n_tiles = (cutlass.max(hi - lo, Int32(0)) + self.tile_n - 1) // self.tile_n
        return lo, hi, full_lo, full_hi, n_tiles

    @cute.jit
    def _chunk(self, base: cute.Tensor, row: Int32, ch: Int32):
        """The 16-byte chunk `ch` of row `row` of a swizzled rows x D tile (see the module docstring)."""
        return base[ch // 8, row // 8, row % 8, (ch % 8) ^ (row % 8), None]

    @cute.kernel
    def kernel(
        self, k_ptr: cute.Pointer, v_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, cu_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, sinks_ptr: cute.Pointer,
        kds_ptr: cute.Pointer, vds_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer,
        k_sp: Int64, k_so: Int64, k_sh: Int64,
        v_sp: Int64, v_so: Int64, v_sh: Int64, pt_sb: Int64,
        kds_b: Int32, kds_h: Int32, vds_b: Int32, vds_h: Int32,
        has_kv_start: Int32, has_sinks: Int32, has_kds: Int32, has_vds: Int32,
        window_left: Int32, sm_scale: Float32, softcap: Float32, cap: Int32, num_pages: Int32,
        tma_k: cute.CopyAtom, m_k: cute.Tensor, tma_v: cute.CopyAtom, m_v: cute.Tensor, tma_q: cute.CopyAtom,
        m_q: cute.Tensor,
    ):
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)  # kernels/cute/storage.py: extend_storage
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wg = tidx // 128
        BN = const_expr(self.tile_n)
        D = const_expr(self.d)
        NS = const_expr(self.stages)
        SLABS = const_expr(max(D // 64, 1))
        dt = self.dtype

        # ---- shared memory: Q, the K and V rings (swizzled, 1024-aligned), the mbarriers ----
        mbar = storage.mbar.data_ptr()  # K full, V full, empty (full_barrier, empty_barrier), Q's (_q_barrier)
        q_tile = cute.recast_ptr(storage.q.data_ptr(), dtype=dt)
        ring = cute.recast_ptr(storage.kv.data_ptr(), dtype=dt)  # NS K tiles, then NS V tiles
        kv_elems = const_expr(BN * D)

        def chunks_view(ptr, rows, stages):  # (stage, slab, row // 8, row % 8, chunk position, 8 elements)
            return cute.make_tensor(ptr, cute.make_layout(
                (stages, SLABS, rows // 8, 8, 8, 8),
                stride=(rows * D, rows * 64, 512, 64, 8, 1)))

        wK = chunks_view(ring, BN, NS)
        wV = chunks_view(ring + NS * kv_elems, BN, NS)

        mma_qk = self._mma_qk()
        mma_pv = self._mma_pv()
        lq = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.block_m, BN, D), dt, self.q_bufs)
        lk = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, BN, D), dt, NS)
        lv = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.block_m, D, BN), dt, NS)
        sQ = cute.make_tensor(cute.recast_ptr(q_tile, lq.inner, dtype=dt), lq.outer)
        sK = cute.make_tensor(cute.recast_ptr(ring, lk.inner, dtype=dt), lk.outer)
        sV = cute.make_tensor(cute.recast_ptr(ring + NS * kv_elems, lv.inner, dtype=dt), lv.outer)

        if tidx == 0:
            for i in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(full_barrier(mbar, NS, 0, i), 128)  # K full: every producer thread arrives
                cute.arch.mbarrier_init(full_barrier(mbar, NS, 1, i), 128)  # V full
                cute.arch.mbarrier_init(empty_barrier(mbar, NS, i), 128 * self.nc)  # empty: every consumer thread
            for qs in cutlass.range_constexpr(self.q_bufs):
                for c in cutlass.range_constexpr(self.nc):
                    cute.arch.mbarrier_init(self._q_barrier(mbar, 0, qs, c), 1)  # Q full: the producer's expect-tx
                    cute.arch.mbarrier_init(self._q_barrier(mbar, 1, qs, c), 128)  # Q empty: the consumer's threads
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        lse_rows = cute.make_tensor(lse_ptr, cute.make_layout((1 << 30,)))
        # Persistent: CTA `cta` takes one work item per round, `_item(k, cta)` for k = cta, cta + ctas, ... (item =
        # hq + Hq x tile, the order of the grid it replaces). The ring runs on across items: `done` counts the
        # tiles this CTA's producer loaded (and its consumers used) for earlier items, so tile `it` of an item is
        # ring tile done + it, in stage (done + it) % NS. The producer and the consumers walk the same items and
        # compute the same key ranges, so their tile counts agree; the producer runs ahead into the next item while
        # the consumers finish the last one (epilogue, next Q).
        if wg == 0:
            cute.arch.setmaxregister_decrease(REGS[self.nc][0])
            if tidx == 0:
                cpasync.prefetch_descriptor(tma_q)
                if const_expr(self.box != 0):
                    cpasync.prefetch_descriptor(tma_k)
                    cpasync.prefetch_descriptor(tma_v)
            done = Int32(0)
            for k in cutlass.range(cta, self.items, self.ctas, unroll=1):
                item = self._item(k, cta)
                hq = item % self.hq
                b, r0, n_b, row0, pad_from = self._tile_map(cu_ptr, item // self.hq)
                if pad_from < 0:
                    length, start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, b, cap)
                    lo, hi, full_lo, full_hi, n_tiles = self._key_range(length, start, r0, n_b, window_left)
                    q_at = (b, r0, row0, hq, self._round(k, cta), q_tile, tma_q, m_q)
                    if const_expr(self._q_first()):
                        self._load_q(tidx, mbar, *q_at)
                    self._produce(tidx, b, hq // self.g, lo, hi, length, n_tiles, done, k_ptr, v_ptr, pt_ptr, k_sp,
                                  k_so, k_sh, v_sp, v_so, v_sh, pt_sb, num_pages, wK, wV, mbar, ring, tma_k, m_k,
                                  tma_v, m_v, None if const_expr(self._q_first()) else q_at)
                    done = done + n_tiles
        else:
            cute.arch.setmaxregister_increase(REGS[self.nc][1])
            ctid = tidx - 128
            wgc = wg - 1
            thr_qk = mma_qk.get_slice(ctid)
            thr_pv = mma_pv.get_slice(ctid)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
            acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((self.block_m, BN)))
            acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.block_m, D)))
            t_cs = thr_qk.partition_C(cute.make_identity_tensor((self.block_m, BN)))
            t_co = thr_pv.partition_C(cute.make_identity_tensor((self.block_m, D)))
            m_run = cute.make_rmem_tensor((2,), Float32)
            l_run = cute.make_rmem_tensor((2,), Float32)
            r_p = cute.make_rmem_tensor(acc_s.layout, dt)
            t_orp = cute.make_tensor(r_p.iterator, cute.make_layout(((2, 2, 2), 1, BN // 16),
                                                                  stride=((1, 2, 4), 0, 8)))
            limit = cute.make_rmem_tensor((2,), Int32)
            alpha = cute.make_rmem_tensor((2,), Float32)
            # the GEMM turns run on across items too, in a ring: consumer warpgroup 0 issues first (the last one
            # passes it the first turn), and takes the last one's pass after the last item (every turn barrier
            # ends complete)
            if wgc == self.nc - 1:
                self._pass_turn(wgc)
            if const_expr(self.overlap):
                r_p.fill(0.0)  # finite before the first tile (the open item's product without keys reads it)
            done = Int32(0)
            qs = Int32(0)
            # the next item's tile map and its request's live length and first visible key, an item ahead
            nb, nr0, nn_b, nrow0, npad_from = self._tile_map(cu_ptr, cta // self.hq)
            n_length, n_start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, nb, cap)
            # The open item (self.overlap): the one before this, whose last P V and stores are still to come.
            # Its last P V is issued with this item's first S = Q K^T, and its rows are stored after this item's
            # first softmax, so that an item's boundary leaves no product alone on the tensor cores. acc_o holds
            # its rows until then; fin their factors and lse (`_finalize`), p_idx0, p_r0, p_n_b where they go
            # (`_store`); p_tiles its key tiles (-1: no open item; 0: no P V to issue), its last one ring tile
            # done - 1. Without overlap an item closes at its own end.
            OV = const_expr(self.overlap)
            p_tiles = Int32(-1)
            p_idx0 = Int64(0)
            p_r0 = Int32(0)
            p_n_b = Int32(0)
            fin = cute.make_rmem_tensor((4,), Float32)
            for k in cutlass.range(cta, self.items, self.ctas, unroll=1):
                item = self._item(k, cta)
                hq = item % self.hq
                h = hq // self.g
                b, r0, n_b, row0, pad_from = nb, nr0, nn_b, nrow0, npad_from
                length, start = n_length, n_start
                # this CTA's next item (past the items after its last, which maps to a tile of the capacity:
                # the map's loads stay in cu_seqlens_q, the live range's in the batch)
                nxt = self._item(k + self.ctas, cta)
                nb, nr0, nn_b, nrow0, npad_from = self._tile_map(cu_ptr, nxt // self.hq)
                n_length, n_start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, nb, cap)
                if pad_from >= 0:
                    if const_expr(OV):
                        if p_tiles >= 0:
                            self._close(acc_o, t_orp, tOrV, t_co, fin, p_tiles, done - 1, mbar, p_idx0, p_r0, p_n_b,
                                        out_ptr, lse_rows, tidx % 32)
                            p_tiles = Int32(-1)
                    self._pad_rows(out_ptr, lse_rows, hq, pad_from, ctid)
                else:
                    lo, hi, full_lo, full_hi, n_tiles = self._key_range(length, start, r0, n_b, window_left)
                    qn = self._round(k, cta)  # its items with Q before this one (`_load_q`)
                    cute.arch.mbarrier_wait(self._q_barrier(mbar, 0, qs, wgc), (qn // self.q_bufs) % 2)
                    cute.arch.barrier(barrier_id=1 + wgc, number_of_threads=128)
                    if const_expr(self.q_bufs == 2):
                        # the last item's Q tile (every product of it is done), for the item after this one
                        self._release_q(mbar, 1 - qs, wgc, qn >= 1)
                    else:
                        self._release_q(mbar, qs, wgc, n_tiles == 0)  # no S reads it
                    k_scale, v_scale = scales(kds_ptr, vds_ptr, has_kds, has_vds, kds_b, kds_h, vds_b, vds_h,
                                              sm_scale, b, h)
                    if const_expr(not OV):
                        acc_o.fill(0.0)
                    for i in cutlass.range_constexpr(2):
                        m_run[i] = Float32(NEG_BIG)
                        l_run[i] = Float32(0.0)
                        # causal limits of this thread's two rows (fragment rows r and r + 8)
                        limit[i] = length - n_b + r0 + t_cs[2 * i][0]
                    if n_tiles > 0:
                        # tile 0: scores and softmax, in flight with the open item's last P V; tile 0's P V is
                        # issued with the next tile's scores
                        k_stage, k_phase = ring_slot(done, NS)
                        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, k_stage), k_phase)
                        # with the open item's last P V (on ring tile done - 1) where it has key tiles; else the
                        # same product on this item's tile 0 (its V waited for here), whose result no store reads
                        # (acc_o is the open item's rows of no key, all scaled by 0, or no item's; P is finite:
                        # zeros before the CTA's first tile, softmaxed scores after). Issued on every path: ptxas
                        # serialized every wgmma of the kernel for a P V under a branch (C7520) in some builds.
                        v_stage = k_stage
                        if const_expr(OV):
                            v_stage, v_phase = ring_slot(done - Int32(p_tiles > 0), NS)
                            cute.arch.mbarrier_wait(full_barrier(mbar, NS, 1, v_stage), v_phase)
                        cute.arch.fence_proxy("async.shared", space="cta")  # cp.async writes -> wgmma reads
                        self._take_turn(wgc)
                        warpgroup.fence()
                        self._scores(acc_s, tSrQ, tSrK, k_stage, qs)
                        if const_expr(OV):
                            self._pv(acc_o, t_orp, tOrV, v_stage)
                        self._pass_turn(wgc)
                        warpgroup.wait_group(1 if OV else 0)
                        if const_expr(self.q_bufs == 1):
                            self._release_q(mbar, qs, wgc, n_tiles == 1)  # the item's last S is done
                        online_softmax(acc_s, t_cs, m_run, l_run, alpha, limit, lo, hi, start, full_lo, full_hi,
                                       k_scale, softcap, window_left, **self._masks())
                    if const_expr(OV):
                        if n_tiles == 0:
                            if p_tiles > 0:  # no first S to go with: the open item's last P V alone
                                self._last_pv(acc_o, t_orp, tOrV, mbar, done - 1)
                        # the open item's last P V is done (waited for on every path: ptxas does not follow which
                        # paths issued it, and serializes the products where a path might read or write its
                        # accumulators before a wait); its epilogue runs while the other consumer warpgroups'
                        # products do
                        warpgroup.wait_group(0)
                        if p_tiles >= 0:
                            self._close(acc_o, t_orp, tOrV, t_co, fin, p_tiles, done - 1, mbar, p_idx0, p_r0, p_n_b,
                                        out_ptr, lse_rows, tidx % 32, issued=True)
                        acc_o.fill(0.0)
                    for it in cutlass.range(1, n_tiles, unroll=1):
                        # P V of tile it - 2 is done (its wait sits here, a loop iteration away from the softmax,
                        # so the compiler cannot move it ahead of the exponentials): O to tile it - 1's max, P of
                        # tile it - 1 into registers, tile it - 2's stage released
                        warpgroup.wait_group(0)
                        self._rescale_and_convert(acc_o, alpha, r_p, acc_s)
                        g = done + it
                        if it >= 2:
                            cute.arch.mbarrier_arrive(empty_barrier(mbar, NS, ring_slot(g - 2, NS)[0]))
                        # in flight together: S = Q K^T of tile it and O += P V of tile it - 1; the softmax of
                        # tile it runs on the CUDA cores while P V (and the other consumer warpgroup's GEMMs) run
                        stage, phase = ring_slot(g, NS)
                        prev, prev_phase = ring_slot(g - 1, NS)
                        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, stage), phase)
                        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 1, prev), prev_phase)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        self._take_turn(wgc)
                        warpgroup.fence()
                        self._scores(acc_s, tSrQ, tSrK, stage, qs)
                        self._pv(acc_o, t_orp, tOrV, prev)
                        self._pass_turn(wgc)
                        warpgroup.wait_group(1)
                        if const_expr(self.q_bufs == 1):
                            self._release_q(mbar, qs, wgc, it == n_tiles - 1)  # the item's last S is done
                        online_softmax(acc_s, t_cs, m_run, l_run, alpha, limit, lo + it * BN, hi, start, full_lo,
                                       full_hi, k_scale, softcap, window_left, **self._masks())
                    if n_tiles > 0:
                        # the last tile's P into registers; its P V goes with the next item's first S (overlap)
                        warpgroup.wait_group(0)
                        self._rescale_and_convert(acc_o, alpha, r_p, acc_s)
                        if n_tiles >= 2:
                            last2, _ = ring_slot(done + n_tiles - 2, NS)
                            cute.arch.mbarrier_arrive(empty_barrier(mbar, NS, last2))
                    if const_expr(self.q_bufs == 2):
                        qs = 1 - qs
                    if const_expr(OV):
                        self._finalize(m_run, l_run, v_scale, self._sink(sinks_ptr, has_sinks, hq), fin)
                        p_tiles = n_tiles
                        p_idx0 = (row0 + Int64(r0)) * self.hq + Int64(hq)  # the tile's row 0 in out and lse
                        p_r0 = r0
                        p_n_b = n_b
                    else:
                        # the item closes at its end: its last P V alone, then its epilogue
                        self._drain(acc_o, t_orp, tOrV, n_tiles, done + n_tiles - 1, mbar)
                        self._epilogue(acc_o, t_co, m_run, l_run, v_scale, sinks_ptr, has_sinks, hq, r0, n_b, row0,
                                       out_ptr, lse_rows, tidx % 32)
                    done = done + n_tiles
            if const_expr(OV):
                if p_tiles >= 0:  # the CTA's last item
                    self._close(acc_o, t_orp, tOrV, t_co, fin, p_tiles, done - 1, mbar, p_idx0, p_r0, p_n_b, out_ptr,
                                lse_rows, tidx % 32)
            if wgc == 0:
                self._take_turn(0)  # the last warpgroup's last pass

    @cute.jit
    def _close(self, acc_o: cute.Tensor, t_orp: cute.Tensor, tOrV: cute.Tensor, t_co: cute.Tensor,
               fin: cute.Tensor, tiles: Int32, g_last: Int32, mbar: cute.Pointer, idx0: Int64, r0: Int32, n_b: Int32,
               out_ptr: cute.Pointer, lse_rows: cute.Tensor, lane: Int32, issued: cutlass.Constexpr = False):
        """Finishes the open item (its last tile's P in registers, its rows' factors and lse in fin: `_finalize`):
        its last P V and stage (`_drain`), then its rows stored (`_store`)."""
        self._drain(acc_o, t_orp, tOrV, tiles, g_last, mbar, issued)
        self._store(acc_o, t_co, fin, idx0, r0, n_b, out_ptr, lse_rows, lane)

    @cute.jit
    def _drain(self, acc_o: cute.Tensor, t_orp: cute.Tensor, tOrV: cute.Tensor, tiles: Int32, g_last: Int32,
               mbar: cute.Pointer, issued: cutlass.Constexpr = False):
        """An item's last P V, on ring tile g_last where it has `tiles` > 0 (already issued where `issued`, with
        the next item's first S; else issued here, alone), waited for, then its stage released."""
        NS = const_expr(self.stages)
        if const_expr(not issued):
            if tiles > 0:
                self._last_pv(acc_o, t_orp, tOrV, mbar, g_last)
                if const_expr(not self.overlap):
                    warpgroup.wait_group(0)
            if const_expr(self.overlap):
                # on every path: with the open item ptxas does not follow that no product is in flight on the
                # path without key tiles, and serialized every wgmma of the kernel for the epilogue's reads
                # there; without it, the wait in this place made ptxas spill 144 bytes a thread at D 256
                warpgroup.wait_group(0)
        if tiles > 0:
            cute.arch.mbarrier_arrive(empty_barrier(mbar, NS, ring_slot(g_last, NS)[0]))

    @cute.jit
    def _last_pv(self, acc_o: cute.Tensor, t_orp: cute.Tensor, tOrV: cute.Tensor, mbar: cute.Pointer,
                 g_last: Int32):
        """Issues an item's last P V alone (outside the GEMM turns), on ring tile g_last once its V has landed."""
        NS = const_expr(self.stages)
        stage, phase = ring_slot(g_last, NS)
        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 1, stage), phase)
        cute.arch.fence_proxy("async.shared", space="cta")
        warpgroup.fence()
        self._pv(acc_o, t_orp, tOrV, stage)

    def _release_q(self, mbar: cute.Pointer, qs: Int32, wgc: Int32, last):
        """Where `last`: this consumer warpgroup's last S = Q K^T of its item is done (each thread arrives after
        its own wait), so Q tile qs's rows of the warpgroup are free for the producer's next load into them
        (`_load_q`). A predicated arrive, no branch (`ptx.mbarrier_arrive_if`)."""
        mbarrier_arrive_if(self._q_barrier(mbar, 1, qs, wgc), Int32(last))

    @cute.jit
    def _sink(self, sinks_ptr: cute.Pointer, has_sinks: Int32, hq: Int32):
        """Query head hq's sink logit in log2 units (NEG_BIG without sinks)."""
        sink = Float32(NEG_BIG)
        if has_sinks != 0:
            sinks = cute.make_tensor(sinks_ptr, cute.make_layout((1 << 30,)))
            sink = Float32(sinks[hq]) * Float32(LOG2E)
        return sink

    @cute.jit
    def _factor(self, m_run: cute.Tensor, l_run: cute.Tensor, v_scale: Float32, sink: Float32,
                rh: cutlass.Constexpr, lse_now: cutlass.Constexpr):
        """Row half rh of this thread at an item's end, the sink (`_sink`) folded into the denominator: (f, lse,
        m, l, seen), f the factor of the row's output (0 for a row that saw no key), m and l the row's max and
        denominator; lse its natural-log lse (-inf for a row that saw no key) where `lse_now`, in f's branch,
        else left to the caller (`_lse`, after the stores). ptxas spilled the 192-row D 64 build with the open
        item's lse computed apart from f, and the D 256 build with its lse computed before the stores."""
        l_r = l_run[rh]
        l_r = l_r + cute.arch.shuffle_sync_bfly(l_r, offset=1)
        l_r = l_r + cute.arch.shuffle_sync_bfly(l_r, offset=2)
        m_r = m_run[rh]
        m_f = cutlass.max(m_r, sink)
        seen = l_r > Float32(0.0)
        l_f = Float32(1.0)
        if seen:
            l_f = l_r * cute.arch.exp2(m_r - m_f) + cute.arch.exp2(sink - m_f)
        f = Float32(0.0)
        lse = Float32(-math.inf)
        if seen:
            f = cute.arch.exp2(m_r - m_f) * v_scale / l_f
            if const_expr(lse_now):
                lse = self._lse(m_f, l_f)
        return f, lse, m_f, l_f, seen

    @staticmethod
    def _lse(m_f: Float32, l_f: Float32):
        """The natural-log lse of a row that saw a key, from `_factor`'s max and denominator (log2 units)."""
        return (m_f + cute.math.log2(l_f)) * Float32(LN2)

    @cute.jit
    def _epilogue(self, acc_o: cute.Tensor, t_co: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor,
                  v_scale: Float32, sinks_ptr: cute.Pointer, has_sinks: Int32, hq: Int32, r0: Int32, n_b: Int32,
                  row0: Int64, out_ptr: cute.Pointer, lse_rows: cute.Tensor, lane: Int32):
        """An item closed at its end (no open item: D 256), after its last P V: each row half's factor, then its
        output rows (`_store_half`) and their lse, for this consumer warpgroup's 64 rows. (The open item's
        order, both halves' factors and lse ahead of the last P V, spilled here and was slower: h200.md,
        "Session 61".)"""
        sink = self._sink(sinks_ptr, has_sinks, hq)
        for rh in cutlass.range_constexpr(2):
            f, _, m_f, l_f, seen = self._factor(m_run, l_run, v_scale, sink, rh, lse_now=False)
            row = t_co[2 * rh][0]
            r = r0 + row
            mine = (r >= 0) & (r < n_b)  # a row of the request (not past it, nor below the tile's row 0)
            idx = (row0 + Int64(r)) * self.hq + Int64(hq)
            self._store_half(acc_o, t_co, rh, f, out_ptr.toint() + idx * self.d * 2, mine, lane)
            if mine:
                if t_co[2 * rh][1] == 0:
                    lse = Float32(-math.inf)
                    if seen:
                        lse = self._lse(m_f, l_f)
                    lse_rows[idx] = lse

    @cute.jit
    def _finalize(self, m_run: cute.Tensor, l_run: cute.Tensor, v_scale: Float32, sink: Float32, fin: cute.Tensor):
        """The open item's softmax state at its end to what its stores need (`_store`), per row half rh of this
        thread (`_factor`): fin[rh] the factor of the row's output, fin[2 + rh] its lse."""
        for rh in cutlass.range_constexpr(2):
            f, lse, _, _, _ = self._factor(m_run, l_run, v_scale, sink, rh, lse_now=True)
            fin[rh] = f
            fin[2 + rh] = lse

    @cute.jit
    def _store(self, acc_o: cute.Tensor, t_co: cute.Tensor, fin: cute.Tensor, idx0: Int64, r0: Int32, n_b: Int32,
               out_ptr: cute.Pointer, lse_rows: cute.Tensor, lane: Int32):
        """The open item's output rows and their lse (`_finalize`'s fin) for this consumer warpgroup's 64 rows:
        tile row `row` is the request's row r0 + row (stored where in [0, n_b)), at (idx0 + row x Hq) x D in
        out and idx0 + row x Hq in lse (idx0: the tile's row 0 and query head)."""
        for rh in cutlass.range_constexpr(2):
            row = t_co[2 * rh][0]
            r = r0 + row
            mine = (r >= 0) & (r < n_b)
            idx = idx0 + Int64(row) * self.hq
            self._store_half(acc_o, t_co, rh, fin[rh], out_ptr.toint() + idx * self.d * 2, mine, lane)
            if mine:
                if t_co[2 * rh][1] == 0:
                    lse_rows[idx] = fin[2 + rh]

    @cute.jit
    def _store_half(self, acc_o: cute.Tensor, t_co: cute.Tensor, rh: cutlass.Constexpr, f: Float32, out_row: Int64,
                    mine, lane: Int32):
        """Row half rh of this thread's output rows, times f, to out_row (the row's byte address) where `mine`,
        straight from the registers: no shared memory, so the Q rows are free for the next item's Q once the
        last S = Q K^T is done.

        A thread holds, per row, 32-bit pairs of columns 8 j + 2 q (q = lane % 4) for every group j of 8
        columns. Lanes q and q ^ 1 trade one pair per two groups (one shuffle): the even lane then holds 4
        adjacent columns of group 2 i, the odd lane 4 of group 2 i + 1, and each stores them as one 8-byte
        write, so every warp store instruction fills 8 rows x 32 contiguous bytes (whole sectors)."""
        dt = self.dtype
        NG = const_expr(self.d // 8)
        odd = lane % 2
        pair = cute.make_rmem_tensor((2,), Uint32)
        for i in cutlass.range_constexpr(NG // 2):
            e0 = const_expr(8 * i + 2 * rh)  # the pair of group 2 i in this row half (element e0, e0 + 1)
            e1 = const_expr(e0 + 4)  # the pair of group 2 i + 1
            w0 = pack2(acc_o[e0] * f, acc_o[e0 + 1] * f, bf16=dt == cutlass.BFloat16)
            w1 = pack2(acc_o[e1] * f, acc_o[e1 + 1] * f, bf16=dt == cutlass.BFloat16)
            send = w1
            if odd != 0:
                send = w0
            # every lane shuffles (shfl.sync over the whole warp), only the rows of the request store
            got = Uint32(cute.arch.shuffle_sync_bfly(send, offset=1))
            pair[0] = w0
            pair[1] = got
            col = t_co[e0][1]
            if odd != 0:
                pair[0] = got
                pair[1] = w1
                col = col + 6  # group 2 i + 1 from column 2 (q - 1)
            if mine:
                dst = cute.make_tensor(cute.make_ptr(Uint32, out_row + col * 2, cute.AddressSpace.gmem,
                                                     assumed_align=8), cute.make_layout((2,)))
                cute.autovec_copy(pair, dst)

    @cute.jit
    def _pad_rows(self, out_ptr: cute.Pointer, lse_rows: cute.Tensor, hq: Int32, pad_from: Int32, ctid: Int32):
        """Packed q's padding rows past cu_seqlens_q[-1]: zeros and lse = -inf into the block_m rows of out from
        row pad_from that are below the capacity T, written by the 128 x NC consumer threads (ctid)."""
        D = const_expr(self.d)
        count = cutlass.min(Int32(self.block_m), Int32(self.s) - pad_from)
        CT = const_expr(128 * self.nc)
        for i in cutlass.range(self.block_m * D // CT, unroll=1):
            e = ctid + i * CT
            if e < count * D:
                r = Int64(pad_from) + Int64(e // D)
                orow = cute.make_tensor(out_ptr + (r * self.hq + Int64(hq)) * D, cute.make_layout((D,)))
                orow[e % D] = self.dtype(0.0)
                if e % D == 0:
                    lse_rows[r * self.hq + Int64(hq)] = Float32(-math.inf)

    def _mma_qk(self):
        """S = Q K^T: NC warpgroups of 64 rows, Q and K from shared memory (both K-major)."""
        kmaj = warpgroup.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, kmaj, kmaj, Float32, (self.nc, 1, 1),
                                                 (64, self.tile_n))

    def _mma_pv(self):
        """O += P V: P from registers, V from shared memory read N-major (the head dim is contiguous)."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, warpgroup.OperandMajorMode.K,
                                                 warpgroup.OperandMajorMode.MN, Float32, (self.nc, 1, 1), (64, self.d),
                                                 a_source=warpgroup.OperandSource.RMEM)

    def _masks(self) -> dict:
        """The compile-time flags of `online_softmax` for this kernel."""
        return dict(tile_n=self.tile_n, causal=self.causal, use_window=self.use_window, use_softcap=self.use_softcap,
                    rescale_log2=RESCALE_LOG2)

    def _take_turn(self, wgc):
        """Waits until consumer warpgroup `wgc` may issue its GEMMs (the one before it in the ring has issued
        its own)."""
        cute.arch.barrier(barrier_id=self.turn_bar + wgc, number_of_threads=256)

    def _pass_turn(self, wgc):
        """Consumer warpgroup `wgc` has issued its GEMMs: the next one in the ring may issue."""
        cute.arch.barrier_arrive(barrier_id=self.turn_bar + (wgc + 1) % self.nc, number_of_threads=256)

    @cute.jit
    def _rescale_and_convert(self, acc_o: cute.Tensor, alpha: cute.Tensor, r_p: cute.Tensor, acc_s: cute.Tensor):
        """O times alpha (its rows to the new running max), and P (the softmaxed score tile) to 16 bits, the A
        registers of the next P V. Only once the P V in flight is done: it reads both."""
        if _moved(alpha):
            _scale_rows(acc_o, alpha)
        r_p.store(acc_s.load().to(self.dtype))

    @cute.jit
    def _scores(self, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor, stage: Int32, qs: Int32):
        """Issues S = Q K^T of Q tile `qs` and the K tile in `stage` (D / 16 wgmma k-steps, one commit group).
        The tiled MMA is made here: its accumulate flag is traced state that must not cross a control-flow
        region."""
        mma_qk = self._mma_qk()
        for k in cutlass.range_constexpr(self.d // 16):
            mma_qk.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_qk, acc_s, tSrQ[None, None, k, qs], tSrK[None, None, k, stage], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _pv(self, acc_o: cute.Tensor, t_orp: cute.Tensor, tOrV: cute.Tensor, stage: Int32):
        """Issues O += P V with P from registers and the V tile in `stage` (one commit group)."""
        mma_pv = self._mma_pv()
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(self.tile_n // 16):
            cute.gemm(mma_pv, acc_o, t_orp[None, None, k], tOrV[None, None, k, stage], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def _produce(self, tidx: Int32, b: Int32, h: Int32, lo: Int32, hi: Int32, length: Int32, n_tiles: Int32,
                 done: Int32, k_ptr: cute.Pointer, v_ptr: cute.Pointer, pt_ptr: cute.Pointer, k_sp: Int64, k_so: Int64,
                 k_sh: Int64, v_sp: Int64, v_so: Int64, v_sh: Int64, pt_sb: Int64, num_pages: Int32, wK: cute.Tensor,
                 wV: cute.Tensor, mbar: cute.Pointer, ring: cute.Pointer, tma_k, m_k, tma_v, m_v, q_at):
        """The producer warpgroup: each tile's K rows, then its V rows, into the ring; the stage's K-full and
        V-full mbarriers (128 arrivals each) complete when the copies land, so the producer never waits for
        its own loads, only for a stage to be released. Tile `it` of this item is ring tile done + it (`done`:
        the tiles loaded for the CTA's earlier items).

        A tile of keys the request has (all below its length, so finite even past the causal or window
        limit) starting on a box boundary goes by TMA where the page geometry allows (`tma_box`, `_tma_tile`);
        any other tile by cp.async (`_cp_async_tile`). Where `q_at` is given (`_load_q`'s arguments), the
        item's Q goes right after its first tile (or alone, for an item without key tiles)."""
        BN = const_expr(self.tile_n)
        NS = const_expr(self.stages)
        BOX = const_expr(self.box)
        if const_expr(q_at is not None):
            if n_tiles == 0:
                self._load_q(tidx, mbar, *q_at)
        for it in cutlass.range(n_tiles, unroll=1):
            g = done + it
            stage, phase = ring_slot(g, NS)
            if g >= NS:
                cute.arch.mbarrier_wait(empty_barrier(mbar, NS, stage), 1 - phase)  # its previous use's release
            j0 = lo + it * BN
            if const_expr(BOX != 0):
                if (j0 % BOX == 0) & (j0 + BN <= length):
                    self._tma_tile(tidx, b, h, j0, stage, pt_ptr, pt_sb, num_pages, mbar, ring, tma_k, m_k, tma_v,
                                   m_v)
                else:
                    self._cp_async_tile(tidx, b, h, j0, hi, stage, k_ptr, v_ptr, pt_ptr, k_sp, k_so, k_sh, v_sp,
                                        v_so, v_sh, pt_sb, num_pages, wK, wV, mbar)
            else:
                self._cp_async_tile(tidx, b, h, j0, hi, stage, k_ptr, v_ptr, pt_ptr, k_sp, k_so, k_sh, v_sp, v_so,
                                    v_sh, pt_sb, num_pages, wK, wV, mbar)
            if const_expr(q_at is not None):
                if it == 0:
                    self._load_q(tidx, mbar, *q_at)

    @cute.jit
    def _load_q(self, tidx: Int32, mbar: cute.Pointer, b: Int32, r0: Int32, row0: Int64, hq: Int32, qn: Int32,
                q_tile: cute.Pointer, tma_q, m_q):
        """The producer's load of a work item's Q by TMA into Q tile qn % q_bufs, qn the CTA's round (every item
        of a CTA before its first padding item has a Q, and none after it). By warp 0, per consumer
        warpgroup c: once c's Q-empty mbarrier says the tile's last reader (the item q_bufs before) is done with
        its rows, the c-th 64 rows of the item's row tile (from row r0 + 64 c of the request), one box per 64
        head-dim elements, completing c's Q-full mbarrier with their bytes (expect-tx). Rows outside q (below
        row 0 of a 4D request) land as zeros; the rows of a packed tile below its request's first row are
        other rows of q, which only rows that are never stored see (a row's scores, softmax and output are its
        own)."""
        QB = const_expr(self.q_bufs)
        D = const_expr(self.d)
        qs = qn % QB
        row = r0
        bq = b
        if const_expr(self.packed):
            row = Int32(row0) + r0
            bq = Int32(0)
        if tidx < 32:  # warp 0: a TMA copy is issued by one elected lane of a whole warp
            for c in cutlass.range(self.nc, unroll=1):
                if qn >= QB:
                    cute.arch.mbarrier_wait(self._q_barrier(mbar, 1, qs, c), (qn // QB + 1) % 2)
                bar = self._q_barrier(mbar, 0, qs, c)
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, 64 * D * 2)
                for sl in cutlass.range_constexpr(max(D // 64, 1)):
                    # Q tile qs, slab sl, rows 64 c ... (elements; see chunks_view)
                    dst = q_tile + (qs * self.block_m * D + sl * self.block_m * 64 + c * 64 * 64)
                    tma.copy_rows(tma_q, m_q, dst, 64, row + 64 * c, sl, hq, bq, bar)

    def _q_first(self) -> bool:
        """Whether the producer loads an item's Q before its first key tile rather than right after it: with two
        Q tiles (the one it loads into was freed an item ago, so its wait is over at once). With one, the wait
        for the tile's Q-empty would hold the item's first K/V loads behind the last item's final S; after the
        first tile it does not (the two orders timed within the runs' spread at 4D, the later ahead with packed q:
        benchmarks/results/h200.md, session 63)."""
        return self.q_bufs == 2

    def _q_barrier(self, mbar: cute.Pointer, empty: int, qs, c: int):
        """Q tile qs's Q-full (empty 0: the producer's TMA landed) or Q-empty (empty 1: consumer warpgroup c's
        last S = Q K^T of the tile's item is done) mbarrier for consumer warpgroup c (storage.extend_storage)."""
        return mbar + 3 * self.stages + (empty * self.q_bufs + qs) * self.nc + c

    @cute.jit
    def _tma_tile(self, tidx: Int32, b: Int32, h: Int32, j0: Int32, stage: Int32, pt_ptr: cute.Pointer,
                  pt_sb: Int64, num_pages: Int32, mbar: cute.Pointer, ring: cute.Pointer, tma_k, m_k, tma_v, m_v):
        """One tile by TMA (keys j0 .. j0 + BN, all the request's): box row r (keys j0 + r x BOX ..., one page)
        goes to warp r % 4, which issues its D / 64 head-dim slabs of K, then of V (a TMA copy is issued by
        one elected lane, with warp-uniform coordinates: the page id is read by lane r // 4 and shuffled).
        Thread 0 arrives with the tile's byte count (expect-tx), the 127 others plainly."""
        BN = const_expr(self.tile_n)
        BOX = const_expr(self.box)
        NS = const_expr(self.stages)
        SLABS = const_expr(max(self.d // 64, 1))
        BOX_ROWS = const_expr(BN // BOX)
        warp = tidx // 32
        lane = tidx % 32
        page = Int32(0)
        if (warp + 4 * lane < BOX_ROWS) & (lane < (BOX_ROWS + 3) // 4):
            page = tma.box_page(PageRow(pt_ptr, pt_sb, b, num_pages), j0, self.page, BOX, warp + 4 * lane)
        for kv in cutlass.range_constexpr(2):
            bar = full_barrier(mbar, NS, kv, stage)
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, BN * self.d * 2)
            else:
                cute.arch.mbarrier_arrive(bar)
            for i in cutlass.range_constexpr((BOX_ROWS + 3) // 4):
                if warp + 4 * i < BOX_ROWS:
                    rb = warp + 4 * i
                    p = cute.arch.shuffle_sync(page, i)
                    for sl in cutlass.range_constexpr(SLABS):
                        # stage, slab sl, rows rb x BOX ... of the K or V ring (elements; see chunks_view)
                        dst = ring + ((kv * NS + stage) * BN * self.d + sl * BN * 64 + rb * BOX * 64)
                        tma.copy_box(tma_k if kv == 0 else tma_v, m_k if kv == 0 else m_v, dst, BOX, j0, self.page,
                                     sl, h, p, bar)

    @cute.jit
    def _cp_async_tile(self, tidx: Int32, b: Int32, h: Int32, j0: Int32, hi: Int32, stage: Int32,
                       k_ptr: cute.Pointer, v_ptr: cute.Pointer, pt_ptr: cute.Pointer, k_sp: Int64, k_so: Int64,
                       k_sh: Int64, v_sp: Int64, v_so: Int64, v_sh: Int64, pt_sb: Int64, num_pages: Int32,
                       wK: cute.Tensor, wV: cute.Tensor, mbar: cute.Pointer):
        """One tile by cp.async: first the K rows, then the V rows, each followed by this thread's
        cp.async.mbarrier.arrive on the stage's K-full or V-full mbarrier."""
        BN = const_expr(self.tile_n)
        CH = const_expr(self.chunks)
        NS = const_expr(self.stages)
        dt = self.dtype
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dt,
                                   num_bits_per_copy=128)
        pt_row = PageRow(pt_ptr, pt_sb, b, num_pages)
        # byte addresses, kept cheap (about 14 instructions per cp.async): page ids and key
        # indices are non-negative, so they divide and widen as unsigned; the page offset stays 64-bit
        ch = tidx % CH
        k_base = k_ptr.toint() + Int64(h) * k_sh * 2 + ch * 16
        v_base = v_ptr.toint() + Int64(h) * v_sh * 2 + ch * 16
        k_sp_b, k_so_b, v_sp_b, v_so_b = k_sp * 2, k_so * 2, v_sp * 2, v_so * 2
        last = Uint32(hi - 1)
        ROWS = const_expr(BN * CH // 128)  # rows of a tile this thread copies (one chunk each)
        j1 = Uint32(j0 + tidx // CH)
        for kv in cutlass.range_constexpr(2):  # K first, so the scores can start before V lands
            w = wK if kv == 0 else wV
            gbase = k_base if kv == 0 else v_base
            sp = k_sp_b if kv == 0 else v_sp_b
            so = k_so_b if kv == 0 else v_so_b
            for i in cutlass.range(ROWS, unroll=8 if self.nc == 2 else 4):
                row = tidx // CH + i * (128 // CH)
                # rows past the range copy the last visible key (finite; the consumers mask it to P = 0)
                j = cutlass.min(j1 + Uint32(i * (128 // CH)), last)
                page = Int64(Uint32(pt_row[j // self.page]))
                src = cute.make_tensor(cute.make_ptr(dt, gbase + page * sp + Int64(j % self.page) * so,
                                                     cute.AddressSpace.gmem, assumed_align=16),
                                       cute.make_layout((8,)))
                cute.copy(atom, src, self._chunk(w[stage, None, None, None, None, None], row, ch))
            cute.arch.cp_async_mbarrier_arrive_noinc(full_barrier(mbar, NS, kv, stage))
