"""MLA decode for requests of at most 16 query rows (S x H <= 16: DeepSeek-V3 / Kimi K2 at 8-way tensor
parallelism, 16 heads a GPU) in CuTe DSL on Hopper: the products transposed, so that the keys fill the wgmma's
64 rows and the query rows are its N = 16.

mla.py runs S = Q K^T with the query rows as the wgmma's M, which is 64: at 16 heads three quarters of every
product, and of the Q tile's shared-memory reads, are padding (benchmarks/results/h200.md, session 35: the Q
reads alone were 28 % of the float8 kernel's shared-memory wavefronts). Here S^T = K Q^T (M = 64 keys of a tile,
N = 16 query rows, K = 576) and O^T += V^T P^T (M = 64 of the 512 value columns, 8 products a tile, N = 16,
K = 64 keys), so every product row is a real one. The problem, grid and outputs are mla.py's: D = 576 for q and
k, Dv = 512, V the first 512 columns of K, one latent KV head, grid (splits, 1, B), one CTA per request and
split; with one split the CTA writes `out` and `lse`, with two (plan.mla_cluster_merge) a request's splits are one
cluster and merge through distributed shared memory (mla.py's `_cluster_merge`), with more the partials go to the
Triton merge kernel.

One CTA of three warpgroups:
- warpgroup 0, the producer, loads tiles of 64 keys into a ring of `stages`: a 16-bit cache as mla.py does
  (`MlaSplitKernel._produce`: TMA where the page geometry allows and all keys are visible, else cp.async with
  keys outside [kv_start, length) copied from the nearest visible one); a float8 cache as stored, by cp.async,
  key rows 608 bytes apart (FP8_ROW: four consecutive keys' 32-byte pieces then fall in distinct banks), four
  threads a key row, page ids read a tile ahead (`_produce_fp8`).
- warpgroups 1 and 2, the consumers, own alternate tiles (c, c + 2, ...) and run independently: each keeps its
  own running column maxima, sums and O^T (16 x 512 fp32: 64 registers a thread) and the two are merged at the
  end (`_finish`), as two splits would be. Per own tile: S^T (one commit group; six with a float8 cache), the
  column softmax (`_softmax`: a query row's maxima over the tile's keys reduce over the lanes of a warp and then,
  through shared memory and one named barrier, over the warpgroup's four warps), P^T (16-bit) into the
  consumer's P buffer, then O^T (one commit group; four with a float8 cache), the wait for it, and the stage's
  release.
- The products' operands: a 16-bit cache runs both from shared memory (K as the K-major A of S^T, V as the
  M-major A of O^T, read from the same 128-byte swizzled tile; Q and P^T as K-major Bs). A float8 cache runs both
  in fp16 with A from registers: each consumer thread loads its fragment's float8 bytes itself and widens them
  (cvt.rn.f16x2.e4m3x2), so no 16-bit copy of the tile is ever written to shared memory. For S^T a thread's 8
  bytes at columns 32 kk + 8 t of its two key rows are its fragment values of k-steps 2 kk and 2 kk + 1: Q's
  columns are permuted the same way when it is stored (`_store_q`: within each block of 32 columns, 16-byte
  chunk j word t holds the columns that chunk t word j holds in q). For O^T a thread loads 16 bytes (value
  columns 128 w + 16 g ...) of four keys, pairs two keys' bytes per column (prmt) and widens them: the value
  columns of its O^T fragment are permuted (`_dim`), and the keys of each k-step too (`_logical_key`, which the
  P^T stores follow).

The split's key range comes from the live length on the device (`live_range`, `split_keys`), page ids through
`PageRow` (clamped into the cache), so one compiled kernel serves every length.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from b12x_inductor.kernels.cute import MLA_D as D
from b12x_inductor.kernels.cute import MLA_DV as DV
from b12x_inductor.kernels.cute import MLA_NARROW_ROWS as ROWS  # query rows of a CTA: the wgmma's N
from b12x_inductor.kernels.cute.common import (NEG_BIG, PageRow, empty_barrier, full_barrier,
                                               live_range, logit, output_factor, ring_slot, scales,
                                               split_keys, visible_range)
from b12x_inductor.kernels.cute.mla import (CHUNKS, CHUNKS8, MlaSplitKernel, _chunk, _chunks_view, _with_stage_stride,
                                            cluster_flag, query_parts)
from b12x_inductor.kernels.cute.ptx import e4m3x4_to_f16x4, pack2, prmt
from b12x_inductor.kernels.cute.softmax import RESCALE_LOG2
from b12x_inductor.kernels.cute.softmax import moved as _moved

THREADS = 384  # producer warpgroup + two consumer warpgroups
TILE_N = 64  # keys of a tile: the wgmma's M
FP8_ROW = D + 32  # bytes between the key rows of a float8 tile
M_TILES = DV // 64  # the O^T products of a tile (64 value columns each)
STAGE_ROW = DV + 4  # fp32 stride of the epilogue's staged output rows (conflict-free column writes)
PRODUCER_REGS, CONSUMER_REGS = 56, 224  # 128 x 56 + 256 x 224 <= 65536
MAX_BAR = 1  # 1, 2: consumer c's warps have published their column maxima of the tile (its 128 threads)
P_BAR = 3  # 3, 4: consumer c's P^T is in shared memory (its 128 threads)
Q_BAR = 5  # the Q tile is in shared memory (both consumers)
END_BAR = 6  # the consumers' maxima and sums, then their staged outputs (both consumers)
S_CHUNK = 6  # float8: k-steps of S^T whose A registers are widened together (two chunks in flight)
V_BUFS = 2  # float8: k-steps of O^T whose A registers (8 column blocks each) are in flight at once


class MlaNarrowKernel(MlaSplitKernel):
    """The narrow MLA kernel for one set of compile-time constants: 64-key tiles in `stages` (at most 2 with a
    16-bit cache and 5 with a float8 one: kernels/cute/__init__.py, mla_narrow_geometry; the plan takes the
    most), at most 16 query rows a request. Shares mla.py's host launch (`MlaSplitKernel.__call__`), its 16-bit
    producer and its float8 page-id reads."""

    def __init__(self, *, s: int, hq: int, page: int, num_splits: int, tile_n: int, stages: int, q_dtype,
                 causal: bool, use_softcap: bool, kv_dtype=None, cluster: bool = False):
        from b12x_inductor.kernels.cute import mla_narrow_geometry, tma_box

        assert tile_n == TILE_N and s * hq <= ROWS, (tile_n, s, hq)
        self.s, self.hq, self.page, self.num_splits = s, hq, page, num_splits
        self.cluster = cluster_flag(cluster, num_splits)
        self.tile_n, self.stages, self.dtype = tile_n, stages, q_dtype
        self.causal, self.use_softcap = causal, use_softcap
        self.fp8 = kv_dtype is not None and kv_dtype.width == 8
        self.mdt = cutlass.Float16 if self.fp8 else q_dtype  # the products' operand type: Q, P, widened K and V
        geo = mla_narrow_geometry(fp8=self.fp8, stages=stages)
        assert geo is not None, "the plan's stages do not fit this kernel (kernels/cute/__init__.py)"
        self.storage, self.smem_bytes, self.tile_bytes = geo["storage"], geo["smem_bytes"], geo["tile_bytes"]
        self.rows = s * hq
        self.row_blocks = 1
        self.box = 0 if self.fp8 else tma_box(page=page, tile_n=tile_n)
        self.threads = THREADS

    @cute.kernel
    def kernel(
        self, q_ptr: cute.Pointer, qpe_ptr: cute.Pointer, k_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, sinks_ptr: cute.Pointer, part_o_ptr: cute.Pointer,
        part_l_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, kds_ptr: cute.Pointer,
        vds_ptr: cute.Pointer, q_sb: Int64, q_ss: Int64, q_sh: Int64, pe_sb: Int64, pe_ss: Int64, pe_sh: Int64,
        k_sp: Int64, k_so: Int64, pt_sb: Int64, kds_b: Int32, vds_b: Int32, has_kds: Int32, has_vds: Int32,
        has_kv_start: Int32, has_sinks: Int32, sm_scale: Float32, softcap: Float32, cap: Int32, num_pages: Int32,
        tma_k: cute.CopyAtom, m_k: cute.Tensor,
    ):
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)  # storage.mla_narrow_storage
        tidx, _, _ = cute.arch.thread_idx()
        split, _, b = cute.arch.block_idx()
        wg = tidx // 128
        BN = const_expr(TILE_N)
        NS = const_expr(self.stages)
        dt = self.mdt

        mbar = storage.mbar.data_ptr()
        ring8 = storage.kv.data_ptr()  # the ring as bytes

        if tidx == 0:
            for i in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(full_barrier(mbar, NS, 0, i), 128)  # every producer thread arrives
                cute.arch.mbarrier_init(empty_barrier(mbar, NS, i), 128)  # every thread of the tile's consumer
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        length, start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, b, cap)
        lo = start - start % BN  # tiles start on a tile (and TMA box) boundary; keys below start are masked
        if start >= length:  # no visible key, so no tile: the copies' nearest visible key would not exist
            lo = length
        s_lo, s_hi, n_tiles = split_keys(lo, length, split, self.num_splits, BN)

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if const_expr(self.fp8):
                self._produce_fp8(tidx, b, s_lo, start, length, n_tiles, k_ptr, pt_ptr, k_sp, k_so, pt_sb,
                                  num_pages, ring8, mbar)
            else:
                self._produce(tidx, b, s_lo, start, length, n_tiles, k_ptr, pt_ptr, k_sp, k_so, pt_sb, num_pages,
                              cute.recast_ptr(ring8, dtype=self.dtype), mbar, tma_k, m_k)
            if const_expr(self.cluster):
                self._producer_cluster_barriers()
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tidx - 128
            wgc = wg - 1
            lt = tidx % 128
            warp = lt // 32
            g = (lt % 32) // 4
            t = lt % 4
            q_tile = cute.recast_ptr(storage.q.data_ptr(), dtype=dt)
            self._store_q(query_parts(q_ptr, q_sb, q_ss, q_sh, qpe_ptr, pe_sb, pe_ss, pe_sh), b, ctid, q_tile)

            mma_s = self._mma_s()
            mma_o = self._mma_o()
            thr_s = mma_s.get_slice(lt)
            thr_o = mma_o.get_slice(lt)
            lq = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, ROWS, D), dt, 1)
            lp = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, ROWS, BN), dt, 1)
            sQ = cute.make_tensor(cute.recast_ptr(q_tile, lq.inner, dtype=dt), lq.outer)
            p_buf = cute.recast_ptr(storage.p.data_ptr(), dtype=dt) + wgc * ROWS * BN
            sP = cute.make_tensor(cute.recast_ptr(p_buf, lp.inner, dtype=dt), lp.outer)
            tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))
            tOrP = thr_o.make_fragment_B(thr_o.partition_B(sP))
            acc_s = thr_s.make_fragment_C(thr_s.partition_shape_C((64, ROWS)))
            acc_o = [thr_o.make_fragment_C(thr_o.partition_shape_C((64, ROWS))) for _ in range(M_TILES)]
            for i in cutlass.range_constexpr(M_TILES):
                acc_o[i].fill(0.0)
            t_cs = thr_s.partition_C(cute.make_identity_tensor((64, ROWS)))
            t_co = thr_o.partition_C(cute.make_identity_tensor((64, ROWS)))

            # the operands' sources: shared-memory descriptors (16-bit cache) or the float8 tile's byte views and
            # the A registers they are widened into
            tSrK, tOrV, ka, kf, va, vf, kw, vw = None, None, None, None, None, None, None, None
            if const_expr(self.fp8):
                words = cute.recast_ptr(ring8, dtype=Uint32)
                kw = cute.make_tensor(words, cute.make_layout((NS, BN, FP8_ROW // 8, 2),
                                                              stride=(self.tile_bytes // 4, FP8_ROW // 4, 2, 1)))
                vw = cute.make_tensor(words, cute.make_layout((NS, BN, FP8_ROW // 16, 4),
                                                              stride=(self.tile_bytes // 4, FP8_ROW // 4, 4, 1)))
                ka = cute.make_rmem_tensor((2 * S_CHUNK * 4,), Uint32)
                kf = cute.make_tensor(cute.recast_ptr(ka.iterator, dtype=dt),
                                      cute.make_layout(((2, 2, 2), 1, 2 * S_CHUNK), stride=((1, 2, 4), 0, 8)))
                va = cute.make_rmem_tensor((V_BUFS * M_TILES * 4,), Uint32)
                vf = cute.make_tensor(cute.recast_ptr(va.iterator, dtype=dt),
                                      cute.make_layout(((2, 2, 2), 1, V_BUFS * M_TILES), stride=((1, 2, 4), 0, 8)))
            else:
                ring = cute.recast_ptr(ring8, dtype=dt)
                STAGE = const_expr(BN * D)
                lk = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (64, ROWS, D), dt, NS)
                sK = cute.make_tensor(cute.recast_ptr(ring, lk.inner, dtype=dt), lk.outer)
                tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))
                lv = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (64, ROWS, BN), dt, 1)
                tOrV = []
                for i in cutlass.range_constexpr(M_TILES):  # slab i of each stage: value columns 64 i ...
                    sV = cute.make_tensor(cute.recast_ptr(ring + i * BN * 64, lv.inner, dtype=dt),
                                          _with_stage_stride(lv.outer, NS, STAGE))
                    tOrV.append(thr_o.make_fragment_A(thr_o.partition_A(sV)))

            m_run = cute.make_rmem_tensor((4,), Float32)  # per column of this thread (cq: e % 2 + 2 (e // 4))
            l_run = cute.make_rmem_tensor((4,), Float32)
            alpha = cute.make_rmem_tensor((4,), Float32)
            limit = cute.make_rmem_tensor((4,), Int32)  # causal limits of the columns' query rows
            for cq in cutlass.range_constexpr(4):
                m_run[cq] = Float32(NEG_BIG)
                l_run[cq] = Float32(0.0)
                limit[cq] = length - self.s + t_cs[_elem(cq)][1] // self.hq
            k_scale, v_scale = scales(kds_ptr, vds_ptr, has_kds, has_vds, kds_b, Int32(0), vds_b, Int32(0), sm_scale,
                                      b, Int32(0))
            full_hi = s_hi
            if const_expr(self.causal):
                full_hi = cutlass.min(full_hi, length - self.s + 1)
            sRed = storage.red.get_tensor(cute.make_layout((2, 2, 4, ROWS), stride=(8 * ROWS, 4 * ROWS, ROWS, 1)))
            sPw = cute.make_tensor(p_buf, cute.make_layout((ROWS, 8, 8), stride=(BN, 8, 1)))

            n_own = (n_tiles - wgc + 1) // 2
            for i in cutlass.range(n_own, unroll=1):
                j = 2 * i + wgc
                stage, phase = ring_slot(j, NS)
                cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, stage), phase)
                cute.arch.fence_proxy("async.shared", space="cta")  # cp.async writes -> wgmma reads
                warpgroup.fence()
                if const_expr(self.fp8):
                    self._scores_fp8(acc_s, ka, kf, kw, tSrQ, stage, warp, g, t)
                else:
                    self._scores(acc_s, tSrK, tSrQ, stage)
                warpgroup.wait_group(0)
                self._softmax(acc_s, t_cs, m_run, l_run, alpha, limit, sRed[wgc, i % 2, None, None], s_lo + j * BN,
                              s_hi, start, full_hi, k_scale, softcap, wgc, warp, g)
                if _moved(alpha):
                    for mt in cutlass.range_constexpr(M_TILES):
                        for e in cutlass.range_constexpr(cute.size(acc_o[mt])):
                            acc_o[mt][e] = acc_o[mt][e] * alpha[_col(e)]
                # P^T -> the consumer's P buffer (its last reader, the previous tile's O^T, is done)
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    n = t_cs[e][1]
                    kl = self._logical_key(t_cs[e][0])
                    sPw[n, (kl // 8) ^ (n % 8), kl % 8] = acc_s[e].to(dt)
                cute.arch.fence_proxy("async.shared", space="cta")  # P writes -> the wgmma reads
                cute.arch.barrier(barrier_id=P_BAR + wgc, number_of_threads=128)
                warpgroup.fence()
                if const_expr(self.fp8):
                    self._pv_fp8(acc_o, va, vf, vw, tOrP, stage, warp, g, t)
                else:
                    self._pv(acc_o, tOrV, tOrP, stage)
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(empty_barrier(mbar, NS, stage))

            self._finish(acc_o, t_co, m_run, l_run, storage, b, split, wgc, ctid, warp, g, t, sinks_ptr, has_sinks,
                         part_o_ptr, part_l_ptr, out_ptr, lse_ptr, v_scale)

    def _mma_s(self):
        """S^T = K Q^T: 64 keys x 16 query rows, K the A (shared memory, or registers with a float8 cache), Q the B
        (shared memory), both K-major."""
        kmaj = warpgroup.OperandMajorMode.K
        src = warpgroup.OperandSource.RMEM if self.fp8 else warpgroup.OperandSource.SMEM
        return sm90_utils.make_trivial_tiled_mma(self.mdt, self.mdt, kmaj, kmaj, Float32, (1, 1, 1), (64, ROWS),
                                                 a_source=src)

    def _mma_o(self):
        """O^T += V^T P^T for 64 value columns: V^T the A (the tile read M-major from shared memory, or registers
        with a float8 cache), P^T the B (shared memory, K-major)."""
        kmaj = warpgroup.OperandMajorMode.K
        if self.fp8:
            return sm90_utils.make_trivial_tiled_mma(self.mdt, self.mdt, kmaj, kmaj, Float32, (1, 1, 1), (64, ROWS),
                                                     a_source=warpgroup.OperandSource.RMEM)
        return sm90_utils.make_trivial_tiled_mma(self.mdt, self.mdt, warpgroup.OperandMajorMode.MN, kmaj, Float32,
                                                 (1, 1, 1), (64, ROWS))

    @cute.jit
    def _scores(self, acc_s: cute.Tensor, tSrK: cute.Tensor, tSrQ: cute.Tensor, stage: Int32):
        """Issues S^T = K Q^T of the 16-bit tile in `stage` (36 k-steps, one commit group)."""
        mma = self._mma_s()
        for k in cutlass.range_constexpr(D // 16):
            mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(mma, acc_s, tSrK[None, None, k, stage], tSrQ[None, None, k, 0], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _pv(self, acc_o: list, tOrV: list, tOrP: cute.Tensor, stage: Int32):
        """Issues O^T += V^T P^T for the 16-bit tile in `stage` (4 k-steps x 8 column blocks, one commit group)."""
        mma = self._mma_o()
        mma.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(TILE_N // 16):
            for mt in cutlass.range_constexpr(M_TILES):
                cute.gemm(mma, acc_o[mt], tOrV[mt][None, None, k, stage], tOrP[None, None, k, 0], acc_o[mt])
        warpgroup.commit_group()

    @cute.jit
    def _scores_fp8(self, acc_s: cute.Tensor, ka: cute.Tensor, kf: cute.Tensor, kw: cute.Tensor, tSrQ: cute.Tensor,
                    stage: Int32, warp: Int32, g: Int32, t: Int32):
        """S^T = K Q^T of the float8 tile in `stage`, A from registers: per chunk of S_CHUNK k-steps this thread
        loads 8 bytes of each of its key rows (warp x 16 + g and + 8) per pair of k-steps (columns 32 kk + 8 t),
        widens them into the chunk's buffer (two buffers: the chunk before last must be done before its buffer is
        rewritten) and issues the chunk (one commit group each; the caller waits for all). The next chunk's bytes
        are loaded before that wait, so their latency hides behind it."""
        mma = self._mma_s()
        CHUNKS_S = const_expr(D // 16 // S_CHUNK)
        x = cute.make_rmem_tensor((2, S_CHUNK // 2, 2, 2), Uint32)  # (chunk parity, 32-column block, rh, word)
        self._load_k_chunk(x, kw, stage, warp, g, t, 0)
        for c in cutlass.range_constexpr(CHUNKS_S):
            buf = c % 2
            if const_expr(c + 1 < CHUNKS_S):
                self._load_k_chunk(x, kw, stage, warp, g, t, c + 1)
            if const_expr(c >= 2):
                warpgroup.wait_group(1)
            for kk in cutlass.range_constexpr(S_CHUNK // 2):
                for rh in cutlass.range_constexpr(2):
                    for s in cutlass.range_constexpr(2):  # word s: k-step 2 col + s
                        slot = (buf * S_CHUNK + 2 * kk + s) * 4
                        ka[slot + rh], ka[slot + 2 + rh] = e4m3x4_to_f16x4(x[buf, kk, rh, s])
            warpgroup.fence()
            for s in cutlass.range_constexpr(S_CHUNK):
                k = c * S_CHUNK + s
                mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(mma, acc_s, kf[None, None, buf * S_CHUNK + s], tSrQ[None, None, k, 0], acc_s)
            warpgroup.commit_group()

    @cute.jit
    def _load_k_chunk(self, x: cute.Tensor, kw: cute.Tensor, stage: Int32, warp: Int32, g: Int32, t: Int32,
                      c: cutlass.Constexpr):
        """Chunk c's float8 bytes of this thread's key rows (8 per row and 32-column block) into x[c % 2]."""
        for kk in cutlass.range_constexpr(S_CHUNK // 2):
            col = c * S_CHUNK // 2 + kk  # the 32-column block
            for rh in cutlass.range_constexpr(2):
                cute.autovec_copy(kw[stage, warp * 16 + g + 8 * rh, 4 * col + t, None], x[c % 2, kk, rh, None])

    @cute.jit
    def _pv_fp8(self, acc_o: list, va: cute.Tensor, vf: cute.Tensor, vw: cute.Tensor, tOrP: cute.Tensor,
                stage: Int32, warp: Int32, g: Int32, t: Int32):
        """O^T += V^T P^T of the float8 tile in `stage`, A from registers. Per k-step s this thread loads 16 bytes
        (value columns 128 warp + 16 g ...) of keys 16 s + 4 j + t (j = 0..3), pairs keys j = 2h and 2h + 1 byte by
        byte (prmt) and widens the pairs: byte b of the 16 is column (M tile b // 2, row warp x 16 + g + 8 (b % 2))
        of the fragment (`_dim`), and the pair is its k values 2t + 8h, + 1 (`_logical_key`). Buffers of 8
        column blocks, V_BUFS buffers (a buffer is rewritten once the k-step that read it is done), one commit
        group a k-step (the caller waits for all); the next k-step's bytes are loaded before that wait."""
        mma = self._mma_o()
        mma.set(warpgroup.Field.ACCUMULATE, True)
        x = cute.make_rmem_tensor((2, 4, 4), Uint32)  # (k-step parity, key j, word)
        for jj in cutlass.range_constexpr(4):
            cute.autovec_copy(vw[stage, 4 * jj + t, 8 * warp + g, None], x[0, jj, None])
        for s in cutlass.range_constexpr(TILE_N // 16):
            buf = s % V_BUFS
            if const_expr(s + 1 < TILE_N // 16):
                for jj in cutlass.range_constexpr(4):
                    key = 16 * (s + 1) + 4 * jj + t
                    cute.autovec_copy(vw[stage, key, 8 * warp + g, None], x[(s + 1) % 2, jj, None])
            if const_expr(s >= V_BUFS):
                warpgroup.wait_group(V_BUFS - 1)
            p = s % 2
            for h in cutlass.range_constexpr(2):
                for xw in cutlass.range_constexpr(4):
                    lo = prmt(x[p, 2 * h, xw], x[p, 2 * h + 1, xw], 0x5140)
                    hi = prmt(x[p, 2 * h, xw], x[p, 2 * h + 1, xw], 0x7362)
                    slot0 = (buf * M_TILES + 2 * xw) * 4 + 2 * h
                    slot1 = (buf * M_TILES + 2 * xw + 1) * 4 + 2 * h
                    va[slot0], va[slot0 + 1] = e4m3x4_to_f16x4(lo)  # columns 4 xw, 4 xw + 1
                    va[slot1], va[slot1 + 1] = e4m3x4_to_f16x4(hi)  # columns 4 xw + 2, 4 xw + 3
            warpgroup.fence()
            for mt in cutlass.range_constexpr(M_TILES):
                cute.gemm(mma, acc_o[mt], vf[None, None, buf * M_TILES + mt], tOrP[None, None, s, 0], acc_o[mt])
            warpgroup.commit_group()

    @cute.jit
    def _logical_key(self, key):
        """The k index of the O^T products (and column of P^T) that the tile's key `key` takes: the key itself
        with a 16-bit cache; with a float8 one, key 16 s + 4 j + t is k index 16 s + 2 t + 8 (j // 2) + j % 2 (the
        pairing of `_pv_fp8`)."""
        if const_expr(not self.fp8):
            return key
        r = key % 16
        return key - r + 2 * (r % 4) + 8 * (r // 8) + (r // 4) % 2

    @cute.jit
    def _dim(self, mt: int, m):
        """The value column of O^T's row m of column block mt: 64 mt + m with a 16-bit cache; with a float8 one
        128 (m // 16) + 16 (m % 8) + 2 mt + (m % 16) // 8 (the byte order of `_pv_fp8`'s loads)."""
        if const_expr(not self.fp8):
            return 64 * mt + m
        return 128 * (m // 16) + 16 * (m % 8) + 2 * mt + (m % 16) // 8

    @cute.jit
    def _softmax(self, acc_s: cute.Tensor, t_cs: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor,
                 alpha: cute.Tensor, limit: cute.Tensor, red: cute.Tensor, j0: Int32, hi: Int32, start: Int32,
                 full_hi: Int32, k_scale: Float32, softcap: Float32, wgc: Int32, warp: Int32, g: Int32):
        """The online softmax of one S^T tile (keys j0 ... j0 + 64 down the rows, query rows across) in place: the
        masks where the tile reaches outside [start, full_hi), each column's max over the tile (its two keys here,
        the warp's 8 lanes of a column by shuffles, the four warps through `red`: this tile's parity of the
        consumer's buffer), the running max (which moves only by more than 2^RESCALE_LOG2, as mla.py's), P =
        exp2(logit - m), alpha and this thread's part of the column sums. A column that sees no key keeps
        m = NEG_BIG (finite): its P are 0 and alpha 1."""
        c = k_scale
        if const_expr(self.use_softcap):
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[e] = logit(acc_s[e], k_scale, softcap, True)
            c = Float32(1.0)
        if (j0 < start) | (j0 + TILE_N > full_hi):
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                k_lo, k_hi = visible_range(hi, start, limit[_col(e)], Int32(0), self.causal, False)
                j = j0 + t_cs[e][0]
                acc_s[e] = acc_s[e] if (j >= k_lo) & (j < k_hi) else Float32(-math.inf)
        for cq in cutlass.range_constexpr(4):
            e0 = _elem(cq)
            x = cute.arch.fmax(acc_s[e0], acc_s[e0 + 2])
            x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=4))
            x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=8))
            x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=16))
            if g == 0:
                red[warp, t_cs[e0][1]] = x
        cute.arch.barrier(barrier_id=MAX_BAR + wgc, number_of_threads=128)
        for cq in cutlass.range_constexpr(4):
            e0 = _elem(cq)
            n = t_cs[e0][1]
            x = cute.arch.fmax(cute.arch.fmax(red[0, n], red[1, n]), cute.arch.fmax(red[2, n], red[3, n]))
            m_new = cute.arch.fmax(m_run[cq], cute.arch.fmax(x * c, Float32(NEG_BIG)))
            m_new = m_new if m_new > m_run[cq] + Float32(RESCALE_LOG2) else m_run[cq]
            alpha[cq] = cute.arch.exp2(m_run[cq] - m_new)
            m_run[cq] = m_new
            p0 = cute.arch.exp2(acc_s[e0] * c - m_new)
            p1 = cute.arch.exp2(acc_s[e0 + 2] * c - m_new)
            acc_s[e0] = p0
            acc_s[e0 + 2] = p1
            l_run[cq] = l_run[cq] * alpha[cq] + (p0 + p1)

    @cute.jit
    def _store_q(self, q: dict, b: Int32, ctid: Int32, q_tile: cute.Pointer):
        """The request's query rows -> the Q tile (zeros past them), by plain loads and stores of 16-byte chunks
        (the 256 consumer threads), converted to the products' type; with a float8 cache the columns are permuted
        for `_scores_fp8`: chunk j of each group of four takes word j of each of the group's chunks. Then the
        barrier of both consumers (after the proxy fence: the wgmma reads Q)."""
        dt = self.dtype
        esize = const_expr(dt.width // 8)
        wq = _chunks_view(cute.recast_ptr(q_tile, dtype=Uint32), ROWS, 1, per_chunk=4)
        x = cute.make_rmem_tensor((8,), dt)
        n = const_expr(ROWS * CHUNKS)
        for i in cutlass.range_constexpr((n + 255) // 256):
            e = ctid + i * 256
            if e < n:
                row = e // CHUNKS
                ch = e % CHUNKS
                for k in cutlass.range_constexpr(8):
                    x[k] = dt(0.0)
                if row < self.rows:
                    ptr, sb, ss, sh = q["nope"]
                    c = ch
                    if ch >= DV // 8:
                        ptr, sb, ss, sh = q["pe"]
                        c = ch - DV // 8
                    addr = ptr.toint() + (Int64(b) * sb + Int64(row // self.hq) * ss + Int64(row % self.hq) * sh
                                          + c * 8) * esize
                    src = cute.make_tensor(cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=16),
                                           cute.make_layout((8,)))
                    cute.autovec_copy(src, x)
                for wd in cutlass.range_constexpr(4):
                    word = pack2(x[2 * wd].to(Float32), x[2 * wd + 1].to(Float32), bf16=self.mdt == cutlass.BFloat16)
                    if const_expr(self.fp8):  # word wd of chunk ch -> word ch % 4 of chunk ch - ch % 4 + wd
                        _chunk(wq[0, None, None, None, None, None], row, ch - ch % 4 + wd)[ch % 4] = word
                    else:
                        _chunk(wq[0, None, None, None, None, None], row, ch)[wd] = word
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Q_BAR, number_of_threads=256)

    @cute.jit
    def _produce_fp8(self, tidx: Int32, b: Int32, s_lo: Int32, start: Int32, length: Int32, n_tiles: Int32,
                     k_ptr: cute.Pointer, pt_ptr: cute.Pointer, k_sp: Int64, k_so: Int64, pt_sb: Int64,
                     num_pages: Int32, ring8: cute.Pointer, mbar: cute.Pointer):
        """The producer with a float8 cache: tile `it`, as stored, by cp.async into stage it % NS once released
        (key rows FP8_ROW bytes apart), then this thread's cp.async.mbarrier.arrive on the stage's full mbarrier.
        Four threads share a key row (`_fp8_chunk`), so each reads one page id per row and tile; the ids of tile
        it + 1 are read right after tile it's copies are issued (mla.py's `_fp8_page_ids`, `_stage_fp8`). Keys
        outside [kv_start, length) copy the nearest visible one (finite; the consumers mask them to P = 0)."""
        BN = const_expr(TILE_N)
        NS = const_expr(self.stages)
        pt_row = PageRow(pt_ptr, pt_sb, b, num_pages)
        keys = (Uint32(start), Uint32(length - 1))
        ids = cute.make_rmem_tensor((BN // 32,), Int32)
        dst = cute.make_tensor(ring8, cute.make_layout((NS, BN, CHUNKS8, 16), stride=(self.tile_bytes, FP8_ROW, 16, 1)))
        if n_tiles > 0:
            self._fp8_page_ids(tidx, pt_row, keys, s_lo, ids)
        for it in cutlass.range(n_tiles, unroll=1):
            stage, phase = ring_slot(it, NS)
            if it >= NS:  # the stage's previous use, released in the other phase
                cute.arch.mbarrier_wait(empty_barrier(mbar, NS, stage), 1 - phase)
            j0 = s_lo + it * BN
            self._stage_fp8(tidx, pt_row, keys, ids, k_ptr, k_sp, k_so, j0, dst[stage, None, None, None])
            if it + 1 < n_tiles:
                self._fp8_page_ids(tidx, pt_row, keys, j0 + BN, ids)
            cute.arch.cp_async_mbarrier_arrive_noinc(full_barrier(mbar, NS, 0, stage))

    @cute.jit
    def _finish(self, acc_o: list, t_co: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, storage, b: Int32,
                split: Int32, wgc: Int32, ctid: Int32, warp: Int32, g: Int32, t: Int32, sinks_ptr: cute.Pointer,
                has_sinks: Int32, part_o_ptr: cute.Pointer, part_l_ptr: cute.Pointer, out_ptr: cute.Pointer,
                lse_ptr: cute.Pointer, v_scale: Float32):
        """The two consumers merged, as two splits: each publishes its column maxima and per-warp column sums
        (`fin`), each column's max m and sum l over both are formed, each consumer's O^T is scaled by
        exp2(m_c - m) and by the output's factor, consumer 0 stages its part in the ring (rows of STAGE_ROW fp32)
        and consumer 1 adds its own, then the 256 threads copy whole 16-byte chunks out (8 values each, packed
        to q's 16-bit type). Several splits: the normalized partial output and log2-sum-exp in the merge kernel's
        layout (row (b S + token) Hq + head, then split); one split: out and lse (natural log) with the sink
        folded in, as mla.py; splits in a cluster (plan.mla_cluster_merge): the staged fp32 rows and their
        log2-sum-exp (after the rows) stay in shared memory and mla.py's `_cluster_merge` merges them into out and
        lse through distributed shared memory. Zeros and -inf for a row that saw no key."""
        ONE = const_expr(self.num_splits == 1)
        fin = storage.fin.get_tensor(cute.make_layout((2, 5, ROWS), stride=(5 * ROWS, ROWS, 1)))  # (c, 4 sums + max)
        for cq in cutlass.range_constexpr(4):
            e0 = _elem(cq)
            l_c = l_run[cq]
            l_c = l_c + cute.arch.shuffle_sync_bfly(l_c, offset=4)
            l_c = l_c + cute.arch.shuffle_sync_bfly(l_c, offset=8)
            l_c = l_c + cute.arch.shuffle_sync_bfly(l_c, offset=16)
            if g == 0:
                fin[wgc, warp, t_co[e0][1]] = l_c
                if warp == 0:
                    fin[wgc, 4, t_co[e0][1]] = m_run[cq]
        cute.arch.barrier(barrier_id=END_BAR, number_of_threads=256)
        lses = cute.make_tensor(part_l_ptr, cute.make_layout((1 << 40,)))
        if const_expr(ONE):
            lses = cute.make_tensor(lse_ptr, cute.make_layout((1 << 40,)))
        fac = cute.make_rmem_tensor((4,), Float32)
        lse_c = cute.make_rmem_tensor((4,), Float32)
        for cq in cutlass.range_constexpr(4):
            n = t_co[_elem(cq)][1]
            m0 = fin[0, 4, n]
            m1 = fin[1, 4, n]
            m = cute.arch.fmax(m0, m1)
            l_0 = (fin[0, 0, n] + fin[0, 1, n]) + (fin[0, 2, n] + fin[0, 3, n])
            l_1 = (fin[1, 0, n] + fin[1, 1, n]) + (fin[1, 2, n] + fin[1, 3, n])
            l_r = l_0 * cute.arch.exp2(m0 - m) + l_1 * cute.arch.exp2(m1 - m)
            f, lse = output_factor(m, l_r, cute.arch.exp2(m_run[cq] - m), sinks_ptr, has_sinks, n % self.hq, v_scale,
                                   ONE)
            fac[cq] = f
            lse_c[cq] = lse
        # the ring is free: both consumers are past all their tiles (END_BAR above), and so are the loads
        stg = cute.make_tensor(cute.recast_ptr(storage.kv.data_ptr(), dtype=Float32),
                               cute.make_layout((ROWS, STAGE_ROW), stride=(STAGE_ROW, 1)))
        s_lse = cute.make_tensor(stg.iterator + ROWS * STAGE_ROW, cute.make_layout((ROWS,)))  # a cluster's
        for cq in cutlass.range_constexpr(4):
            n = t_co[_elem(cq)][1]
            if (wgc == 0) & (warp == 0) & (g == 0):
                if const_expr(self.cluster):
                    s_lse[n] = lse_c[cq]
                elif n < self.rows:
                    part = Int64(b) * self.rows + Int64(n)
                    if const_expr(not ONE):
                        part = part * self.num_splits + Int64(split)
                    lses[part] = lse_c[cq]
        if wgc == 0:
            for mt in cutlass.range_constexpr(M_TILES):
                for e in cutlass.range_constexpr(cute.size(acc_o[mt])):
                    stg[t_co[e][1], self._dim(mt, t_co[e][0])] = acc_o[mt][e] * fac[_col(e)]
        cute.arch.barrier(barrier_id=END_BAR, number_of_threads=256)
        if wgc == 1:
            for mt in cutlass.range_constexpr(M_TILES):
                for e in cutlass.range_constexpr(cute.size(acc_o[mt])):
                    n = t_co[e][1]
                    d = self._dim(mt, t_co[e][0])
                    stg[n, d] = stg[n, d] + acc_o[mt][e] * fac[_col(e)]
        cute.arch.barrier(barrier_id=END_BAR, number_of_threads=256)
        if const_expr(self.cluster):
            self._cluster_merge(stg.iterator, STAGE_ROW, s_lse, ROWS, b, Int32(0), split, ctid, sinks_ptr, has_sinks,
                                out_ptr, lse_ptr)
            return
        # 8 values a chunk, packed to q's 16-bit type: out's rows, or (several splits) the partials'
        o_base = out_ptr.toint()
        if const_expr(not ONE):
            o_base = part_o_ptr.toint()
        chunk = cute.make_rmem_tensor((4,), Uint32)
        for i in cutlass.range_constexpr(ROWS * DV // 8 // 256):
            e = ctid + i * 256
            row = e // (DV // 8)
            ch = e % (DV // 8)
            if row < self.rows:
                for k in cutlass.range_constexpr(4):
                    chunk[k] = pack2(stg[row, 8 * ch + 2 * k], stg[row, 8 * ch + 2 * k + 1],
                                     bf16=self.dtype == cutlass.BFloat16)
                part = Int64(b) * self.rows + row
                if const_expr(not ONE):
                    part = part * self.num_splits + Int64(split)
                addr = o_base + (part * DV + ch * 8) * 2
                cute.autovec_copy(chunk, cute.make_tensor(cute.make_ptr(Uint32, addr, cute.AddressSpace.gmem,
                                                                        assumed_align=16), cute.make_layout((4,))))


def _elem(cq: int) -> int:
    """The first accumulator element of this thread's column cq (0..3) in an m64n16 fragment; element e + 2 is
    the same column's other key row (8 rows down). Element e's column index is `_col(e)`."""
    return cq % 2 + 4 * (cq // 2)


def _col(e: int) -> int:
    """This thread's column index (0..3) of accumulator element e of an m64n16 fragment: the element's column is
    2 t + e % 2 + 8 (e // 4), the same in every M tile."""
    return e % 2 + 2 * (e // 4)
