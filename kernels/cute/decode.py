"""Decode and verify in CuTe DSL: split-KV attention over paged K/V, staged through shared memory by TMA or cp.async.

One CTA (32 x num_warps threads) takes request b, KV head h and one partition (split) of the visible key
range, and serves all R = S x G query rows of that KV head (row r: token r // G, query head h * G + r % G),
so each K/V tile is read from memory once. The products run on the CUDA cores in fp32 (a GEMV per row: with
R <= 16 rows most of a tensor-core tile would be padding). The thread geometry is `geometry` in
kernels/cute/__init__.py. Per tile of TN keys:

1. The tile's K and V rows go into a STAGES-deep ring of shared-memory buffers (key j of the request lives
   at page page_table[b, j // PAGE], slot j % PAGE). Chunks of 16 bytes are XOR-swizzled within a row
   (chunk c of key r at c ^ (r & swizzle)) so that the per-key reads below hit distinct banks.
   - By TMA (kernels/cute/tma.py) where a key's row is 128 bytes (float8 D 128, 16-bit D 64: the swizzle
     is then exactly TMA's 128-byte one) and the page geometry allows (`tma_box`): a tile whose keys are
     all below the partition's end and that starts on a box goes as one box per page (or tile-sized part of
     a page), K and V completing the stage's mbarrier with their byte count. The other tiles of such a
     kernel go by cp.async and arrive on the same mbarrier as their copies land.
   - By cp.async otherwise, with a commit group per tile (the page id widened to 64 bits before it is
     multiplied by the page stride). Keys past the partition are zero-filled, never left stale.
   Float8 rows of 128-key tiles by TMA: 16x16384 went from 183 to 158 us (h200.md).
2. Scores: each thread takes 2 keys and one part of the head dim and accumulates the R partial dot
   products in fp32 (float8 keys are widened in registers; q is kept in shared memory in fp32 and read by
   broadcast).
3. Softmax: one warp per row adds the parts, applies scale (descale folded in), softcap and the masks
   (kv_start, causal, window), and updates the row's running max and sum (log2 domain).
4. P V: each thread owns CPT adjacent columns of V for a subset of the tile's keys and accumulates R x CPT
   fp32 sums; the subsets are added at the end.

Every CTA writes its normalized partial output and log2-sum-exp in the layout of the Triton family's
scratch ([rows, splits, D] and [rows, splits]); the Triton merge kernel then combines the splits with the
sink and writes `out` and `lse`, so both families share one merge. With one split the CTA writes `out` and
`lse` itself, the sink folded in as the merge folds it (`_emit`, common.output_factor), and no merge runs.

The split's key range is computed on the device from the live length, exactly as in the Triton kernel, so
one compiled kernel serves every length (lengths, kv_start and page ids clamped as the Triton kernels clamp
them: `live_range`, `PageRow`); all launches go on the stream the caller passes (torch's current
stream), which is what makes them capturable in a CUDA graph.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from b12x_inductor.kernels.cute import KEYS_PER_THREAD, geometry, tma, tma_box

from b12x_inductor.kernels.cute.common import (NEG_BIG, PageRow, live_range, logit, output_factor, ring_slot,
                                               scales, split_keys, visible_range)


class SplitKernel:
    """The split kernel for one set of compile-time constants (see `kernels/cute/__init__.py`)."""

    GEOMETRY = staticmethod(geometry)  # the thread geometry function of this kernel (kernels/cute/__init__.py)

    def __init__(self, *, d: int, s: int, g: int, hkv: int, page: int, num_splits: int, tile_n: int, stages: int,
                 num_warps: int, q_dtype, kv_dtype, causal: bool, use_window: bool, use_softcap: bool,
                 sm_count: int):
        # TMA for whole tiles where a key's row is one 128-byte swizzle row (float8 D 128, 16-bit D 64) and the
        # page geometry allows (tma_box); 0: every tile by cp.async
        self.box = tma_box(page=page, tile_n=tile_n) if d * kv_dtype.width == 1024 else 0
        geo = self.GEOMETRY(d=d, rows=s * g, kv_bits=kv_dtype.width, tile_n=tile_n, stages=stages,
                            num_warps=num_warps, tma=self.box != 0)
        assert geo is not None, ("the plan's tile does not fit this kernel (kernels/cute/__init__.py: "
                                 f"{self.GEOMETRY.__name__})")
        self.__dict__.update(geo)  # with `storage`, the kernel's shared memory (kernels/cute/storage.py)
        self.s, self.g, self.hkv, self.page, self.num_splits = s, g, hkv, page, num_splits
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.causal, self.use_window, self.use_softcap = causal, use_window, use_softcap
        self.sm_count = sm_count

    @cute.jit
    def __call__(
        self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, kds_ptr: cute.Pointer, vds_ptr: cute.Pointer,
        part_o_ptr: cute.Pointer, part_l_ptr: cute.Pointer, sinks_ptr: cute.Pointer,
        batch: Int32, q_sb: Int64, q_ss: Int64, q_sh: Int64, k_sp: Int64, k_so: Int64, k_sh: Int64,
        v_sp: Int64, v_so: Int64, v_sh: Int64, pt_sb: Int64,
        kds_b: Int32, kds_h: Int32, vds_b: Int32, vds_h: Int32,
        has_kv_start: Int32, has_kds: Int32, has_vds: Int32, has_sinks: Int32,
        window_left: Int32, sm_scale: Float32, softcap: Float32, k_pages: Int32, v_pages: Int32, max_pages: Int32,
        stream,
    ):
        tma_k, m_k, tma_v, m_v = None, None, None, None
        if const_expr(self.box != 0):
            geo = dict(page=self.page, d=self.d, hkv=self.hkv, box=self.box)
            tma_k, m_k = tma.cache_tma(k_ptr, k_pages, k_sp, k_so, k_sh, **geo)
            tma_v, m_v = tma.cache_tma(v_ptr, v_pages, v_sp, v_so, v_sh, **geo)
        self.kernel(
            q_ptr, k_ptr, v_ptr, pt_ptr, seqlens_ptr, kv_start_ptr, kds_ptr, vds_ptr, part_o_ptr, part_l_ptr,
            sinks_ptr, batch, q_sb, q_ss, q_sh, k_sp, k_so, k_sh, v_sp, v_so, v_sh, pt_sb, kds_b, kds_h, vds_b,
            vds_h, has_kv_start, has_kds, has_vds, has_sinks, window_left, sm_scale, softcap, max_pages * self.page,
            k_pages, tma_k, m_k, tma_v, m_v,
        ).launch(grid=self._grid(batch), block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream)

    def _grid(self, batch: Int32):
        """The launch grid: one CTA per (split, KV head, request)."""
        return (self.num_splits, self.hkv, batch)

    @cute.jit
    def _load_tile(self, k_base: Int64, v_base: Int64, pt_row: PageRow, sK: cute.Tensor, sV: cute.Tensor,
                   atom, tile_lo: Int32, s_hi: Int32, stage: Int32, tidx: Int32,
                   k_sp: Int64, k_so: Int64, v_sp: Int64, v_so: Int64):
        TILE_N = const_expr(self.tile_n)
        THREADS = const_expr(self.threads)
        ch_n = const_expr(self.chunks)
        vec = const_expr(self.vec)
        esize = const_expr(self.kv_dtype.width // 8)
        for i in cutlass.range_constexpr(TILE_N * ch_n // THREADS):
            ci = tidx + i * THREADS
            key = ci // ch_n
            ch = ci % ch_n
            phys = ch ^ (key & self.swizzle)
            dst_k = sK[stage, key, phys, None]
            dst_v = sV[stage, key, phys, None]
            j = tile_lo + key
            if j < s_hi:
                page = Int64(pt_row[j // self.page])
                slot = Int64(j % self.page)
                off = Int64(ch * vec)
                src_k = cute.make_tensor(
                    cute.make_ptr(self.kv_dtype, k_base + (page * k_sp + slot * k_so + off) * esize,
                                  cute.AddressSpace.gmem, assumed_align=16), cute.make_layout((vec,)))
                src_v = cute.make_tensor(
                    cute.make_ptr(self.kv_dtype, v_base + (page * v_sp + slot * v_so + off) * esize,
                                  cute.AddressSpace.gmem, assumed_align=16), cute.make_layout((vec,)))
                cute.copy(atom, src_k, dst_k)
                cute.copy(atom, src_v, dst_v)
            else:
                for e in cutlass.range_constexpr(vec):
                    dst_k[e] = self.kv_dtype(0.0)
                    dst_v[e] = self.kv_dtype(0.0)

    @cute.jit
    def _ring(self, storage, tidx: Int32, tma_k, m_k, tma_v, m_v):
        """The K/V ring of the split kernels' shared memory (`storage.ring`, 1024-byte aligned for TMA's swizzle;
        its `partials` reuse it for their reductions): (its raw pointer, sK, sV, tiles). With TMA (self.box)
        `tiles` holds what `_fill` and `_wait` need, with one mbarrier per stage (`storage.mbar`) completed by
        the THREADS arrivals of whoever filled it (plus the TMA bytes); without, None (cp.async groups)."""
        TILE_N = const_expr(self.tile_n)
        D = const_expr(self.d)
        kv_layout = cute.make_layout((self.stages, TILE_N, self.chunks, self.vec),
                                     stride=(TILE_N * D, D, self.vec, 1))
        raw = storage.ring.kv.data_ptr()
        ring = cute.recast_ptr(raw, dtype=self.kv_dtype)
        sK = cute.make_tensor(ring, kv_layout)
        sV = cute.make_tensor(ring + self.stages * TILE_N * D, kv_layout)
        if const_expr(self.box == 0):
            return raw, sK, sV, None
        mbar = storage.mbar.data_ptr()
        if tidx == 0:
            for i in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(mbar + i, self.threads)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        return raw, sK, sV, (tma_k, m_k, tma_v, m_v, mbar)

    def _sources(self, pt_ptr: cute.Pointer, pt_sb: Int64, num_pages: Int32, k_ptr: cute.Pointer,
                 v_ptr: cute.Pointer, k_sh: Int64, v_sh: Int64, b: Int32, h: Int32):
        """(pt_row, k_base, v_base, atom) as `_fill` takes them: request b's page-table row (a `PageRow`), the
        byte addresses of KV head h in the two caches, and the 16-byte cp.async atom."""
        kvt = self.kv_dtype
        pt_row = PageRow(pt_ptr, pt_sb, b, num_pages)
        k_base = k_ptr.toint() + Int64(h) * k_sh * (kvt.width // 8)
        v_base = v_ptr.toint() + Int64(h) * v_sh * (kvt.width // 8)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), kvt,
                                   num_bits_per_copy=128)
        return pt_row, k_base, v_base, atom

    def _whole(self, tile_lo: Int32, s_hi: Int32):
        """Whether the tile from tile_lo goes by TMA: every key below s_hi (so the request's) and its start on a
        box."""
        return (tile_lo % self.box == 0) & (tile_lo + self.tile_n <= s_hi)

    @cute.jit
    def _tile_pages(self, pt_row: PageRow, tile_lo: Int32, s_hi: Int32, tidx: Int32):
        """The page id this thread hands `_tma_tile` for the tile from tile_lo: box row warp + WARPS x lane's
        where the tile goes by TMA and the lane has a box row, else 0 (read for no other tile, so no index
        reaches past the page-table row). The kernels read a tile's ids here one tile before its `_fill`, so
        the load of an id is not on the path from a stage's release to its copy."""
        page = Int32(0)
        if const_expr(self.box != 0):
            WARPS = const_expr(self.warps)
            BOX_ROWS = const_expr(self.tile_n // self.box)
            warp = tidx // 32
            lane = tidx % 32
            if self._whole(tile_lo, s_hi) & (warp + WARPS * lane < BOX_ROWS):
                page = tma.box_page(pt_row, tile_lo, self.page, self.box, warp + WARPS * lane)
        return page

    def _guess_pages(self, pt_row: PageRow, cap: Int32, tidx: Int32):
        """The first NS tiles' `_tile_pages` for a range from key 0, read before the live length is (the page
        table's capacity `cap` bounding them), so that a CTA's first page ids load beside its length."""
        return [self._tile_pages(pt_row, Int32(st * self.tile_n), cap, tidx) for st in range(self.stages)]

    def _first_pages(self, guess: list, pt_row: PageRow, s_lo: Int32, s_hi: Int32, tidx: Int32):
        """The first NS tiles' `_tile_pages` of the range [s_lo, s_hi): `guess` where s_lo is 0 (each a tile
        that `_fill` takes by TMA has the same ids whichever end bounds it), else read now."""
        return [self._guess_or_read(guess[st], pt_row, s_lo, s_hi, st, tidx) for st in range(self.stages)]

    @cute.jit
    def _guess_or_read(self, guess: Int32, pt_row: PageRow, s_lo: Int32, s_hi: Int32, st: cutlass.Constexpr,
                       tidx: Int32):
        page = guess
        if s_lo != 0:
            page = self._tile_pages(pt_row, s_lo + st * self.tile_n, s_hi, tidx)
        return page

    @cute.jit
    def _fill(self, k_base: Int64, v_base: Int64, pt_row: PageRow, sK: cute.Tensor, sV: cute.Tensor, atom,
              tile_lo: Int32, s_hi: Int32, stage: Int32, tidx: Int32, h: Int32, k_sp: Int64, k_so: Int64,
              v_sp: Int64, v_so: Int64, tiles, pages: Int32):
        """Loads one tile into `stage`: by TMA where it is whole (`_whole`), its page ids `pages` as
        `_tile_pages` read them, else by cp.async (keys past s_hi zero-filled); with TMA compiled in, the
        cp.async copies then arrive on the stage's mbarrier as they land."""
        if const_expr(self.box == 0):
            self._load_tile(k_base, v_base, pt_row, sK, sV, atom, tile_lo, s_hi, stage, tidx, k_sp, k_so, v_sp,
                            v_so)
        else:
            tma_k, m_k, tma_v, m_v, mbar = tiles
            if self._whole(tile_lo, s_hi):
                self._tma_tile(pages, sK, sV, tile_lo, stage, tidx, h, tma_k, m_k, tma_v, m_v, mbar + stage)
            else:
                self._load_tile(k_base, v_base, pt_row, sK, sV, atom, tile_lo, s_hi, stage, tidx, k_sp, k_so, v_sp,
                                v_so)
                cute.arch.cp_async_mbarrier_arrive_noinc(mbar + stage)

    @cute.jit
    def _tma_tile(self, page: Int32, sK: cute.Tensor, sV: cute.Tensor, tile_lo: Int32, stage: Int32,
                  tidx: Int32, h: Int32, tma_k, m_k, tma_v, m_v, bar: cute.Pointer):
        """One whole tile by TMA: box row r (keys tile_lo + r x BOX ..., one page) goes to warp r % WARPS, which
        copies its K box and its V box (one elected lane each; the page id, `page` of lane r // WARPS, is
        shuffled). Thread 0 arrives with the tile's byte count (expect-tx), the others plainly."""
        TILE_N = const_expr(self.tile_n)
        BOX = const_expr(self.box)
        WARPS = const_expr(self.warps)
        BOX_ROWS = const_expr(TILE_N // BOX)
        PER_WARP = const_expr((BOX_ROWS + WARPS - 1) // WARPS)
        warp = tidx // 32
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * TILE_N * 128)
        else:
            cute.arch.mbarrier_arrive(bar)
        for i in cutlass.range_constexpr(PER_WARP):
            if warp + WARPS * i < BOX_ROWS:
                rb = warp + WARPS * i
                p = cute.arch.shuffle_sync(page, i)
                off = (stage * TILE_N + rb * BOX) * self.d
                tma.copy_box(tma_k, m_k, sK.iterator + off, BOX, tile_lo, self.page, 0, h, p, bar)
                tma.copy_box(tma_v, m_v, sV.iterator + off, BOX, tile_lo, self.page, 0, h, p, bar)

    def _commit(self):
        """Closes a tile's cp.async group (cp.async pipeline only)."""
        if const_expr(self.box == 0):
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _wait(self, it: Int32, tiles):
        """Waits until tile `it` has landed in its stage and every thread is done with the stage the next fill
        overwrites (the tile before it)."""
        if const_expr(self.box == 0):
            cute.arch.cp_async_wait_group(self.stages - 2)
        else:
            mbar = tiles[4]
            stage, phase = ring_slot(it, self.stages)
            cute.arch.mbarrier_wait(mbar + stage, phase)
        cute.arch.barrier()

    @cute.jit
    def _split_range(self, seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, has_kv_start: Int32,
                     window_left: Int32, split: Int32, b: Int32, cap: Int32):
        """(length, start, s_lo, s_hi, n_tiles): this split's visible key range [s_lo, s_hi), sized on the device
        from the live length exactly as the Triton kernel does, in whole tiles."""
        TILE_N = const_expr(self.tile_n)
        length, start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, b, cap)
        lo = start
        if const_expr(self.use_window):
            lo = cutlass.max(lo, length - self.s - window_left)
        s_lo, s_hi, n_tiles = split_keys(lo, length, split, self.num_splits, TILE_N)
        return length, start, s_lo, s_hi, n_tiles

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
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)  # kernels/cute/storage.py: split_storage
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        TILE_N = const_expr(self.tile_n)
        THREADS = const_expr(self.threads)
        WARPS = const_expr(self.warps)
        D = const_expr(self.d)
        S = const_expr(self.s)
        G = const_expr(self.g)
        R = const_expr(self.rows)
        VEC = const_expr(self.vec)
        CH = const_expr(self.chunks)
        NS = const_expr(self.stages)
        PARTS = const_expr(self.parts)
        CPT = const_expr(self.cpt)
        KP = const_expr(self.key_parts)

        # ---- shared memory ----
        _, sK, sV, tiles = self._ring(storage, tidx, tma_k, m_k, tma_v, m_v)
        sQ = storage.q.get_tensor(cute.make_layout((R, CH, VEC), stride=(D, VEC, 1)))
        sS = storage.scores.get_tensor(cute.make_layout((PARTS, R, TILE_N), stride=(R * TILE_N, TILE_N, 1)))
        sP = storage.p.get_tensor(cute.make_layout((TILE_N, R), stride=(R, 1)))
        sAlpha = storage.alpha.get_tensor(cute.make_layout((R,)))
        sM = storage.row_max.get_tensor(cute.make_layout((R,)))
        sL = storage.row_sum.get_tensor(cute.make_layout((R,)))

        # ---- the split's key range, from the live length (device-side); its first page ids read beside it ----
        pt_row, k_base, v_base, atom = self._sources(pt_ptr, pt_sb, num_pages, k_ptr, v_ptr, k_sh, v_sh, b, h)
        guess = self._guess_pages(pt_row, cap, tidx)
        length, start, s_lo, s_hi, n_tiles = self._split_range(seqlens_ptr, kv_start_ptr, has_kv_start, window_left,
                                                               split, b, cap)
        k_scale, v_scale = scales(kds_ptr, vds_ptr, has_kds, has_vds, kds_b, kds_h, vds_b, vds_h, sm_scale, b, h)

        # ---- q rows of this KV head -> shared memory (fp32) ----
        q_rows = cute.make_tensor(q_ptr, cute.make_layout((1 << 30,)))
        for i in cutlass.range_constexpr((R * D + THREADS - 1) // THREADS):
            e = tidx + i * THREADS
            if e < R * D:
                r = e // D
                col = e % D
                off = Int64(b) * q_sb + Int64(r // G) * q_ss + Int64(h * G + r % G) * q_sh + Int64(col)
                sQ[r, col // VEC, col % VEC] = Float32(q_rows[off])

        # ---- per-thread state ----
        # score phase: keys kj and kj + TILE_N / 2, head-dim part qp
        kj = tidx % (TILE_N // KEYS_PER_THREAD)
        qp = tidx // (TILE_N // KEYS_PER_THREAD)
        # P V phase: columns cg * CPT ... + CPT - 1, keys kp, kp + KP, ...
        cg = tidx % self.col_groups
        kp = tidx // self.col_groups
        acc = cute.make_rmem_tensor((R, CPT), Float32)
        for r in cutlass.range_constexpr(R):
            for c in cutlass.range_constexpr(CPT):
                acc[r, c] = Float32(0.0)
        # softmax phase: warp w owns rows w, w + WARPS, ...
        m_run = cute.make_rmem_tensor((self.rows_per_warp,), Float32)
        l_run = cute.make_rmem_tensor((self.rows_per_warp,), Float32)
        for i in cutlass.range_constexpr(self.rows_per_warp):
            m_run[i] = Float32(NEG_BIG)
            l_run[i] = Float32(0.0)

        # ---- prologue: the first NS - 1 tiles in flight ----
        # page ids a tile ahead of their fill (`_tile_pages`): the prologue's tiles' and the first fill's together
        pages = self._first_pages(guess, pt_row, s_lo, s_hi, tidx)
        for st in cutlass.range_constexpr(NS - 1):
            if st < n_tiles:
                self._fill(k_base, v_base, pt_row, sK, sV, atom, s_lo + st * TILE_N, s_hi, Int32(st), tidx, h,
                           k_sp, k_so, v_sp, v_so, tiles, pages[st])
            self._commit()
        next_pages = pages[NS - 1]
        cute.arch.barrier()

        for it in cutlass.range(n_tiles, unroll=1):
            stage = ring_slot(it, NS)[0]
            self._wait(it, tiles)
            nxt = it + NS - 1
            if nxt < n_tiles:
                self._fill(k_base, v_base, pt_row, sK, sV, atom, s_lo + nxt * TILE_N, s_hi, ring_slot(nxt, NS)[0],
                           tidx, h, k_sp, k_so, v_sp, v_so, tiles, next_pages)
            self._commit()
            next_pages = self._tile_pages(pt_row, s_lo + (nxt + 1) * TILE_N, s_hi, tidx)
            tile_lo = s_lo + it * TILE_N

            # 2. partial scores over this thread's part of the head dim
            dots = cute.make_rmem_tensor((KEYS_PER_THREAD, R), Float32)
            for kk in cutlass.range_constexpr(KEYS_PER_THREAD):
                for r in cutlass.range_constexpr(R):
                    dots[kk, r] = Float32(0.0)
            for c in cutlass.range_constexpr(CH // PARTS):
                ch = qp * (CH // PARTS) + c
                key0 = kj
                key1 = kj + TILE_N // KEYS_PER_THREAD
                k0 = sK[stage, key0, ch ^ (key0 & self.swizzle), None].load().to(Float32)
                k1 = sK[stage, key1, ch ^ (key1 & self.swizzle), None].load().to(Float32)
                for r in cutlass.range_constexpr(R):
                    qv = sQ[r, ch, None].load()
                    for e in cutlass.range_constexpr(VEC):
                        dots[0, r] = dots[0, r] + qv[e] * k0[e]
                        dots[1, r] = dots[1, r] + qv[e] * k1[e]
            for kk in cutlass.range_constexpr(KEYS_PER_THREAD):
                for r in cutlass.range_constexpr(R):
                    sS[qp, r, kj + kk * (TILE_N // KEYS_PER_THREAD)] = dots[kk, r]
            cute.arch.barrier()

            # 3. softmax of the tile, one warp per row
            for i in cutlass.range_constexpr(self.rows_per_warp):
                r = warp + i * WARPS
                if r < R:
                    tok = r // G
                    limit = length - S + tok
                    k_lo, k_hi = visible_range(s_hi, start, limit, window_left, self.causal, self.use_window)
                    pv = cute.make_rmem_tensor((TILE_N // 32,), Float32)
                    t_max = Float32(NEG_BIG)
                    for u in cutlass.range_constexpr(TILE_N // 32):
                        key = lane + u * 32
                        j = tile_lo + key
                        x = Float32(0.0)
                        for p in cutlass.range_constexpr(PARTS):
                            x = x + sS[p, r, key]
                        x = logit(x, k_scale, softcap, self.use_softcap)
                        x = x if (j >= k_lo) & (j < k_hi) else Float32(-math.inf)
                        pv[u] = x
                        t_max = cutlass.max(t_max, x)
                    for off in cutlass.range_constexpr(5):
                        t_max = cutlass.max(t_max, cute.arch.shuffle_sync_bfly(t_max, offset=1 << (4 - off)))
                    m_new = cutlass.max(m_run[i], t_max)
                    alpha = cute.arch.exp2(m_run[i] - m_new)
                    t_sum = Float32(0.0)
                    for u in cutlass.range_constexpr(TILE_N // 32):
                        pexp = cute.arch.exp2(pv[u] - m_new)
                        sP[lane + u * 32, r] = pexp
                        t_sum = t_sum + pexp
                    for off in cutlass.range_constexpr(5):
                        t_sum = t_sum + cute.arch.shuffle_sync_bfly(t_sum, offset=1 << (4 - off))
                    l_run[i] = l_run[i] * alpha + t_sum
                    m_run[i] = m_new
                    if lane == 0:
                        sAlpha[r] = alpha
            cute.arch.barrier()

            # 4. P V over this thread's columns and keys
            for r in cutlass.range_constexpr(R):
                a = sAlpha[r]
                for c in cutlass.range_constexpr(CPT):
                    acc[r, c] = acc[r, c] * a
            col0 = cg * CPT
            vch = col0 // VEC
            vin = col0 % VEC
            for u in cutlass.range_constexpr(TILE_N // KP):
                key = kp + u * KP
                vrow = sV[stage, key, vch ^ (key & self.swizzle), None]
                vv = cute.make_tensor(vrow.iterator + vin, cute.make_layout((CPT,))).load().to(Float32)
                pr = sP[key, None].load()
                for r in cutlass.range_constexpr(R):
                    for c in cutlass.range_constexpr(CPT):
                        acc[r, c] = acc[r, c] + pr[r] * vv[c]

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        self._write_partials(acc, m_run, l_run, sM, sL, storage.ring.partials.data_ptr(), part_o_ptr, part_l_ptr,
                             sinks_ptr, has_sinks, v_scale, tidx, kp, cg, b, h, split)

    @cute.jit
    def _write_partials(self, acc: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, sM: cute.Tensor,
                        sL: cute.Tensor, partials: cute.Pointer, part_o_ptr: cute.Pointer,
                        part_l_ptr: cute.Pointer, sinks_ptr: cute.Pointer, has_sinks: Int32, v_scale: Float32,
                        tidx: Int32, kp: Int32, cg: Int32, b: Int32, h: Int32, split: Int32):
        """The split's epilogue: the key parts of P V added up (in `partials`, the ring reused) and each row's
        elements written by `_emit`."""
        warp = tidx // 32
        lane = tidx % 32
        THREADS = const_expr(self.threads)
        WARPS = const_expr(self.warps)
        D = const_expr(self.d)
        R = const_expr(self.rows)
        CPT = const_expr(self.cpt)
        KP = const_expr(self.key_parts)
        for i in cutlass.range_constexpr(self.rows_per_warp):
            r = warp + i * WARPS
            if r < R:
                if lane == 0:
                    sM[r] = m_run[i]
                    sL[r] = l_run[i]
        red = cute.make_tensor(partials, cute.make_layout((KP, R, D), stride=(R * D, D, 1)))
        for r in cutlass.range_constexpr(R):
            for c in cutlass.range_constexpr(CPT):
                red[kp, r, cg * CPT + c] = acc[r, c]
        cute.arch.barrier()
        part_o = cute.make_tensor(part_o_ptr, cute.make_layout((1 << 30,)))
        part_l = cute.make_tensor(part_l_ptr, cute.make_layout((1 << 30,)))
        for i in cutlass.range_constexpr((R * D + THREADS - 1) // THREADS):
            e = tidx + i * THREADS
            if e < R * D:
                r = e // D
                col = e % D
                total = Float32(0.0)
                for p in cutlass.range_constexpr(KP):
                    total = total + red[p, r, col]
                self._emit(part_o, part_l, sinks_ptr, has_sinks, v_scale, b, h, split, r, col, total, sM[r], sL[r])

    @cute.jit
    def _emit(self, part_o: cute.Tensor, part_l: cute.Tensor, sinks_ptr: cute.Pointer, has_sinks: Int32,
              v_scale: Float32, b: Int32, h: Int32, split: Int32, r: Int32, col: Int32, total: Float32, m: Float32,
              l_r: Float32):
        """One element of a row whose unnormalized output is `total`, running max m and sum l_r (log2 domain),
        and (column 0) the row's LSE, at row (b * S + token) * Hq + head: with several splits the split's
        normalized partial and log2-sum-exp, in the layout of the Triton merge kernel (then split); with one
        split `out` and `lse` themselves (part_o, part_l are they), the head's sink folded in as the merge
        folds it and the LSE in natural log (common.output_factor)."""
        D = const_expr(self.d)
        G = const_expr(self.g)
        f, lse = output_factor(m, l_r, Float32(1.0), sinks_ptr, has_sinks, h * G + r % G, v_scale,
                               self.num_splits == 1)
        out_row = Int64((b * self.s + r // G) * (self.hkv * G) + h * G + r % G)
        part = out_row * self.num_splits + Int64(split)
        part_o[part * D + Int64(col)] = (total * f).to(self.q_dtype)
        if col == 0:
            part_l[part] = lse
