"""`python -m b12x_inductor.bench [kernels]` on the CPU (B12X_BENCH_DEVICE=cpu, a dry run): the rows and their
labels (the default rows' must stay comparable with earlier runs), the model-shaped rows (window, sinks, GQA
7, head dims 64 and 256) through main on tiny sizes, the reference check (window and sinks included: an
output that drops either fails it) and the bytes/FLOPs counted for windowed rows."""

from __future__ import annotations

import json

import pytest
import torch

from b12x_inductor.bench import kernels, parse_sizes
from b12x_inductor.bench import mla as mla_bench

# the default groups' labels as earlier runs printed them (benchmarks/results/kernels_h200.json), the verify rows
# at S=2 and S=8 (added later) after the S=4 ones
DEFAULT_LABELS = [
    "decode 1x32768", "decode 8x8192", "decode 32x4096", "decode 64x2048", "decode 128x1024", "decode 16x16384",
    "verify 8x8192", "verify 32x4096", "verify 64x2048",
    "verify S=2 8x8192", "verify S=2 32x4096", "verify S=2 64x2048",
    "verify S=8 8x8192", "verify S=8 32x4096", "verify S=8 64x2048",
    "extend 4x4096", "extend 1x16384",
    "decode-fp8 1x32768", "decode-fp8 8x8192", "decode-fp8 32x4096", "decode-fp8 64x2048", "decode-fp8 128x1024",
    "decode-fp8 16x16384",
]
MODEL_LABELS = [
    "gpt-oss swa128 decode 32x4096", "gpt-oss swa128 decode 8x16384", "gpt-oss swa128 verify 32x4096",
    "gpt-oss full decode 32x4096", "gpt-oss full decode 8x16384", "gpt-oss full verify 32x4096",
    "gemma D256 decode 32x4096", "gemma D256 decode 8x8192", "gemma D256 extend 4x4096",
    "qwen2 gqa7 decode 32x4096", "qwen2 gqa7 decode 8x8192", "qwen2 gqa7 decode 1x32768",
    "llama3-70b gqa8 decode 32x4096", "llama3-70b gqa8 verify 32x4096",
]


@pytest.fixture
def cpu_bench(monkeypatch):
    """The module's state as a CPU dry run sees it; monkeypatch restores DEVICE and PROFILE (main sets it)."""
    monkeypatch.setattr(kernels, "DEVICE", "cpu")
    monkeypatch.setattr(kernels, "PROFILE", False)
    return kernels


def test_default_rows_unchanged():
    rows = kernels.build_rows("decode,verify,extend,fp8".split(","))
    assert [r.label for r in rows] == DEFAULT_LABELS
    assert {r.shape for r in rows} == {kernels.Shape(hq=32, hkv=8, d=128, page=16, window_left=-1, sinks=False)}
    assert [r.q_len for r in rows if r.mode == "verify"] == [4, 4, 4, 2, 2, 2, 8, 8, 8]
    assert [r.q_len for r in rows if r.mode == "extend"] == [4096, 16384]
    assert kernels.DEFAULT_ROWS.split(",") == ["decode", "verify", "extend", "fp8", "models"]
    # --head-dim changes the default rows only (and says so in their labels); --page-size every row
    d64 = kernels.build_rows(["decode", "models"], kernels.Shape(d=64), page=32)
    assert d64[0].label == "decode 1x32768 D64" and d64[0].shape.d == 64
    assert [r.label for r in d64[6:]] == MODEL_LABELS
    assert {r.shape.page for r in d64} == {32}


def test_model_rows():
    rows = kernels.build_rows(kernels.DEFAULT_ROWS.split(","))
    assert [r.label for r in rows] == DEFAULT_LABELS + MODEL_LABELS
    by_label = {r.label: r for r in rows}
    swa, full = by_label["gpt-oss swa128 verify 32x4096"], by_label["gpt-oss full decode 8x16384"]
    assert (swa.shape.hq, swa.shape.hkv, swa.shape.d, swa.shape.window_left, swa.shape.sinks) == (64, 8, 64, 127, True)
    assert swa.q_len == 4 and (full.shape.window_left, full.shape.sinks) == (-1, True)
    gemma = by_label["gemma D256 extend 4x4096"]
    assert (gemma.shape.hq, gemma.shape.hkv, gemma.shape.d, gemma.q_len) == (16, 8, 256, 4096)
    qwen = by_label["qwen2 gqa7 decode 1x32768"]
    assert (qwen.shape.hq, qwen.shape.hkv, qwen.shape.d, qwen.shape.window_left) == (28, 4, 128, -1)
    nosinks = kernels.build_rows(["nosinks"])
    assert [r.label for r in nosinks] == [f"{x} (no sinks)" for x in MODEL_LABELS[:6]]
    assert not any(r.shape.sinks for r in nosinks) and nosinks[0].shape.window_left == 127
    with pytest.raises(ValueError, match="unknown --rows"):
        kernels.build_rows(["decode", "model"])
    assert kernels.MODELS == ("gpt-oss", "gemma", "qwen2", "llama3-70b")
    only = kernels.build_rows(["decode", "models", "nosinks"], models=["gpt-oss"])  # default rows stay
    assert [r.label for r in only] == (DEFAULT_LABELS[:6] + MODEL_LABELS[:6]
                                       + [f"{x} (no sinks)" for x in MODEL_LABELS[:6]])
    assert [r.label for r in kernels.build_rows(["models"], models=["qwen2", "gemma"])] == MODEL_LABELS[6:12]
    with pytest.raises(ValueError, match="unknown --models"):
        kernels.build_rows(["models"], models=["llama"])


def test_dry_run_main(cpu_bench, tmp_path):
    """main on tiny sizes: every model row and one default group, b12x timed and checked, SDPA timed where it
    can run and n/a (with its reason) where the row has sinks."""
    argv = ["--rows", "models,verify", "--sizes", "2x256", "--peers", "sdpa", "--out", str(tmp_path), "--tag", "t"]
    cpu_bench.main(argv)
    doc = json.loads((tmp_path / "kernels_t.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    expected = [r.label for r in kernels.build_rows(["models", "verify"], sizes=[(2, 256)])]
    assert list(rows) == expected and "verify 2x256" in rows and "gpt-oss swa128 decode 2x256" in rows
    assert len(expected) == 12  # the sizes collapse onto 2x256: one row per model shape and mode, and per verify S
    assert [rows[f"verify {s}2x256"]["q_len"] for s in ("", "S=2 ", "S=8 ")] == [4, 2, 8]
    sweep = [r.label for r in kernels.build_rows(["decode", "fp8"], sizes=parse_sizes("2x256,3x128"))]
    assert sweep == ["decode 2x256", "decode-fp8 2x256", "decode 3x128", "decode-fp8 3x128"], sweep
    for bad in ("2x", "2x256,3", "0x64", "2x64x1", "ax64"):  # a bad --sizes names the option, kernels and mla
        with pytest.raises(ValueError, match="--sizes: expected BxL"):
            parse_sizes(bad)
        with pytest.raises(SystemExit, match="--sizes"):
            cpu_bench.main(["--sizes", bad, "--out", str(tmp_path)])
        with pytest.raises(SystemExit, match="--sizes"):
            mla_bench.main(["--sizes", bad, "--out", str(tmp_path)])
    for label, r in rows.items():
        ours = r["impls"]["b12x"]
        assert ours["us"] > 0 and ours["max_err"] < 0.05 and ours["method"] == "wall (cpu dry run)", label
        assert ours["host_us"] > 0, label
        assert set(r["shape"]) == {"hq", "hkv", "d", "page_size", "window_left", "sinks"}
        assert (r["batch"], r["kv_len"]) == (2, 256)
        sdpa = r["impls"]["sdpa"]
        if r["shape"]["sinks"]:
            assert sdpa == {"na": "n/a: SDPA takes no attention sinks"}, label
        else:
            assert sdpa["us"] > 0 and sdpa["max_err"] < 0.05, label
    swa = rows["gpt-oss swa128 decode 2x256"]
    assert swa["model"] == "gpt-oss swa128" and swa["shape"] == dict(hq=64, hkv=8, d=64, page_size=16,
                                                                        window_left=127, sinks=True)
    gemma = rows["gemma D256 extend 2x256"]
    assert gemma["q_len"] == 256 and "tflops" in gemma["impls"]["b12x"]
    assert rows["qwen2 gqa7 decode 2x256"]["shape"]["hq"] == 28
    assert rows["llama3-70b gqa8 verify 2x256"]["q_len"] == 4
    assert rows["verify 2x256"]["model"] == "" and rows["verify 2x256"]["shape"]["d"] == 128
    assert doc["shape"] == dict(hq=32, hkv=8, d=128, page_size=16)


def test_dry_run_packed_extend(cpu_bench, tmp_path):
    """--packed: extend rows also time b12x-packed (q packed [B x S, Hq, D] with cu_seqlens_q), checked against
    the reference like b12x; decode and verify rows do not time it."""
    argv = ["--rows", "extend,verify", "--sizes", "2x128", "--head-dim", "64", "--peers", "", "--packed",
            "--out", str(tmp_path), "--tag", "p"]
    cpu_bench.main(argv)
    rows = {r["row"]: r for r in json.loads((tmp_path / "kernels_p.json").read_text())["rows"]}
    packed = rows["extend 2x128 D64"]["impls"]["b12x-packed"]
    assert packed["us"] > 0 and packed["max_err"] < 0.05 and "tflops" in packed
    assert "b12x-packed" not in rows["verify 2x128 D64"]["impls"]


def test_dry_run_packed_families_and_variants(cpu_bench, tmp_path, monkeypatch):
    """--packed with --families and --variants: each family's and variant's plan also runs on the packed q
    (b12x-packed-<family>, b12x-packed-<variant>), with cu_seqlens_q and the variant's tiles asked of
    family_plan, each checked against the reference; decode rows get no packed cells. (The torch family has no
    tiles: the spy records the variant's and plans without them.)"""
    from b12x_inductor import plan as plan_mod

    asked = []
    real_family_plan = plan_mod.family_plan

    def spy(problem, family, **tiles):
        asked.append((problem.packed, family, tiles))
        return real_family_plan(problem, family)

    monkeypatch.setattr(plan_mod, "family_plan", spy)
    argv = ["--rows", "extend,decode", "--sizes", "2x128", "--head-dim", "64", "--peers", "", "--packed",
            "--families", "torch", "--variants", "torch:0:32:0:0", "--out", str(tmp_path), "--tag", "pv"]
    cpu_bench.main(argv)
    rows = {r["row"]: r for r in json.loads((tmp_path / "kernels_pv.json").read_text())["rows"]}
    impls = rows["extend 2x128 D64"]["impls"]
    for name in ("b12x-torch", "b12x-packed-torch", "b12x-torch-v0:32:0:0", "b12x-packed-torch-v0:32:0:0"):
        assert impls[name]["us"] > 0 and impls[name]["max_err"] < 0.05, (name, impls[name])
    assert (True, "torch", {"block_n": 32}) in asked and (False, "torch", {"block_n": 32}) in asked
    assert (True, "torch", {}) in asked
    assert not any(n.startswith("b12x-packed") for n in rows["decode 2x128 D64"]["impls"])


def test_dry_run_packed_batch_pads_to_max_batch(cpu_bench, tmp_path, monkeypatch):
    """--packed-batch M: b12x-packed runs with cu_seqlens_q [M + 1], the page table [M, pages] and the lengths
    [M] (the requests past B empty, as the serving engine pads to its max_batch), and still matches the
    reference."""
    seen = []
    real = cpu_bench._op_call

    def spy(s, shape, q, out, cu_seqlens_q=None, page_table=None, seqlens=None):
        if cu_seqlens_q is not None:
            seen.append((cu_seqlens_q.tolist(), tuple(page_table.shape), seqlens.tolist()))
        return real(s, shape, q, out, cu_seqlens_q, page_table=page_table, seqlens=seqlens)

    monkeypatch.setattr(cpu_bench, "_op_call", spy)
    argv = ["--rows", "extend", "--sizes", "2x128", "--head-dim", "64", "--peers", "", "--packed-batch", "5",
            "--out", str(tmp_path), "--tag", "pb"]
    cpu_bench.main(argv)
    rows = {r["row"]: r for r in json.loads((tmp_path / "kernels_pb.json").read_text())["rows"]}
    packed = rows["extend 2x128 D64"]["impls"]["b12x-packed"]
    assert packed["us"] > 0 and packed["max_err"] < 0.05
    cu, pt_shape, lens = seen[0]
    assert cu == [0, 128, 256, 256, 256, 256] and pt_shape[0] == 5 and lens[2:] == [0, 0, 0] and min(lens[:2]) > 0


@pytest.mark.parametrize("shape,mode,q_len", [(kernels.GPT_OSS_SWA, "decode", 1), (kernels.GPT_OSS_FULL, "verify", 4)])
def test_reference_check_sees_window_and_sinks(cpu_bench, shape, mode, q_len):
    """The check passes b12x's output and fails a corrupted one, one without the sinks and one without the
    window: a peer that dropped either could not pass."""
    import b12x_inductor as b12x

    s = kernels.make_set(shape, mode, 2, 256, q_len, torch.bfloat16, seed=3)
    refs = kernels.reference_slices(s, shape, mode)
    call, out = kernels.b12x_call(s, shape, mode)
    call()
    assert kernels.reference_check(refs, out(), "b12x") < 0.05
    bad = out().clone()
    bad[-1, -1, 5, 7] += 1.0
    with pytest.raises(AssertionError, match="against the reference"):
        kernels.reference_check(refs, bad, "corrupted")
    args = (s["q"], s["k_cache"], s["v_cache"], s["page_table"], s["cache_seqlens"])
    no_sinks = b12x.paged_attention(*args, window_left=shape.window_left)
    with pytest.raises(AssertionError, match="against the reference"):
        kernels.reference_check(refs, no_sinks, "no sinks")
    if shape.window_left >= 0:
        no_window = b12x.paged_attention(*args, sinks=s["sinks"])
        with pytest.raises(AssertionError, match="against the reference"):
            kernels.reference_check(refs, no_window, "no window")


def test_windowed_metrics():
    us = 1e6  # one second: TB/s * 1e12 = bytes, TFLOP/s * 1e12 = FLOPs
    bf16 = torch.bfloat16
    # the default rows as before: all L keys
    tb = kernels.row_metrics(kernels.Shape(), "decode", 8, 8192, 1, bf16, us)["tbps"] * 1e12
    assert tb == pytest.approx(8 * 8192 * 8 * 128 * 2 * 2 + 2 * 8 * 1 * 32 * 128 * 2)
    # decode over a window of 128: min(L, window_left + 1) keys a request
    tb = kernels.row_metrics(kernels.GPT_OSS_SWA, "decode", 32, 4096, 1, bf16, us)["tbps"] * 1e12
    assert tb == pytest.approx(32 * 128 * 8 * 64 * 2 * 2 + 2 * 32 * 1 * 64 * 64 * 2)
    # verify S=4: the four windows together, 131 keys
    tb = kernels.row_metrics(kernels.GPT_OSS_SWA, "verify", 32, 4096, 4, bf16, us)["tbps"] * 1e12
    assert tb == pytest.approx(32 * 131 * 8 * 64 * 2 * 2 + 2 * 32 * 4 * 64 * 64 * 2)
    tb = kernels.row_metrics(kernels.GPT_OSS_SWA, "decode", 2, 64, 1, bf16, us)["tbps"] * 1e12  # L < window
    assert tb == pytest.approx(2 * 64 * 8 * 64 * 2 * 2 + 2 * 2 * 64 * 64 * 2)
    # extend: the causal triangle as before; with a window each query's min(position + 1, window + 1) keys
    fl = kernels.row_metrics(kernels.GEMMA_D256, "extend", 4, 4096, 4096, bf16, us)["tflops"] * 1e12
    assert fl == pytest.approx(4 * 4 * 16 * 256 * (4096 * 4096 - 4096 * 4096 / 2))
    fl = kernels.row_metrics(kernels.GPT_OSS_SWA, "extend", 1, 300, 300, bf16, us)["tflops"] * 1e12
    pairs = sum(range(1, 129)) + (300 - 128) * 128
    assert fl == pytest.approx(4 * 1 * 64 * 64 * pairs)


def test_peers_for_sink_rows():
    """FlashInfer on a sink row: the plain wrappers recorded n/a (they would drop the sinks), the sink wrapper
    as flashinfer-sink-fa2/-fa3; SDPA and Flex listed (they raise Unable for sinks)."""
    everyone = {"flashinfer", "sdpa", "flex"}
    names = [n for n, _ in kernels.peers_for(kernels.GPT_OSS_SWA, "decode", torch.bfloat16, everyone)]
    assert names == ["flashinfer", "flashinfer-sink-fa2", "flashinfer-sink-fa3", "sdpa", "flex"]
    names = [n for n, _ in kernels.peers_for(kernels.GPT_OSS_FULL, "verify", torch.bfloat16, {"flashinfer"})]
    assert names == ["flashinfer-fa2", "flashinfer-fa3", "flashinfer-sink-fa2", "flashinfer-sink-fa3"]
    names = [n for n, _ in kernels.peers_for(kernels.GEMMA_D256, "decode", torch.bfloat16, {"flashinfer"})]
    assert names == ["flashinfer"]
    with pytest.raises(kernels.Unable, match="ignore sinks"):
        kernels.flashinfer_call(None, kernels.GPT_OSS_SWA, "decode")


def test_device_tag_names_results_after_the_device():
    """The default --tag of the suites: a run on an H100 never writes over the H200's result files."""
    from b12x_inductor.bench import device_tag

    assert device_tag("NVIDIA H200") == "h200" and device_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert device_tag("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090" and device_tag("cpu") == "cpu"


@pytest.mark.gpu
def test_gpu_time_graph(monkeypatch):
    """time_graph on the GPU: calls that capture are timed from CUDA graphs, a call that cannot be captured (it
    waits on the host) eagerly, and says so. Each call reads and writes 128 MB, so a time per call below what
    10 TB/s (more than any GPU's memory gives) would take means the timed replays did not run it."""
    monkeypatch.setattr(kernels, "DEVICE", "cuda")
    x = torch.randn(1 << 25, device="cuda")  # 128 MB
    floor_us = 2 * x.numel() * x.element_size() / 10e12 * 1e6

    def call():
        torch.neg(x, out=x)

    us, method = kernels.time_graph([call, call], target_ms=2.0, replays=3)
    assert method == "graph" and floor_us < us < 1e5, (us, floor_us)
    us1, _ = kernels.time_graph([call], target_ms=2.0, replays=3)
    assert floor_us < us1 < 1e5, (us1, floor_us)

    def syncs():
        torch.neg(x, out=x)
        x[0].item()  # a host wait: capture fails

    us2, method2 = kernels.time_graph([syncs], target_ms=2.0, replays=3)
    assert method2.startswith("eager") and floor_us < us2 < 1e5, (method2, us2)
