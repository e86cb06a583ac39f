"""Value head dim != key head dim (MLA) on CPU: the reference against plain attention over decompressed K/V, the
torch family against the reference with unused slots NaN-poisoned, `mla_attention` eager and compiled, bad
shapes. (The Triton family's Dv != D cases: tests/test_triton_kernels.py, INTERPRETER_CASES and GPU_CASES.)

DeepSeek-V3's attention, one layer: per token a latent c (kv_lora_rank 512) and a rope key k_pe (64, shared by
the heads); head h's key is [c @ W_UK[h], k_pe] (128 + 64 = 192) and its value c @ W_UV[h] (128). Non-absorbed,
that is paged attention with D = 192, Dv = 128; absorbed (W_UK folded into q, W_UV applied after), attention
over the latent cache itself with D = 576, Dv = 512 and one KV head.
"""

from __future__ import annotations

import pytest
import torch

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from tests import helpers
from tests.test_errors import _raises
from tests.test_triton_kernels import check_close, make_inputs

RANK, ROPE, NOPE, VDIM = 512, 64, 128, 128  # DeepSeek-V3's kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
#                                             v_head_dim
SCALE = (NOPE + ROPE) ** -0.5  # the 192-dim qk head's softmax scale (DeepSeek-V3 also multiplies YaRN's mscale^2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from helpers.one_thread()


# ----------------------------------------------------------------------------------------------------------
# A DeepSeek-style layer: latent cache, decompressed K/V, plain attention


def _mla_layer(*, batch=2, q_len=1, heads=4, page_size=4, lens=(9, 14), seed=0, packed=False, q_lens=None):
    """Random latent tokens paged into a [num_pages, page_size, 576] cache (pages in random order, unused
    slots NaN), weights W_UK [H, 128, 512] and W_UV [H, 512, 128], queries q_nope [.., H, 128] and q_pe
    [.., H, 64]. Returns a dict; the tokens per request are kept for the plain computation."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens) + 1
    num_pages = batch * max_pages + 2
    cache = torch.full((num_pages, page_size, RANK + ROPE), float("nan"), dtype=torch.float64)
    page_table = torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages)
    latents = []
    for b, n in enumerate(lens):
        tokens = torch.randn(n, RANK + ROPE, generator=gen, dtype=torch.float64)
        j = torch.arange(n)
        cache[page_table[b, j // page_size], j % page_size] = tokens
        latents.append(tokens)
    w_uk = torch.randn(heads, NOPE, RANK, generator=gen, dtype=torch.float64) / RANK ** 0.5
    w_uv = torch.randn(heads, RANK, VDIM, generator=gen, dtype=torch.float64) / RANK ** 0.5
    if packed:
        q_lens = list(q_lens)
        cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        rows = int(cu[-1]) + 2  # two padding rows
        q_nope = torch.randn(rows, heads, NOPE, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(rows, heads, ROPE, generator=gen, dtype=torch.float64)
    else:
        q_lens, cu = [q_len] * batch, None
        q_nope = torch.randn(batch, q_len, heads, NOPE, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(batch, q_len, heads, ROPE, generator=gen, dtype=torch.float64)
    return dict(cache=cache, page_table=page_table.int(), cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                cu_seqlens_q=cu, q_lens=q_lens, latents=latents, w_uk=w_uk, w_uv=w_uv, q_nope=q_nope, q_pe=q_pe)


def _query_rows(layer, b):
    """(q_nope, q_pe) rows of request b: [S_b, H, 128], [S_b, H, 64]."""
    if layer["cu_seqlens_q"] is None:
        return layer["q_nope"][b], layer["q_pe"][b]
    lo, hi = int(layer["cu_seqlens_q"][b]), int(layer["cu_seqlens_q"][b + 1])
    return layer["q_nope"][lo:hi], layer["q_pe"][lo:hi]


def _plain_attention(layer):
    """Written apart from the kernels and the reference: per request, decompress K and V from the latent
    tokens and run SDPA (float64, a causal mask aligned to the last S_b positions). Returns out
    [.., H, 128] in q's row layout (padding rows zero)."""
    out = torch.zeros(layer["q_nope"].shape[:-1] + (VDIM,), dtype=torch.float64)
    for b, tokens in enumerate(layer["latents"]):
        c, k_pe = tokens[:, :RANK], tokens[:, RANK:]
        k = torch.cat([torch.einsum("lr,hnr->hln", c, layer["w_uk"]),
                       k_pe.expand(layer["w_uk"].shape[0], -1, -1)], dim=-1)  # [H, L, 192]
        v = torch.einsum("lr,hrv->hlv", c, layer["w_uv"])  # [H, L, 128]
        q_nope, q_pe = _query_rows(layer, b)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, S, 192]
        s, length = q.shape[1], tokens.shape[0]
        visible = torch.arange(length)[None, :] <= (length - s + torch.arange(s))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=SCALE)
        o = o.transpose(0, 1)  # [S, H, 128]
        if layer["cu_seqlens_q"] is None:
            out[b] = o
        else:
            out[int(layer["cu_seqlens_q"][b]): int(layer["cu_seqlens_q"][b + 1])] = o
    return out


def _decompressed_cache(layer):
    """The non-absorbed paged caches: k [num_pages, page_size, H, 192] and v [.., H, 128] from each slot's latent
    (NaN slots stay NaN)."""
    c, k_pe = layer["cache"][..., :RANK], layer["cache"][..., RANK:]
    heads = layer["w_uk"].shape[0]
    k = torch.cat([torch.einsum("psr,hnr->pshn", c, layer["w_uk"]),
                   k_pe[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)
    return k, torch.einsum("psr,hrv->pshv", c, layer["w_uv"])


def _absorbed_q(layer):
    """q = [q_nope @ W_UK[h], q_pe] per head: [.., H, 576]."""
    return torch.cat([torch.einsum("...hn,hnr->...hr", layer["q_nope"], layer["w_uk"]), layer["q_pe"]], dim=-1)


def _up(layer, latent_out):
    """Absorbed output [.., H, 512] through W_UV: [.., H, 128]."""
    return torch.einsum("...hr,hrv->...hv", latent_out.double(), layer["w_uv"])


LAYERS = {"decode": dict(q_len=1), "verify": dict(q_len=3, lens=(5, 13)),
          "packed": dict(packed=True, q_lens=(4, 7), lens=(6, 11))}


@pytest.mark.parametrize("shape", list(LAYERS))
def test_reference_matches_plain_attention_over_decompressed_kv(shape):
    """The reference's Dv != D semantics from the math, both ways DeepSeek-V3 computes it: non-absorbed
    (D = 192, Dv = 128, Hkv = Hq) and absorbed (D = 576, Dv = 512 over the latent cache, then W_UV) equal SDPA
    over the decompressed K/V."""
    layer = _mla_layer(**LAYERS[shape], seed=len(shape))
    expected = _plain_attention(layer)
    assert expected.abs().sum() > 0
    rows = slice(None) if layer["cu_seqlens_q"] is None else slice(0, int(layer["cu_seqlens_q"][-1]))
    k, v = _decompressed_cache(layer)
    q = torch.cat([layer["q_nope"], layer["q_pe"]], dim=-1)
    out, _ = paged_attention_reference(q.float(), k.float(), v.float(), layer["page_table"], layer["cache_seqlens"],
                                       layer["cu_seqlens_q"], scale=SCALE)
    assert out.shape == expected.shape
    torch.testing.assert_close(out[rows].double(), expected[rows], atol=2e-5, rtol=2e-5)
    latent = layer["cache"].float()[:, :, None, :]
    out, _ = paged_attention_reference(_absorbed_q(layer).float(), latent, latent[..., :RANK], layer["page_table"],
                                       layer["cache_seqlens"], layer["cu_seqlens_q"], scale=SCALE)
    assert out.shape[-1] == RANK
    torch.testing.assert_close(_up(layer, out)[rows], expected[rows], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", ["decode", "packed"])
def test_mla_attention_matches_plain_attention(shape):
    """The public MLA entry (vLLM's latent cache, q_nope and q_pe apart) through W_UV equals SDPA over the
    decompressed K/V."""
    layer = _mla_layer(**LAYERS[shape], seed=7)
    q_abs = _absorbed_q(layer).float()
    out = b12x.mla_attention(q_abs[..., :RANK], q_abs[..., RANK:], layer["cache"].float(), layer["page_table"],
                             layer["cache_seqlens"], layer["cu_seqlens_q"], scale=SCALE)
    rows = slice(None) if layer["cu_seqlens_q"] is None else slice(0, int(layer["cu_seqlens_q"][-1]))
    torch.testing.assert_close(_up(layer, out)[rows], _plain_attention(layer)[rows], atol=5e-5, rtol=5e-5)
    if layer["cu_seqlens_q"] is not None:
        assert (out[int(layer["cu_seqlens_q"][-1]):] == 0).all()  # padding rows


# ----------------------------------------------------------------------------------------------------------
# The torch family against the reference, Dv != D


PAIRS = {"d192_dv128": dict(d=192, dv=128, hq=4, hkv=2), "mla576": dict(d=576, dv=512, hq=4, hkv=1, v_view=True)}
MODES = {"decode": dict(q_len=1), "verify": dict(q_len=4), "extend": dict(q_len=18),
         "packed_padded": dict(packed=True, q_lens=[6, 11])}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_torch_family_matches_reference(pair, mode, page_size, monkeypatch):
    """fp32 q and caches; every slot no row sees is NaN; page size 1 takes the CUDA path (no host reads of
    device values), kv_start and a window on the 16-slot pages."""
    from b12x_inductor.kernels import torch_impl

    if page_size == 1:
        monkeypatch.setattr(torch_impl, "HOST_BOUNDS", False)
    lens = [MODES[mode].get("q_len", 11) + 13, 40]
    t = make_inputs(**PAIRS[pair], **MODES[mode], page_size=page_size, lens=lens, dtype=torch.float32,
                    nan_unused=True, kv_start=page_size == 16, seed=page_size + len(mode),
                    sinks=mode == "verify")
    opts = dict(scale=0.07, window_left=9 if page_size == 16 else -1)
    args = {k: t[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q")}
    extra = {k: t[k] for k in ("kv_start", "sinks")}
    out, lse = b12x.paged_attention(**args, **extra, **opts, return_lse=True)
    dv = t["v_cache"].shape[-1]
    assert out.shape == t["q"].shape[:-1] + (dv,) and torch.isfinite(out).all()
    ref_out, ref_lse = paged_attention_reference(**args, **extra, **opts)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    if t["cu_seqlens_q"] is not None:
        end = int(t["cu_seqlens_q"][-1])
        assert end < out.shape[0] and (out[end:] == 0).all() and torch.isneginf(lse[end:]).all()


def test_torch_family_bf16_fp8_and_out():
    """bf16 q with a float8 latent cache and its descales, out= of shape [.., Dv]."""
    t = make_inputs(d=576, dv=512, hq=8, hkv=1, v_view=True, q_len=2, page_size=16, kv_dtype=torch.float8_e4m3fn,
                    descale="b", nan_unused=True, seed=3)
    args = {k: t[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q")}
    out = torch.full(t["q"].shape[:-1] + (512,), float("nan"), dtype=torch.bfloat16)
    _, lse = b12x.paged_attention(**args, k_descale=t["k_descale"], v_descale=t["v_descale"], out=out,
                                  return_lse=True)
    check_close(out, lse, *paged_attention_reference(**args, k_descale=t["k_descale"], v_descale=t["v_descale"]),
                what="bf16/fp8 576/512")


def test_plans_for_dv():
    """Dv != D: the CuTe family refuses it (the Triton family plans it on an H200), tiles follow max(D, Dv),
    the split scratch is sized by Dv; Problem's v_head_dim defaults to head_dim."""
    from b12x_inductor.kernels import cute
    from b12x_inductor.plan import Problem, select_plan, split_scratch_bytes

    base = dict(batch=8, q_len=1, packed=False, num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                page_size=64, max_pages=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD",
                device_type="cuda", sm_count=132, capability=(9, 0))
    p = Problem(**base)
    assert not cute.supports(p) and cute.supports(Problem(**{**base, "head_dim": 128, "v_head_dim": 128}))
    assert Problem(**{**base, "v_head_dim": None}).v_head_dim == 576
    plan = select_plan(p)
    assert (plan.family, plan.block_m, plan.block_n, plan.num_warps) == ("triton", 16, 16, 4) and plan.num_splits > 1
    assert plan.scratch_bytes == split_scratch_bytes(p, plan.num_splits) == 8 * 16 * plan.num_splits * 513 * 4
    extend = select_plan(Problem(**{**base, "q_len": 300}))
    assert (extend.family, extend.block_m, extend.block_n, extend.num_warps) == ("triton", 32, 16, 8)
    tiles = lambda plan: (plan.family, plan.num_splits, plan.block_m, plan.block_n, plan.num_warps, plan.num_stages)
    nonabsorbed = dict(base, head_dim=192, v_head_dim=128, num_kv_heads=16)
    same_dv = Problem(**dict(nonabsorbed, v_head_dim=192))
    assert tiles(select_plan(Problem(**nonabsorbed))) == tiles(select_plan(same_dv))
    assert select_plan(Problem(**{**base, "device_type": "cpu", "sm_count": 0})).family == "torch"


# ----------------------------------------------------------------------------------------------------------
# mla_attention


def _latent_inputs(*, q_len=1, packed=False, heads=8, page_size=16, dtype=torch.float32, seed=0):
    """vLLM's latent cache [num_pages, page_size, 576] (unused slots NaN) and absorbed queries."""
    t = make_inputs(d=576, dv=512, hq=heads, hkv=1, v_view=True, q_len=q_len, packed=packed, page_size=page_size,
                    dtype=dtype, nan_unused=True, seed=seed)
    latent = t["k_cache"][:, :, 0]  # [num_pages, page_size, 576], strided (a view of a combined cache)
    return t, latent


def _mla_reference(t, **opts):
    return paged_attention_reference(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                                     t["cu_seqlens_q"], **opts)


@pytest.mark.parametrize("form", ["split_q", "whole_q", "flashinfer_pair"])
def test_mla_attention_eager(form):
    t, latent = _latent_inputs(q_len=3, seed=5)
    q = t["q"]
    q_nope, q_pe = (q[..., :512], q[..., 512:]) if form != "whole_q" else (q, None)
    kv = latent
    if form == "flashinfer_pair":
        buf = torch.full((latent.shape[0], latent.shape[1], 576), float("nan"))
        buf.copy_(latent)
        kv = (buf[..., :512], buf[..., 512:])
    out, lse = b12x.mla_attention(q_nope, q_pe, kv, t["page_table"], t["cache_seqlens"], scale=0.05,
                                  return_lse=True)
    assert out.shape == q.shape[:-1] + (512,)
    ref_out, ref_lse = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_mla_attention_out_and_lse_packed():
    t, latent = _latent_inputs(packed=True, seed=6)
    q = t["q"]
    out = torch.full(q.shape[:-1] + (512,), float("nan"))
    got = b12x.mla_attention(q[..., :512], q[..., 512:], latent, t["page_table"], t["cache_seqlens"],
                             t["cu_seqlens_q"], scale=0.05, out=out)
    assert got is out
    ref_out, _ = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len", [1, 20])
def test_mla_attention_compiled_fullgraph(q_len):
    """torch.compile(fullgraph=True, Inductor): the cat of q, the cache views and the op trace; the lowering
    plans D = 576 / Dv = 512 (the torch family on CPU); equal to the reference."""
    t, latent = _latent_inputs(q_len=q_len, heads=4, seed=8)

    def step(q_nope, q_pe, kv, pt, lens):
        out, lse = b12x.mla_attention(q_nope, q_pe, kv, pt, lens, scale=0.05, return_lse=True)
        return out * 2.0, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    q = t["q"]
    out, lse = compiled(q[..., :512].contiguous(), q[..., 512:].contiguous(), latent, t["page_table"],
                        t["cache_seqlens"])
    ref_out, ref_lse = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out / 2.0, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------------------------------
# Bad shapes


def _mla_args():
    t, latent = _latent_inputs(q_len=1, heads=4, seed=9)
    q = t["q"]
    return dict(q_nope=q[..., :512], q_pe=q[..., 512:], kv_cache=latent, page_table=t["page_table"],
                cache_seqlens=t["cache_seqlens"], scale=0.05)


def _set(**changes):
    def f(args):
        for k, val in changes.items():
            args[k] = val(args) if callable(val) else val
    return f


MLA_CASES = [
    ("q_pe_shape", _set(q_pe=lambda a: a["q_pe"][..., :32]), ValueError, r"q_pe must be of shape \(2, 1, 4, 64\)"),
    ("q_pe_dtype", _set(q_pe=lambda a: a["q_pe"].double()), TypeError, "q_pe must be of q_nope's dtype"),
    ("q_nope_dim", _set(q_nope=lambda a: a["q_nope"][..., :256]), ValueError,
     "q_nope must be of last dim kv_lora_rank = 512"),
    ("whole_q_dim", _set(q_pe=None), ValueError, r"q_nope must be of last dim kv_lora_rank \+ rope_dim = 576"),
    ("q_nope_5d", _set(q_nope=lambda a: a["q_nope"][None], q_pe=lambda a: a["q_pe"][None]), ValueError,
     r"q_nope must be \[B, S, H, kv_lora_rank\]"),
    ("kv_cache_dims", _set(kv_cache=lambda a: a["kv_cache"][:, :, None]), ValueError,
     "kv_cache must be 3-dimensional"),
    ("kv_cache_narrow", _set(kv_cache=lambda a: a["kv_cache"][..., :512]), ValueError,
     "kv_cache must be wider than kv_lora_rank = 512"),
    ("kv_cache_type", _set(kv_cache=[1, 2, 3]), ValueError, r"kv_cache must be a tensor or a pair \(ckv, kpe\)"),
    ("scale_none", _set(scale=None), TypeError, "scale must be a Python float"),
    ("kv_lora_rank", _set(kv_lora_rank=0), ValueError, "kv_lora_rank must be a positive int"),
    ("rank_576", _set(kv_lora_rank=448, q_nope=lambda a: torch.randn(2, 1, 4, 448), q_pe=lambda a: torch.randn(
        2, 1, 4, 128)), ValueError, "paged_attention: v_cache must be of value head dim 512 with q/k head dim 576"),
]


@pytest.mark.parametrize("name,change,exc,message", MLA_CASES, ids=[c[0] for c in MLA_CASES])
@pytest.mark.parametrize("where", ["eager", "compiled"])
def test_mla_attention_bad_input(name, change, exc, message, where):
    args = _mla_args()
    change(args)
    fn = b12x.mla_attention
    if where == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="eager")
    _raises(fn, exc, message, **args)


def test_mla_attention_scale_is_required():
    args = _mla_args()
    del args["scale"]
    with pytest.raises(TypeError, match="scale"):
        b12x.mla_attention(**args)


def test_flashinfer_pair_must_be_adjacent_views():
    args = _mla_args()
    latent = args["kv_cache"]
    ckv, kpe = latent[..., :512], latent[..., 512:]
    assert b12x.mla.latent_cache(ckv, kpe).data_ptr() == latent.data_ptr()
    for name, pair, message in [
        ("separate buffers", (ckv.contiguous(), kpe.contiguous()), r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("swapped", (latent[..., 64:], latent[..., :64]), r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("overlapping", (latent[..., 1:513], latent[..., 512:]), r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("other buffer", (torch.randn(latent.shape[0], 2, *latent.shape[1:])[:, 0, :, :512], kpe),
         r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("pages", (ckv, kpe[:-1]), r"kv_cache\[1\] \(kpe\) must be of ckv's \[num_pages, page_size\]"),
        ("rank", (latent[..., :448], latent[..., 448:]), r"kv_cache\[0\] \(ckv\) must be of last dim kv_lora_rank"),
    ]:
        with pytest.raises(ValueError, match=message):
            b12x.mla_attention(args["q_nope"], args["q_pe"], pair, args["page_table"], args["cache_seqlens"],
                               scale=0.05)
    # under torch.compile the pair is refused (Dynamo cannot read data pointers): pass the view
    torch._dynamo.reset()
    fn = torch.compile(b12x.mla_attention, fullgraph=True, backend="eager")
    _raises(fn, ValueError, "kv_cache must be one .* tensor under torch.compile", q_nope=args["q_nope"],
            q_pe=args["q_pe"], kv_cache=(ckv, kpe), page_table=args["page_table"],
            cache_seqlens=args["cache_seqlens"], scale=0.05)


def test_mla_attention_keeps_inputs():
    """No input changes (the cat copies q; the cache is only read)."""
    args = _mla_args()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    b12x.mla_attention(**args)
    for k, v in before.items():
        torch.testing.assert_close(args[k], v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_write_kv_dv(kv_layout):
    """write_kv takes v [N, Hkv, Dv] into a v_cache of head dim Dv (non-absorbed MLA's 192 / 128), as the
    reference writes it, duplicates and skipped slots included."""
    from b12x_inductor.kernels.reference import write_kv_reference

    gen = torch.Generator().manual_seed(4)
    shape = (5, 4, 2) if kv_layout == "NHD" else (5, 2, 4)
    k_cache, v_cache = torch.randn(*shape, 192, generator=gen), torch.randn(*shape, 128, generator=gen)
    k, v = torch.randn(6, 2, 192, generator=gen), torch.randn(6, 2, 128, generator=gen)
    slots = torch.tensor([3, -1, 17, 3, 0, 19])
    ek, ev = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, ek, ev, slots, kv_layout=kv_layout)
    b12x.write_kv(k, v, k_cache, v_cache, slots, kv_layout=kv_layout)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)
    page, off = 17 // 4, 17 % 4
    assert torch.equal(v_cache[page, off] if kv_layout == "NHD" else v_cache[page, :, off], v[2])


# ---- transformers' DeepSeek-V3 (non-absorbed: q/k head dim 192, v head dim 128) ----

@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_deepseek_v3_tokens_equal_eager(cache):
    """A tiny DeepSeek-V3 (MLA with q/k head dim 128 + 64 rope = 192 and v head dim 128, a small MoE) generates
    the same greedy tokens with attn_implementation="b12x" as with eager attention, on a left-padded batch,
    and every attention call ran on the b12x op (2 layers x (prefill + 5 decode steps))."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM

    import b12x_inductor.integrations.hf  # noqa: F401  (registers "b12x")

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=256, n_group=1, topk_group=1,
        rope_scaling=None, initializer_range=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 256, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
              **({"cache_implementation": "static"} if cache == "static" else {}))

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.namespace == "b12x"
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.set_attn_implementation("b12x")
        with Count():
            ours = model.generate(ids, **kw)
    assert torch.equal(ours, eager), (ours, eager)
    assert Count.calls == 2 * 6, Count.calls
