"""MLA decode and verify in CuTe DSL on Hopper: split-KV over the paged latent cache, with wgmma.

The problem (plan.py's table): one latent KV head, D = 576 (512 latent + 64 rope) for q and k, Dv = 512, V
the first 512 columns of K (Problem.v_in_k: v_cache is a view of k_cache), so each key's 576 values are read
once and serve both products. One CTA of three warpgroups takes BLOCK_M = 64 query rows of request b (row r
of the request's S x Hq: token r // Hq, head r % Hq) and one partition (split) of its keys, grid
(splits, row blocks, B):

- warpgroup 0, the producer (40 registers after setmaxnreg), loads each tile of TN keys x 576 into a
  STAGES-deep ring (TN 32 with 4 stages, the plan's, or 64 with 2: what the shared memory holds beside Q;
  64 with 2 measured 1.1-1.3x slower, its loads exposed), waiting only
  on a stage's `empty` mbarrier before reusing it. By TMA (kernels/cute/tma.py: 9 boxes of 64 columns per
  box row) where the page geometry allows (`tma_box`) and every key of the tile is the request's and visible
  ([kv_start, length)); by cp.async otherwise, with keys outside that range copied from the nearest visible
  key (finite values the consumers mask to P = 0), so nothing stale or NaN is ever multiplied.
- warpgroups 1 and 2, the consumers (232 registers), take turns owning the tiles: consumer c owns tiles
  c, c + 2, ... Both hold the same 64 rows; consumer c keeps the output columns [256 c, 256 c + 256) in
  registers (64 x 256 fp32: 128 per thread; all 512 would not fit one warpgroup). For its own tile j the
  owner computes S = Q K_j^T (wgmma, 64 x TN x 576, Q and K from shared memory), the masks and the online
  softmax against the running max the other consumer published for tile j - 1, writes P_j (16-bit) into
  tile j's rope columns (free once S is taken) and its new row maxima, and signals (named barrier
  PUB_BAR + c). Each consumer then adds P_j V_j for its half of the columns (wgmma, P and V from shared
  memory, V read N-major from the same tile), for its own tiles and, once signalled, for the other's.
  Rescaling: the row maxima form one sequence m_0, m_1, ... over the tiles, which both consumers follow
  (each reads the other's), so both rescale O and their partial row sums by the same exp2(m_{j-1} - m_j);
  the row sum is the two partial sums added at the end. A row's max moves only when it grows by more than
  2^RESCALE_LOG2 (online_softmax), so after the first tiles most warps skip the rescale of O. Every
  wgmma.wait_group is reached by the whole warpgroup (the instruction is .aligned: one under a warp's own
  condition is undefined), so only the rescale itself depends on the warp.
- Per own tile j the owner issues S_j before it waits for tile j - 1's P (the other's softmax), so one
  consumer's scores run on the tensor cores while the other's softmax runs. A stage is released (every
  consumer thread arrives on its `empty` barrier) once both consumers' P V of it are complete: the owner at
  the top of its next tile, the other consumer before its own next P V.

A float8_e4m3fn cache (with per-request or scalar descales, K's folded into the scores' scale and V's into the
output) runs the products in fp16: e4m3 widens to fp16 exactly and in one instruction per pair (to bf16 it does
not), Q is widened to fp16 in place after its load where q is bf16 (`_q_to_fp16`), and P is fp16. Its producer
(`_produce_fp8`) loads each tile as stored (32 keys x 576 bytes) by cp.async into the upper half of its ring
stage, and FP8_LAG tiles later widens it in place into the 16-bit tile the consumers read (`_widen_fp8`: each
thread holds the chunks it copied in registers across a producer barrier, then writes them widened), so the
ring, its barriers and the consumers are the 16-bit kernel's. Four producer threads share a key row, so each
reads one page id per row and tile, a tile ahead of its copies.

Shared-memory tiles use the 128-byte swizzle wgmma reads: a tile of rows x 576 is 9 slabs of rows x 128
bytes, 16-byte chunk c of row r at chunk position c ^ (r % 8) (as extend.py); the MMAs read the same bytes
through `sm90_utils.make_smem_layout_a/b`, the V and P views with the ring's stage stride.

With several splits every CTA writes its normalized partial output and log2-sum-exp in the layout of the Triton
family's scratch ([rows, splits, 512] and [rows, splits]) and the Triton merge kernel combines the splits with
the sink into `out` and `lse`; with one split the CTA writes `out` and `lse` itself (no scratch, no merge). Where
the plan says so (plan.mla_cluster_merge: 2 splits) a row block's splits are one thread-block cluster: each CTA
stages its normalized partial rows and their log2-sum-exp in its ring, and after a cluster barrier CTA k merges
rows k, k + N, ... from every CTA's shared memory (distributed shared memory, `_cluster_merge`) into `out` and
`lse`, the merge kernel's arithmetic on the same 16-bit partials; no scratch, no second launch.
Either output leaves through the ring (from Q's tile on where the ring is smaller than the rows), free by then:
each thread stores its scaled fragment pairs into rows of 512 values (16-byte chunks swizzled by row % 8), then
every thread copies whole 16-byte chunks out, so each warp writes 512 contiguous bytes per instruction (`out`'s
rows must start on 16 bytes: _run_mla checks).
The split's key range is computed on the device from the live length (clamped: `live_range`, page ids by
`PageRow`), so one compiled kernel serves every length.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint8, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from b12x_inductor.kernels.cute import MLA_BLOCK_M as BLOCK_M
from b12x_inductor.kernels.cute import MLA_D as D
from b12x_inductor.kernels.cute import MLA_DV as DV
from b12x_inductor.kernels.cute import mla_geometry, tma, tma_box
from b12x_inductor.kernels.cute.common import (LN2, LOG2E, NEG_BIG, PageRow, empty_barrier, full_barrier,
                                               live_range, output_factor, ring_slot, scales, split_keys)
from b12x_inductor.kernels.cute.plan import MLA_FP8_LAG as FP8_LAG  # float8 tiles loaded ahead of the one widened
from b12x_inductor.kernels.cute.ptx import e4m3x4_to_f16x4, ld_dsmem_f32, ld_dsmem_v4, pack2
from b12x_inductor.kernels.cute.softmax import RESCALE_LOG2, online_softmax
from b12x_inductor.kernels.cute.softmax import moved as _moved
from b12x_inductor.kernels.cute.softmax import scale_rows as _scale_rows

THREADS = 384  # producer warpgroup + two consumer warpgroups
HALF = DV // 2  # output columns per consumer warpgroup
SLABS = D // 64  # 128-byte slabs of a 576-wide row (the last one: the rope keys, then P)
CHUNKS = D // 8  # 16-byte chunks of a row
CHUNKS8 = D // 16  # 16-byte chunks of a float8 row
# setmaxnreg moves registers between the warpgroups of the launch's 168 a thread (65536 / 384, down to a multiple
# of 8): an increase waits until decreases have freed enough, so 128 x producer + 256 x consumer <= 384 x 168
LAUNCH_REGS = 65536 // THREADS // 8 * 8
PRODUCER_REGS, CONSUMER_REGS = 40, 232
# with a float8 cache the producer holds a tile's 9 chunks a thread (36 registers) while it widens them, and the
# next tile's page ids: 72 spill 8 bytes (ptxas -v, sm_90a), 80 do not, and the consumers do not spill at 208
PRODUCER_REGS_FP8, CONSUMER_REGS_FP8 = 80, 208
PUB_BAR = 3  # 3, 4: consumer c has published its tile's P and row maxima (its 128 threads arrive, the other syncs)
OWN_BAR = 5  # 5, 6: consumer c's own P writes are complete (its 128 threads)
Q_BAR = 7  # the Q tile is in shared memory (both consumers)
SUM_BAR = 8  # the partial row sums are exchanged (both consumers)
PRODUCER_BAR = 9  # float8 cache: the producer's 128 threads hold a tile's float8 chunks, which widening overwrites


def cluster_flag(cluster: bool, num_splits: int) -> bool:
    """An MLA kernel's `cluster` (the splits of a row block are one thread-block cluster and merge there:
    `MlaSplitKernel._cluster_merge`), checked: a cluster merges 2 to 8 splits (a portable cluster size)."""
    assert not cluster or 2 <= num_splits <= 8, "a cluster merges 2 to 8 splits (a portable cluster size)"
    return cluster


class MlaSplitKernel:
    """The MLA split kernel for one set of compile-time constants (see `mla_geometry` in __init__.py). Its host
    launch (`__call__`: the TMA atom where pages have a box, then the grid) serves the seesaw kernel too, with
    that kernel's `threads`."""

    def __init__(self, *, s: int, hq: int, page: int, num_splits: int, tile_n: int, stages: int, q_dtype,
                 causal: bool, use_softcap: bool, kv_dtype=None, cluster: bool = False):
        self.s, self.hq, self.page, self.num_splits = s, hq, page, num_splits
        self.cluster = cluster_flag(cluster, num_splits)
        self.tile_n, self.stages, self.dtype = tile_n, stages, q_dtype
        self.causal, self.use_softcap = causal, use_softcap
        self.fp8 = kv_dtype is not None and kv_dtype.width == 8
        self.mdt = cutlass.Float16 if self.fp8 else q_dtype  # the products' operand type: Q, the ring, P
        self.regs = (PRODUCER_REGS_FP8, CONSUMER_REGS_FP8) if self.fp8 else (PRODUCER_REGS, CONSUMER_REGS)
        assert 128 * self.regs[0] + 256 * self.regs[1] <= THREADS * LAUNCH_REGS, self.regs
        geo = mla_geometry(tile_n=tile_n, stages=stages)
        assert geo is not None, "the plan's tile does not fit this kernel (kernels/cute/__init__.py: mla_geometry)"
        assert not self.fp8 or stages > FP8_LAG, "a float8 cache needs more ring stages than tiles loaded ahead"
        assert not self.fp8 or tile_n % 32 == 0, "the float8 producer copies 32 key rows per pass (_fp8_chunk)"
        self.storage, self.smem_bytes = geo["storage"], geo["smem_bytes"]  # kernels/cute/storage.py: mla_storage
        self.rows = s * hq  # query rows of one request
        self.row_blocks = -(-self.rows // BLOCK_M)
        self.box = 0 if self.fp8 else tma_box(page=page, tile_n=tile_n)  # float8 tiles are staged by cp.async
        self.threads = THREADS

    @cute.jit
    def __call__(
        self, q_ptr: cute.Pointer, qpe_ptr: cute.Pointer, k_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, sinks_ptr: cute.Pointer, part_o_ptr: cute.Pointer,
        part_l_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, kds_ptr: cute.Pointer,
        vds_ptr: cute.Pointer, batch: Int32, q_sb: Int64, q_ss: Int64, q_sh: Int64, pe_sb: Int64, pe_ss: Int64,
        pe_sh: Int64, k_sp: Int64, k_so: Int64, pt_sb: Int64, kds_b: Int32, vds_b: Int32, has_kds: Int32,
        has_vds: Int32, has_kv_start: Int32, has_sinks: Int32, sm_scale: Float32, softcap: Float32, k_pages: Int32,
        max_pages: Int32, stream,
    ):
        tma_k, m_k = None, None
        if const_expr(self.box != 0):
            tma_k, m_k = tma.cache_tma(k_ptr, k_pages, k_sp, k_so, k_so, page=self.page, d=D, hkv=1, box=self.box)
        self.kernel(
            q_ptr, qpe_ptr, k_ptr, pt_ptr, seqlens_ptr, kv_start_ptr, sinks_ptr, part_o_ptr, part_l_ptr, out_ptr,
            lse_ptr, kds_ptr, vds_ptr, q_sb, q_ss, q_sh, pe_sb, pe_ss, pe_sh, k_sp, k_so, pt_sb, kds_b, vds_b,
            has_kds, has_vds, has_kv_start, has_sinks, sm_scale, softcap, max_pages * self.page, k_pages, tma_k, m_k,
        ).launch(grid=(self.num_splits, self.row_blocks, batch), block=(self.threads, 1, 1), smem=self.smem_bytes,
                 cluster=(self.num_splits, 1, 1) if const_expr(self.cluster) else None, stream=stream,
                 min_blocks_per_mp=1)

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
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)  # kernels/cute/storage.py: mla_storage
        tidx, _, _ = cute.arch.thread_idx()
        split, rb, b = cute.arch.block_idx()
        wg = tidx // 128
        BN = const_expr(self.tile_n)
        NS = const_expr(self.stages)
        STAGE = const_expr(BN * D)  # elements of one ring stage
        dt = self.mdt  # the products' operand type (Q as loaded is q's dtype: _issue_q)

        mbar = storage.mbar.data_ptr()  # K full, (unused), empty: full_barrier, empty_barrier
        q_tile = cute.recast_ptr(storage.q.data_ptr(), dtype=self.dtype)
        ring = cute.recast_ptr(storage.kv.data_ptr(), dtype=dt)

        if tidx == 0:
            for i in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(full_barrier(mbar, NS, 0, i), 128)  # every producer thread arrives
                cute.arch.mbarrier_init(empty_barrier(mbar, NS, i), 256)  # every consumer thread arrives
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # ---- the split's key range, from the live length (device-side) ----
        length, start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, b, cap)
        lo = start - start % BN  # tiles start on a tile (and TMA box) boundary; keys below start are masked
        if start >= length:  # no visible key, so no tile: the copies' nearest visible key would not exist
            lo = length
        s_lo, s_hi, n_tiles = split_keys(lo, length, split, self.num_splits, BN)

        if wg == 0:
            cute.arch.setmaxregister_decrease(self.regs[0])
            if const_expr(self.fp8):
                self._produce_fp8(tidx, b, s_lo, start, length, n_tiles, k_ptr, pt_ptr, k_sp, k_so, pt_sb,
                                  num_pages, ring, mbar)
            else:
                self._produce(tidx, b, s_lo, start, length, n_tiles, k_ptr, pt_ptr, k_sp, k_so, pt_sb, num_pages,
                              ring, mbar, tma_k, m_k)
            if const_expr(self.cluster):
                self._producer_cluster_barriers()
        else:
            cute.arch.setmaxregister_increase(self.regs[1])
            ctid = tidx - 128
            wgc = wg - 1
            lt = tidx % 128
            self._load_q(query_parts(q_ptr, q_sb, q_ss, q_sh, qpe_ptr, pe_sb, pe_ss, pe_sh), b, rb, ctid, q_tile)

            # ---- the operands' shared-memory views ----
            lq = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, BN, D), dt, 1)
            lk = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BN, D), dt, NS)
            lp = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, HALF, BN), dt, 1)
            lv = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BLOCK_M, HALF, BN), dt, 1)
            sQ = cute.make_tensor(cute.recast_ptr(q_tile, lq.inner, dtype=dt), lq.outer)  # fp16 if widened
            sK = cute.make_tensor(cute.recast_ptr(ring, lk.inner, dtype=dt), lk.outer)
            # P in each stage's rope slab, V (this consumer's 256 columns: slabs 4c .. 4c + 3) in its first 512
            # columns: the single-stage layouts with the ring's stage stride
            sP = cute.make_tensor(cute.recast_ptr(ring + (SLABS - 1) * BN * 64, lp.inner, dtype=dt),
                                  _with_stage_stride(lp.outer, NS, STAGE))
            v_base = ring + wgc * (HALF // 64) * BN * 64
            sV = cute.make_tensor(cute.recast_ptr(v_base, lv.inner, dtype=dt), _with_stage_stride(lv.outer, NS, STAGE))

            mma_qk = self._mma_qk()
            mma_pv = self._mma_pv()
            thr_qk = mma_qk.get_slice(lt)
            thr_pv = mma_pv.get_slice(lt)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
            acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((BLOCK_M, BN)))
            acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BLOCK_M, HALF)))
            t_cs = thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, BN)))
            t_co = thr_pv.partition_C(cute.make_identity_tensor((BLOCK_M, HALF)))
            r_p = cute.make_rmem_tensor(acc_s.layout, dt)
            acc_o.fill(0.0)
            m_run = cute.make_rmem_tensor((2,), Float32)
            l_run = cute.make_rmem_tensor((2,), Float32)
            alpha = cute.make_rmem_tensor((2,), Float32)
            limit = cute.make_rmem_tensor((2,), Int32)  # causal limits of this thread's two rows
            for i in cutlass.range_constexpr(2):
                m_run[i] = Float32(NEG_BIG)
                l_run[i] = Float32(0.0)
                limit[i] = length - self.s + (rb * BLOCK_M + t_cs[2 * i][0]) // self.hq
            sM = storage.row_max.get_tensor(cute.make_layout((2, BLOCK_M), stride=(BLOCK_M, 1)))
            k_scale, v_scale = scales(kds_ptr, vds_ptr, has_kds, has_vds, kds_b, Int32(0), vds_b, Int32(0), sm_scale,
                                      b, Int32(0))
            full_hi = s_hi
            if const_expr(self.causal):
                full_hi = cutlass.min(full_hi, length - self.s + 1)

            n_own = (n_tiles - wgc + 1) // 2
            for i in cutlass.range(n_own, unroll=1):
                j = 2 * i + wgc
                stage, phase = ring_slot(j, NS)
                # this consumer's P V of its previous tile j - 2 done, and that stage released, before tile j is
                # waited for: with 2 stages tile j goes into it, and with more the producer refills it soonest (the
                # release deferred past the scores of tile j measured 1.1-1.35x slower; h200.md, session 27)
                warpgroup.wait_group(0)
                if j >= 2:
                    cute.arch.mbarrier_arrive(empty_barrier(mbar, NS, ring_slot(j - 2, NS)[0]))
                # S_j = Q K_j^T, in flight while the other consumer's tile j - 1 is taken in
                cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, stage), phase)
                cute.arch.fence_proxy("async.shared", space="cta")  # cp.async writes -> wgmma reads
                warpgroup.fence()
                self._scores(acc_s, tSrQ, tSrK, stage)
                if j >= 1:
                    self._take_other(j - 1, wgc, acc_o, m_run, l_run, alpha, t_co, sM, tOrP, tOrV, mbar, 1)
                    warpgroup.wait_group(1)  # S_j done (P V of tile j - 1 may run on)
                else:
                    warpgroup.wait_group(0)
                online_softmax(acc_s, t_cs, m_run, l_run, alpha, limit, s_lo + j * BN, s_hi, start, start, full_hi,
                               k_scale, softcap, Int32(0), tile_n=BN, causal=self.causal, use_window=False,
                               use_softcap=self.use_softcap, rescale_log2=RESCALE_LOG2)
                # publish P_j (into the tile's rope slab: S_j, its last reader, is done) and the new row maxima
                r_p.store(acc_s.load().to(dt))
                t_sp = thr_qk.partition_C(sP[None, None, stage])
                cute.autovec_copy(r_p, t_sp)
                if lt % 4 == 0:
                    for rh in cutlass.range_constexpr(2):
                        sM[wgc, t_cs[2 * rh][0]] = m_run[rh]
                cute.arch.fence_proxy("async.shared", space="cta")  # P writes -> the wgmma reads of both consumers
                cute.arch.barrier(barrier_id=OWN_BAR + wgc, number_of_threads=128)
                cute.arch.barrier_arrive(barrier_id=PUB_BAR + wgc, number_of_threads=256)
                # O to m_j, then O += P_j V_j (P V of tile j - 1 first: it reads O too)
                warpgroup.wait_group(0)
                if j >= 1:
                    cute.arch.mbarrier_arrive(empty_barrier(mbar, NS, ring_slot(j - 1, NS)[0]))
                if _moved(alpha):
                    _scale_rows(acc_o, alpha)
                warpgroup.fence()
                self._pv(acc_o, tOrP, tOrV, stage)
            if n_tiles >= 1:
                if (n_tiles - 1) % 2 != wgc:  # the other consumer owns the last tile
                    self._take_other(n_tiles - 1, wgc, acc_o, m_run, l_run, alpha, t_co, sM, tOrP, tOrV, mbar, 0)
            warpgroup.wait_group(0)

            self._epilogue(acc_o, t_co, m_run, l_run, storage, b, rb, split, wgc, lt, sinks_ptr, has_sinks,
                           part_o_ptr, part_l_ptr, out_ptr, lse_ptr, v_scale)

    @cute.jit
    def _take_other(self, j: Int32, wgc: Int32, acc_o: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor,
                    alpha: cute.Tensor, t_co: cute.Tensor, sM: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor,
                    mbar: cute.Pointer, in_flight: cutlass.Constexpr):
        """Tile j, the other consumer's: waits for the other's P_j and row maxima, rescales the partial row sums
        and, after this consumer's last P V (which wrote O) is done (`in_flight` groups committed after it may run
        on; the wait is the whole warpgroup's), O where a row's max moved; then issues O += P_j V_j."""
        NS = const_expr(self.stages)
        cute.arch.barrier(barrier_id=PUB_BAR + 1 - wgc, number_of_threads=256)
        stage, phase = ring_slot(j, NS)
        cute.arch.mbarrier_wait(full_barrier(mbar, NS, 0, stage), phase)
        for rh in cutlass.range_constexpr(2):
            m_new = sM[1 - wgc, t_co[2 * rh][0]]
            alpha[rh] = cute.arch.exp2(m_run[rh] - m_new)
            m_run[rh] = m_new
            l_run[rh] = l_run[rh] * alpha[rh]
        warpgroup.wait_group(in_flight)  # unconditional: wgmma.wait_group is warpgroup-wide (.aligned)
        if _moved(alpha):
            _scale_rows(acc_o, alpha)
        warpgroup.fence()
        self._pv(acc_o, tOrP, tOrV, stage)

    @cute.jit
    def _epilogue(self, acc_o: cute.Tensor, t_co: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, storage,
                  b: Int32, rb: Int32, split: Int32, wgc: Int32, lt: Int32, sinks_ptr: cute.Pointer,
                  has_sinks: Int32, part_o_ptr: cute.Pointer, part_l_ptr: cute.Pointer, out_ptr: cute.Pointer,
                  lse_ptr: cute.Pointer, v_scale: Float32):
        """The row sums (this consumer's partial sums, reduced over the quad, plus the other's), then this
        consumer's 256 columns of each row, times `v_scale` (a float8 cache's V descale, else 1). Several splits:
        the normalized partial output (out's 16-bit type) and (consumer 0) the row's log2-sum-exp in the merge
        kernel's layout, row (b * S + token) * Hq + head, then split. One split: the output itself (out [B, S,
        Hq, 512] in q's dtype) and lse (natural log), with the sink folded into the denominator as the merge
        kernel folds it; zeros and -inf for a row that saw no key."""
        sL = storage.row_sum.get_tensor(cute.make_layout((2, BLOCK_M), stride=(BLOCK_M, 1)))
        for rh in cutlass.range_constexpr(2):
            l_r = l_run[rh]
            l_r = l_r + cute.arch.shuffle_sync_bfly(l_r, offset=1)
            l_r = l_r + cute.arch.shuffle_sync_bfly(l_r, offset=2)
            l_run[rh] = l_r
            if lt % 4 == 0:
                sL[wgc, t_co[2 * rh][0]] = l_r
        cute.arch.barrier(barrier_id=SUM_BAR, number_of_threads=256)
        ONE = const_expr(self.num_splits == 1)
        lses = cute.make_tensor(part_l_ptr, cute.make_layout((1 << 40,)))
        if const_expr(ONE):
            lses = cute.make_tensor(lse_ptr, cute.make_layout((1 << 40,)))
        NO_ELEMS = const_expr(cute.size(acc_o))
        # O goes out through the ring (free: every product that read it is done, SUM_BAR above): each thread
        # writes its scaled pairs into rows of DV values, 16-byte chunks swizzled by row % 8 (conflict-free), then
        # the 256 threads copy whole 16-byte chunks out, each warp 512 contiguous bytes of a row (the fragment's
        # own stores would touch 8 rows of 8 bytes each per instruction).
        ODT = self.dtype  # out's 16-bit type, also the partials' (split_partials)
        EPC = const_expr(128 // ODT.width)  # elements per 16-byte chunk: 8
        CPR = const_expr(DV // EPC)  # chunks per row
        # the cluster merge keeps the rows' log2-sum-exp and its weights (BLOCK_M x (1 + splits) fp32) after them
        staged = BLOCK_M * DV * ODT.width // 8 + (4 * BLOCK_M * (1 + self.num_splits) if self.cluster else 0)
        if const_expr(self.stages * self.tile_n * D * 2 < staged):
            # the rows go out through the ring, which holds them in every geometry mla_geometry admits (2 stages
            # of 32 keys: 72 KB; the rows: 64 KB, and 2.25 KB at most for the cluster merge)
            raise ValueError(f"MLA epilogue: a ring of {self.stages} x {self.tile_n} keys cannot stage the rows")
        ring = cute.recast_ptr(storage.kv.data_ptr(), dtype=ODT)
        s_o = cute.make_tensor(ring, cute.make_layout((BLOCK_M, CPR, EPC), stride=(DV, EPC, 1)))
        s_w = cute.make_tensor(cute.recast_ptr(ring, dtype=Uint32),  # the same rows as pairs of 16-bit values
                               cute.make_layout((BLOCK_M, CPR, EPC // 2), stride=(DV // 2, EPC // 2, 1)))
        s_lse = cute.make_tensor(cute.recast_ptr(ring + BLOCK_M * DV, dtype=Float32), cute.make_layout((BLOCK_M,)))
        for rh in cutlass.range_constexpr(2):
            row = t_co[2 * rh][0]
            r = rb * BLOCK_M + row
            l_r = l_run[rh] + sL[1 - wgc, row]
            f, lse = output_factor(m_run[rh], l_r, Float32(1.0), sinks_ptr, has_sinks, r % self.hq, v_scale, ONE)
            for e in cutlass.range_constexpr(0, NO_ELEMS, 2):  # e, e + 1: adjacent columns of one row
                if const_expr((e // 2) % 2 == rh):
                    col = wgc * HALF + t_co[e][1]
                    ch = (col // EPC) ^ (row % 8)
                    s_w[row, ch, (col % EPC) // 2] = pack2(acc_o[e] * f, acc_o[e + 1] * f,
                                                            bf16=self.dtype == cutlass.BFloat16)
            if const_expr(self.cluster):
                if (wgc == 0) & (lt % 4 == 0):
                    s_lse[row] = lse
            elif r < self.rows:
                part = Int64(b) * self.rows + Int64(r)
                if const_expr(not ONE):
                    part = part * self.num_splits + Int64(split)
                if (wgc == 0) & (lt % 4 == 0):
                    lses[part] = lse
        cute.arch.barrier(barrier_id=SUM_BAR, number_of_threads=256)
        ctid = wgc * 128 + lt
        if const_expr(self.cluster):
            self._cluster_merge(ring, 0, s_lse, BLOCK_M, b, rb, split, ctid, sinks_ptr, has_sinks, out_ptr,
                                lse_ptr)
            return
        o_base = part_o_ptr.toint()
        if const_expr(ONE):
            o_base = out_ptr.toint()
        chunk = cute.make_rmem_tensor((EPC,), ODT)
        for i in cutlass.range_constexpr(BLOCK_M * CPR // 256):
            e = ctid + i * 256
            row = e // CPR
            ch = e % CPR
            r = rb * BLOCK_M + row
            if r < self.rows:
                part = Int64(b) * self.rows + Int64(r)
                if const_expr(not ONE):
                    part = part * self.num_splits + Int64(split)
                cute.autovec_copy(s_o[row, ch ^ (row % 8), None], chunk)
                addr = o_base + (part * DV + ch * EPC) * (ODT.width // 8)
                dst = cute.make_tensor(cute.make_ptr(ODT, addr, cute.AddressSpace.gmem, assumed_align=16),
                                       cute.make_layout((EPC,)))
                cute.autovec_copy(chunk, dst)

    @cute.jit
    def _cluster_merge(self, staged: cute.Pointer, f32_row: cutlass.Constexpr, s_lse: cute.Tensor,
                       block_m: cutlass.Constexpr, b: Int32, rb: Int32, rank: Int32, ctid: Int32,
                       sinks_ptr: cute.Pointer, has_sinks: Int32, out_ptr: cute.Pointer, lse_ptr: cute.Pointer):
        """The splits of one row block are one cluster (rank = split): each CTA's normalized partial rows and
        their log2-sum-exp (`s_lse`: block_m fp32, then room for splits x block_m weights) are read by the other
        CTAs through distributed shared memory. The staged rows (`staged`): out's 16-bit type, 16-byte chunks
        swizzled by row % 8 (f32_row 0: this kernel's epilogue), or fp32 rows f32_row values apart, unswizzled
        (mla_narrow.py's). CTA `rank` merges rows rank, rank + N, ... as the Triton merge kernel does (weights
        exp2(lse_s - m) over their sum plus the sink's exp2(sink - m); zeros and -inf for a row no split saw) into
        `out` and `lse`. A cluster barrier before (every partial in place) and one after (no CTA leaves while
        another reads its shared memory); the 256 consumer threads (ctid) take part, the producer warpgroup
        arrives at both barriers (`_producer_cluster_barriers`)."""
        N = const_expr(self.num_splits)
        ODT = self.dtype
        EPC = const_expr(128 // ODT.width)
        CPR = const_expr(DV // EPC)
        OWNED = const_expr(-(-block_m // N))  # rows of the block a CTA merges, at most
        s_w = cute.make_tensor(s_lse.iterator + block_m, cute.make_layout((N, block_m), stride=(block_m, 1)))
        lses = cute.make_tensor(lse_ptr, cute.make_layout((1 << 40,)))
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if ctid < block_m:
            row = ctid
            if row % N == rank:
                r = rb * block_m + row
                ls = cute.make_rmem_tensor((N,), Float32)
                m = Float32(-math.inf)
                for s in cutlass.range_constexpr(N):
                    ls[s] = ld_dsmem_f32(Uint32(s_lse.iterator.toint()) + Uint32(row * 4), Int32(s))
                    m = cutlass.max(m, ls[s])
                seen = m > Float32(-math.inf)
                sink = Float32(NEG_BIG)
                if has_sinks != 0:
                    sinks = cute.make_tensor(sinks_ptr, cute.make_layout((1 << 30,)))
                    sink = Float32(sinks[r % self.hq]) * Float32(LOG2E)
                if not seen:
                    m = Float32(0.0)
                m = cutlass.max(m, sink)
                denom = cute.arch.exp2(sink - m)
                for s in cutlass.range_constexpr(N):
                    ls[s] = cute.arch.exp2(ls[s] - m)  # 0 for a split that saw no key (its partial is zeros)
                    denom = denom + ls[s]
                lse = Float32(-math.inf)
                inv = Float32(0.0)
                if seen:
                    inv = Float32(1.0) / denom
                    lse = (m + cute.math.log2(denom)) * Float32(LN2)
                for s in cutlass.range_constexpr(N):
                    s_w[s, row] = ls[s] * inv
                if r < self.rows:
                    lses[Int64(b) * self.rows + Int64(r)] = lse
        cute.arch.barrier(barrier_id=SUM_BAR, number_of_threads=256)
        # 16 bytes of a peer's row a load: EPC values of out's type, or (fp32 rows) 4 values, two loads a chunk
        WORDS = const_expr(8 if f32_row else 4)
        src_w = cute.make_rmem_tensor((WORDS,), Uint32)
        src = cute.make_tensor(cute.recast_ptr(src_w.iterator, dtype=Float32 if f32_row else ODT),
                               cute.make_layout((EPC,)))
        acc = cute.make_rmem_tensor((EPC,), Float32)
        chunk = cute.make_rmem_tensor((EPC,), ODT)
        for i in cutlass.range_constexpr(-(-OWNED * CPR // 256)):
            e = ctid + i * 256
            row = rank + N * (e // CPR)
            ch = e % CPR
            r = rb * block_m + row
            if (row < block_m) & (r < self.rows):
                acc.fill(0.0)
                at = Uint32(staged.toint()) + Uint32((row * DV + (ch ^ (row % 8)) * EPC) * (ODT.width // 8))
                if const_expr(f32_row):
                    at = Uint32(staged.toint()) + Uint32((row * f32_row + ch * EPC) * 4)
                for s in cutlass.range_constexpr(N):
                    for h in cutlass.range_constexpr(WORDS // 4):
                        words = ld_dsmem_v4(at + Uint32(16 * h), Int32(s))
                        for w in cutlass.range_constexpr(4):
                            src_w[4 * h + w] = words[w]
                    acc.store(acc.load() + src.load().to(Float32) * s_w[s, row])
                chunk.store(acc.load().to(ODT))
                addr = out_ptr.toint() + ((Int64(b) * self.rows + Int64(r)) * DV + ch * EPC) * (ODT.width // 8)
                cute.autovec_copy(chunk, cute.make_tensor(cute.make_ptr(ODT, addr, cute.AddressSpace.gmem,
                                                                        assumed_align=16), cute.make_layout((EPC,))))
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def _producer_cluster_barriers(self):
        """The producer warpgroup's part in `_cluster_merge`'s two cluster barriers (every thread of every CTA of
        the cluster arrives at them): after its last load it arrives and waits twice."""
        for _ in cutlass.range_constexpr(2):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _load_q(self, q: dict, b: Int32, rb: Int32, ctid: Int32, q_tile: cute.Pointer):
        """The CTA's 64 query rows -> shared memory by cp.async (both consumers; zeros past the request's rows),
        then a barrier of both consumers: Q is in place for their wgmma (_issue_q, then _wait_q; widened to fp16
        where the products run in fp16 on bf16 q: a float8 cache)."""
        self._issue_q(q, b, rb, ctid, q_tile)
        self._wait_q()
        if const_expr(self.mdt is not self.dtype):
            self._q_to_fp16(ctid, q_tile)

    @cute.jit
    def _issue_q(self, q: dict, b: Int32, rb: Int32, ctid: Int32, q_tile: cute.Pointer):
        """_load_q's copies, as one cp.async group (its threads' 256 ids: ctid). `q` (`query_parts`): the query's
        columns 0..511 and 512..575, each a pointer and (request, token, head) strides; row r of the request is
        token r // Hq, head r % Hq."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                   num_bits_per_copy=128)
        wQ = _chunks_view(q_tile, BLOCK_M, 1)
        self._issue_q_part(atom, wQ, q["nope"], b, rb, ctid, 0, DV // 8)
        self._issue_q_part(atom, wQ, q["pe"], b, rb, ctid, DV // 8, CHUNKS - DV // 8)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _issue_q_part(self, atom, wQ: cute.Tensor, part: tuple, b: Int32, rb: Int32, ctid: Int32,
                      first: cutlass.Constexpr, n: cutlass.Constexpr):
        """The cp.async copies of one part of the query rows: its 16-byte chunks 0 .. n - 1 of each row go to the
        tile's chunks first .. first + n - 1 (BLOCK_M x n chunks, a whole number per thread)."""
        dt = self.dtype
        ptr, sb, ss, sh = part
        base = ptr.toint() + Int64(b) * sb * (dt.width // 8)
        for i in cutlass.range_constexpr(BLOCK_M * n // 256):
            e = ctid + i * 256
            row = e // n
            c = e % n
            dst = _chunk(wQ[0, None, None, None, None, None], row, first + c)
            r = rb * BLOCK_M + row
            if r < self.rows:
                src_addr = base + (Int64(r // self.hq) * ss + Int64(r % self.hq) * sh + c * 8) * (dt.width // 8)
                src = cute.make_tensor(cute.make_ptr(dt, src_addr, cute.AddressSpace.gmem, assumed_align=16),
                                       cute.make_layout((8,)))
                cute.copy(atom, src, dst)
            else:
                for k in cutlass.range_constexpr(8):
                    dst[k] = dt(0.0)

    @cute.jit
    def _wait_q(self):
        """The wait for _issue_q's group (the calling thread's only one in flight), then the barrier of the 256."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Q_BAR, number_of_threads=256)

    @cute.jit
    def _q_to_fp16(self, ctid: Int32, q_tile: cute.Pointer):
        """bf16 Q -> fp16 in place, 8 elements (one 16-byte chunk) at a time, 18 chunks per consumer thread, then
        the barrier of the 256. Elementwise, so the swizzle does not matter. fp16 holds every bf16 query value of
        magnitude 6e-5 to 65504 exactly (the Triton family's float8 products do the same)."""
        n = BLOCK_M * CHUNKS
        src = cute.make_tensor(q_tile, cute.make_layout((n, 8), stride=(8, 1)))
        dst = cute.make_tensor(cute.recast_ptr(q_tile, dtype=cutlass.Float16), cute.make_layout((n, 8), stride=(8, 1)))
        x = cute.make_rmem_tensor((8,), self.dtype)
        y = cute.make_rmem_tensor((8,), cutlass.Float16)
        for i in cutlass.range_constexpr(n // 256):
            e = ctid + i * 256
            cute.autovec_copy(src[e, None], x)
            y.store(x.load().to(cutlass.Float16))
            cute.autovec_copy(y, dst[e, None])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Q_BAR, number_of_threads=256)

    def _mma_qk(self):
        """S = Q K^T: one warpgroup of 64 rows, Q and K from shared memory (both K-major)."""
        kmaj = warpgroup.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(self.mdt, self.mdt, kmaj, kmaj, Float32, (1, 1, 1),
                                                 (64, self.tile_n))

    def _mma_pv(self):
        """O += P V for one consumer's 256 columns: P from shared memory (K-major), V read N-major."""
        return sm90_utils.make_trivial_tiled_mma(self.mdt, self.mdt, warpgroup.OperandMajorMode.K,
                                                 warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1), (64, HALF))

    @cute.jit
    def _scores(self, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor, stage: Int32):
        """Issues S = Q K^T of the tile in `stage` (36 wgmma k-steps, one commit group). The tiled MMA is made
        here: its accumulate flag is traced state that must not cross a control-flow region."""
        mma_qk = self._mma_qk()
        for k in cutlass.range_constexpr(D // 16):
            mma_qk.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_qk, acc_s, tSrQ[None, None, k, 0], tSrK[None, None, k, stage], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _pv(self, acc_o: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor, stage: Int32):
        """Issues O += P V with P and V from the tile in `stage` (one commit group)."""
        mma_pv = self._mma_pv()
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(self.tile_n // 16):
            cute.gemm(mma_pv, acc_o, tOrP[None, None, k, stage], tOrV[None, None, k, stage], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def _produce(self, tidx: Int32, b: Int32, s_lo: Int32, start: Int32, length: Int32, n_tiles: Int32,
                 k_ptr: cute.Pointer, pt_ptr: cute.Pointer, k_sp: Int64, k_so: Int64, pt_sb: Int64, num_pages: Int32,
                 ring: cute.Pointer, mbar: cute.Pointer, tma_k, m_k):
        """The producer warpgroup: each tile into the ring; the stage's full mbarrier (128 arrivals) completes
        when the copies land, so the producer never waits for its own loads, only for a stage to be released.
        A tile whose keys are all visible ([kv_start, length)) goes by TMA where the page geometry allows
        (`tma_box`; tiles start on a box boundary), any other by cp.async."""
        BN = const_expr(self.tile_n)
        NS = const_expr(self.stages)
        BOX = const_expr(self.box)
        if const_expr(BOX != 0):
            if tidx == 0:
                cpasync.prefetch_descriptor(tma_k)
        for it in cutlass.range(n_tiles, unroll=1):
            stage, phase = ring_slot(it, NS)
            if it >= NS:  # the stage's previous use, released in the other phase
                cute.arch.mbarrier_wait(empty_barrier(mbar, NS, stage), 1 - phase)
            j0 = s_lo + it * BN
            if const_expr(BOX != 0):
                if (j0 >= start) & (j0 + BN <= length):
                    self._tma_tile(tidx, b, j0, stage, pt_ptr, pt_sb, num_pages, mbar, ring, tma_k, m_k)
                else:
                    self._cp_async_tile(tidx, b, j0, start, length, stage, k_ptr, pt_ptr, k_sp, k_so, pt_sb,
                                        num_pages, ring, mbar)
            else:
                self._cp_async_tile(tidx, b, j0, start, length, stage, k_ptr, pt_ptr, k_sp, k_so, pt_sb, num_pages,
                                    ring, mbar)

    @cute.jit
    def _tma_tile(self, tidx: Int32, b: Int32, j0: Int32, stage: Int32, pt_ptr: cute.Pointer, pt_sb: Int64,
                  num_pages: Int32, mbar: cute.Pointer, ring: cute.Pointer, tma_k, m_k):
        """One tile by TMA (keys j0 .. j0 + TN, all visible): box row r (keys j0 + r x BOX ..., one page) goes to
        warp r % 4, which issues its 9 slabs (a TMA copy is issued by one elected lane, with warp-uniform
        coordinates: the page id is read by lane r // 4 and shuffled). Thread 0 arrives with the tile's byte
        count (expect-tx), the 127 others plainly."""
        BN = const_expr(self.tile_n)
        BOX = const_expr(self.box)
        NS = const_expr(self.stages)
        BOX_ROWS = const_expr(BN // BOX)
        warp = tidx // 32
        lane = tidx % 32
        page = Int32(0)
        if (warp + 4 * lane < BOX_ROWS) & (lane < (BOX_ROWS + 3) // 4):
            page = tma.box_page(PageRow(pt_ptr, pt_sb, b, num_pages), j0, self.page, BOX, warp + 4 * lane)
        bar = full_barrier(mbar, NS, 0, stage)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, BN * D * 2)
        else:
            cute.arch.mbarrier_arrive(bar)
        for i in cutlass.range_constexpr((BOX_ROWS + 3) // 4):
            if warp + 4 * i < BOX_ROWS:
                rbox = warp + 4 * i
                p = cute.arch.shuffle_sync(page, i)
                for sl in cutlass.range_constexpr(SLABS):
                    dst = ring + (stage * BN * D + sl * BN * 64 + rbox * BOX * 64)
                    tma.copy_box(tma_k, m_k, dst, BOX, j0, self.page, sl, Int32(0), p, bar)

    @cute.jit
    def _cp_async_tile(self, tidx: Int32, b: Int32, j0: Int32, start: Int32, length: Int32, stage: Int32,
                       k_ptr: cute.Pointer, pt_ptr: cute.Pointer, k_sp: Int64, k_so: Int64, pt_sb: Int64,
                       num_pages: Int32, ring: cute.Pointer, mbar: cute.Pointer):
        """One tile by cp.async (16-byte chunks, 36 or 18 per thread), then this thread's
        cp.async.mbarrier.arrive on the stage's full mbarrier. Keys outside [kv_start, length) copy the nearest
        visible one (finite; the consumers mask them to P = 0)."""
        BN = const_expr(self.tile_n)
        NS = const_expr(self.stages)
        dt = self.dtype
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dt,
                                   num_bits_per_copy=128)
        pt_row = PageRow(pt_ptr, pt_sb, b, num_pages)
        wK = _chunks_view(ring, BN, NS)
        keys = (Uint32(start), Uint32(length - 1))
        k_base = k_ptr.toint()
        for i in cutlass.range(BN * CHUNKS // 128, unroll=4):
            e = tidx + i * 128
            row = e // CHUNKS
            ch = e % CHUNKS
            j = _nearest_visible(j0 + row, keys)
            addr = self._key_row(k_base, Int64(Uint32(pt_row[j // self.page])), j, k_sp, k_so, 2) + ch * 16
            src = cute.make_tensor(cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=16),
                                   cute.make_layout((8,)))
            cute.copy(atom, src, _chunk(wK[stage, None, None, None, None, None], row, ch))
        cute.arch.cp_async_mbarrier_arrive_noinc(full_barrier(mbar, NS, 0, stage))

    @cute.jit
    def _key_row(self, k_base: Int64, page: Int64, j: Uint32, k_sp: Int64, k_so: Int64, esize: cutlass.Constexpr):
        """The global address of key j's row, in page `page` (an id clamped into the cache, 64 bits), of the cache
        at k_base with page and slot strides in elements of `esize` bytes. Both cp.async gathers' (_cp_async_tile,
        _stage_fp8)."""
        return k_base + page * k_sp * esize + Int64(j % self.page) * k_so * esize

    @cute.jit
    def _produce_fp8(self, tidx: Int32, b: Int32, s_lo: Int32, start: Int32, length: Int32, n_tiles: Int32,
                     k_ptr: cute.Pointer, pt_ptr: cute.Pointer, k_sp: Int64, k_so: Int64, pt_sb: Int64,
                     num_pages: Int32, ring: cute.Pointer, mbar: cute.Pointer):
        """The producer warpgroup with a float8 cache. Tile `it` goes by cp.async, as stored, into the upper half
        of its ring stage once the stage is released (`_stage_fp8`); FP8_LAG iterations later, the next tiles'
        loads in flight meanwhile, it is widened in place to the fp16 tile the consumers read (`_widen_fp8`)
        and every producer thread arrives on the stage's full mbarrier (128 arrivals). One
        cp.async group is committed per iteration (empty where no tile is loaded), so wait_group(FP8_LAG - 1)
        always means: this thread's chunks of tile it - FP8_LAG have landed. Keys outside [kv_start, length)
        copy the nearest visible one, as _cp_async_tile.

        Each thread copies and widens whole chunks of its own key rows (`_fp8_chunk`), so it needs one page id
        per row and tile; the ids of tile it + 1 are read right after tile it's copies are issued and used one
        iteration later (`_fp8_page_ids`), so no copy waits on a page-table read."""
        BN = const_expr(self.tile_n)
        NS = const_expr(self.stages)
        pt_row = PageRow(pt_ptr, pt_sb, b, num_pages)
        keys = (Uint32(start), Uint32(length - 1))
        ids = cute.make_rmem_tensor((BN // 32,), Int32)
        if n_tiles > 0:
            self._fp8_page_ids(tidx, pt_row, keys, s_lo, ids)
        for it in cutlass.range(n_tiles + FP8_LAG, unroll=1):
            if it >= FP8_LAG:
                done = ring_slot(it - FP8_LAG, NS)[0]
                cute.arch.cp_async_wait_group(FP8_LAG - 1)
                self._widen_fp8(tidx, done, ring)
                cute.arch.fence_proxy("async.shared", space="cta")  # the widened tile -> the consumers' wgmma
                cute.arch.mbarrier_arrive(full_barrier(mbar, NS, 0, done))
            if it < n_tiles:
                stage, phase = ring_slot(it, NS)
                if it >= NS:  # the stage's previous use, released in the other phase
                    cute.arch.mbarrier_wait(empty_barrier(mbar, NS, stage), 1 - phase)
                self._stage_fp8(tidx, pt_row, keys, ids, k_ptr, k_sp, k_so, s_lo + it * BN,
                                _fp8_rows(ring, BN, NS)[stage, None, None, None])
                if it + 1 < n_tiles:
                    self._fp8_page_ids(tidx, pt_row, keys, s_lo + (it + 1) * BN, ids)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _fp8_key(self, tidx: Int32, keys: tuple, j0: Int32, k: cutlass.Constexpr):
        """The key this thread's row k of the tile at j0 copies: key j0 + row, clamped to the visible keys
        [kv_start, length - 1] (`keys`), so a key outside copies the nearest visible one."""
        row, _ = _fp8_chunk(tidx, k * CHUNKS8 // 4)
        return _nearest_visible(j0 + row, keys)

    @cute.jit
    def _fp8_page_ids(self, tidx: Int32, pt_row, keys: tuple, j0: Int32, ids: cute.Tensor):
        """The page-table entries of this thread's rows of the tile at j0, as read: nothing uses them here, so the
        reads stay in flight until `_stage_fp8` clamps them into the cache (PageRow's bound) one iteration later."""
        for k in cutlass.range_constexpr(self.tile_n // 32):
            ids[k] = Int32(pt_row.ids[self._fp8_key(tidx, keys, j0, k) // self.page])

    @cute.jit
    def _stage_fp8(self, tidx: Int32, pt_row, keys: tuple, ids: cute.Tensor, k_ptr: cute.Pointer, k_sp: Int64,
                   k_so: Int64, j0: Int32, dst: cute.Tensor):
        """Keys j0 .. j0 + TN of the float8 cache, as stored (576 bytes a key), into `dst` (key row, 16-byte chunk,
        byte: a ring stage's view; mla.py's rows are contiguous in the upper half of the 16-bit stage, `_fp8_rows`,
        mla_narrow.py's 608 bytes apart): this thread's chunks (`_fp8_chunk`), one cp.async each, from the rows'
        page ids `ids` (`_fp8_page_ids`), clamped into the cache here and widened to 64 bits."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Uint8,
                                   num_bits_per_copy=128)
        k_base = k_ptr.toint()
        for k in cutlass.range_constexpr(self.tile_n // 32):
            page = Int64(cutlass.min(cutlass.max(ids[k], Int32(0)), pt_row.last))
            j = self._fp8_key(tidx, keys, j0, k)
            row_addr = self._key_row(k_base, page, j, k_sp, k_so, 1)
            for i in cutlass.range_constexpr(CHUNKS8 // 4):
                row, ch = _fp8_chunk(tidx, k * CHUNKS8 // 4 + i)
                src = cute.make_tensor(cute.make_ptr(Uint8, row_addr + ch * 16, cute.AddressSpace.gmem,
                                                     assumed_align=16), cute.make_layout((16,)))
                cute.copy(atom, src, dst[row, ch, None])

    @cute.jit
    def _widen_fp8(self, tidx: Int32, stage: Int32, ring: cute.Pointer):
        """Ring stage `stage`'s float8 tile (its upper half: `_stage_fp8`) -> fp16 in place. Each thread reads the
        chunks it copied (`_fp8_chunk`) into registers; after the producer's barrier (the fp16 rows overwrite
        other threads' float8 chunks) it writes each chunk's 16 values (two cvt.rn.f16x2.e4m3x2 per 32-bit word)
        as the row's 16-bit chunks 2c and 2c + 1, at their swizzled places."""
        BN = const_expr(self.tile_n)
        PER = const_expr(BN * CHUNKS8 // 128)  # chunks per thread
        src = _fp8_half(ring, BN, self.stages, Uint32)
        wK = _chunks_view(cute.recast_ptr(ring, dtype=Uint32), BN, self.stages, per_chunk=4)
        x = cute.make_rmem_tensor((PER, 4), Uint32)
        for i in cutlass.range_constexpr(PER):
            row, ch = _fp8_chunk(tidx, i)
            cute.autovec_copy(src[stage, row * CHUNKS8 + ch, None], x[i, None])
        cute.arch.barrier(barrier_id=PRODUCER_BAR, number_of_threads=128)
        lo = cute.make_rmem_tensor((4,), Uint32)
        hi = cute.make_rmem_tensor((4,), Uint32)
        for i in cutlass.range_constexpr(PER):
            row, ch = _fp8_chunk(tidx, i)
            for k in cutlass.range_constexpr(2):
                lo[2 * k], lo[2 * k + 1] = e4m3x4_to_f16x4(x[i, k])
                hi[2 * k], hi[2 * k + 1] = e4m3x4_to_f16x4(x[i, 2 + k])
            cute.autovec_copy(lo, _chunk(wK[stage, None, None, None, None, None], row, 2 * ch))
            cute.autovec_copy(hi, _chunk(wK[stage, None, None, None, None, None], row, 2 * ch + 1))


def query_parts(q_ptr, q_sb, q_ss, q_sh, qpe_ptr, pe_sb, pe_ss, pe_sh) -> dict:
    """The query's two sources as `_issue_q` takes them: "nope", columns 0..511 (q), and "pe", 512..575 (q_pe,
    or q's own columns 512.. when the query is one tensor: the host passes that view), each (pointer, request
    stride, token stride, head stride) in elements."""
    assert (BLOCK_M * (DV // 8)) % 256 == 0 and (BLOCK_M * (CHUNKS - DV // 8)) % 256 == 0
    return {"nope": (q_ptr, q_sb, q_ss, q_sh), "pe": (qpe_ptr, pe_sb, pe_ss, pe_sh)}


def _with_stage_stride(layout, stages: int, stride: int):
    """A single-stage operand layout ((...), (...), (1, 1)) with its stage mode replaced by `stages` stages
    `stride` elements apart (the ring's stage stride, not the operand's own size)."""
    shape, strides = layout.shape, layout.stride
    return cute.make_layout((shape[0], shape[1], (1, stages)), stride=(strides[0], strides[1], (0, stride)))


def _fp8_rows(ring, rows: int, stages: int):
    """(stage, key row, 16-byte chunk, byte) of the float8 tiles in the upper halves of the ring's 16-bit stages:
    `_fp8_half` by rows, the view `_stage_fp8` copies into."""
    return cute.make_tensor(cute.recast_ptr(ring + rows * D // 2, dtype=Uint8),
                            cute.make_layout((stages, rows, CHUNKS8, 16), stride=(rows * D * 2, D, 16, 1)))


def _fp8_half(ring, rows: int, stages: int, dtype):
    """(stage, 16-byte chunk, values) of the float8 tiles in the upper halves of the ring's 16-bit stages (rows x
    576 bytes, rows contiguous), as `dtype` (Uint8: 16 values a chunk; Uint32: 4)."""
    per = 128 // dtype.width
    stage = rows * D * 2 // (dtype.width // 8)  # a 16-bit stage, in `dtype` elements
    return cute.make_tensor(cute.recast_ptr(ring + rows * D // 2, dtype=dtype),
                            cute.make_layout((stages, rows * CHUNKS8, per), stride=(stage, per, 1)))


@cute.jit
def _nearest_visible(j: Int32, keys: tuple):
    """Key j clamped to the visible keys [kv_start, length - 1] (`keys`, as Uint32): the key a cp.async gather
    copies for key j, so a key outside copies the nearest visible one."""
    return cutlass.min(cutlass.max(Uint32(j), keys[0]), keys[1])


def _fp8_chunk(tidx, i: int):
    """(row, chunk) of a float8 tile that producer thread `tidx` copies and widens as its i-th chunk: four threads
    per key row (rows tidx // 4 + 32 k, k = i // 9), each every fourth of the row's 36 16-byte chunks (tidx % 4
    + 4 (i % 9)). A warp's copy i reads 8 rows x 64 contiguous bytes; in shared memory each quarter warp's 16-byte
    accesses fall in two rows whose bytes take disjoint banks (float8 rows 576 bytes apart, fp16 chunk positions
    XOR-ed by the row)."""
    per_row = CHUNKS8 // 4
    return tidx // 4 + 32 * (i // per_row), tidx % 4 + 4 * (i % per_row)


def _chunks_view(ptr, rows: int, stages: int, per_chunk: int = 8):
    """(stage, slab, row // 8, row % 8, chunk position, `per_chunk` elements) of `stages` swizzled rows x 576
    tiles of 16-bit values, through a pointer of 8 elements per 16-byte chunk (or 4: 32-bit words of pairs)."""
    return cute.make_tensor(ptr, cute.make_layout((stages, SLABS, rows // 8, 8, 8, per_chunk),
                                                  stride=(rows * D * per_chunk // 8, rows * 8 * per_chunk,
                                                          64 * per_chunk, 8 * per_chunk, per_chunk, 1)))


@cute.jit
def _chunk(base: cute.Tensor, row: Int32, ch: Int32):
    """The 16-byte chunk `ch` of row `row` of a swizzled rows x 576 tile (see the module docstring)."""
    return base[ch // 8, row // 8, row % 8, (ch % 8) ^ (row % 8), None]
