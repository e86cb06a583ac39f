"""GPU fuzz of each kernel family against the reference, every cache slot no query row sees poisoned with NaN
or Inf (tests/test_fuzz.py's configurations and poisoning, on CUDA, with the family forced).

At least 500 configurations per family (Triton, CuTe DSL). A kernel compiles once per shape class (the
static sizes and the compile-time flags: mode, dtypes, layout, page size, head dim, groups, batch, capacity,
causal, window, softcap), so each family draws a fixed set of classes its `supports` accepts and many
runtime variants of each: fresh values, lengths, page orders, kv_start, window size, sinks, softcap value,
scale, descales, strided (combined) caches and the poison. The list is deterministic; a failure prints its
configuration. Each part prints a summary line (counted configurations, classes) for
benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

from tests import helpers
from tests.test_fuzz import FP8, Config, build
from tests.test_triton_kernels import check_close

pytestmark = pytest.mark.gpu

PER_FAMILY = int(os.environ.get("GPU_FUZZ_PER_FAMILY", "520"))  # fewer under compute-sanitizer
PARTS = 10
CLASSES = {"triton": 26, "cute": 20}


def _family_module(family):
    from b12x_inductor.kernels import cute, triton

    return {"triton": triton, "cute": cute}[family]


def _tensors(cfg: Config):
    """(t, options) of run_family for a configuration, on CUDA."""
    args, kw = build(cfg)
    q, k_cache, v_cache, page_table, lengths, cu = args
    dev = lambda x: None if x is None else x.cuda()  # noqa: E731
    t = dict(q=dev(q), k_cache=dev(k_cache), v_cache=dev(v_cache), page_table=dev(page_table),
             cache_seqlens=dev(lengths), cu_seqlens_q=dev(cu), kv_start=dev(kw.get("kv_start")),
             sinks=dev(kw.get("sinks")), k_descale=dev(kw.get("k_descale")), v_descale=dev(kw.get("v_descale")))
    options = dict(kv_layout=cfg.kv_layout, causal=cfg.causal, scale=cfg.scale, window_left=cfg.window_left,
                   softcap=cfg.softcap)
    return t, options


def _problem(t, options):
    from b12x_inductor import validate

    return validate.check_paged_attention(
        t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
        kv_layout=options["kv_layout"], causal=options["causal"], scale=options["scale"],
        window_left=options["window_left"], kv_start=t["kv_start"], sinks=t["sinks"], softcap=options["softcap"],
        k_descale=t["k_descale"], v_descale=t["v_descale"], out=None)


def _class(rng: random.Random, index: int) -> Config:
    """One shape class (its runtime fields are placeholders that `_variant` redraws)."""
    mode = ("decode", "verify", "extend", "packed")[index % 4]
    q_dtype = rng.choice((torch.bfloat16, torch.float16))
    kv_dtype = FP8 if rng.random() < 0.3 else q_dtype
    page_size = rng.choice((1, 5, 16, 16, 64, 64))
    head_dim = rng.choice((64, 128, 256, 96))
    hkv = rng.choice((1, 2, 4))
    group = rng.choice((1, 2, 4, 8) if mode in ("decode", "verify") else (1, 2, 4))
    batch = rng.randint(1, 4)
    q_len = {"decode": 1, "verify": rng.randint(2, 8), "extend": rng.randint(17, 150),
             "packed": rng.randint(8, 200)}[mode]
    keys = rng.choice((80, 300, 700, 1500)) if mode in ("decode", "verify") else rng.randint(q_len + 8, 400)
    return Config(
        index=index, mode=mode, q_dtype=q_dtype, kv_dtype=kv_dtype, descale="none",
        kv_layout=rng.choice(("NHD", "HND")), combined=False, page_size=page_size, head_dim=head_dim, hkv=hkv,
        group=group, batch=batch, q_len=q_len, max_pages=max(1, math.ceil(keys / page_size)), kv_start=False,
        window_left=rng.choice((-1, -1, 7)), sinks=False, softcap=rng.choice((0.0, 0.0, 20.0)),
        scale=None, causal=mode == "decode" or rng.random() < 0.85, return_lse=True, poison="nan", seed=0)


def _variant(cls: Config, rng: random.Random, index: int) -> Config:
    fp8 = cls.kv_dtype == FP8
    return dataclasses.replace(
        cls, index=index, seed=rng.randrange(1 << 30),
        descale=rng.choice(("none", "scalar", "batch", "batch_head")) if fp8 else "none",
        combined=rng.random() < 0.4, kv_start=rng.random() < 0.3, sinks=rng.random() < 0.3,
        window_left=rng.choice((0, 1, 7, 33, 200)) if cls.window_left >= 0 else -1,
        softcap=rng.choice((2.5, 20.0)) if cls.softcap > 0 else 0.0, scale=rng.choice((None, 0.05, 0.3)),
        poison=rng.choice(("nan", "inf", "mixed")) if not fp8 else "nan")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from helpers.one_thread()  # the reference runs on the CPU, one xdist worker per core


@pytest.fixture(scope="module")
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def configs(family: str, seed: int = 0) -> list[tuple[int, Config]]:
    """(class id, configuration) pairs: CLASSES[family] classes the family supports, PER_FAMILY in all."""
    module = _family_module(family)
    rng = random.Random(seed)
    classes, tried = [], 0
    while len(classes) < CLASSES[family]:
        cls = _class(rng, tried)
        tried += 1
        if module.supports(_problem(*_tensors(cls))):
            classes.append(cls)
    per_class = -(-PER_FAMILY // len(classes))
    return [(c, _variant(cls, rng, c * per_class + i)) for c, cls in enumerate(classes) for i in range(per_class)]


@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("family", ["triton", "cute"])
def test_gpu_fuzz(family, part, _cuda):
    if family == "cute" and not _family_module("cute").available():
        pytest.skip("nvidia-cutlass-dsl is not installed")
    all_configs = configs(family)
    mine = [(c, cfg) for c, cfg in all_configs if c % PARTS == part]  # one part compiles only its classes
    for _, cfg in mine:
        t, options = _tensors(cfg)
        out, lse, plan, _ = helpers.run_family(t, options, family)
        torch.cuda.synchronize()
        assert plan.family == family
        assert torch.isfinite(out).all(), f"non-finite output: {cfg} {plan}"
        ref_out, ref_lse = helpers_reference(t, options)
        check_close(out, lse, ref_out, ref_lse, what=f"{cfg} {plan}")
    classes = {c for c, _ in mine}
    print(f"\ngpu fuzz {family} part {part}: {len(mine)} configurations of {len(classes)} classes passed "
          f"({len(all_configs)} configurations in all for {family})")


def helpers_reference(t, options):
    from b12x_inductor.kernels.reference import paged_attention_reference

    return paged_attention_reference(**t, **options)
