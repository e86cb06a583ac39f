"""A seeded fuzz of the public op (torch family on CPU) against the reference, with every cache slot no query
row sees poisoned with NaN or Inf: 480 eager configurations and a 60-configuration slice under
torch.compile(backend="inductor", fullgraph=True).

Each configuration draws a mode (decode, verify, extend padded, extend packed), q dtype (fp32, bf16, fp16),
cache dtype (q's or float8_e4m3fn with descales None / scalar / [B] / [B, Hkv]), layout, strided views of a
combined [num_pages, 2, ...] cache, page size, head dim, GQA group, kv_start, window_left, sinks, softcap,
scale, causal and return_lse. The list is deterministic (seed 0); a failure prints its configuration.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from tests import helpers

FP8 = torch.float8_e4m3fn
NUM_EAGER = 480
NUM_COMPILED = 60


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from helpers.one_thread()


@dataclasses.dataclass(frozen=True)
class Config:
    index: int
    mode: str
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    descale: str  # none, scalar, batch, batch_head (float8 caches only)
    kv_layout: str
    combined: bool  # k and v are views of one [num_pages, 2, ...] cache
    page_size: int
    head_dim: int
    hkv: int
    group: int
    batch: int
    q_len: int  # S for 4-D q, the capacity T for packed q
    max_pages: int
    kv_start: bool
    window_left: int
    sinks: bool
    softcap: float
    scale: float | None
    causal: bool
    return_lse: bool
    poison: str  # nan, inf, mixed
    seed: int


def _configs(n: int, seed: int) -> list[Config]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mode = ("decode", "verify", "extend", "packed")[i % 4]
        q_dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
        kv_dtype = FP8 if q_dtype != torch.float32 and rng.random() < 0.35 else q_dtype
        page_size = rng.choice((1, 3, 16, 64) if mode != "decode" else (1, 3, 5, 16, 64))
        head_dim = rng.choice((64, 96, 128, 192, 256))
        hkv = rng.choice((1, 2, 4))
        group = rng.choice((1, 2, 4, 8) if hkv < 4 else (1, 2))
        batch = rng.randint(1, 4)
        q_len = {"decode": 1, "verify": rng.randint(2, 16), "extend": rng.randint(17, 24),
                 "packed": rng.randint(4, 24)}[mode]
        keys = rng.randint(max(q_len, 8) if mode != "packed" else 8, 80)  # capacity in keys
        max_pages = max(1, math.ceil(keys / page_size))
        out.append(Config(
            index=i, mode=mode, q_dtype=q_dtype, kv_dtype=kv_dtype,
            descale=rng.choice(("none", "scalar", "batch", "batch_head")) if kv_dtype == FP8 else "none",
            kv_layout=rng.choice(("NHD", "HND")), combined=rng.random() < 0.3, page_size=page_size,
            head_dim=head_dim, hkv=hkv, group=group, batch=batch, q_len=q_len, max_pages=max_pages,
            kv_start=rng.random() < 0.3, window_left=rng.choice((-1, -1, 0, 1, 5, 17)), sinks=rng.random() < 0.3,
            softcap=rng.choice((0.0, 0.0, 0.0, 2.5, 30.0)), scale=rng.choice((None, None, 0.05, 0.3)),
            causal=rng.random() < 0.8, return_lse=rng.random() < 0.5,
            poison=rng.choice(("nan", "inf", "mixed")) if kv_dtype != FP8 else "nan", seed=rng.randrange(1 << 30)))
    return out


def visible_slots(page_table, lengths, num_new, kv_start, *, num_pages, page_size, causal, window_left):
    """bool [num_pages, page_size]: the slots some query row sees under the semantics (the rest may hold
    anything)."""
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b in range(page_table.shape[0]):
        length, n = int(lengths[b]), int(num_new[b])
        start = 0 if kv_start is None else int(kv_start[b])
        j = torch.arange(length)[None, :]
        c = (length - n + torch.arange(n))[:, None]  # each new row's causal limit
        ok = (j >= start) & ((j <= c) if causal else True)
        if window_left >= 0:
            ok = ok & (j >= c - window_left)
        seen = ok.any(0) if n else torch.zeros(length, dtype=torch.bool)
        j = torch.arange(length)[seen]
        used[page_table[b, j // page_size].long(), j % page_size] = True
    return used


def poison_unused(k_cache, v_cache, used, kv_layout, how, gen):
    """Writes NaN / +-Inf into every slot `used` leaves out, in both caches, in place."""
    for cache in (k_cache, v_cache):
        view = cache if kv_layout == "NHD" else cache.transpose(1, 2)  # [num_pages, page_size, Hkv, D]
        bad = torch.full(view.shape, float("nan"))
        if how != "nan":
            inf = torch.where(torch.rand(view.shape, generator=gen) < 0.5, float("inf"), float("-inf"))
            bad = inf if how == "inf" else torch.where(torch.rand(view.shape, generator=gen) < 0.5, bad, inf)
        view[~used] = bad[~used].to(cache.dtype)


def build(cfg: Config):
    """The config's arguments: (positional tensors, keyword options)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    hq, d, ps = cfg.hkv * cfg.group, cfg.head_dim, cfg.page_size
    num_pages = cfg.batch * cfg.max_pages + 2
    shape = (num_pages, ps, cfg.hkv, d) if cfg.kv_layout == "NHD" else (num_pages, cfg.hkv, ps, d)
    scale_up = 4.0 if cfg.kv_dtype == FP8 else 1.0
    if cfg.combined:
        kv = (torch.randn(num_pages, 2, *shape[1:], generator=gen) * scale_up).to(cfg.kv_dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = (torch.randn(shape, generator=gen) * scale_up).to(cfg.kv_dtype)
        v_cache = (torch.randn(shape, generator=gen) * scale_up).to(cfg.kv_dtype)
    page_table = torch.randperm(num_pages, generator=gen)[: cfg.batch * cfg.max_pages].reshape(cfg.batch, -1)
    cap = cfg.max_pages * ps
    cu = None
    if cfg.mode == "packed":
        num_new = torch.randint(0, max(1, cfg.q_len // cfg.batch) + 1, (cfg.batch,), generator=gen)
        num_new = num_new.clamp(max=cap)
        while int(num_new.sum()) > cfg.q_len:
            num_new[int(torch.argmax(num_new))] -= 1
        cu = torch.zeros(cfg.batch + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(num_new, 0)
        q = torch.randn(cfg.q_len, hq, d, generator=gen)
        q[int(cu[-1]):] = float("nan")  # padding rows hold garbage too
    else:
        num_new = torch.full((cfg.batch,), cfg.q_len)
        q = torch.randn(cfg.batch, cfg.q_len, hq, d, generator=gen)
    lengths = num_new + torch.randint(0, cap + 1, (cfg.batch,), generator=gen).clamp(max=cap - num_new)
    kv_start = None
    if cfg.kv_start:
        kv_start = (torch.rand(cfg.batch, generator=gen) * (lengths.float() * 0.7)).long().int()
    kw = dict(kv_layout=cfg.kv_layout, causal=cfg.causal, scale=cfg.scale, window_left=cfg.window_left,
              kv_start=kv_start, softcap=cfg.softcap)
    if cfg.sinks:
        kw["sinks"] = torch.randn(hq, generator=gen) * 2
    if cfg.descale != "none":
        shapes = {"scalar": (), "batch": (cfg.batch,), "batch_head": (cfg.batch, cfg.hkv)}[cfg.descale]
        kw["k_descale"] = torch.rand(shapes, generator=gen) * 0.5 + 0.1
        kw["v_descale"] = torch.rand(shapes, generator=gen) * 0.5 + 0.1
    used = visible_slots(page_table, lengths, num_new, kv_start, num_pages=num_pages, page_size=ps,
                         causal=cfg.causal, window_left=cfg.window_left)
    poison_unused(k_cache, v_cache, used, cfg.kv_layout, cfg.poison, gen)
    args = (q.to(cfg.q_dtype), k_cache, v_cache, page_table.int(), lengths.int(), cu)
    return args, kw


TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def check(cfg: Config, fn=None):
    args, kw = build(cfg)
    fn = fn or (lambda *a, **k: b12x.paged_attention(*a, **k))
    got = fn(*args, **kw, return_lse=cfg.return_lse)
    out, lse = got if cfg.return_lse else (got, None)
    ref_out, ref_lse = paged_attention_reference(*args, **kw)
    assert out.dtype == cfg.q_dtype and out.shape == args[0].shape, cfg
    assert torch.isfinite(out).all(), f"non-finite output: {cfg}"
    atol, rtol = TOL[cfg.q_dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=atol, rtol=rtol, msg=lambda m: f"{cfg}\nout: {m}")
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, atol=2e-4, rtol=2e-4, msg=lambda m: f"{cfg}\nlse: {m}")


EAGER = _configs(NUM_EAGER, seed=0)
COMPILED = _configs(NUM_COMPILED, seed=1)


def test_fuzz_covers_the_space():
    seen = lambda f: {getattr(c, f) for c in EAGER}  # noqa: E731
    assert seen("mode") == {"decode", "verify", "extend", "packed"}
    assert seen("q_dtype") == {torch.float32, torch.bfloat16, torch.float16} and FP8 in seen("kv_dtype")
    assert seen("descale") == {"none", "scalar", "batch", "batch_head"}
    assert seen("head_dim") == {64, 96, 128, 192, 256} and {1, 3, 16, 64} <= seen("page_size")
    assert seen("combined") == seen("causal") == seen("kv_start") == seen("sinks") == {True, False}
    assert seen("kv_layout") == {"NHD", "HND"} and seen("poison") == {"nan", "inf", "mixed"}


@pytest.mark.parametrize("part", range(8))
def test_fuzz_eager(part):
    for cfg in EAGER[part::8]:
        check(cfg)


def test_fuzz_eager_static_loops(monkeypatch):
    """Every 6th configuration with the loops CUDA runs (static tile count, the whole capacity, no host reads)."""
    from b12x_inductor.kernels import torch_impl

    monkeypatch.setattr(torch_impl, "HOST_BOUNDS", False)
    for cfg in EAGER[::6]:
        check(cfg)


def test_fuzz_compiled():
    def attend(*args, **kw):
        return b12x.paged_attention(*args, **kw)

    for cfg in COMPILED:
        torch._dynamo.reset()
        check(cfg, torch.compile(attend, backend="inductor", fullgraph=True, dynamic=False))
