"""The executable definition of paged attention: fp32 math, plain torch, one request at a time.

Every kernel and plan in this project is tested against `paged_attention_reference`. It is written to be
read, not to be fast: it walks requests and heads in Python and materialises each request's keys.

Semantics (the README repeats them):
- Request b holds L = cache_seqlens[b] keys, gathered from its pages: key j lives in page
  page_table[b, j // page_size] at offset j % page_size.
- Its S_b new queries are the last S_b positions, so query i (0-based among them) has causal limit
  c = L - S_b + i. Key j is visible iff kv_start[b] <= j <= c (without causal: kv_start[b] <= j < L) and,
  when window_left >= 0, j >= c - window_left.
- logits = scale * q.k; with softcap > 0, logits = softcap * tanh(logits / softcap); softmax over the
  visible keys, with sinks[h] (when given) one more logit in the denominator only. float8 caches are
  dequantized with k_descale / v_descale (a scalar, one per request [B], or one per request and KV head
  [B, Hkv]).
- lse is the natural-log log-sum-exp over the same terms, the sink included. A query with no visible key
  outputs zeros and lse = -inf. Packed rows past cu_seqlens_q[-1] output zeros and lse = -inf.
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
    """Keys (or values) 0..length-1 of one request as fp32 [length, Hkv, D]."""
    page_size = cache.shape[1] if kv_layout == "NHD" else cache.shape[2]
    rows = []
    for j in range(length):
        page = int(page_table_row[j // page_size])
        off = j % page_size
        rows.append(cache[page, off] if kv_layout == "NHD" else cache[page, :, off])
    if not rows:
        hkv, d = (cache.shape[2], cache.shape[3]) if kv_layout == "NHD" else (cache.shape[1], cache.shape[3])
        return torch.empty(0, hkv, d, dtype=torch.float32)
    return torch.stack(rows).float()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse) in fp32 on the CPU: out shaped like q, lse like q without its last dim."""
    q, k_cache, v_cache = q.detach().cpu(), k_cache.detach().cpu(), v_cache.detach().cpu()
    page_table, cache_seqlens = page_table.cpu(), cache_seqlens.cpu()
    packed = q.dim() == 3
    head_dim = q.shape[-1]
    num_q_heads = q.shape[-2]
    num_kv_heads = k_cache.shape[2] if kv_layout == "NHD" else k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    batch = page_table.shape[0]

    out = torch.zeros(q.shape, dtype=torch.float32)
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
        for i in range(num_new):
            limit = length - num_new + i
            visible = pos >= start
            visible &= (pos <= limit) if causal else (pos < length)
            if window_left >= 0:
                visible &= pos >= limit - window_left
            for h in range(num_q_heads):
                hk = h // group
                if not bool(visible.any()):
                    continue  # zeros and lse = -inf
                logits = (keys[visible, hk] @ q_rows[i, h]) * scale
                if softcap > 0:
                    logits = softcap * torch.tanh(logits / softcap)
                terms = logits if sinks is None else torch.cat([logits, sinks[h].float().cpu().reshape(1)])
                row_lse = torch.logsumexp(terms, dim=0)
                probs = torch.exp(logits - row_lse)
                o = probs @ vals[visible, hk]
                if packed:
                    out[q0 + i, h], lse[q0 + i, h] = o, row_lse
                else:
                    out[b, i, h], lse[b, i, h] = o, row_lse
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
    """Writes token n's k/v into slot slot_mapping[n] (page = slot // page_size), skipping slots < 0."""
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    for cache, x, sc in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        for n in range(x.shape[0]):
            slot = int(slot_mapping[n])
            if slot < 0:
                continue
            row = x[n].float()
            if cache.dtype == torch.float8_e4m3fn:
                s = torch.ones(()) if sc is None else sc.float().cpu()
                s = s if s.dim() == 0 else s[n]  # scalar, per token [N] or per token and head [N, Hkv]
                row = (row.cpu() / (s[:, None] if s.dim() == 1 else s)).clamp(-448.0, 448.0).to(row.device)
            page, off = slot // page_size, slot % page_size
            if kv_layout == "NHD":
                cache[page, off] = row.to(cache.dtype)
            else:
                cache[page, :, off] = row.to(cache.dtype)
