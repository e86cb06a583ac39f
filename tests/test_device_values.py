"""Device values outside the contract: lengths past the page table's capacity or negative, page ids outside
the cache, kv_start outside [0, L], cu_seqlens_q past T. Every family clamps them on the device, without a
host sync, and returns the reference of the clamped values (kernels/reference.py, `clamp_to_contract`);
none touches memory outside its tensors.

CPU (CI): the torch family eagerly and under Inductor; the Triton kernels under TRITON_INTERPRET=1 in a
subprocess (before the clamps, each of these calls segfaulted there). GPU (`gpu`): the Triton and CuTe
families, also the calls `compute-sanitizer --tool memcheck` checks (benchmarks/results/h200_sanitizer.log).
write_kv: slots past the cache are skipped like negative ones.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

if __name__ == "__main__":  # the interpreter worker runs this file as a script, from the project root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from b12x_inductor.kernels.reference import clamp_to_contract, paged_attention_reference
from tests import helpers
from tests.test_triton_kernels import check_close, make_inputs

# (name, mode, make_inputs kwargs, what breaks the contract)
CASES = [
    ("length_past_capacity", "decode", dict(lens=[21, 30]), "lengths"),
    ("negative_length", "decode", dict(lens=[21, 30]), "negative_length"),
    ("page_id_negative", "decode", dict(lens=[21, 30]), "page_negative"),
    ("page_id_huge", "decode", dict(lens=[21, 30]), "page_huge"),
    ("page_id_int_min", "decode", dict(lens=[21, 30], kv_layout="HND"), "page_int_min"),
    ("kv_start_outside", "decode", dict(lens=[21, 30], kv_start=True), "kv_start"),
    ("verify_length_and_pages", "verify", dict(q_len=4, lens=[21, 30]), "lengths+pages"),
    ("extend_length_and_pages", "extend", dict(q_len=20, lens=[21, 30]), "lengths+pages"),
    ("packed_cu_past_t", "packed", dict(packed=True, lens=[21, 30], q_lens=[3, 9]), "cu_past_t"),
    ("packed_cu_negative", "packed", dict(packed=True, lens=[21, 30], q_lens=[3, 9]), "cu_negative"),
    ("packed_everything", "packed", dict(packed=True, lens=[21, 30], q_lens=[3, 9], kv_start=True), "all"),
]


def break_contract(t: dict, what: str, page_size: int) -> dict:
    """A copy of the inputs with the case's device values out of contract."""
    t = dict(t)
    pt, lens = t["page_table"].clone(), t["cache_seqlens"].clone()
    cap = pt.shape[1] * page_size
    if what in ("lengths", "lengths+pages", "all"):
        lens[0] = cap + 7
        lens[1] = 3 * cap
    if what == "negative_length":
        lens[0] = -5
    if what in ("page_negative", "lengths+pages", "all"):
        pt[0, 1] = -100000
    if what in ("page_huge", "lengths+pages", "all"):
        pt[1, 0] = 2**30
    if what == "page_int_min":
        pt[0, 0], pt[1, -1] = -(2**31), 2**31 - 1
    if what in ("kv_start", "all"):
        t["kv_start"] = torch.tensor([-4, int(lens[1]) + 3], dtype=torch.int32, device=lens.device)
    if t["cu_seqlens_q"] is not None and what in ("cu_past_t", "cu_negative", "all"):
        cu = t["cu_seqlens_q"].clone()
        if what in ("cu_past_t", "all"):
            cu[-1] = t["q"].shape[0] + 9
        if what == "cu_negative":
            cu[0] = -5
        t["cu_seqlens_q"] = cu
    t["page_table"], t["cache_seqlens"] = pt, lens
    return t


def clamped_reference(t: dict, options: dict):
    """The reference of the values the kernels clamp `t`'s device values to."""
    page_size = t["k_cache"].shape[1] if options["kv_layout"] == "NHD" else t["k_cache"].shape[2]
    pt, lens, cu, kv_start = clamp_to_contract(
        t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"], t["kv_start"], num_pages=t["k_cache"].shape[0],
        page_size=page_size, num_tokens=t["q"].shape[0])
    return paged_attention_reference(**dict(t, page_table=pt, cache_seqlens=lens, cu_seqlens_q=cu, kv_start=kv_start),
                                     **options)


def case_inputs(name: str, device: str, dtype=torch.bfloat16, page_size=4, d=64):
    _, mode, kw, what = next(c for c in CASES if c[0] == name)
    kw = dict(kw, hq=8, hkv=2, d=d, page_size=page_size, dtype=dtype, device=device, seed=len(name))
    t = make_inputs(**kw)
    options = dict(kv_layout=kw.get("kv_layout", "NHD"), causal=True, scale=0.9 * d**-0.5, window_left=-1,
                   softcap=0.0)
    return mode, break_contract(t, what, page_size), options


def _public(t: dict, options: dict, fn=None):
    import b12x_inductor as b12x

    fn = fn or b12x.paged_attention
    return fn(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
              kv_start=t["kv_start"], sinks=t["sinks"], k_descale=t["k_descale"], v_descale=t["v_descale"],
              return_lse=True, **options)


# ----------------------------------------------------------------------------------------------------------
# CPU: the torch family, eager and compiled


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_torch_family_clamps(name, monkeypatch):
    monkeypatch.delenv("B12X_DEBUG", raising=False)
    _, t, options = case_inputs(name, "cpu", dtype=torch.float32)
    out, lse = _public(t, options)
    check_close(out, lse, *clamped_reference(t, options), what=name)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_torch_family_clamps_without_host_reads(name, monkeypatch):
    """The CUDA path of the torch family (static loops over the whole capacity, no host reads)."""
    from b12x_inductor.kernels import torch_impl

    monkeypatch.setattr(torch_impl, "HOST_BOUNDS", False)
    _, t, options = case_inputs(name, "cpu", dtype=torch.float32)
    out, lse = _public(t, options)
    check_close(out, lse, *clamped_reference(t, options), what=name)


@pytest.mark.parametrize("name", ["length_past_capacity", "page_id_huge", "packed_everything"])
def test_torch_family_clamps_compiled(name):
    import b12x_inductor as b12x

    torch._dynamo.reset()
    _, t, options = case_inputs(name, "cpu", dtype=torch.float32)
    fn = torch.compile(lambda *a, **k: b12x.paged_attention(*a, **k), backend="inductor", fullgraph=True)
    out, lse = _public(t, options, fn)
    check_close(out, lse, *clamped_reference(t, options), what=name)


@pytest.mark.parametrize("name", ["length_past_capacity", "page_id_huge", "kv_start_outside", "packed_cu_past_t"])
def test_debug_raises_for_the_same_values(name, monkeypatch):
    import b12x_inductor as b12x  # noqa: F401

    monkeypatch.setenv("B12X_DEBUG", "1")
    _, t, options = case_inputs(name, "cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="^paged_attention: (cache_seqlens|page_table|kv_start|cu_seqlens_q)"):
        _public(t, options)


def test_write_kv_skips_slots_past_the_cache():
    """Slots >= num_pages * page_size are skipped, as negative ones are (B12X_DEBUG=1 raises for them)."""
    import b12x_inductor as b12x

    k_cache, v_cache = torch.randn(5, 4, 2, 64), torch.randn(5, 4, 2, 64)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    b12x.write_kv(k, v, k_cache, v_cache, torch.tensor([3, 20, 2**40, 7]))
    expect_k, expect_v = before_k.clone(), before_v.clone()
    expect_k[0, 3], expect_v[0, 3] = k[0], v[0]
    expect_k[1, 3], expect_v[1, 3] = k[3], v[3]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


# ----------------------------------------------------------------------------------------------------------
# CPU: the Triton kernels under the interpreter (subprocess)

def _interpreter_worker() -> None:
    from b12x_inductor.kernels import triton as tk

    results = {}
    for name, mode, _, _ in CASES:
        try:
            _, t, options = case_inputs(name, "cpu")
            splits = 2 if mode != "extend" and mode != "packed" else 1
            call = helpers.direct_call(t, "extend" if mode == "packed" else mode, options,
                                       dict(num_splits=splits, block_m=16, block_n=16, num_warps=4, num_stages=2))
            tk.run(call)
            check_close(call.out, call.lse, *clamped_reference(t, options), what=name)
            results[name] = "ok"
        except Exception as e:  # reported per case by the parent test
            results[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def interpreter_report():
    return helpers.interpreter_worker_report(__file__)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check for CPU machines; the GPU tests run the kernels")
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_triton_interpreter_clamps(interpreter_report, name):
    assert interpreter_report.get(name) == "ok", interpreter_report.get(name)


# ----------------------------------------------------------------------------------------------------------
# GPU: the Triton and CuTe families


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["triton", "cute"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_gpu_families_clamp(name, page_size, d, family):
    """Page sizes 16 and 64 with D 64 and 128 take the CuTe kernels' TMA paths as well as cp.async."""
    from b12x_inductor.kernels import cute

    if family == "cute" and not cute.available():
        pytest.skip("nvidia-cutlass-dsl is not installed")
    _, t, options = case_inputs(name, "cuda", page_size=page_size, d=d)
    out, lse, plan, _ = helpers.run_family(t, options, family)
    torch.cuda.synchronize()
    check_close(out, lse, *clamped_reference(t, options), what=f"{name} {plan}")


if __name__ == "__main__" and "--triton-interpreter-worker" in sys.argv:
    _interpreter_worker()
