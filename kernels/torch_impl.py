"""The vectorized torch implementation of the entry ops: the "torch" kernel family.

It runs everywhere (CPU in CI, CUDA where no kernel family supports a problem). Both q forms go the same
way, FlashAttention-style: the queries are cut into tiles of one request each (a device-side tile-to-request
map, as the Triton extend kernel has, so packed q shares each key tile between the rows of a tile as 4-D q
does), a chunk of tiles at a time gathers one tile of keys and values from the pages, and an online softmax
runs over the key tiles. Memory beyond the inputs and outputs is O(chunk of tiles x key tile), whatever T,
S or the page-table capacity.

Unused slots (pages no request lists, the tail of the last live page, slots before kv_start or before the
window, keys the key_mask hides) may hold anything, NaN and Inf included: keys and values a tile's rows do
not see are replaced by zeros before any product, and the logits of the keys one row does not see by -inf.

No host sync on CUDA: the loops cover the page-table capacity and a static tile count. On CPU (where reading
a device value costs nothing) the exact tile count and the key range each chunk sees are read on the host,
so dead tiles and key tiles past the live lengths or before the window are skipped.
"""

from __future__ import annotations

import math

import torch

from b12x_inductor.validate import cache_dims

_MAX_BLOCK_M = 64  # query rows per tile (of one request)
_MAX_BLOCK_N = 512  # keys per key tile
HOST_BOUNDS = True  # on CPU, read the tile count and key ranges on the host (tests turn it off: the CUDA path)
_BUDGET = 1 << 22  # floats per chunk for each of the gathered keys, values and logits (16 MB each)


def _rows_per_tile(rows_per_request: float) -> int:
    """A power of two <= _MAX_BLOCK_M near the mean rows per request (bounds padding waste to about 2x)."""
    bm = 1
    while bm * 2 <= min(_MAX_BLOCK_M, rows_per_request):
        bm *= 2
    return bm


def _gather(cache: torch.Tensor, page: torch.Tensor, off: torch.Tensor, heads: torch.Tensor,
            kv_layout: str) -> torch.Tensor:
    """page [N, 1, n], off [1, 1, n], heads [1, Hkv, 1] -> [N, Hkv, n, D] in the cache's dtype."""
    return cache[page, off, heads] if kv_layout == "NHD" else cache[page, heads, off]


def _descale(descale: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
    """fp32 factors broadcastable to [N, Hkv, n, D] for tiles of requests `req` [N]."""
    if descale.dim() == 0:
        return descale.float()
    d = descale.float()[req]
    return d[:, None, None, None] if d.dim() == 1 else d[:, :, None, None]


def paged_attention_torch(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start, sinks, k_descale, v_descale,
    out, lse, *, kv_layout, causal, scale, window_left, softcap, key_mask=None, q_pe=None,
) -> None:
    """Writes out (q's shape with v's head dim Dv, q's dtype) and lse (fp32, q's shape without D) for any mode.
    q and k have head dim D, v and out Dv (which may differ: MLA). With q_pe (absorbed MLA's query in two
    tensors) the query is cat(q, q_pe, dim=-1)."""
    if q_pe is not None:
        q = torch.cat([q, q_pe], dim=-1)
    batch, max_pages = page_table.shape
    hq, d = q.shape[-2], q.shape[-1]
    dv = v_cache.shape[-1]
    page_size, hkv = cache_dims(k_cache.shape, kv_layout)
    g = hq // hkv
    dev = q.device
    host = dev.type == "cpu" and HOST_BOUNDS  # device values may be read on the host for free
    cap = max_pages * page_size
    # Device values clamped as the kernels clamp them (README, "Bad input"): lengths to [0, cap], kv_start to
    # [0, length], page ids to [0, num_pages - 1], cu_seqlens_q to [0, T].
    lengths = cache_seqlens.long().clamp(0, cap)
    starts = torch.zeros_like(lengths) if kv_start is None else torch.minimum(kv_start.long().clamp(min=0), lengths)
    # Pages past each request's live length may hold any id: read page 0 there instead (masked anyway).
    live_page = torch.arange(max_pages, device=dev)[None, :] * page_size < lengths[:, None]
    pages = torch.where(live_page, page_table.long().clamp(0, k_cache.shape[0] - 1), 0)

    if q.dim() == 4:
        s = q.shape[1]
        total = batch * s
        qf = None  # rows gathered as q[token // s, token % s]: no copy of a strided q
        outf = out.view(total, hq, dv)
        lsef = lse.view(total, hq)
        cu = torch.arange(batch + 1, device=dev) * s
        bm = min(s, _MAX_BLOCK_M)
        num_tiles = batch * math.ceil(s / bm)
    else:
        total = q.shape[0]
        qf, outf, lsef = q, out, lse
        cu = cu_seqlens_q.long().clamp(0, total)
        bm = _rows_per_tile(total / max(batch, 1))
        num_tiles = min(batch * math.ceil(total / bm), (total + batch * (bm - 1)) // bm)
    # identity: 4-D q of at most _MAX_BLOCK_M rows, one tile per request, written in place. Otherwise rows
    # accumulate into zeros (a dead row of a tile adds zeros to row 0) and rows no request owns end at -inf.
    identity = q.dim() == 4 and bm == q.shape[1]
    if not identity:
        out.zero_()
        lse.zero_()
        owned = torch.arange(total, device=dev)
        owned = (owned >= cu[0]) & (owned < cu[-1])
        lse.masked_fill_(~owned.reshape(lse.shape[:-1])[..., None], float("-inf"))
    if total == 0 or batch == 0:
        return

    if identity:  # tile b is request b's s rows
        tile_req = torch.arange(batch, device=dev)
        length, start = lengths, starts
        limit = length[:, None] - bm + torch.arange(bm, device=dev)[None, :]
        lo = start if window_left < 0 else torch.maximum(start, length - bm - window_left)
        hi = length
        token = row_live = None
    else:
        # The tile map: request b's n_b rows make ceil(n_b / bm) tiles; tile i belongs to request tile_req[i].
        num_new = (cu[1:] - cu[:-1]).clamp(min=0)
        tiles_per_req = (num_new + bm - 1) // bm
        tile_end = torch.cumsum(tiles_per_req, 0)
        if host:
            num_tiles = min(num_tiles, int(tile_end[-1]))
        if num_tiles == 0:
            return
        tile_ids = torch.arange(num_tiles, device=dev)
        tile_req = torch.searchsorted(tile_end, tile_ids, right=True)  # == batch for dead tiles
        tile_live = tile_req < batch
        tile_req = tile_req.clamp(max=batch - 1)
        tile_first = (tile_ids - (tile_end - tiles_per_req)[tile_req]) * bm  # first row among the request's
        row_in_req = tile_first[:, None] + torch.arange(bm, device=dev)[None, :]  # [num_tiles, bm]
        n_req = num_new[tile_req]
        row_live = tile_live[:, None] & (row_in_req < n_req[:, None])
        token = cu[tile_req][:, None] + row_in_req
        row_live &= (token >= 0) & (token < total)
        token = torch.where(row_live, token, 0)
        length = lengths[tile_req]
        start = starts[tile_req]
        limit = length[:, None] - n_req[:, None] + row_in_req  # causal limit of each row [num_tiles, bm]
        # The keys some live row of the tile may see: [lo, hi).
        last_row = torch.minimum(tile_first + bm, n_req) - 1
        hi = torch.minimum(length, length - n_req + last_row + 1) if causal else length
        lo = start
        if window_left >= 0:
            lo = torch.maximum(lo, length - n_req + tile_first - window_left)
        hi = torch.where(tile_live, hi, 0)

    block_n = max(1, min(_MAX_BLOCK_N, cap))
    per_tile = max(block_n * hkv * max(d, dv), hq * bm * block_n, hq * bm * max(d, dv))
    chunk = max(1, _BUDGET // per_tile)
    heads = torch.arange(hkv, device=dev)[None, :, None]
    sink = None if sinks is None else sinks.float().reshape(1, hkv, g)

    for c0 in range(0, num_tiles, chunk):
        c1 = min(num_tiles, c0 + chunk)
        n = c1 - c0
        req = tile_req[c0:c1]
        lim, t_lo, t_hi = limit[c0:c1], lo[c0:c1], hi[c0:c1]
        if key_mask is not None:  # key_mask[mask_req, mask_row, j]: each row's mask (4-D q only)
            mask_req = req[:, None, None]
            if key_mask.shape[1] == 1:
                mask_row = torch.zeros((1, 1, 1), dtype=torch.long, device=dev)
            elif identity:
                mask_row = torch.arange(bm, device=dev)[None, :, None]
            else:
                mask_row = row_in_req[c0:c1].clamp(max=key_mask.shape[1] - 1)[:, :, None]
        j_begin, j_end = 0, cap
        if host:
            j_end = min(cap, max(0, int(t_hi.max())))
            j_begin = min(j_end, max(0, int(t_lo.min())))
            j_begin -= j_begin % block_n  # key tiles aligned as without the host
        # [n, Hkv, bm * G, D]: row r, group member gi at r * G + gi
        if identity:
            qt = q[c0:c1].float()
        else:
            tok, live = token[c0:c1], row_live[c0:c1]
            flat = tok.reshape(-1)
            qt = (q[flat // q.shape[1], flat % q.shape[1]] if qf is None else qf[flat]).float()
        qt = qt.reshape(n, bm, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(n, hkv, bm * g, d)
        m_i = torch.full((n, hkv, bm * g), float("-inf"), device=dev)
        l_i = torch.zeros((n, hkv, bm * g), device=dev)
        acc = torch.zeros((n, hkv, bm * g, dv), device=dev)
        tile_pages = pages[req][:, None, :]  # [n, 1, max_pages]
        for j0 in range(j_begin, j_end, block_n):
            j = torch.arange(j0, min(j_end, j0 + block_n), device=dev)
            bn = j.shape[0]
            page, off = tile_pages[:, :, j // page_size], (j % page_size)[None, None, :]
            seen = (j[None, :] >= t_lo[:, None]) & (j[None, :] < t_hi[:, None])  # [n, bn]
            if key_mask is not None:
                shown = key_mask[mask_req, mask_row, j[None, None, :]]  # [n, bm or 1, bn]
                seen = seen & shown.any(1)
            seen4 = seen[:, None, :, None]
            # [n, Hkv, bn, D] and [n, Hkv, bn, Dv]; keys and values no row of the tile sees become zeros before
            # any product
            keys = torch.where(seen4, _gather(k_cache, page, off, heads, kv_layout), 0).float()
            vals = torch.where(seen4, _gather(v_cache, page, off, heads, kv_layout), 0).float()
            if k_descale is not None:
                keys = keys * _descale(k_descale, req)
            if v_descale is not None:
                vals = vals * _descale(v_descale, req)
            logits = torch.matmul(qt, keys.transpose(-1, -2)) * scale  # [n, Hkv, bm * G, bn]
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            jj = j[None, None, :]
            vis = seen[:, None, :]  # [lo, hi) is inside [kv_start, length)
            if key_mask is not None:
                vis = vis & shown
            if causal:
                vis = vis & (jj <= lim[:, :, None])
            if window_left >= 0:
                vis = vis & (jj >= lim[:, :, None] - window_left)
            hidden = ~vis[:, None, :, None, :]  # [n, 1, bm, 1, bn] or [n, 1, 1, 1, bn]
            logits.view(n, hkv, bm, g, bn).masked_fill_(hidden, float("-inf"))
            m_new = torch.maximum(m_i, logits.amax(-1))
            m_safe = m_new.clamp(min=-1e30)  # a row that sees nothing yet: exp(-inf - m_safe) = 0
            alpha = torch.exp(m_i - m_safe)
            p = torch.exp(logits - m_safe[..., None])
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, vals)
            m_i = m_new
        seen_any = ~torch.isneginf(m_i)
        l_safe = torch.where(seen_any, l_i, 1.0)
        row_lse = m_i + torch.log(l_safe)
        o = acc / l_safe[..., None]
        if sink is not None:
            sink_rows = sink.reshape(1, hkv, 1, g).expand(n, hkv, bm, g).reshape(n, hkv, bm * g)
            with_sink = torch.logaddexp(row_lse, sink_rows)
            o = o * torch.exp(row_lse - with_sink)[..., None]
            row_lse = with_sink
        o = torch.where(seen_any[..., None], o, 0.0)
        row_lse = torch.where(seen_any, row_lse, float("-inf"))
        # back to [n * bm, Hq(, D)] and into the rows' places; dead rows add zeros to row 0 and skip lse
        o = o.reshape(n, hkv, bm, g, dv).permute(0, 2, 1, 3, 4).reshape(n * bm, hq, dv)
        row_lse = row_lse.reshape(n, hkv, bm, g).permute(0, 2, 1, 3).reshape(n * bm, hq)
        if identity:
            outf.view(batch, bm, hq, dv)[c0:c1] = o.reshape(n, bm, hq, dv).to(outf.dtype)
            lsef.view(batch, bm, hq)[c0:c1] = row_lse.reshape(n, bm, hq)
            continue
        flat_live = live.reshape(-1)
        o = torch.where(flat_live[:, None, None], o, 0.0).to(outf.dtype)
        outf.index_put_((tok.reshape(-1),), o, accumulate=True)
        lsef.index_put_((tok.reshape(-1),), torch.where(flat_live[:, None], row_lse, 0.0), accumulate=True)


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping, *, kv_layout, k_scale, v_scale) -> None:
    """Scatters k, v [N, Hkv, D] into their slots in place; slots outside [0, num_pages * page_size) are skipped
    (negative ones by contract, larger ones as the clamp of out-of-contract values) without a host sync.

    Duplicate slots: the last kept token wins (as in write_kv_reference), wherever skipped tokens sit. Every
    token that targets a slot carries that slot's winner (found with a stable sort of the slots), and a
    skipped token rewrites the first kept token's slot with the same winner, so every index_put_ target gets
    one value however often it repeats and whatever order the writes land in; when no token is kept, slot 0
    gets its own value back.
    """
    page_size, _ = cache_dims(k_cache.shape, kv_layout)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slot_mapping = slot_mapping.long()
    idx = torch.arange(n, device=k.device)
    keep = (slot_mapping >= 0) & (slot_mapping < k_cache.shape[0] * page_size)
    any_keep = keep.any()
    sorted_slots, order = torch.sort(torch.where(keep, slot_mapping, -1), stable=True)
    # position p ends its group of equal slots iff the next one differs; the group's last (latest token) wins
    ends = torch.ones(n, dtype=torch.bool, device=k.device)
    ends[:-1] = sorted_slots[1:] != sorted_slots[:-1]
    group_end = torch.where(ends, idx, n).flip(0).cummin(0).values.flip(0)
    winner = torch.empty_like(idx).scatter_(0, order, order[group_end])  # winner[t]: token whose row t writes
    first = torch.argmax(keep.to(torch.int32)).view(1)  # [1]: indexing with it gathers on the device (no item())
    src = torch.where(keep, winner, winner[first])
    slots = torch.where(any_keep, torch.where(keep, slot_mapping, slot_mapping[first]), 0)
    page, off = slots // page_size, slots % page_size
    for cache, x, sc in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        view = cache if kv_layout == "NHD" else cache.transpose(1, 2)  # [num_pages, page_size, Hkv, D]
        rows = x[src]
        if cache.dtype == torch.float8_e4m3fn:
            rows = rows.float()
            if sc is not None:
                s = sc.float() if sc.dim() == 0 else sc.float()[src]
                rows = rows / (s[:, None, None] if s.dim() == 1 else (s[:, :, None] if s.dim() == 2 else s))
            rows = rows.clamp(-448.0, 448.0)
        rows = torch.where(any_keep, rows, view[page, off].to(rows.dtype))
        view.index_put_((page, off), rows.to(cache.dtype))


def write_latent_torch(ckv, kpe, kv_cache, slot_mapping, *, scale) -> None:
    """Scatters the latent tokens cat(ckv, kpe) [T, kv_lora_rank + rope_dim] into the latent cache [num_pages,
    page_size, kv_lora_rank + rope_dim] in place: write_kv_torch over the cache as one KV head whose k_cache is the
    first kv_lora_rank columns and v_cache the rest (two views of its memory), so slots, duplicates and the
    float8 scale are write_kv's."""
    rank = ckv.shape[-1]
    cache = kv_cache.unsqueeze(2)  # [num_pages, page_size, 1, kv_lora_rank + rope_dim]: NHD, one head
    write_kv_torch(ckv[:, None], kpe[:, None], cache[..., :rank], cache[..., rank:], slot_mapping, kv_layout="NHD",
                   k_scale=scale, v_scale=scale)


class TorchFamily:
    """The torch family as a KernelFamily (kernels/__init__.py): it takes every problem (last in
    FAMILY_ORDER) and needs no tiles, scratch or compile."""

    name = "torch"

    def available(self) -> bool:
        return True

    def supports(self, problem) -> bool:
        return True

    def preferred(self, problem) -> bool:
        return True

    def plan(self, problem, **tiles):
        from b12x_inductor.plan import Plan

        if tiles:
            raise ValueError(f"paged_attention: the torch family has no tiles to replace; got {sorted(tiles)}")
        return Plan(mode=problem.mode, family="torch", num_splits=1, block_m=0, block_n=0, num_warps=0,
                    num_stages=0, scratch_bytes=0)

    def precompile(self, problem, plan, options) -> None:
        return None

    def run(self, call) -> None:
        paged_attention_torch(**call.inputs(), out=call.out, lse=call.lse, **call.options.as_kwargs())


FAMILY = TorchFamily()
