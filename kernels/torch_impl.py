"""The vectorized torch implementation of the entry ops: the "torch" kernel family.

It runs everywhere (CPU in CI, CUDA where no kernel family supports a problem): gather the pages of the
page table, one batched matmul per query chunk, the masks of the semantics, softmax with sinks. It reads
the whole page-table capacity, not just the live keys, so it is for correctness, not speed. No host sync:
lengths stay on the device.
"""

from __future__ import annotations

import torch

from b12x_inductor.validate import cache_dims

_CHUNK = 256  # query rows (4D q) or tokens (packed q) per batched matmul, to bound memory


def _gather(cache: torch.Tensor, pages: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """[N, P] page ids -> fp32 [N, P * page_size, Hkv, D]."""
    g = cache[pages]  # NHD: [N, P, ps, Hkv, D]; HND: [N, P, Hkv, ps, D]
    if kv_layout == "HND":
        g = g.transpose(2, 3)
    n, p, ps, h, d = g.shape
    return g.reshape(n, p * ps, h, d).float()


def _descale(descale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 factors broadcastable to [N, L, Hkv, D] for rows that belong to requests `rows`."""
    if descale.dim() == 0:
        return descale
    d = descale[rows]
    return d[:, None, None, None] if d.dim() == 1 else d[:, None, :, None]


def _attend(q, keys, vals, limit, start, length, *, causal, scale, window_left, sinks, softcap):
    """q [N, M, Hkv, G, D]; keys/vals [N, L, Hkv, D]; limit [N, M]; start, length [N] -> out, lse."""
    logits = torch.einsum("nmhgd,nlhd->nmhgl", q, keys) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    pos = torch.arange(keys.shape[1], device=q.device)
    lim = limit[:, :, None]
    visible = pos >= start[:, None, None]
    visible = visible & ((pos <= lim) if causal else (pos < length[:, None, None]))
    if window_left >= 0:
        visible = visible & (pos >= lim - window_left)
    visible = visible[:, :, None, None, :]  # [N, M, 1, 1, L]
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        hkv, g = q.shape[2], q.shape[3]
        sink = sinks.float().reshape(1, 1, hkv, g, 1).expand(*logits.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(logits, dim=-1)
    any_visible = visible.any(-1)  # [N, M, 1, 1]
    lse = torch.where(any_visible, lse, float("-inf"))
    probs = torch.exp(logits - torch.where(any_visible, lse, 0.0)[..., None])
    out = torch.einsum("nmhgl,nlhd->nmhgd", probs, vals)
    return out, lse


def paged_attention_torch(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start, sinks, k_descale, v_descale,
    out, lse, *, kv_layout, causal, scale, window_left, softcap,
) -> None:
    """Writes out (q's shape and dtype) and lse (fp32, q's shape without D) for any mode."""
    batch, max_pages = page_table.shape
    hq, d = q.shape[-2], q.shape[-1]
    page_size, hkv = cache_dims(k_cache.shape, kv_layout)
    g = hq // hkv
    lengths = cache_seqlens.long()
    starts = torch.zeros_like(lengths) if kv_start is None else kv_start.long()
    # Pages past each request's live length may hold anything: read page 0 there instead (masked anyway).
    live_page = torch.arange(max_pages, device=q.device)[None, :] * page_size < lengths[:, None]
    pages = torch.where(live_page, page_table.long(), 0)
    opts = dict(causal=causal, scale=scale, window_left=window_left, sinks=sinks, softcap=softcap)

    if q.dim() == 4:
        s = q.shape[1]
        keys, vals = _gather(k_cache, pages, kv_layout), _gather(v_cache, pages, kv_layout)
        all_rows = torch.arange(batch, device=q.device)
        if k_descale is not None:
            keys = keys * _descale(k_descale, all_rows)
        if v_descale is not None:
            vals = vals * _descale(v_descale, all_rows)
        for i0 in range(0, s, _CHUNK):
            i1 = min(s, i0 + _CHUNK)
            qc = q[:, i0:i1].float().reshape(batch, i1 - i0, hkv, g, d)
            limit = lengths[:, None] - s + torch.arange(i0, i1, device=q.device)[None, :]
            o, l = _attend(qc, keys, vals, limit, starts, lengths, **opts)
            out[:, i0:i1] = o.reshape(batch, i1 - i0, hq, d).to(out.dtype)
            lse[:, i0:i1] = l.reshape(batch, i1 - i0, hq)
        return

    cu = cu_seqlens_q.long()
    total = q.shape[0]
    for t0 in range(0, total, _CHUNK):
        t1 = min(total, t0 + _CHUNK)
        tok = torch.arange(t0, t1, device=q.device)
        req = torch.searchsorted(cu[1:], tok, right=True)  # == batch for padding rows
        live = req < batch
        req = req.clamp(max=batch - 1)
        keys, vals = _gather(k_cache, pages[req], kv_layout), _gather(v_cache, pages[req], kv_layout)
        if k_descale is not None:
            keys = keys * _descale(k_descale, req)
        if v_descale is not None:
            vals = vals * _descale(v_descale, req)
        num_new = cu[req + 1] - cu[req]
        limit = (lengths[req] - num_new + (tok - cu[req]))[:, None]
        qc = q[t0:t1].float().reshape(t1 - t0, 1, hkv, g, d)
        o, l = _attend(qc, keys, vals, limit, starts[req], lengths[req], **opts)
        o = torch.where(live[:, None, None], o.reshape(t1 - t0, hq, d), 0.0)
        l = torch.where(live[:, None], l.reshape(t1 - t0, hq), float("-inf"))
        out[t0:t1] = o.to(out.dtype)
        lse[t0:t1] = l


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping, *, kv_layout, k_scale, v_scale) -> None:
    """Scatters k, v [N, Hkv, D] into their slots in place; slots < 0 are skipped without a host sync.

    A skipped token rewrites the slot (and value) of the first kept token, so every index_put_ target gets
    one value however often it repeats; when no token is kept, slot 0 gets its own value back.
    """
    page_size, _ = cache_dims(k_cache.shape, kv_layout)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    keep = slot_mapping >= 0
    any_keep = keep.any()
    first = torch.argmax(keep.to(torch.int32))
    src = torch.where(keep, torch.arange(n, device=k.device), first)
    slots = torch.where(any_keep, slot_mapping[src], 0)
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
