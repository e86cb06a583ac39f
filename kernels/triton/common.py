"""Math shared by the Triton family's kernels (decode.py, extend.py), written once.

- `live_range`: a request's length and kv_start, clamped to what the kernel knows from the tensors' shapes
  (the page table's capacity), and `page_id`: a page id clamped into the cache, widened to 64 bits. No device
  value makes a kernel touch memory outside its tensors (the README's "Bad input" states the contract).
- `tile`: one BLOCK_N-key tile of the online softmax (log2 domain) over the paged cache, with the optional
  key mask (HAS_KEY_MASK: one uint8 row per query row, read for the tile's keys; a key no row of the tile
  sees has its values replaced by zeros, so whatever the slot holds never reaches a product). q and k have
  head dim D (read as BLOCK_D columns, plus BLOCK_DPE more from column BLOCK_D on where D = 576 = 512 + 64:
  two products, not one 1024-wide), v and the accumulator DV (BLOCK_DV columns).
- `tile_ids`: a tile's page ids (one, one a page, or one a key), which the split kernel reads a tile ahead.
- `present` and `sink_logit`: an absent optional tensor is a dummy pointer with a zero flag, which masks its
  loads (the dummy is never read); the sink logit of a query head, or NEG_BIG without sinks.
- `finish`: the epilogue of a row's softmax: the sink folded into the denominator, normalized output and
  natural-log lse; a row that saw no key gets zeros and lse = -inf.
- `RUNTIME_ARGS`: the arguments no kernel specializes on (optional tensors, their flags and strides, the
  window size and the clamping bounds), so one compile serves every value.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so masked tiles never make exp2(-inf - -inf)


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def present(flag, like):
    """An optional tensor's flag (a runtime int) as a mask of `like`'s shape (an int scalar or tensor): its
    loads read nothing where the flag is 0 (the dummy pointer behind a zero flag may be an output no program
    has written yet). Built by arithmetic on `like`: Triton's interpreter takes no scalar-and-tensor mask."""
    return (like * 0 + flag) != 0


@triton.jit
def sink_logit(SINKS, head, has_sinks):
    """The sink logit of query head(s) `head` (a scalar or tensor, each < Hq) in the log2 domain, or NEG_BIG
    where the call has no sinks (the dummy pointer then is not read)."""
    sink = tl.load(SINKS + head, mask=present(has_sinks, head), other=0.0)
    return tl.where(has_sinks != 0, sink * LOG2E, NEG_BIG)


@triton.jit
def live_range(SEQLENS, KV_START, has_kv_start, b, max_pages, PAGE: tl.constexpr):
    """(length, start) of request b, clamped: the length to [0, max_pages * PAGE] (the page table's capacity),
    kv_start to [0, length]."""
    length = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), max_pages * PAGE)
    start = tl.load(KV_START + b, mask=present(has_kv_start, b), other=0)
    return length, tl.minimum(tl.maximum(start, 0), length)


@triton.jit
def page_id(page, num_pages):
    """A page id clamped to [0, num_pages - 1], as int64 (the cache's page stride may pass 2^31 elements)."""
    return tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)


@triton.jit
def q_rows(q_ptr, pe_ptr, row_ok, offs_d, d_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr,
           DOT: tl.constexpr):
    """The query rows [BLOCK_M] as (q [BLOCK_M, BLOCK_D], q_pe [BLOCK_M, BLOCK_DPE], offs_pe, pe_ok): q's
    columns 0.. at q_ptr, and (BLOCK_DPE > 0) columns BLOCK_D.. of D at pe_ptr (the rows' tail: q_pe's rows, or
    q's own rows from column BLOCK_D on; offs_pe are those columns' indices in K). BLOCK_DPE 0: q_pe, offs_pe,
    pe_ok repeat q, offs_d, d_ok, unused."""
    q = tl.load(q_ptr[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    if BLOCK_DPE > 0:
        offs_pe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        pe_ok = offs_pe < D
        q_pe = tl.load(pe_ptr[:, None] + (offs_pe - BLOCK_D)[None, :], mask=row_ok[:, None] & pe_ok[None, :],
                       other=0.0).to(DOT)
    else:
        offs_pe = offs_d
        pe_ok = d_ok
        q_pe = q
    return q, q_pe, offs_pe, pe_ok


@triton.jit
def tile_ids(pt_row, j0, hi, num_pages, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGE_ALIGNED: tl.constexpr):
    """The page ids of the tile at j0 (keys from hi on read id 0): one scalar where the tile lies in one page,
    BLOCK_N // PAGE where it spans whole pages (PAGE_ALIGNED), else one a key."""
    if PAGE_ALIGNED and PAGE >= BLOCK_N:
        return page_id(tl.load(pt_row + j0 // PAGE, mask=j0 < hi, other=0), num_pages)
    elif PAGE_ALIGNED:
        NP: tl.constexpr = BLOCK_N // PAGE
        first = j0 // PAGE + tl.arange(0, NP)
        return page_id(tl.load(pt_row + first, mask=first * PAGE < hi, other=0), num_pages)
    else:
        offs_n = j0 + tl.arange(0, BLOCK_N)
        return page_id(tl.load(pt_row + offs_n // PAGE, mask=offs_n < hi, other=0), num_pages)


@triton.jit
def tile(acc, m_i, l_i, q, q_pe, j0, hi, start, limit, k_head, v_head, pt_row, num_pages, stride_kp, stride_ko,
         stride_vp, stride_vo, offs_d, d_ok, offs_pe, pe_ok, offs_dv, dv_ok, k_scale, softcap, window_left,
         km_rows, km_j,
         BLOCK_N: tl.constexpr, PAGE: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
         MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
         DOT: tl.constexpr, HAS_KEY_MASK: tl.constexpr, BLOCK_DPE: tl.constexpr, V_FROM_K: tl.constexpr,
         PAGE_ALIGNED: tl.constexpr, ids):
    """One BLOCK_N-key tile of the online softmax (decode, verify and extend): gathers the tile's K (columns
    offs_d, and offs_pe with BLOCK_DPE > 0) and V (columns offs_dv) through the page table, applies scale,
    softcap and (MASKED) the kv_start / causal / window masks and the tile end `hi`, and returns the updated
    (acc, m, l). Unmasked tiles (extend's middle) skip every mask but the key mask (HAS_KEY_MASK: key j of row
    r visible only where km_rows[r][j * km_j] != 0; offs_n < hi keeps the reads inside the mask's rows, whose
    length is the page table's capacity). EVEN_D / EVEN_DV: the column blocks hold no column past D / DV.
    V_FROM_K: V's tile is K's first column block, not loaded again (the launch has checked that v is k's first
    DV columns and that DV is that block's width, every column inside D).
    PAGE_ALIGNED (MASKED tiles only): j0 is a multiple of min(PAGE, BLOCK_N) and one of PAGE, BLOCK_N divides
    the other, so the tile spans whole pages (or lies in one): one page id is read per page, not per key, and
    keys before `start` (the caller rounded its range down to the alignment) are neither loaded nor seen, like
    those from `hi` on. `ids` (MASKED tiles only; unused otherwise): the tile's page ids, `tile_ids(..., j0, hi,
    ...)`. The split kernel reads them a tile ahead; read inside the same iteration (extend), Triton's pipeliner
    takes the K / V loads for indirect and keeps one buffer of each whatever num_stages says. `start`: keys
    before it are seen by no row (kv_start, or any later key that no row of the tile sees)."""
    offs_n = j0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    ONE_PAGE: tl.constexpr = MASKED and PAGE_ALIGNED and PAGE >= BLOCK_N  # the tile lies in one page
    if MASKED:
        if PAGE_ALIGNED:
            n_ok = n_ok & (offs_n >= start)
        if PAGE_ALIGNED and not ONE_PAGE:  # BLOCK_N // PAGE whole pages, each id broadcast over its PAGE keys
            NP: tl.constexpr = BLOCK_N // PAGE
            page = tl.reshape(tl.broadcast_to(ids[:, None], (NP, PAGE)), (BLOCK_N,))
        else:  # one id (the tile lies in one page) or one a key
            page = ids
        kv_mask = n_ok[:, None] & d_ok[None, :]
        v_mask = n_ok[:, None] & dv_ok[None, :]
    else:
        page = page_id(tl.load(pt_row + offs_n // PAGE), num_pages)
        kv_mask = d_ok[None, :]
        v_mask = dv_ok[None, :]
    slot = (offs_n % PAGE).to(tl.int64)
    if ONE_PAGE:
        page_col = page  # a scalar
    else:
        page_col = page[:, None]
    k_rows = k_head + page_col * stride_kp + slot[:, None] * stride_ko
    v_ptrs = v_head + page_col * stride_vp + slot[:, None] * stride_vo + offs_dv[None, :]
    k_ptrs = k_rows + offs_d[None, :]
    if HAS_KEY_MASK:
        shown = tl.load(km_rows[:, None] + offs_n[None, :].to(tl.int64) * km_j, mask=n_ok[None, :], other=0) != 0
        v_ok = (tl.max(shown.to(tl.int32), 0) > 0)[:, None] & v_mask
    if MASKED or not EVEN_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if V_FROM_K:
        if HAS_KEY_MASK:  # rows no query sees may hold anything: zero them, as the masked load would
            v = tl.where(v_ok, k, 0.0)
        else:
            v = k
    elif HAS_KEY_MASK:
        v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    elif MASKED or not EVEN_DV:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k.to(DOT)))
    if BLOCK_DPE > 0:  # the second column block of q.k (D = 576: the 64 rope columns)
        if MASKED:
            k_pe = tl.load(k_rows + offs_pe[None, :], mask=n_ok[:, None] & pe_ok[None, :], other=0.0)
        elif EVEN_D:
            k_pe = tl.load(k_rows + offs_pe[None, :])
        else:
            k_pe = tl.load(k_rows + offs_pe[None, :], mask=pe_ok[None, :], other=0.0)
        qk = tl.dot(q_pe, tl.trans(k_pe.to(DOT)), qk)
    if USE_SOFTCAP:
        logits = softcap * LOG2E * _tanh(qk * (k_scale / softcap))
    else:
        logits = qk * (k_scale * LOG2E)
    if MASKED:
        visible = n_ok[None, :] & (offs_n[None, :] >= start)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= limit[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] >= limit[:, None] - window_left)
        if HAS_KEY_MASK:
            visible = visible & shown
        logits = tl.where(visible, logits, float("-inf"))
    elif HAS_KEY_MASK:
        logits = tl.where(shown, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT))
    return acc, m_new, l_i


@triton.jit
def finish(acc, m_i, l_i, sink, v_scale):
    """(out rows, lse) of a finished online softmax: acc [M, DV] and the running max m_i / sum l_i (log2
    domain), with the sink logit (log2 domain; NEG_BIG when absent) in the denominator only and the V descale
    applied. Rows that saw no key: zeros and lse = -inf."""
    seen = l_i > 0.0
    m_f = tl.maximum(m_i, sink)
    l_f = tl.where(seen, l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f), 1.0)
    o = acc * (tl.exp2(m_i - m_f) * v_scale / l_f)[:, None]
    o = tl.where(seen[:, None], o, 0.0)
    lse = tl.where(seen, (m_f + tl.log2(l_f)) * LN2, float("-inf"))
    return o, lse


RUNTIME_ARGS = [
    "KV_START", "SINKS", "KDS", "VDS", "kds_b", "kds_h", "vds_b", "vds_h",
    "has_kv_start", "has_sinks", "has_kds", "has_vds", "window_left", "max_pages", "num_pages",
    "KM", "km_b", "km_s", "km_j",
]
