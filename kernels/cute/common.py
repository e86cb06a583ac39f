"""Math shared by the CuTe DSL family's kernels (decode.py, decode_mma.py, extend.py and the MLA kernels), written
once: the per-(request, KV head) scales, a request's live key range (clamped: `live_range`) and a split's share of
it (`split_keys`), its page-table row (page ids clamped into the cache: `PageRow`), a score's log2-domain logit and
the keys visible to a row (`visible_range`), a row's output factor and lse (`output_factor`: mla.py's and
mla_narrow.py's epilogues); and the stage barriers of a pipelined K/V ring (`full_barrier`, `empty_barrier`) and a
tile's slot in it (`ring_slot`).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_BIG = -1.0e30


@cute.jit
def scales(kds_ptr: cute.Pointer, vds_ptr: cute.Pointer, has_kds: Int32, has_vds: Int32, kds_b: Int32,
           kds_h: Int32, vds_b: Int32, vds_h: Int32, sm_scale: Float32, b: Int32, h: Int32):
    """(k_scale, v_scale): the logit scale in the log2 domain with the K descale folded in; the V descale."""
    k_scale = sm_scale * Float32(LOG2E)
    if has_kds != 0:
        kds = cute.make_tensor(kds_ptr, cute.make_layout((1 << 30,)))
        k_scale = k_scale * Float32(kds[b * kds_b + h * kds_h])
    v_scale = Float32(1.0)
    if has_vds != 0:
        vds = cute.make_tensor(vds_ptr, cute.make_layout((1 << 30,)))
        v_scale = Float32(vds[b * vds_b + h * vds_h])
    return k_scale, v_scale


@cute.jit
def live_range(seqlens_ptr: cute.Pointer, kv_start_ptr: cute.Pointer, has_kv_start: Int32, b: Int32, cap: Int32):
    """(length, start): request b's live length (read on the device) clamped to [0, cap] (the page table's
    capacity, max_pages * PAGE) and its first visible key (kv_start) clamped to [0, length]."""
    seqlens = cute.make_tensor(seqlens_ptr, cute.make_layout((1 << 30,)))
    length = cutlass.min(cutlass.max(Int32(seqlens[b]), Int32(0)), cap)
    start = Int32(0)
    if has_kv_start != 0:
        kvs = cute.make_tensor(kv_start_ptr, cute.make_layout((1 << 30,)))
        start = cutlass.min(cutlass.max(Int32(kvs[b]), Int32(0)), length)
    return length, start


@cute.jit
def split_keys(lo: Int32, hi: Int32, split: Int32, num_splits: cutlass.Constexpr, tile_n: cutlass.Constexpr):
    """(s_lo, s_hi, n_tiles): partition `split` of num_splits of the key range [lo, hi), in whole tiles of
    tile_n keys from lo (as the Triton split kernel partitions it), and its tile count (0 for an empty one)."""
    span = cutlass.max(hi - lo, Int32(0))
    per_split = (span + num_splits - 1) // num_splits
    chunk = (per_split + tile_n - 1) // tile_n * tile_n
    s_lo = lo + split * chunk
    s_hi = cutlass.min(s_lo + chunk, hi)
    n_tiles = cutlass.max((s_hi - s_lo + tile_n - 1) // tile_n, Int32(0))
    return s_lo, s_hi, n_tiles


class PageRow:
    """Request b's page-table row: `row[i]` is the id of its page i clamped to [0, num_pages - 1], so no page
    id makes a kernel read outside the caches. Indices stay below the row's columns because lengths are
    clamped to the capacity (`live_range`)."""

    def __init__(self, pt_ptr: cute.Pointer, pt_sb: Int64, b: Int32, num_pages: Int32):
        self.ids = cute.make_tensor(pt_ptr + Int64(b) * pt_sb, cute.make_layout((1 << 30,)))
        self.last = num_pages - 1

    def __getitem__(self, i):
        return cutlass.min(cutlass.max(Int32(self.ids[i]), Int32(0)), self.last)


@cute.jit
def output_factor(m: Float32, l: Float32, weight: Float32, sinks_ptr: cute.Pointer, has_sinks: Int32, head: Int32,
                  v_scale: Float32, one_split: cutlass.Constexpr):
    """(factor, lse) of a row whose running max is m (log2 domain) and whose sum of exp2(score - m) is l; the
    factor multiplies the row's unnormalized O. `weight` scales the factor: exp2(m_c - m) where a consumer holds
    O's part for its own max m_c (mla_narrow.py), else 1. One split: the output itself, times `v_scale`, with the
    head's sink (a logit) folded into the denominator as the merge kernel folds it, and lse in natural log.
    Several: the normalized partial and its log2-sum-exp, in the merge kernel's terms. A row that saw no key
    (l = 0): factor 0 and lse -inf."""
    seen = l > Float32(0.0)
    f = Float32(0.0)
    lse = Float32(-math.inf)
    if const_expr(one_split):
        sink = Float32(NEG_BIG)
        if has_sinks != 0:
            sinks = cute.make_tensor(sinks_ptr, cute.make_layout((1 << 30,)))
            sink = Float32(sinks[head]) * Float32(LOG2E)
        m_f = cutlass.max(m, sink)
        if seen:
            l_f = l * cute.arch.exp2(m - m_f) + cute.arch.exp2(sink - m_f)
            f = weight * cute.arch.exp2(m - m_f) / l_f * v_scale
            lse = (m_f + cute.math.log2(l_f)) * Float32(LN2)
    else:
        if seen:
            f = weight * v_scale / l
            lse = m + cute.math.log2(l)
    return f, lse


@cute.jit
def logit(x: Float32, k_scale: Float32, softcap: Float32, use_softcap: cutlass.Constexpr):
    """A raw score q.k as a log2-domain logit: scaled (descale folded into k_scale), and with use_softcap
    softcap * tanh(score * scale / softcap) (tanh as 1 - 2 / (exp(2y) + 1))."""
    if const_expr(use_softcap):
        y = x * (k_scale / (softcap * Float32(LOG2E)))
        x = softcap * Float32(LOG2E) * (Float32(1.0) - Float32(2.0) / (cute.math.exp(Float32(2.0) * y) + Float32(1.0)))
    else:
        x = x * k_scale
    return x


@cute.jit
def visible_range(hi: Int32, start: Int32, limit: Int32, window_left: Int32, causal: cutlass.Constexpr,
                  use_window: cutlass.Constexpr):
    """The keys [k_lo, k_hi) visible to a row whose causal limit (last visible key) is `limit`: from kv_start
    (and, with a window, limit - window_left) up to hi (and, causal, limit + 1). Every kernel's masks test a key
    against this range."""
    k_lo = start
    k_hi = hi
    if const_expr(causal):
        k_hi = cutlass.min(hi, limit + 1)
    if const_expr(use_window):
        k_lo = cutlass.max(start, limit - window_left)
    return k_lo, k_hi


# The 3 x NS mbarriers of an NS-stage ring of K and V tiles, from `mbar`: per stage a K-full and a V-full
# barrier, completed as the producer's copies land, and an empty one, which every consumer thread arrives on
# when it is done with the stage. Tile `it` lives in stage it % NS; on the n-th use of a stage (n = it // NS)
# its full barriers complete in phase n % 2 (`ring_slot`), and the producer, before refilling it, waits for
# the release of its previous use: the other phase, (n + 1) % 2. Plain functions, not an object: the DSL cannot
# carry a Python object through a run-time `if`.

def full_barrier(mbar: cute.Pointer, stages: int, kv: int, stage):
    """The K-full (kv 0) or V-full (kv 1) barrier of a stage."""
    return mbar + kv * stages + stage


def empty_barrier(mbar: cute.Pointer, stages: int, stage):
    return mbar + 2 * stages + stage


def ring_slot(it, stages: int):
    """(stage, phase): tile `it`'s stage (it % NS) and the phase its full barriers complete in ((it // NS) % 2;
    the producer's release phase is the other), for it >= 0 in unsigned arithmetic, which compiles to a mask
    and a shift (NS a power of two) or a multiply-high, where signed division adds a fix-up for negative it.
    Every kernel's ring takes its slots from here."""
    u = Uint32(it)
    return Int32(u % stages), Int32((u // stages) % 2)
