"""The online softmax of one wgmma score tile, written once for the CuTe DSL kernels that keep scores in an
m64nN accumulator (extend.py, mla.py), and the lazy rescale those and the other kernels share (RESCALE_LOG2,
`moved`, `scale_rows`).

Fragment element i of the accumulator is in row half (i // 2) % 2: each thread holds two rows (r and r + 8)
of the tile, and the four threads of a quad share them (a row's maxima and sums reduce over the quad by
shuffles of offsets 1 and 2). m_run, l_run, alpha and limit are (2,) register tensors, one entry per row half.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from b12x_inductor.kernels.cute.common import NEG_BIG, logit, visible_range

RESCALE_LOG2 = 8.0  # the running max moves only by more than 2^8 (online_softmax): O is rarely rescaled


@cute.jit
def online_softmax(acc_s: cute.Tensor, t_cs: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor,
                   alpha: cute.Tensor, limit: cute.Tensor, j0: Int32, hi: Int32, start: Int32, full_lo: Int32,
                   full_hi: Int32, k_scale: Float32, softcap: Float32, window_left: Int32,
                   tile_n: cutlass.Constexpr, causal: cutlass.Constexpr, use_window: cutlass.Constexpr,
                   use_softcap: cutlass.Constexpr, rescale_log2: cutlass.Constexpr = 0.0):
    """One score tile (keys j0 ... j0 + tile_n; t_cs: the fragment's (row, key) coordinates) in place: the masks
    where the tile reaches past the fully visible range [full_lo, full_hi), then P = exp2(logit - m); updates
    the rows' running max and (this thread's part of the) sum and sets alpha, the factor that rescales O to
    the new max. full_lo is at or above every stored row's first visible key (kv_start, and with a window
    limit - window_left): a tile from full_lo tests only the rows' upper bounds.

    Without softcap the scale is folded into the exponent (one FMA, exp2(s * k_scale - m)) and the max is
    taken on raw scores: k_scale > 0 (the scale is validated positive; the kernels that call this take caches
    in q's dtype, so no descale). With softcap the logits are computed first. The max and the sum use four
    partial chains per row (shorter dependency chains). A row that sees no key keeps m = NEG_BIG (finite), so
    every P is 0 and alpha 1, never NaN.

    rescale_log2 > 0: the running max moves only when a row's new max exceeds it by more than rescale_log2
    (log2 units), else it stays and alpha is exactly 1 (P up to 2^rescale_log2, exact in fp32 and as
    representable in 16 bits as any P): the caller may then skip rescaling O, and with it the wait for the
    product that last wrote O. O and the sum stay relative to the same max, so the result is the same."""
    BN = const_expr(tile_n)
    N = const_expr(cute.size(acc_s))
    c = k_scale
    if const_expr(use_softcap):
        for i in cutlass.range_constexpr(N):
            acc_s[i] = logit(acc_s[i], k_scale, softcap, True)
        c = Float32(1.0)
    # the masks, where the tile reaches past [full_lo, full_hi): each row's visible keys [k_lo, k_hi) as offsets
    # from this thread's first key, so that an element's test compares its compile-time column offset with a
    # register (one compare and one select a bound); the lower bound only on a tile below full_lo (at kv_start
    # or a window's edge). Both branches are uniform over the tile (a branch that diverges within a warp
    # serializes the kernel's wgmma: ptxas C7520)
    if j0 < full_lo:
        _mask(acc_s, t_cs, limit, j0, hi, start, window_left, causal, use_window, True)
    elif j0 + BN > full_hi:
        _mask(acc_s, t_cs, limit, j0, hi, start, window_left, causal, use_window, False)
    for rh in cutlass.range_constexpr(2):
        idx = [i for i in range(N) if (i // 2) % 2 == rh]  # this row's elements (compile-time list)
        part = [acc_s[idx[k]] for k in range(4)]
        for k in cutlass.range_constexpr(4, len(idx)):
            part[k % 4] = cute.arch.fmax(part[k % 4], acc_s[idx[k]])
        t_max = cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))
        t_max = cute.arch.fmax(t_max, cute.arch.shuffle_sync_bfly(t_max, offset=1))
        t_max = cute.arch.fmax(t_max, cute.arch.shuffle_sync_bfly(t_max, offset=2))
        m_new = cute.arch.fmax(m_run[rh], cute.arch.fmax(t_max * c, Float32(NEG_BIG)))
        if const_expr(rescale_log2 > 0):
            m_new = m_new if m_new > m_run[rh] + Float32(rescale_log2) else m_run[rh]
        alpha[rh] = cute.arch.exp2(m_run[rh] - m_new)
        m_run[rh] = m_new
        sums = [Float32(0.0)] * 4
        for k in cutlass.range_constexpr(len(idx)):
            p = cute.arch.exp2(acc_s[idx[k]] * c - m_new)
            acc_s[idx[k]] = p
            sums[k % 4] = sums[k % 4] + p
        l_run[rh] = l_run[rh] * alpha[rh] + ((sums[0] + sums[1]) + (sums[2] + sums[3]))


@cute.jit
def moved(alpha: cute.Tensor):
    """Whether any alpha of this warp (its rows', or mla_narrow.py's columns') is not 1 (a running max moved:
    online_softmax's rescale_log2); warp-uniform (not warpgroup-uniform: never a condition around
    wgmma.wait_group), so a warp whose maxima did not move skips rescaling O."""
    any_moved = alpha[0] != Float32(1.0)
    for i in cutlass.range_constexpr(1, cute.size(alpha)):
        any_moved = any_moved | (alpha[i] != Float32(1.0))
    return cute.arch.vote_any_sync(any_moved)


@cute.jit
def scale_rows(acc_o: cute.Tensor, alpha: cute.Tensor):
    """O's rows times alpha (element e of the accumulator fragment is in row half (e // 2) % 2, as in
    online_softmax's score tile)."""
    for e in cutlass.range_constexpr(cute.size(acc_o)):
        acc_o[e] = acc_o[e] * alpha[(e // 2) % 2]


@cute.jit
def _mask(acc_s: cute.Tensor, t_cs: cute.Tensor, limit: cute.Tensor, j0: Int32, hi: Int32, start: Int32,
          window_left: Int32, causal: cutlass.Constexpr, use_window: cutlass.Constexpr, lower: cutlass.Constexpr):
    """Sets the scores of keys a row does not see to -inf (`common.visible_range`); `lower`: also those below
    a row's first visible key."""
    base = j0 + t_cs[0][1]
    up = cute.make_rmem_tensor((2,), Int32)
    low = cute.make_rmem_tensor((2,), Int32)
    for rh in cutlass.range_constexpr(2):
        k_lo, k_hi = visible_range(hi, start, limit[rh], window_left, causal, use_window)
        up[rh] = k_hi - base
        low[rh] = k_lo - base
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        off = t_cs[i][1] - t_cs[0][1]  # compile-time: a thread's columns are its first plus a fixed pattern
        ok = off < up[(i // 2) % 2]
        if const_expr(lower):
            ok = ok & (off >= low[(i // 2) % 2])
        acc_s[i] = acc_s[i] if ok else Float32(-math.inf)
