"""The executable definition of paged attention: fp32 math, plain torch, one request at a time.

Every kernel and plan in this project is tested against `paged_attention_reference`. It is written to be
read, not to be fast: it walks requests and heads in Python and materialises each request's keys.

Semantics (the README repeats them):
- Request b holds L = cache_seqlens[b] keys, gathered from its pages: key j lives in page
  page_table[b, j // page_size] at offset j % page_size.
- Its S_b new queries are the last S_b positions, so query i (0-based among them) has causal limit
  c = L - S_b + i. Key j is visible iff kv_start[b] <= j <= c (without causal: kv_start[b] <= j < L) and,
  when window_left >= 0, j >= c - window_left; with a key_mask [B, S or 1, max_pages * page_size] (4-D q
  only), also key_mask[b, i or 0, j].
- Head dims: q and k share the head dim D, v has the value head dim Dv (Dv == D for plain GQA; DeepSeek-V3's
  MLA: D = 192 and Dv = 128 non-absorbed, D = 576 and Dv = 512 absorbed, where v is a view of k's first 512
  values). out has q's shape with Dv: [B, S, Hq, Dv] or [T, Hq, Dv].
- logits = scale * q.k (a dot product over D; scale defaults to D ** -0.5); with softcap > 0,
  logits = softcap * tanh(logits / softcap); probs = softmax over the visible keys, with sinks[h] (when
  given) one more logit in the denominator only; out = probs @ v (over the visible keys, Dv wide). float8
  caches are dequantized with k_descale / v_descale (a scalar, one per request [B], or one per request and
  KV head [B, Hkv]).
- lse is the natural-log log-sum-exp over the same terms, the sink included. A query with no visible key
  outputs zeros and lse = -inf. Packed rows past cu_seqlens_q[-1] output zeros and lse = -inf.
- Device values outside the contract (lengths past the page table's capacity, page ids outside the cache,
  cu_seqlens_q past T, kv_start outside [0, L]) are clamped by every family on the device, never read past:
  such a call returns the reference of `clamp_to_contract`'s values (B12X_DEBUG=1 raises instead). Only
  decreasing cu_seqlens_q offsets have no defined result: which rows then hold what is unspecified, but no
  write leaves out and lse.
"""

from __future__ import annotations

import math

import torch


def _descale(descale: torch.Tensor | None, b: int, num_kv_heads: int) -> torch.Tensor:
    """The dequantization factor of request b as an fp32 [Hkv] vector (ones when absent)."""
    if descale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32)
    d = descale.detach().float().cpu()
    if d.dim() == 0:
        return d.expand(num_kv_heads)
    if d.dim() == 1:
        return d[b].expand(num_kv_heads)
    return d[b]


def gather_request_kv(cache: torch.Tensor, page_table_row: torch.Tensor, length: int, kv_layout: str) -> torch.Tensor:
    """Keys (or values) 0..length-1 of one request as fp32 [length, Hkv, D] (values: [length, Hkv, Dv])."""
    page_size = cache.shape[1] if kv_layout == "NHD" else cache.shape[2]
    j = torch.arange(length)
    page, off = page_table_row[j // page_size].long(), j % page_size
    rows = cache[page, off] if kv_layout == "NHD" else cache[page, :, off]
    return rows.float()


def clamp_to_contract(page_table: torch.Tensor, cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                      kv_start: torch.Tensor | None, *, num_pages: int, page_size: int, num_tokens: int | None = None):
    """(page_table, cache_seqlens, cu_seqlens_q, kv_start) as the kernels clamp them on the device: lengths to
    [0, max_pages * page_size], kv_start to [0, length], page ids to [0, num_pages - 1], cu_seqlens_q (packed q
    of num_tokens = T rows) to [0, T]. In-contract values come back unchanged."""
    lengths = cache_seqlens.long().clamp(0, page_table.shape[1] * page_size)
    starts = None if kv_start is None else torch.minimum(kv_start.long().clamp(min=0), lengths).to(kv_start.dtype)
    cu = None if cu_seqlens_q is None else cu_seqlens_q.long().clamp(0, num_tokens).to(cu_seqlens_q.dtype)
    return (page_table.long().clamp(0, num_pages - 1).to(page_table.dtype), lengths.to(cache_seqlens.dtype), cu,
            starts)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    kv_layout: str = "NHD",
    causal: bool = True,
    scale: float | None = None,
    window_left: int = -1,
    kv_start: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    q_pe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse) in fp32 on the CPU: out shaped like q with v's head dim Dv as its last dim, lse like q
    without its last dim. With q_pe (absorbed MLA's query in two tensors) the query is cat(q, q_pe, dim=-1)."""
    if q_pe is not None:
        q = torch.cat([q.detach().cpu(), q_pe.detach().cpu()], dim=-1)
    q, k_cache, v_cache = q.detach().cpu(), k_cache.detach().cpu(), v_cache.detach().cpu()
    page_table, cache_seqlens = page_table.cpu(), cache_seqlens.cpu()
    packed = q.dim() == 3
    head_dim = q.shape[-1]
    num_q_heads = q.shape[-2]
    num_kv_heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    batch = page_table.shape[0]

    v_head_dim = v_cache.shape[-1]
    out = torch.zeros(q.shape[:-1] + (v_head_dim,), dtype=torch.float32)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32)
    for b in range(batch):
        length = int(cache_seqlens[b])
        start = 0 if kv_start is None else int(kv_start[b])
        if packed:
            q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            q_rows = q[q0:q1].float()
        else:
            q_rows = q[b].float()
        num_new = q_rows.shape[0]
        keys = gather_request_kv(k_cache, page_table[b], length, kv_layout) * _descale(k_descale, b, num_kv_heads)[:, None]
        vals = gather_request_kv(v_cache, page_table[b], length, kv_layout) * _descale(v_descale, b, num_kv_heads)[:, None]
        pos = torch.arange(length)
        heads_kv = torch.arange(num_q_heads) // group  # the KV head of each query head
        for i in range(num_new):
            limit = length - num_new + i
            visible = pos >= start
            visible &= (pos <= limit) if causal else (pos < length)
            if window_left >= 0:
                visible &= pos >= limit - window_left
            if key_mask is not None:
                visible &= key_mask[b, i if key_mask.shape[1] > 1 else 0, :length].cpu()
            if not bool(visible.any()):
                continue  # zeros and lse = -inf
            k_vis = keys[visible][:, heads_kv]  # [n, Hq, D]: each query head's keys
            v_vis = vals[visible][:, heads_kv]  # [n, Hq, Dv]: its values
            logits = torch.einsum("nhd,hd->hn", k_vis, q_rows[i]) * scale  # [Hq, n]: q.k over D
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            terms = logits if sinks is None else torch.cat([logits, sinks.float().cpu()[:, None]], dim=1)
            row_lse = torch.logsumexp(terms, dim=1)  # [Hq]
            probs = torch.exp(logits - row_lse[:, None])
            o = torch.einsum("hn,nhe->he", probs, v_vis)  # [Hq, Dv]: probs @ v
            if packed:
                out[q0 + i], lse[q0 + i] = o, row_lse
            else:
                out[b, i], lse[b, i] = o, row_lse
    return out, lse


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_layout: str = "NHD",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes token n's k/v into slot slot_mapping[n] (page = slot // page_size), in token order (so the last
    of duplicate slots wins), skipping slots < 0 and, as the clamp of out-of-contract values, slots past the
    cache (>= num_pages * page_size)."""
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    for cache, x, sc in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        for n in range(x.shape[0]):
            slot = _kept_slot(slot_mapping, n, cache.shape[0] * page_size)
            if slot is None:
                continue
            s = None
            if sc is not None:
                s = sc.float().cpu()
                s = s if s.dim() == 0 else s[n]  # scalar, per token [N] or per token and head [N, Hkv]
                s = s[:, None] if s.dim() == 1 else s
            page, off = slot // page_size, slot % page_size
            if kv_layout == "NHD":
                cache[page, off] = _stored(x[n], cache.dtype, s)
            else:
                cache[page, :, off] = _stored(x[n], cache.dtype, s)


def _kept_slot(slot_mapping: torch.Tensor, n: int, num_slots: int) -> int | None:
    """Token n's slot, or None where it is skipped: slots < 0 by contract, slots >= num_slots (past the cache) as
    the clamp of out-of-contract values."""
    slot = int(slot_mapping[n])
    return slot if 0 <= slot < num_slots else None


def _stored(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x as a cache of `dtype` stores it: float8_e4m3fn caches hold x / scale (fp32 math; scale None: 1)
    saturated to +-448, other caches x itself."""
    row = x.float()
    if dtype == torch.float8_e4m3fn:
        s = torch.ones(()) if scale is None else scale.float().cpu()
        row = (row.cpu() / s).clamp(-448.0, 448.0).to(row.device)
    return row.to(dtype)


def write_latent_reference(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
) -> None:
    """Writes token n's latent cat(ckv[n], kpe[n]) (kv_lora_rank compressed-KV values, then rope_dim rope-key
    values) into slot slot_mapping[n] of the latent cache [num_pages, page_size, kv_lora_rank + rope_dim]
    (page = slot // page_size), in token order (the last of duplicate slots wins), skipping slots as
    write_kv_reference does; a float8 cache stores latent / scale, saturated."""
    page_size = kv_cache.shape[1]
    for n in range(ckv.shape[0]):
        slot = _kept_slot(slot_mapping, n, kv_cache.shape[0] * page_size)
        if slot is not None:
            kv_cache[slot // page_size, slot % page_size] = _stored(torch.cat([ckv[n], kpe[n]]), kv_cache.dtype, scale)
