"""MLA decode and verify in CuTe DSL on Hopper, the seesaw schedule: 64-key tiles in two buffers, per-slab TMA
barriers, two warpgroups and no producer.

The problem is mla.py's (D = 576 for q and k, Dv = 512, V the first 512 columns of K, one latent KV head, the
same grid (splits, row blocks, B) of 64 query rows of request b and one split of its keys, the same outputs).
Where mla.py streams 32-key tiles through a 4-stage ring filled by a producer warpgroup, this kernel keeps two
64-key tiles (buffer t % 2 holds tile t) and refills each buffer in parts as soon as its readers are done with
them, the schedule of FlashMLA's Hopper kernel (DeepSeek, "splitkv_mla"). N = 64 halves the reads of Q from
shared memory per key against N = 32, the bound of mla.py (benchmarks/results/h200.md, session 27 and 28).

Warpgroup c (256 threads, 128 each, no setmaxnreg: 255 registers) owns the output columns [256 c, 256 c + 256)
of all 64 rows (64 x 256 fp32: 128 registers) and the scores of tiles c, c + 2, ... (a round is tiles
a = 2r, in buffer 0, scored by warpgroup 0, and b = 2r + 1, in buffer 1, by warpgroup 1):

- S = Q K^T per tile (wgmma m64n64k16, 36 k-steps: slabs 0-7 with Q from shared memory, slab 8, the rope
  columns, with Q's rope slab held in registers, `r_q8`, so that its shared memory holds P_b instead). Each
  128-byte slab of a buffer (64 keys x 64 columns) completes its own mbarrier (TMA expect-tx, 8 KB), so the
  scores start on the first slab to land.
- The max runs as one chain a, b, a', b', ...: warpgroup 0 takes the max of S_a against the chain's last
  (row_max), publishes the new max and its factor (scale0) (named barrier SCALE0); warpgroup 1 then does the
  same for S_b (SCALE1). Warpgroup 0 adds P_a V_a (its columns; P from registers) at once, then brings P_a and
  O to b's max (times scale1) and publishes P_a (16-bit, `p0`; P0_BAR); warpgroup 1 publishes P_b in Q's rope
  slab (P1_BAR) and adds P_b V_b (registers) and P_a V_a (shared memory); warpgroup 0 adds P_b V_b. Both O
  halves and both partial row sums follow the same max, so the epilogue (mla.py's) adds the sums.
- Refills, each by the warpgroup that reads those slabs last (no empty barriers; the named barriers above
  order the other warpgroup's reads before them): buffer 0's slabs 0-3 (V_a's left half) by warpgroup 0 after
  its P_a V_a; buffer 1's slabs 0-3 by warpgroup 0 after its P_b V_b; buffer 1's slabs 4-8 by warpgroup 1
  after its P_b V_b; buffer 0's slabs 4-8 by warpgroup 1 after its P_a V_a. Each warpgroup's next scores take
  first the slabs it refilled itself (warpgroup 0: 0-3 then 4-8, warpgroup 1: 4-8 then 0-3). The page ids of
  a round's refills are read at the round's start (`_round_pages`), so the page table's latency is not added
  to theirs; Q's copies are issued before anything else (its address needs no load), waited for after the
  first two tiles' loads.
- TMA always (`tma_box(page, 64)`: pages of 8 to 256 keys that divide 64 or that 64 divides; the plan keeps
  other pages on mla.py): one copy per box of min(page, 64) keys and slab, issued by warp 0 of a warpgroup.
  A tile that reaches outside [kv_start, length) loads whole boxes (page ids clamped to the last live key's
  page, then into the cache: `PageRow`); its scores there are masked (online_softmax) and each warpgroup zeroes
  the V rows of those keys in its half before its P V (a stale or NaN slot times P = 0 would be NaN).

Rounds where all four tiles a, b, a + 2, b + 2 exist run a body without run-time conditions around the
wgmma (`steady`); the last one or two rounds take the flags at run time.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

from b12x_inductor.kernels.cute import MLA_BLOCK_M as BLOCK_M
from b12x_inductor.kernels.cute import MLA_D as D
from b12x_inductor.kernels.cute import tma, tma_box
from b12x_inductor.kernels.cute.common import NEG_BIG, LOG2E, PageRow, live_range, split_keys
from b12x_inductor.kernels.cute.mla import (HALF, SLABS, SUM_BAR, MlaSplitKernel, _with_stage_stride, cluster_flag,
                                            query_parts)
from b12x_inductor.kernels.cute.softmax import RESCALE_LOG2, online_softmax
from b12x_inductor.kernels.cute.softmax import moved as _moved
from b12x_inductor.kernels.cute.softmax import scale_rows as _scale_rows

THREADS = 256  # two warpgroups, both consumers; warp 0 of each issues its refills
TILE_N = 64
SLAB = TILE_N * 64  # elements of one 128-byte slab of a tile (64 keys x 64 columns)
STAGE = TILE_N * D  # elements of one buffer
SLAB_BYTES = SLAB * 2
SCALE0_BAR, SCALE1_BAR = 1, 2  # warpgroup c's new row maxima and factors are published (c's 128 arrive)
P0_BAR, P1_BAR = 3, 4  # P_a (warpgroup 0) / P_b (warpgroup 1) is in shared memory
# mla.py's Q_BAR (7) and SUM_BAR (8) serve _load_q and the epilogue


class MlaSeesawKernel(MlaSplitKernel):
    """The seesaw MLA kernel for one set of compile-time constants. It shares mla.py's Q load, epilogue and
    host-side launch (`MlaSplitKernel.__call__`, with THREADS); `tile_n` must be 64 and `stages` 2
    (plan.MLA_SEESAW_TILE; kernels/cute/__init__.py: mla_seesaw_geometry)."""

    def __init__(self, *, s: int, hq: int, page: int, num_splits: int, tile_n: int, stages: int, q_dtype,
                 causal: bool, use_softcap: bool, kv_dtype=None, cluster: bool = False):
        from b12x_inductor.kernels.cute import mla_seesaw_geometry

        assert (tile_n, stages) == (TILE_N, 2), "the seesaw kernel's tile is 2 buffers of 64 keys"
        assert kv_dtype is None or kv_dtype is q_dtype, "the seesaw kernel reads a 16-bit cache in q's dtype"
        self.s, self.hq, self.page, self.num_splits = s, hq, page, num_splits
        self.cluster = cluster_flag(cluster, num_splits)
        self.tile_n, self.stages, self.dtype = TILE_N, 2, q_dtype
        self.fp8, self.mdt = False, q_dtype
        self.causal, self.use_softcap = causal, use_softcap
        geo = mla_seesaw_geometry()
        self.storage, self.smem_bytes = geo["storage"], geo["smem_bytes"]  # storage.py: mla_seesaw_storage
        self.rows = s * hq
        self.row_blocks = -(-self.rows // BLOCK_M)
        self.box = tma_box(page=page, tile_n=TILE_N)
        self.threads = THREADS
        assert self.box != 0, "the seesaw kernel loads every tile by TMA (the plan keeps other pages on mla.py)"

    @cute.kernel
    def kernel(
        self, q_ptr: cute.Pointer, qpe_ptr: cute.Pointer, k_ptr: cute.Pointer, pt_ptr: cute.Pointer,
        seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, sinks_ptr: cute.Pointer, part_o_ptr: cute.Pointer,
        part_l_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, kds_ptr: cute.Pointer,
        vds_ptr: cute.Pointer, q_sb: Int64, q_ss: Int64, q_sh: Int64, pe_sb: Int64, pe_ss: Int64, pe_sh: Int64,
        k_sp: Int64, k_so: Int64, pt_sb: Int64, kds_b: Int32, vds_b: Int32, has_kds: Int32, has_vds: Int32,
        has_kv_start: Int32, has_sinks: Int32, sm_scale: Float32, softcap: Float32, cap: Int32, num_pages: Int32,
        tma_k: cute.CopyAtom, m_k: cute.Tensor,
    ):  # kds_* / vds_*: a float8 cache's descales, which this kernel never reads (16-bit caches only)
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)  # storage.py: mla_seesaw_storage
        tidx, _, _ = cute.arch.thread_idx()
        split, rb, b = cute.arch.block_idx()
        wgc = tidx // 128
        lt = tidx % 128
        dt = self.dtype

        mbar = storage.mbar.data_ptr()  # slab s of buffer u completes mbar + 9 u + s
        q_tile = cute.recast_ptr(storage.q.data_ptr(), dtype=dt)
        ring = cute.recast_ptr(storage.kv.data_ptr(), dtype=dt)
        p0_tile = cute.recast_ptr(storage.p0.data_ptr(), dtype=dt)
        p1_tile = q_tile + (SLABS - 1) * SLAB  # Q's rope slab, free once r_q8 holds it

        # first: Q's address needs no load
        self._issue_q(query_parts(q_ptr, q_sb, q_ss, q_sh, qpe_ptr, pe_sb, pe_ss, pe_sh), b, rb, tidx, q_tile)
        if tidx == 0:
            for i in cutlass.range_constexpr(2 * SLABS):
                cute.arch.mbarrier_init(mbar + i, 1)  # the issuing lane's arrive with expect-tx
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        length, start = live_range(seqlens_ptr, kv_start_ptr, has_kv_start, b, cap)
        lo = start - start % TILE_N  # tiles start on a tile (and box) boundary; keys below start are masked
        s_lo, s_hi, n_tiles = split_keys(lo, length, split, self.num_splits, TILE_N)
        pt_row = PageRow(pt_ptr, pt_sb, b, num_pages)

        # the first two tiles, all their slabs, by warp 0 of warpgroup 0, before Q is waited for
        ctx = dict(lt=lt, s_lo=s_lo, length=length, pt_row=pt_row, mbar=mbar, ring=ring, tma_k=tma_k, m_k=m_k)
        if tidx < 32:
            cpasync.prefetch_descriptor(tma_k)
            if n_tiles >= 1:
                self._refill(ctx, Int32(0), 0, 0, SLABS, self._page_ids(ctx, Int32(0)))
            if n_tiles >= 2:
                self._refill(ctx, Int32(1), 1, 0, SLABS, self._page_ids(ctx, Int32(1)))
        self._wait_q()

        # ---- the operands' shared-memory views and fragments ----
        lq = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, TILE_N, D), dt, 1)
        lk = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, TILE_N, D), dt, 2)
        lp = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, HALF, TILE_N), dt, 1)
        lv = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BLOCK_M, HALF, TILE_N), dt, 1)
        sQ = cute.make_tensor(cute.recast_ptr(q_tile, lq.inner, dtype=dt), lq.outer)
        sK = cute.make_tensor(cute.recast_ptr(ring, lk.inner, dtype=dt), lk.outer)
        sP0 = cute.make_tensor(cute.recast_ptr(p0_tile, lp.inner, dtype=dt), lp.outer)
        sP1 = cute.make_tensor(cute.recast_ptr(p1_tile, lp.inner, dtype=dt), lp.outer)
        v_base = ring + wgc * (HALF // 64) * SLAB  # this warpgroup's 256 columns: slabs 4c .. 4c + 3
        sV = cute.make_tensor(cute.recast_ptr(v_base, lv.inner, dtype=dt), _with_stage_stride(lv.outer, 2, STAGE))

        thr_qk = self._mma_qk(False).get_slice(lt)
        thr_qk_r = self._mma_qk(True).get_slice(lt)
        thr_pv = self._mma_pv(False).get_slice(lt)
        thr_pv_r = self._mma_pv(True).get_slice(lt)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tSrK_r = thr_qk_r.make_fragment_B(thr_qk_r.partition_B(sK))
        tOrP0 = thr_pv.make_fragment_A(thr_pv.partition_A(sP0))
        tOrP1 = thr_pv.make_fragment_A(thr_pv.partition_A(sP1))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        tOrV_r = thr_pv_r.make_fragment_B(thr_pv_r.partition_B(sV))
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((BLOCK_M, TILE_N)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BLOCK_M, HALF)))
        t_cs = thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, TILE_N)))
        t_co = thr_pv.partition_C(cute.make_identity_tensor((BLOCK_M, HALF)))
        # the accumulator fragment of 64 keys, in 16 bits, is the A fragment of a 64-deep k (extend.py)
        a_frag = cute.make_layout(((2, 2, 2), 1, TILE_N // 16), stride=((1, 2, 4), 0, 8))
        r_p = cute.make_rmem_tensor(acc_s.layout, dt)
        t_rp = cute.make_tensor(r_p.iterator, a_frag)
        # Q's rope slab as the A fragment of the scores' last 4 k-steps, converted from fp32 as P is: packed
        # 16-bit pairs (scalar 16-bit loads would be packed between the wgmma, which ptxas then serializes)
        q8 = cute.make_rmem_tensor(acc_s.layout, Float32)
        for i in cutlass.range_constexpr(cute.size(q8)):
            q8[i] = Float32(sQ[t_cs[i][0], (SLABS - 1) * 64 + t_cs[i][1], 0])
        r_q8 = cute.make_rmem_tensor(acc_s.layout, dt)
        r_q8.store(q8.load().to(dt))
        t_rq8 = cute.make_tensor(r_q8.iterator, a_frag)
        t_sp0 = thr_qk.partition_C(sP0[None, None, 0])
        t_sp1 = thr_qk.partition_C(sP1[None, None, 0])

        acc_o.fill(0.0)
        m_run = cute.make_rmem_tensor((2,), Float32)
        l_run = cute.make_rmem_tensor((2,), Float32)
        alpha = cute.make_rmem_tensor((2,), Float32)
        limit = cute.make_rmem_tensor((2,), Int32)
        for i in cutlass.range_constexpr(2):
            m_run[i] = Float32(NEG_BIG)
            l_run[i] = Float32(0.0)
            limit[i] = length - self.s + (rb * BLOCK_M + t_cs[2 * i][0]) // self.hq
        sM = storage.row_max.get_tensor(cute.make_layout((BLOCK_M,)))
        sA = storage.scale.get_tensor(cute.make_layout((2, BLOCK_M), stride=(BLOCK_M, 1)))
        k_scale = sm_scale * Float32(LOG2E)
        full_hi = s_hi
        if const_expr(self.causal):
            full_hi = cutlass.min(full_hi, length - self.s + 1)
        ctx.update(tidx=tidx, s_hi=s_hi, start=start, full_hi=full_hi, n_tiles=n_tiles, k_scale=k_scale,
                   softcap=softcap)

        # ---- the first round's scores ----
        # (each wgmma is waited for inside the region that issued it: a wait after a run-time branch lets the
        # branch's join define the accumulator registers while the wgmma runs, and ptxas serializes them all)
        if wgc == 0:
            if n_tiles >= 1:
                self._scores(acc_s, tSrQ, tSrK, tSrK_r, t_rq8, 0, Int32(0), tuple(range(SLABS)), mbar)
                warpgroup.wait_group(0)
        else:
            if n_tiles >= 2:
                self._scores(acc_s, tSrQ, tSrK, tSrK_r, t_rq8, 1, Int32(0), tuple(range(SLABS)), mbar)
                warpgroup.wait_group(0)

        # rounds: the steady ones (tiles a, b, a + 2, b + 2 all exist), then the tail, whose flags (b, a + 2,
        # b + 2 exist) follow from the parity of the tile count: even, one (T, F, F) round; odd, (T, T, F) and
        # (F, F, F). Every round is compiled for its flags.
        n_steady = cutlass.max((n_tiles - 2) // 2, Int32(0))
        args = (acc_s, acc_o, r_p, t_rp, t_rq8, tSrQ, tSrK, tSrK_r, tOrV, tOrV_r, t_cs, m_run, l_run, alpha, limit,
                sM, sA)
        if wgc == 0:
            self._rounds(ctx, self._round0, n_steady, (tOrP1, t_sp0), args)
        else:
            self._rounds(ctx, self._round1, n_steady, (tOrP0, t_sp1), args)
        # the chain's last max (written by a quad's first lane: a barrier before the other lanes read it)
        cute.arch.barrier(barrier_id=SUM_BAR, number_of_threads=256)
        if n_tiles >= 1:
            for rh in cutlass.range_constexpr(2):
                m_run[rh] = sM[t_co[2 * rh][0]]
        self._epilogue(acc_o, t_co, m_run, l_run, storage, b, rb, split, wgc, lt, sinks_ptr, has_sinks,
                       part_o_ptr, part_l_ptr, out_ptr, lse_ptr, Float32(1.0))

    @cute.jit
    def _rounds(self, ctx: dict, round_fn: cutlass.Constexpr, n_steady: Int32, own: tuple, args: tuple):
        """One warpgroup's rounds (`round_fn`: _round0 or _round1; `own`: its P view and P store fragment): the
        steady ones, then the tail for the tile count's parity."""
        n_tiles = ctx["n_tiles"]
        for r in cutlass.range(n_steady, unroll=1):
            round_fn(ctx, r, (True, True, True), *own, *args)
        if n_tiles % 2 == 0:
            if n_tiles >= 2:
                round_fn(ctx, n_steady, (True, False, False), *own, *args)
        else:
            if n_tiles >= 3:
                round_fn(ctx, n_steady, (True, True, False), *own, *args)
            round_fn(ctx, n_tiles // 2, (False, False, False), *own, *args)

    @cute.jit
    def _round0(self, ctx: dict, r: Int32, flags: cutlass.Constexpr, tOrP1, t_sp0, acc_s, acc_o, r_p, t_rp, t_rq8,
                tSrQ, tSrK, tSrK_r, tOrV, tOrV_r, t_cs, m_run, l_run, alpha, limit, sM, sA):
        """Warpgroup 0's round r: tiles a = 2r (its own, scored in acc_s) and b = 2r + 1; `flags`: whether
        tiles b, a + 2 and b + 2 exist."""
        a = 2 * r
        lt = ctx["lt"]
        has_b, has_a2, has_b2 = flags
        j_a = ctx["s_lo"] + a * TILE_N
        pg_a2, pg_b2 = self._round_pages(ctx, a, has_a2, has_b2)
        # softmax of S_a against the chain's last max (warpgroup 1's of the previous round)
        if r > 0:
            for rh in cutlass.range_constexpr(2):
                m_run[rh] = sM[t_cs[2 * rh][0]]
        self._softmax(ctx, acc_s, t_cs, m_run, l_run, alpha, limit, j_a)
        if lt % 4 == 0:
            for rh in cutlass.range_constexpr(2):
                sM[t_cs[2 * rh][0]] = m_run[rh]
                sA[0, t_cs[2 * rh][0]] = alpha[rh]
        cute.arch.barrier_arrive(barrier_id=SCALE0_BAR, number_of_threads=256)
        if _moved(alpha):
            _scale_rows(acc_o, alpha)
        r_p.store(acc_s.load().to(self.dtype))
        # O += P_a V_a (P from registers)
        self._zero_outside(ctx, j_a, 0)
        warpgroup.fence()
        self._pv(acc_o, t_rp, tOrV_r, 0, True)
        warpgroup.wait_group(0)
        cute.arch.barrier(barrier_id=SCALE1_BAR, number_of_threads=256)
        if const_expr(has_a2):  # buffer 0's slabs 0-3: their readers (S_a, P_a V_a) are done
            self._refill(ctx, a + 2, 0, 0, 4, pg_a2)
        # P_a to b's max, published for warpgroup 1
        if const_expr(has_b):
            for rh in cutlass.range_constexpr(2):
                alpha[rh] = sA[1, t_cs[2 * rh][0]]
                l_run[rh] = l_run[rh] * alpha[rh]
            if _moved(alpha):
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = acc_s[i] * alpha[(i // 2) % 2]
                r_p.store(acc_s.load().to(self.dtype))
        cute.autovec_copy(r_p, t_sp0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=P0_BAR, number_of_threads=256)
        # O to b's max, then O += P_b V_b (P from shared memory, once warpgroup 1 has published it)
        if const_expr(has_b):
            cute.arch.barrier(barrier_id=P1_BAR, number_of_threads=256)
            self._zero_outside(ctx, j_a + TILE_N, 1)
            if _moved(alpha):
                _scale_rows(acc_o, alpha)
            warpgroup.fence()
            self._pv(acc_o, tOrP1, tOrV, 1, False)
        # S_a' (tile a + 2): slabs 0-3 (refilled above), then 4-8 (by warpgroup 1)
        if const_expr(has_a2):
            self._scores(acc_s, tSrQ, tSrK, tSrK_r, t_rq8, 0, (a + 2) // 2, (0, 1, 2, 3), ctx["mbar"])
        if const_expr(has_b2):  # buffer 1's slabs 0-3, once P_b V_b is done
            warpgroup.wait_group(1)
            self._refill(ctx, a + 3, 1, 0, 4, pg_b2)
        if const_expr(has_a2):
            self._scores(acc_s, tSrQ, tSrK, tSrK_r, t_rq8, 0, (a + 2) // 2, (4, 5, 6, 7, 8), ctx["mbar"],
                         first=False)
        warpgroup.wait_group(0)

    @cute.jit
    def _round1(self, ctx: dict, r: Int32, flags: cutlass.Constexpr, tOrP0, t_sp1, acc_s, acc_o, r_p, t_rp, t_rq8,
                tSrQ, tSrK, tSrK_r, tOrV, tOrV_r, t_cs, m_run, l_run, alpha, limit, sM, sA):
        """Warpgroup 1's round r: tiles a = 2r and b = 2r + 1 (its own, scored in acc_s); `flags` as _round0's."""
        a = 2 * r
        has_b, has_a2, has_b2 = flags
        j_a = ctx["s_lo"] + a * TILE_N
        lt = ctx["lt"]
        pg_a2, pg_b2 = self._round_pages(ctx, a, has_a2, has_b2)
        # after warpgroup 0's softmax of S_a: O and the sums to a's max, then the softmax of S_b against it
        cute.arch.barrier(barrier_id=SCALE0_BAR, number_of_threads=256)
        a0 = cute.make_rmem_tensor((2,), Float32)
        for rh in cutlass.range_constexpr(2):
            a0[rh] = sA[0, t_cs[2 * rh][0]]
            l_run[rh] = l_run[rh] * a0[rh]
            alpha[rh] = Float32(1.0)
        if const_expr(has_b):
            for rh in cutlass.range_constexpr(2):
                m_run[rh] = sM[t_cs[2 * rh][0]]
            self._softmax(ctx, acc_s, t_cs, m_run, l_run, alpha, limit, j_a + TILE_N)
            if lt % 4 == 0:
                for rh in cutlass.range_constexpr(2):
                    sM[t_cs[2 * rh][0]] = m_run[rh]
                    sA[1, t_cs[2 * rh][0]] = alpha[rh]
        cute.arch.barrier_arrive(barrier_id=SCALE1_BAR, number_of_threads=256)
        for rh in cutlass.range_constexpr(2):
            alpha[rh] = alpha[rh] * a0[rh]
        if _moved(alpha):
            _scale_rows(acc_o, alpha)
        # publish P_b (Q's rope slab), O += P_b V_b (P from registers)
        if const_expr(has_b):
            r_p.store(acc_s.load().to(self.dtype))
            cute.autovec_copy(r_p, t_sp1)
            cute.arch.fence_proxy("async.shared", space="cta")
            self._zero_outside(ctx, j_a + TILE_N, 1)
            warpgroup.fence()
            self._pv(acc_o, t_rp, tOrV_r, 1, True)
        # O += P_a V_a (P from shared memory, once warpgroup 0 has published it)
        cute.arch.barrier(barrier_id=P0_BAR, number_of_threads=256)
        self._zero_outside(ctx, j_a, 0)
        warpgroup.fence()
        self._pv(acc_o, tOrP0, tOrV, 0, False)
        if const_expr(has_b):
            cute.arch.barrier_arrive(barrier_id=P1_BAR, number_of_threads=256)
        if const_expr(has_b2):  # buffer 1's slabs 4-8: their readers (S_b, P_b V_b) are done
            warpgroup.wait_group(1)
            self._refill(ctx, a + 3, 1, 4, SLABS, pg_b2)
        if const_expr(has_a2):  # buffer 0's slabs 4-8: S_a (warpgroup 0, before SCALE0) and P_a V_a are done
            warpgroup.wait_group(0)
            self._refill(ctx, a + 2, 0, 4, SLABS, pg_a2)
        # S_b' (tile b + 2): slabs 4-8 (refilled above), then 0-3 (by warpgroup 0)
        if const_expr(has_b2):
            self._scores(acc_s, tSrQ, tSrK, tSrK_r, t_rq8, 1, (a + 3) // 2, (4, 5, 6, 7, 8, 0, 1, 2, 3),
                         ctx["mbar"])
        warpgroup.wait_group(0)

    @cute.jit
    def _softmax(self, ctx: dict, acc_s, t_cs, m_run, l_run, alpha, limit, j0: Int32):
        online_softmax(acc_s, t_cs, m_run, l_run, alpha, limit, j0, ctx["s_hi"], ctx["start"], ctx["start"],
                       ctx["full_hi"], ctx["k_scale"], ctx["softcap"], Int32(0), tile_n=TILE_N, causal=self.causal,
                       use_window=False, use_softcap=self.use_softcap, rescale_log2=RESCALE_LOG2)

    def _mma_qk(self, a_in_registers: bool):
        """S = Q K^T, 64 x 64 per warpgroup: Q from shared memory (slabs 0-7) or registers (slab 8)."""
        kmaj = warpgroup.OperandMajorMode.K
        src = warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, kmaj, kmaj, Float32, (1, 1, 1),
                                                 (64, TILE_N), a_source=src)

    def _mma_pv(self, a_in_registers: bool):
        """O += P V for one warpgroup's 256 columns: P from registers (its own tile) or shared memory (the
        other's), V read N-major."""
        src = warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, warpgroup.OperandMajorMode.K,
                                                 warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1), (64, HALF),
                                                 a_source=src)

    @cute.jit
    def _scores(self, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor, tSrK_r: cute.Tensor,
                t_rq8: cute.Tensor, buf: cutlass.Constexpr, use: Int32, slabs: cutlass.Constexpr, mbar: cute.Pointer,
                first: cutlass.Constexpr = True):
        """Issues the scores of the tile in buffer `buf` (its `use`-th load: barrier phase use % 2) over `slabs`,
        each after its barrier, as one commit group; `first`: the group starts the accumulation. The tiled
        MMAs are made here: their accumulate flag is traced state that must not cross a control-flow region."""
        mma = self._mma_qk(False)
        mma_r = self._mma_qk(True)
        for n, sl in enumerate(slabs):
            cute.arch.mbarrier_wait(mbar + buf * SLABS + sl, use % 2)
            warpgroup.fence()  # after each wait (a loop): ptxas serializes the wgmma otherwise
            for kk in cutlass.range_constexpr(4):
                acc = not (first and n == 0 and kk == 0)
                if const_expr(sl < SLABS - 1):
                    mma.set(warpgroup.Field.ACCUMULATE, acc)
                    cute.gemm(mma, acc_s, tSrQ[None, None, sl * 4 + kk, 0], tSrK[None, None, sl * 4 + kk, buf], acc_s)
                else:
                    mma_r.set(warpgroup.Field.ACCUMULATE, acc)
                    cute.gemm(mma_r, acc_s, t_rq8[None, None, kk], tSrK_r[None, None, sl * 4 + kk, buf], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _pv(self, acc_o: cute.Tensor, t_p: cute.Tensor, t_v: cute.Tensor, buf: cutlass.Constexpr,
            p_in_registers: cutlass.Constexpr):
        """Issues O += P V with V from buffer `buf` and P from registers or shared memory (one commit group)."""
        mma = self._mma_pv(p_in_registers)
        mma.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(TILE_N // 16):
            if const_expr(p_in_registers):
                cute.gemm(mma, acc_o, t_p[None, None, k], t_v[None, None, k, buf], acc_o)
            else:
                cute.gemm(mma, acc_o, t_p[None, None, k, 0], t_v[None, None, k, buf], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def _page_ids(self, ctx: dict, t: Int32):
        """Lane i < (box rows of a tile) of warp 0 (of either warpgroup: `lt`): the page id of tile t's box row i,
        clamped to the last live key's page; 0 elsewhere. Read at the start of the round whose refill uses it,
        so the page table's latency is not added to the refill's."""
        BOX = const_expr(self.box)
        page = Int32(0)
        if ctx["lt"] < TILE_N // BOX:
            key = cutlass.min(ctx["s_lo"] + t * TILE_N + ctx["lt"] * BOX, ctx["length"] - 1)
            page = ctx["pt_row"][key // self.page]
        return page

    @cute.jit
    def _round_pages(self, ctx: dict, a: Int32, has_a2: cutlass.Constexpr, has_b2: cutlass.Constexpr):
        """The page ids of the round's refills (tiles a + 2 and a + 3, where they exist), read at its start."""
        pg_a2 = Int32(0)
        pg_b2 = Int32(0)
        if const_expr(has_a2):
            pg_a2 = self._page_ids(ctx, a + 2)
        if const_expr(has_b2):
            pg_b2 = self._page_ids(ctx, a + 3)
        return pg_a2, pg_b2

    @cute.jit
    def _refill(self, ctx: dict, t: Int32, buf: cutlass.Constexpr, s0: cutlass.Constexpr, s1: cutlass.Constexpr,
                page: Int32):
        """Tile t's slabs s0 .. s1 - 1 into buffer `buf` (t % 2), by warp 0 of the calling warpgroup; `page`:
        _page_ids(t)."""
        if ctx["lt"] < 32:
            self._load(ctx["lt"], ctx["s_lo"] + t * TILE_N, Int32(buf), s0, s1, page, ctx["mbar"], ctx["ring"],
                       ctx["tma_k"], ctx["m_k"])

    @cute.jit
    def _load(self, lane: Int32, j0: Int32, buf: Int32, s0: cutlass.Constexpr, s1: cutlass.Constexpr, page: Int32,
              mbar: cute.Pointer, ring: cute.Pointer, tma_k, m_k):
        """One warp's TMA copies of slabs s0 .. s1 - 1 of the tile at key j0 into buffer `buf`: lane 0 arms each
        slab's barrier with its 8 KB, then each box row (min(page, 64) keys of one page; lane i holds box row
        i's page id, `page`, and shuffles it) goes slab by slab."""
        BOX = const_expr(self.box)
        ROWS = const_expr(TILE_N // BOX)
        if lane == 0:
            for sl in cutlass.range_constexpr(s0, s1):
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + buf * SLABS + sl, SLAB_BYTES)
        for rbox in cutlass.range(ROWS, unroll=1):  # unrolled, 8 rows x 9 slabs of coordinates spill at page 8
            p = cute.arch.shuffle_sync(page, rbox)
            for sl in cutlass.range_constexpr(s0, s1):
                dst = ring + (buf * STAGE + sl * SLAB + rbox * BOX * 64)
                tma.copy_box(tma_k, m_k, dst, BOX, j0, self.page, sl, Int32(0), p, mbar + buf * SLABS + sl)

    @cute.jit
    def _zero_outside(self, ctx: dict, j0: Int32, buf: cutlass.Constexpr):
        """Zeroes, in this warpgroup's V half of buffer `buf`, the rows of the tile at key j0 whose keys lie
        outside [kv_start, length) (loaded whole by TMA: stale or NaN values, masked to P = 0 in the scores),
        then fences the writes for the tensor cores. Only tiles that reach outside that range do any work."""
        lo_row = ctx["start"] - j0
        hi_row = ctx["length"] - j0
        if (lo_row > 0) | (hi_row < TILE_N):
            lt = ctx["lt"]
            wgc = ctx["tidx"] // 128
            base = ctx["ring"] + (buf * STAGE + wgc * (HALF // 64) * SLAB)
            zero = cute.make_rmem_tensor((8,), self.dtype)
            zero.fill(0.0)
            for i in cutlass.range_constexpr(TILE_N * 4 * 8 // 128):  # rows x 4 slabs x 8 chunks of 16 bytes
                e = lt + i * 128
                row = e // 32
                if (row < lo_row) | (row >= hi_row):
                    off = ((e % 32) // 8) * SLAB + row * 64 + (e % 8) * 8
                    cute.autovec_copy(zero, cute.make_tensor(base + off, cute.make_layout((8,))))
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=5 + wgc, number_of_threads=128)
