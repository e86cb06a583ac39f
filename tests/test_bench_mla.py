"""`python -m b12x_inductor.bench mla` on CPU (the dry run, kernels.DEVICE = "cpu"): every row through main
into a JSON with a b12x time and max error, the reference check catching a corrupted or unwritten output
(and the row then recording an error, untimed), and the FlashInfer peer's wiring against fakes of its MLA
wrapper that compute attention from the CSR metadata they are given (0.7's keyword form, with a backend
that refuses the ckv/kpe views and gets separate copies; the flat form of earlier versions, without fp8)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from b12x_inductor.bench import kernels, parse_sizes
from b12x_inductor.bench import mla as bench

TINY = ["--sizes", "2x128", "--heads", "4", "--page-size", "16"]
ROWS = ["decode H4 2x128", "verify S=4 H4 2x128", "decode-fp8 H4 2x128"]


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    """The dry run: kernels.DEVICE (read from B12X_BENCH_DEVICE at import; the MLA suite reads it at call
    time) is "cpu"; main's --page-size is undone afterwards; FlashInfer's workspace is not kept."""
    monkeypatch.setattr(kernels, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "PAGE", bench.PAGE)
    monkeypatch.setattr(bench, "_FI_WS", {})


def _run(tmp_path, *extra):
    bench.main(TINY + ["--out", str(tmp_path)] + list(extra))
    return json.loads((tmp_path / "mla_cpu.json").read_text())  # the default --tag: the device's


def test_dry_run_every_row(tmp_path, capsys):
    doc = _run(tmp_path, "--peers", "")
    assert [r["row"] for r in doc["rows"]] == ROWS
    for r in doc["rows"]:
        ours = r["impls"]["b12x"]
        assert ours["us"] > 0 and ours["max_err"] < 0.05 and ours["tflops"] > 0 and ours["tbps"] > 0, r
        assert ours["host_us"] > 0, r
        assert ours["plan"] == "torch 1:0:0 w0 m0", r  # the CPU family's plan (select_plan, as on the GPU)
        assert r["page_size"] == 16 and r["sets"] == 2
    assert doc["rows"][1]["q_len"] == 4 and doc["rows"][2]["kv_dtype"] == "float8_e4m3fn"
    assert doc["argv"][:2] == ["--sizes", "2x128"] and doc["shape"]["scale"] == 192**-0.5
    lines = doc["markdown"].splitlines()
    assert lines[0] == "| row | b12x us | TFLOP/s | TB/s | fa2 us | fa3 us | b12x vs best |"
    assert lines[2].startswith("| decode H4 2x128 | ") and lines[2].endswith(" | n/a | n/a | – |")
    out = capsys.readouterr().out
    assert "[decode-fp8 H4 2x128] b12x " in out and lines[0] in out and "% (torch 1:0:0 w0 m0)" in out


def test_rows_and_metrics():
    todo = bench.todo_rows({"decode", "verify", "fp8"}, [128, 16])
    assert len(todo) == 2 * 5 + 3
    assert todo[0] == ("decode", 1, 32768, 1, 128, torch.bfloat16) and todo[4][:5] == ("verify", 32, 4096, 4, 128)
    assert {t[4] for t in todo if t[5] == torch.float8_e4m3fn} == {16}
    assert bench.todo_rows({"fp8"}, [8])[0] == ("decode", 32, 4096, 1, 8, torch.float8_e4m3fn)
    assert bench.todo_rows({"decode"}, [16], parse_sizes("2x128,3x64")) == [
        ("decode", 2, 128, 1, 16, torch.bfloat16), ("decode", 3, 64, 1, 16, torch.bfloat16)]
    m = bench.row_metrics(2, 1024, 4, 16, torch.bfloat16, 1e6)  # one second
    assert m["tflops"] == pytest.approx(2 * 2 * 16 * 4 * 1024 * 1088 / 1e12)
    assert m["tbps"] == pytest.approx((2 * 1024 * 576 * 2 + 2 * 4 * 16 * 1088 * 2) / 1e12)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_reference_check_catches_bad_outputs(kv_dtype):
    bench.PAGE = 16
    s = bench.make_set(3, 64, 2, 16, kv_dtype, seed=3)
    refs = bench.reference_slices(s)
    assert [b for b, _, _ in refs] == [0, 2] and refs[0][2].shape == (1, 2, 8, 512)  # every second head
    call, out = bench.b12x_call(s)
    assert out.isnan().all()  # poisoned until written
    call()
    assert bench.check(refs, out, "b12x") < 0.05
    out[2, 1, 14, 7] += 1.0  # a checked head (14 = 7 x 2) of the last request
    with pytest.raises(AssertionError, match="max error"):
        bench.check(refs, out, "b12x")
    with pytest.raises(AssertionError):
        bench.check(refs, bench._poisoned_out(s), "unwritten")


def test_failed_check_is_an_error_never_timed(monkeypatch):
    bench.PAGE = 16
    real = bench.b12x_call

    def corrupted(s):
        call, out = real(s)

        def bad():
            call()
            out.mul_(2)
        return bad, out
    monkeypatch.setattr(bench, "b12x_call", corrupted)
    r = bench.run_row("decode", 2, 64, 1, 4, torch.bfloat16, set(), [], float("nan"))
    assert "max error" in r["impls"]["b12x"]["error"] and "us" not in r["impls"]["b12x"]


# ----------------------------------------------------------------------------------------------------------
# fakes of flashinfer.mla.BatchMLAPagedAttentionWrapper: attention computed from the plan's CSR metadata

def _attend(meta, cfg, q_nope, q_pe, ckv, kpe, out, ckv_scale, kpe_scale):
    qo, kv_indptr = meta["qo_indptr"].tolist(), meta["kv_indptr"].tolist()
    for b in range(len(qo) - 1):
        pages = meta["kv_indices"][kv_indptr[b]:kv_indptr[b + 1]].long()
        n = int(meta["kv_len_arr"][b])
        assert len(pages) == -(-n // cfg["page_size"])  # kv_indptr counts pages, kv_len tokens
        c = ckv[pages].reshape(-1, ckv.shape[-1])[:n].float() * ckv_scale
        p = kpe[pages].reshape(-1, kpe.shape[-1])[:n].float() * kpe_scale
        rows = slice(qo[b], qo[b + 1])
        logits = (torch.einsum("shd,nd->shn", q_nope[rows].float(), c)
                  + torch.einsum("shd,nd->shn", q_pe[rows].float(), p)) * cfg["sm_scale"]
        s = logits.shape[0]
        if cfg["causal"]:
            last = n - s + torch.arange(s)  # the new tokens are the last s keys
            logits = logits.masked_fill(torch.arange(n)[None, None, :] > last[:, None, None], float("-inf"))
        out[rows] = torch.einsum("shn,nd->shd", logits.softmax(-1), c).to(out.dtype)


class _Wrapper07:
    """0.7's form: plan(metadata=MLAPlanMetadata.csr(..), keywords), run(query=, kv_cache=, out=, scales);
    the "fa3" fake refuses non-contiguous ckv/kpe."""

    plans = []

    def __init__(self, workspace, backend="auto"):
        assert workspace.dtype == torch.uint8 and workspace.numel() == 128 * 2**20
        self.backend = backend

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout="packed", kv_cache_layout="packed", scale_mode="default"):
        assert (head_dim_ckv, head_dim_kpe, q_data_type) == (512, 64, torch.bfloat16)
        assert query_layout == kv_cache_layout == "split"
        assert (scale_mode == "kv-per-tensor") == (kv_data_type == torch.float8_e4m3fn)
        assert all(t.dtype == torch.int32 for t in metadata.values())
        self.meta = metadata
        self.cfg = dict(page_size=page_size, causal=causal, sm_scale=sm_scale, num_heads=num_heads,
                        kv_data_type=kv_data_type)
        _Wrapper07.plans.append((self.backend, self.cfg))

    def run(self, *, query, kv_cache, out=None, ckv_scale=None, kpe_scale=None):
        (q_nope, q_pe), (ckv, kpe) = query, kv_cache
        assert q_nope.dim() == 3 and q_nope.shape[1] == self.cfg["num_heads"] and ckv.dtype == self.cfg["kv_data_type"]
        fp8 = ckv.dtype == torch.float8_e4m3fn
        assert (ckv_scale is not None and kpe_scale is not None) == fp8
        if self.backend == "fa3" and not (ckv.is_contiguous() and kpe.is_contiguous()):
            raise ValueError("fake fa3: ckv/kpe must be contiguous")
        _attend(self.meta, self.cfg, q_nope, q_pe, ckv, kpe, out, ckv_scale or 1.0, kpe_scale or 1.0)
        return out


class _WrapperFlat:
    """The flat positional form of FlashInfer before 0.7: no KV scales, so no fp8."""

    def __init__(self, workspace, backend="auto"):
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self.meta = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        self.cfg = dict(page_size=page_size, causal=causal, sm_scale=sm_scale)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        _attend(self.meta, self.cfg, q_nope, q_pe, ckv_cache, kpe_cache, out, 1.0, 1.0)
        return out


def _fake_flashinfer(monkeypatch, wrapper, canonical):
    fi, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    fi.__version__, fi.mla = "0.7.0-fake", mla
    mla.BatchMLAPagedAttentionWrapper = wrapper
    if canonical:
        mla.MLAPlanMetadata = types.SimpleNamespace(csr=lambda qo_indptr, kv_indptr, kv_indices, kv_len_arr: dict(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr))
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)


def test_flashinfer_peer_on_a_fake_of_0_7(tmp_path, monkeypatch):
    _fake_flashinfer(monkeypatch, _Wrapper07, canonical=True)
    _Wrapper07.plans.clear()
    doc = _run(tmp_path)
    assert doc["versions"]["flashinfer"] == "0.7.0-fake" and doc["peers_skipped"] == {}
    for r in doc["rows"]:
        fa2, fa3 = r["impls"]["flashinfer-fa2"], r["impls"]["flashinfer-fa3"]
        assert fa2["us"] > 0 and fa2["max_err"] < 0.05 and fa2["kv_cache"] == "views of the 576 cache", r
        assert fa3["us"] > 0 and fa3["kv_cache"].startswith("separate contiguous ckv/kpe copies"), r
        assert r["speedup_vs_best_peer"] > 0
    assert {(b, c["causal"], c["page_size"], c["sm_scale"]) for b, c in _Wrapper07.plans} == {
        (b, causal, 16, 192**-0.5) for b in ("fa2", "fa3") for causal in (False, True)}
    assert doc["markdown"].splitlines()[2].endswith("x |")


def test_flashinfer_flat_form_has_no_fp8(tmp_path, monkeypatch):
    _fake_flashinfer(monkeypatch, _WrapperFlat, canonical=False)
    doc = _run(tmp_path, "--rows", "verify,fp8")
    verify, fp8 = doc["rows"]
    assert verify["impls"]["flashinfer-fa2"]["us"] > 0 and verify["impls"]["flashinfer-fa3"]["us"] > 0
    assert "no fp8 path" in fp8["impls"]["flashinfer-fa2"]["unsupported"] and "us" in fp8["impls"]["b12x"]
    lines = doc["markdown"].splitlines()
    assert lines[3].endswith(" | n/a | n/a | – |") and any("no fp8 path" in x for x in lines[4:])


def test_variants_parse_v_from_k(tmp_path):
    """--variants takes a last field "vk" (plan.v_from_k) beside the tile numbers; each variant is its own cell
    (on the CPU the Triton family cannot run, so the cell records that error, untimed)."""
    doc = _run(tmp_path, "--peers", "", "--rows", "decode", "--variants", "0:32:0:4,0:0:0:0:0:vk")
    cells = doc["rows"][0]["impls"]
    assert {"b12x", "b12x-triton-v0:32:0:4", "b12x-triton-v0:0:0:0:0:vk"} <= set(cells)
    assert "us" not in cells["b12x-triton-v0:0:0:0:0:vk"] and "error" in cells["b12x-triton-v0:0:0:0:0:vk"]
