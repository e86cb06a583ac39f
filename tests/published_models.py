"""Decoder models written as their projects publish them, tiny, for the substitution tests.

Written here in the published code's structure (no download, no new dependency), so that the graph the pass
sees is the one a user of that project compiles. Each section names the repository, path and commit it
follows, and what was left out (nothing the attention graph depends on).

- gpt-fast (`GptFastTransformer`): github.com/meta-pytorch/gpt-fast (formerly pytorch-labs/gpt-fast),
  model.py and generate.py at c9f683edd4f89d3e81ed8f52387e866a245e3226 (2024-09-13), the last model.py that
  calls `F.scaled_dot_product_attention`: later commits (9ba2eac and after) moved it to flex_attention with a
  BlockMask. The mask is `self.causal_mask[None, None, input_pos]`, a bool tril tensor that `setup_caches`
  stores on the module, indexed by the positions; its values are unknown to a compile.
- torchtune (`TorchtuneDecoder`): github.com/pytorch/torchtune at bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1
  (2026-04-23, the newest snapshot): torchtune/modules/kv_cache.py (KVCache with its `cache_pos` buffer,
  `update(k_val, v_val)` writing at `cache_pos[:seq_len]`: the current convention, not the older
  `update(input_pos, k_val, v_val)`), torchtune/modules/attention.py (MultiHeadAttention),
  attention_utils.py (`_sdpa_call`: `mask[:, None, :, :]`), position_embeddings.py (RoPE), rms_norm.py,
  feed_forward.py, transformer.py (TransformerSelfAttentionLayer, TransformerDecoder) and
  torchtune/generation/_generation.py (generate, generate_next_token, sample and the padding-mask helpers:
  bool masks [B, S, max_seq_len], True = attend, rows of one causal mask of the static cache with the left
  padding of each prompt hidden, indexed by the current position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# ==== gpt-fast: model.py (SDPA version) ====
# Left out: ModelArgs.from_name and transformer_configs, Attention.load_hook (checkpoint conversion) and
# rope_scaling (llama 3.1's frequency rescaling; None here, as in the configs without it).

def find_multiple(n: int, k: int) -> int:
    if n % k == 0:
        return n
    return n + k - (n % k)


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            hidden_dim = 4 * self.dim
            n_hidden = int(2 * hidden_dim / 3)
            self.intermediate_size = find_multiple(n_hidden, 256)
        self.head_dim = self.dim // self.n_head


# Tiny: head_dim = dim // n_head = 64 (the op takes 64, 96, 128, 192, 256), GQA 4 query heads on 2 KV heads.
GPT_FAST_TINY = dict(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=256,
                     intermediate_size=512)


class GptFastKVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.bfloat16):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer('k_cache', torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer('v_cache', torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]

        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val

        return k_out, v_out


class GptFastTransformer(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.config = config

        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(GptFastTransformerBlock(config) for _ in range(config.n_layer))
        self.norm = GptFastRMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

        self.freqs_cis: Optional[Tensor] = None
        self.mask_cache: Optional[Tensor] = None
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size, max_seq_length):
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        head_dim = self.config.dim // self.config.n_head
        max_seq_length = find_multiple(max_seq_length, 8)
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        dtype = self.output.weight.dtype
        for b in self.layers:
            b.attention.kv_cache = GptFastKVCache(max_batch_size, max_seq_length, self.config.n_local_heads,
                                                  head_dim, dtype)

        self.freqs_cis = precompute_freqs_cis(self.config.block_size, self.config.dim // self.config.n_head,
                                              self.config.rope_base, dtype)
        # As published: a plain tensor attribute (not register_buffer); under torch.compile it is a graph input.
        self.causal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))

    def forward(self, idx: Tensor, input_pos: Optional[Tensor] = None) -> Tensor:
        assert self.freqs_cis is not None, "Caches must be initialized first"
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)

        for i, layer in enumerate(self.layers):
            x = layer(x, input_pos, freqs_cis, mask)
        x = self.norm(x)
        logits = self.output(x)
        return logits


class GptFastTransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.attention = GptFastAttention(config)
        self.feed_forward = GptFastFeedForward(config)
        self.ffn_norm = GptFastRMSNorm(config.dim, config.norm_eps)
        self.attention_norm = GptFastRMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class GptFastAttention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        assert config.dim % config.n_head == 0

        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        # key, query, value projections for all heads, but in a batch
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Optional[Tensor] = None) -> Tensor:
        bsz, seqlen, _ = x.shape

        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)

        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))

        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)

        y = self.wo(y)
        return y


class GptFastFeedForward(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GptFastRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x: Tensor) -> Tensor:
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000,
                         dtype: torch.dtype = torch.bfloat16) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )

    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


# ---- gpt-fast: generate.py (prefill / decode_one_token), greedy ----
# generate.py samples with `torch.empty_like(probs).exponential_(1)` (random draws): greedy argmax here, so
# that compiled runs with the pass off and on can be compared token for token. The decode position is an int32
# tensor [1] (`torch.tensor([T], dtype=torch.int)`) advanced in place by `input_pos += 1`, as generate.py does.

def gpt_fast_prefill(model: GptFastTransformer, x: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
    logits = model(x, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True).to(dtype=torch.int), logits


def gpt_fast_decode_one_token(model: GptFastTransformer, x: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
    assert input_pos.shape[-1] == 1
    logits = model(x, input_pos)
    return logits[:, -1].argmax(-1, keepdim=True).to(dtype=torch.int), logits


def make_gpt_fast(*, batch: int, max_seq_length: int, seed: int = 0, dtype=torch.float32, device="cpu",
                  **overrides) -> GptFastTransformer:
    """The tiny gpt-fast Transformer (GPT_FAST_TINY with `overrides`), random weights, eval mode, with its caches
    set up (gpt-fast's generate calls setup_caches under `with torch.device(device)`)."""
    torch.manual_seed(seed)
    model = GptFastTransformer(ModelArgs(**{**GPT_FAST_TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():  # RMSNorm weights stay 1; larger projections make attention decide tokens
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.device(device):
        model.setup_caches(max_batch_size=batch, max_seq_length=max_seq_length)
    return model


# ==== torchtune: modules/kv_cache.py ====

class TorchtuneKVCache(nn.Module):
    """torchtune.modules.KVCache: [B, num_kv_heads, max_seq_len, head_dim] buffers and `cache_pos`, the slots
    the next update writes (advanced by each update's length)."""

    def __init__(self, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        cache_shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, cache_shape[2]), persistent=False)
        self.batch_size = batch_size

    def reset(self) -> None:
        """Reset the cache to zero."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos -= self.size

    @property
    def size(self) -> int:
        return self.cache_pos[0].item()

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, _, seq_len, _ = k_val.shape
        if bsz > self.k_cache.shape[0]:
            raise ValueError(
                f"The current cache has been setup with a batch size of {self.k_cache.shape[0]}"
                f", but found new key tensors with batch size {k_val.shape[0]}!"
            )

        assert (self.cache_pos[0] + seq_len) <= self.k_cache.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache

        k_out[:, :, self.cache_pos[:seq_len]] = k_val
        v_out[:, :, self.cache_pos[:seq_len]] = v_val

        # forward cache_pos seq_len positions along (compile-friendly: no int size tracker)
        self.cache_pos.add_(seq_len)

        return k_out, v_out


# ==== torchtune: modules/attention_utils.py (the SDPA branch of _sdpa_or_flex_attention) ====

def _sdpa_call(q, k, v, mask, dropout_p: float, is_causal: bool) -> torch.Tensor:
    # shape: [b, 1, s, s]
    if mask is not None:
        mask = mask[:, None, :, :]

    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                      is_causal=is_causal)


# ==== torchtune: modules/attention.py ====
# Left out: the flex-attention branch (BlockMask masks, sample packing: not a decode), the argument checks'
# messages and the logger.

class TorchtuneMultiHeadAttention(nn.Module):
    def __init__(self, *, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, q_proj: nn.Module,
                 k_proj: nn.Module, v_proj: nn.Module, output_proj: nn.Module,
                 pos_embeddings: Optional[nn.Module] = None, q_norm: Optional[nn.Module] = None,
                 k_norm: Optional[nn.Module] = None, kv_cache: Optional[TorchtuneKVCache] = None,
                 max_seq_len: int = 4096, is_causal: bool = True, attn_dropout: float = 0.0) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if bool(q_norm) ^ bool(k_norm):
            raise ValueError("q and k norm must be set together")

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.attn_dropout = attn_dropout
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.is_causal = is_causal

        self.kv_cache = kv_cache
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.output_proj = output_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.pos_embeddings = pos_embeddings

        self._attention_call = _sdpa_call

        # whether to update the kv-cache during forward passes
        self.cache_enabled = False

    def setup_cache(self, batch_size: int, dtype: torch.dtype, max_seq_len: int) -> None:
        if self.kv_cache is None:
            self.kv_cache = TorchtuneKVCache(batch_size=batch_size, max_seq_len=max_seq_len,
                                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)
            self.cache_enabled = True

    def reset_cache(self):
        if self.kv_cache is None:
            raise RuntimeError("Key value caches are not setup. Call ``setup_caches()`` first.")
        self.kv_cache.reset()

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None, *, mask: Optional[Tensor] = None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x has shape [b, s_x, d]
        # y has shape [b, s_y, d]
        b, s_x, _ = x.shape
        s_y = y.shape[1] if y is not None else 0

        # q has shape [b, s_x, num_heads * head_dim]
        q = self.q_proj(x)

        # number of queries per key/value
        q_per_kv = self.num_heads // self.num_kv_heads
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)

        # Apply positional embeddings
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)

        # [b, n_h, s_x, h_d]
        q = q.transpose(1, 2)

        # Normalize q
        if self.q_norm is not None:
            q = self.q_norm(q)

        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
            k = self.kv_cache.k_cache
            v = self.kv_cache.v_cache
        else:
            # k,v shape [b, s_y, num_kv_heads * head_dim]
            k = self.k_proj(y)
            v = self.v_proj(y)

            # k,v shape: [b, s_y, n_kv, h_d]
            k = k.view(b, s_y, -1, self.head_dim)
            v = v.view(b, s_y, -1, self.head_dim)
            if self.pos_embeddings is not None:
                k = self.pos_embeddings(k, input_pos=input_pos)

            # k,v shape: [b, n_kv, s_y, h_d]
            k = k.transpose(1, 2)
            v = v.transpose(1, 2)

            # Normalize k
            if self.k_norm is not None:
                k = self.k_norm(k)

            # Update key-value cache
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)

        # If needed, expand the key and value tensors to have the same shape
        # as the query tensor by copying values across the relevant dim
        # k,v shape: [b, n_kv, s, h_d] -> [b, n_h, s, h_d]
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)

        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )

        # reshape the output to be the same shape as the input
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


# ==== torchtune: modules/position_embeddings.py, rms_norm.py, feed_forward.py ====

class TorchtuneRotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim: int, max_seq_len: int = 4096, base: int = 10_000) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        self.max_seq_len = max_seq_len
        self.rope_init()

    def rope_init(self):
        theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2)[: (self.dim // 2)].float() / self.dim))
        self.register_buffer("theta", theta, persistent=False)
        self.build_rope_cache(self.max_seq_len)

    def build_rope_cache(self, max_seq_len: int = 4096) -> None:
        seq_idx = torch.arange(max_seq_len, dtype=self.theta.dtype, device=self.theta.device)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, self.theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        # input tensor has shape [b, s, n_h, h_d]
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        # tensor has shape [b, s, n_h, h_d // 2, 2]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        # [b, s, 1, h_d // 2, 2] if packed samples, otherwise [1, s, 1, h_d // 2, 2]
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        x_out = x_out.flatten(3)
        return x_out.type_as(x)


class TorchtuneRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return x_normed * self.scale


class TorchtuneFeedForward(nn.Module):
    def __init__(self, *, gate_proj: nn.Module, down_proj: nn.Module, up_proj: Optional[nn.Module] = None,
                 activation: nn.Module = nn.SiLU()):
        super().__init__()
        self.w1 = gate_proj
        self.w2 = down_proj
        self.w3 = up_proj
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.w1(x))
        if self.w3 is not None:
            h = h * self.w3(x)
        h = self.w2(h)
        return h


# ==== torchtune: modules/transformer.py ====
# Left out: cross-attention / fusion layers, output_hidden_states, chunked output, input_embeds.

class TorchtuneTransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn: TorchtuneMultiHeadAttention, mlp: nn.Module, *, sa_norm: Optional[nn.Module] = None,
                 mlp_norm: Optional[nn.Module] = None, sa_scale: Optional[nn.Module] = None,
                 mlp_scale: Optional[nn.Module] = None, mask_mod: Optional[Callable] = None) -> None:
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm or nn.Identity()
        self.mlp_norm = mlp_norm or nn.Identity()
        self.sa_scale = sa_scale or nn.Identity()
        self.mlp_scale = mlp_scale or nn.Identity()
        self.mask_mod = mask_mod or None

    def setup_caches(self, batch_size: int, dtype: torch.dtype, *, encoder_max_seq_len: int,
                     decoder_max_seq_len: int) -> None:
        self.attn.setup_cache(batch_size, dtype, max_seq_len=decoder_max_seq_len)

    def caches_are_setup(self) -> bool:
        return self.attn.kv_cache is not None

    def caches_are_enabled(self) -> bool:
        return self.attn.cache_enabled

    def reset_cache(self):
        self.attn.reset_cache()

    def forward(self, x: torch.Tensor, *, mask: Optional[Tensor] = None, input_pos: Optional[torch.Tensor] = None,
                **kwargs: dict) -> torch.Tensor:
        h = self.sa_norm(x)
        if self.mask_mod is not None:
            bsz, seq_len, *_ = h.shape
            mask = self.mask_mod(mask=mask, bsz=bsz, seq_len=seq_len)
        attn_out = self.attn(h, h, mask=mask, input_pos=input_pos)
        h = self.sa_scale(attn_out) + x
        mlp_out = self.mlp(self.mlp_norm(h))
        out = h + self.mlp_scale(mlp_out)
        return out


class TorchtuneTransformerDecoder(nn.Module):
    def __init__(self, *, tok_embeddings: nn.Embedding, layers: nn.ModuleList, max_seq_len: int, num_heads: int,
                 head_dim: int, norm: nn.Module, output: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.layers = layers
        self.norm = norm
        self.output = output
        self.max_seq_len = max_seq_len
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.causal_mask = None
        self.decoder_max_cache_seq_len = None

    def setup_caches(self, batch_size: int, dtype: torch.dtype, *, encoder_max_seq_len: Optional[int] = None,
                     decoder_max_seq_len: Optional[int] = None):
        self.decoder_max_cache_seq_len = decoder_max_seq_len if decoder_max_seq_len is not None \
            else self.max_seq_len
        for layer in self.layers:
            layer.setup_caches(batch_size, dtype, encoder_max_seq_len=None,
                               decoder_max_seq_len=self.decoder_max_cache_seq_len)

    def caches_are_setup(self) -> bool:
        return self.layers[0].caches_are_setup()

    def caches_are_enabled(self) -> bool:
        return self.layers[0].caches_are_enabled()

    def reset_caches(self):
        if not self.caches_are_enabled():
            raise RuntimeError("Key value caches are not setup. Call model.setup_caches first.")
        for layer in self.layers:
            layer.reset_cache()

    def _validate_inputs(self, tokens, mask=None, input_pos=None):
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"seq_len ({seq_len}) of input tensor should be smaller "
                             f"than max_seq_len ({self.max_seq_len})")
        if self.caches_are_enabled():
            if mask is None:
                raise ValueError("KV-caches for self-attention layers are setup for inference mode, causal masks "
                                 "must be provided! Use the `mask` arg to provide a causal mask.")
            if input_pos is None:
                raise ValueError("KV-caches are setup for inference mode, input positions must be provided!")

    def forward(self, tokens: torch.Tensor, *, mask: Optional[Tensor] = None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._validate_inputs(tokens, mask=mask, input_pos=input_pos)
        # shape: [b, s, d]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask, input_pos=input_pos)
        return self.unembed(h)

    def unembed(self, h):
        h = self.norm(h)
        # shape: [b, seq_len, out_dim]
        return self.output(h).float()


# Tiny llama3-style decoder (torchtune/models/llama3/_component_builders.py's llama3 layout): head_dim 64.
TORCHTUNE_TINY = dict(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=256, intermediate_dim=512,
                      max_seq_len=64, norm_eps=1e-5, rope_base=500_000)


def make_torchtune(*, batch: int, decoder_max_seq_len: int, seed: int = 0, dtype=torch.float32, device="cpu",
                   **overrides) -> TorchtuneTransformerDecoder:
    """The tiny llama3-style TransformerDecoder, random weights, eval mode, its KV caches set up."""
    c = {**TORCHTUNE_TINY, **overrides}
    head_dim = c["embed_dim"] // c["num_heads"]
    torch.manual_seed(seed)

    def layer():
        rope = TorchtuneRotaryPositionalEmbeddings(dim=head_dim, max_seq_len=c["max_seq_len"], base=c["rope_base"])
        attn = TorchtuneMultiHeadAttention(
            embed_dim=c["embed_dim"], num_heads=c["num_heads"], num_kv_heads=c["num_kv_heads"], head_dim=head_dim,
            q_proj=nn.Linear(c["embed_dim"], c["num_heads"] * head_dim, bias=False),
            k_proj=nn.Linear(c["embed_dim"], c["num_kv_heads"] * head_dim, bias=False),
            v_proj=nn.Linear(c["embed_dim"], c["num_kv_heads"] * head_dim, bias=False),
            output_proj=nn.Linear(c["embed_dim"], c["embed_dim"], bias=False), pos_embeddings=rope,
            max_seq_len=c["max_seq_len"], attn_dropout=0.0)
        mlp = TorchtuneFeedForward(gate_proj=nn.Linear(c["embed_dim"], c["intermediate_dim"], bias=False),
                                   down_proj=nn.Linear(c["intermediate_dim"], c["embed_dim"], bias=False),
                                   up_proj=nn.Linear(c["embed_dim"], c["intermediate_dim"], bias=False))
        return TorchtuneTransformerSelfAttentionLayer(attn=attn, mlp=mlp,
                                                      sa_norm=TorchtuneRMSNorm(c["embed_dim"], eps=c["norm_eps"]),
                                                      mlp_norm=TorchtuneRMSNorm(c["embed_dim"], eps=c["norm_eps"]))

    model = TorchtuneTransformerDecoder(
        tok_embeddings=nn.Embedding(c["vocab_size"], c["embed_dim"]),
        layers=nn.ModuleList(layer() for _ in range(c["num_layers"])), max_seq_len=c["max_seq_len"],
        num_heads=c["num_heads"], head_dim=head_dim, norm=TorchtuneRMSNorm(c["embed_dim"], eps=c["norm_eps"]),
        output=nn.Linear(c["embed_dim"], c["vocab_size"], bias=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.device(device):
        model.setup_caches(batch_size=batch, dtype=dtype, decoder_max_seq_len=decoder_max_seq_len)
    return model


# ==== torchtune: generation/_generation.py ====
# As published but for: no stop tokens, no rng argument (greedy through `top_k=1` makes the drawn q
# irrelevant: every logit but the top one becomes -inf).

def multinomial_sample_one(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Samples from a multinomial distribution."""
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


def sample(logits: torch.Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
           q: Optional[torch.Tensor] = None) -> torch.Tensor:
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    if q is None:
        uniform_val = torch.rand_like(probs)
        epsilon = torch.finfo(uniform_val.dtype).eps / 2
        condition = uniform_val >= 1.0 - epsilon
        q = -torch.where(condition, -epsilon, torch.log(uniform_val))
    return multinomial_sample_one(probs, q)


def generate_next_token(model: TorchtuneTransformerDecoder, input_pos: torch.Tensor, x: torch.Tensor,
                        q: Optional[torch.Tensor] = None, *, mask: Optional[torch.Tensor] = None,
                        temperature: float = 1.0, top_k: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # model produces logits in [bsz, seq_length, vocab_size]
    logits = model(x, input_pos=input_pos, mask=mask)[:, -1]
    return sample(logits.clone(), temperature=temperature, top_k=top_k, q=q), logits.unsqueeze(1)


def get_causal_mask_from_padding_mask(padding_mask: torch.Tensor,
                                      target_seq_len: Optional[int] = None) -> torch.Tensor:
    bsz, seq_len = padding_mask.shape
    target_seq_len = seq_len if target_seq_len is None else target_seq_len
    if target_seq_len < seq_len:
        raise AssertionError("target_seq_len cannot be shorter than the sequence length of the padding mask.")
    mask = torch.tril(torch.ones(seq_len, target_seq_len, device=padding_mask.device, dtype=bool),
                      diagonal=0).repeat(bsz, 1, 1)
    mask.narrow(2, 0, seq_len).mul_(padding_mask[:, None, :].expand(-1, seq_len, -1))
    mask.diagonal(dim1=1, dim2=2).copy_(torch.Tensor([True]))
    return mask


def get_position_ids_from_padding_mask(padding_mask: torch.Tensor):
    return ((padding_mask.cumsum(-1) - 1) * padding_mask).to(torch.int)


@torch.no_grad()
def torchtune_generate(model: TorchtuneTransformerDecoder, prompt: torch.Tensor, *, max_generated_tokens: int,
                       pad_id: int = 0, temperature: float = 1.0, top_k: Optional[int] = None,
                       compiled_generate_next_token: Optional[Callable] = None,
                       masks_hook: Optional[Callable] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtune.generation.generate (incremental decoding: caches enabled): prefill with generate_next_token,
    then `max_generated_tokens - 1` decode steps with `compiled_generate_next_token`, each given
    `masks[:, curr_pos, None, :]` (its row of the [B, total, max_cache_len] mask) and `input_pos[:, curr_pos]`.
    `masks_hook(masks) -> masks` (not in torchtune) lets a test edit the mask rows the decode steps read."""
    prompt = prompt.view(1, -1) if prompt.ndim == 1 else prompt
    bsz, prompt_length = prompt.size()
    total_response_length = prompt_length + max_generated_tokens
    generated_tokens = prompt.clone()
    incremental_decoding = model.caches_are_enabled()
    assert incremental_decoding, "this form is the KV-cache decode"
    max_seq_len = model.decoder_max_cache_seq_len

    padding_masks = generated_tokens != pad_id
    if not padding_masks.all():
        padding_masks = torch.nn.functional.pad(padding_masks, (0, max_generated_tokens), value=True)
        masks = get_causal_mask_from_padding_mask(padding_masks, target_seq_len=max_seq_len)
        input_pos = get_position_ids_from_padding_mask(padding_masks)
    else:
        masks = torch.tril(torch.ones(total_response_length, max_seq_len, dtype=torch.bool,
                                      device=prompt.device)).unsqueeze(0)
        input_pos = torch.arange(0, total_response_length, device=generated_tokens.device).unsqueeze(0)
    if masks_hook is not None:
        masks = masks_hook(masks)

    curr_masks = masks[:, :prompt_length]
    tokens, generated_logits = generate_next_token(model, input_pos=input_pos[:, :prompt_length].squeeze(),
                                                   mask=curr_masks, x=prompt, temperature=temperature, top_k=top_k)
    generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
    curr_pos = prompt_length
    next_token_fn = compiled_generate_next_token if compiled_generate_next_token is not None \
        else generate_next_token
    for _ in range(max_generated_tokens - 1):
        curr_input_pos = input_pos[:, curr_pos].contiguous()
        curr_masks = masks[:, curr_pos, None, :].contiguous()
        tokens, logits = next_token_fn(model, input_pos=curr_input_pos, x=tokens.clone(), mask=curr_masks,
                                       temperature=temperature, top_k=top_k)
        generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
        generated_logits = torch.cat([generated_logits, logits], dim=1)
        curr_pos += 1
    return generated_tokens, generated_logits
