"""The CuTe DSL family's kernels compile for sm_90a on a machine without a GPU (CI installs
nvidia-cutlass-dsl; the test skips where it is absent): every distinct kernel the family's plans emit over
a grid of problems (modes, head dims, groups, page sizes (TMA boxes or cp.async), dtypes, float8 caches,
causal, window, softcap, packed q). A DSL error, or a launch ABI that the fake arguments of `_compiled`
no longer match, fails here before any device time; so does a launch whose arguments `run` builds out of
the kernel's signature (`_abi`) wrongly."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
cute_dsl = pytest.importorskip("cutlass.cute")

from b12x_inductor.kernels import Options  # noqa: E402
from b12x_inductor.kernels import cute  # noqa: E402
from b12x_inductor.kernels.cute.plan import mla_narrow_tile  # noqa: E402
from b12x_inductor.plan import Problem, family_plan  # noqa: E402

F8 = torch.float8_e4m3fn


def _problem(**kw):
    base = dict(batch=4, q_len=1, packed=False, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                max_pages=256, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD", device_type="cuda",
                sm_count=132, capability=(9, 0))
    base.update(kw)
    base["max_pages"] = 4096 // base["page_size"]
    return Problem(**base)


def _cases():
    """(name, problem, plan, options): each kernel of the family (CUDA-core and tensor-core split kernels,
    extend) over its head dims, page sizes (1: cp.async only; 16 and 64: TMA boxes where the row allows),
    cache dtypes and layouts, with causal, window and softcap spread over them."""
    grid = []
    for d, page, fp8 in itertools.product((64, 128, 256), (1, 16, 64), (False, True)):
        grid.append((dict(head_dim=d, page_size=page, kv_dtype=F8 if fp8 else torch.bfloat16), {}))
    for d, page, fp8 in itertools.product((64, 128), (16, 64), (False, True)):
        grid.append((dict(head_dim=d, page_size=page, kv_dtype=F8 if fp8 else torch.bfloat16), dict(block_m=16)))
    for page, fp8 in itertools.product((16, 64), (False, True)):
        grid.append((dict(q_len=4, page_size=page, kv_dtype=F8 if fp8 else torch.float16, q_dtype=torch.float16), {}))
    for d, page, packed in itertools.product((64, 128), (1, 16, 64), (False, True)):
        grid.append((dict(q_len=512 if packed else 300, packed=packed, head_dim=d, page_size=page), {}))
    grid.append((dict(q_len=300, head_dim=256, page_size=16), {}))  # extend at D 256: 64-key tiles, 2 stages
    for page, packed in ((16, False), (1, True)):  # extend at D 64 in 192-row tiles (three consumer warpgroups)
        grid.append((dict(q_len=512 if packed else 300, packed=packed, head_dim=64, page_size=page),
                     dict(block_m=192, num_warps=16)))
    mla = dict(num_q_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512, v_in_k=True)
    seesaw = dict(block_n=64, num_stages=2, num_warps=8)  # mla_seesaw.py where the plan is mla.py
    # the two of 2 splits merge in their cluster (plan.mla_cluster_merge), as the third float8 one below does
    for q_len, heads, page, tiles in ((1, 128, 64, {}), (1, 16, 1, {}), (4, 16, 16, seesaw),
                                      (2, 128, 128, dict(seesaw, num_splits=1)), (4, 16, 8, {}),
                                      (1, 128, 64, dict(seesaw, num_splits=2)), (1, 16, 16, dict(num_splits=2)),
                                      (1, 128, 256, {})):  # pages of 256 keys: 64-key TMA boxes of one page
        grid.append((dict(mla, q_len=q_len, num_q_heads=heads, page_size=page), tiles))  # mla(_seesaw).py
    for q_len, heads, page, q_dtype, tiles in ((1, 16, 64, torch.bfloat16, {}), (4, 128, 1, torch.float16, {}),
                                               (2, 128, 64, torch.bfloat16, dict(num_splits=2))):
        grid.append((dict(mla, q_len=q_len, num_q_heads=heads, page_size=page, q_dtype=q_dtype, kv_dtype=F8), tiles))
    for q_len, heads, page, q_dtype, kv_dtype in ((1, 16, 64, torch.bfloat16, torch.bfloat16),
                                                   (2, 8, 1, torch.float16, torch.float16),
                                                   (1, 16, 16, torch.bfloat16, F8),
                                                   (1, 16, 256, torch.bfloat16, F8)):  # mla_narrow.py
        kw = dict(mla, q_len=q_len, num_q_heads=heads, page_size=page, q_dtype=q_dtype, kv_dtype=kv_dtype)
        grid.append((kw, mla_narrow_tile(_problem(**kw))))
    cases = []
    for i, (kw, tiles) in enumerate(grid):
        p = _problem(**kw, kv_layout="HND" if i % 2 else "NHD")
        assert cute.supports(p), p
        plan = family_plan(p, "cute", **tiles)
        options = Options(kv_layout=p.kv_layout, causal=i % 3 != 0, scale=0.1, window_left=63 if i % 4 == 1 else -1,
                          softcap=30.0 if i % 5 == 2 else 0.0)
        name = f"{plan.mode}-m{plan.block_m}-d{p.head_dim}-p{p.page_size}-{str(p.kv_dtype)[6:]}-{p.kv_layout}"
        cases.append((name + ("-packed" if p.packed else ""), p, plan, options))
    return cases


CASES = _cases()


def test_the_grid_reaches_every_kernel():
    modes = {(c[2].mode, c[2].block_m) for c in CASES}
    assert {("decode", 1), ("decode", 16), ("verify", 1), ("extend", 128), ("extend", 192)} <= modes, modes
    assert ("decode", 64) in modes and ("verify", 64) in modes  # mla.py, mla_seesaw.py
    assert {(c[2].block_m, c[2].num_warps) for c in CASES if c[2].v_from_k} == {(64, 8), (64, 12), (16, 12)}
    assert {c[1].page_size for c in CASES} == {1, 8, 16, 64, 128, 256}  # cp.async only, TMA boxes of 8 to 64
    clusters = {(c[2].num_warps, c[1].kv_dtype) for c in CASES if c[2].v_from_k and c[2].num_splits == 2
                and c[2].block_m == 64}  # the cluster merge (plan.mla_cluster_merge): seesaw, ring, float8 ring
    assert clusters == {(8, torch.bfloat16), (12, torch.bfloat16), (12, F8)}, clusters


@pytest.mark.parametrize("name,problem,plan,options", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_sm90a(name, problem, plan, options, monkeypatch):
    compile_ = cute_dsl.compile
    monkeypatch.setattr(cute_dsl, "compile", lambda *a, **k: compile_(*a, options="--gpu-arch sm_90a", **k))
    assert cute.compile_kernel(problem, plan, options) is not None


@pytest.mark.parametrize("kv_dtype,q_len,heads,splits", [(F8, 1, 16, 2), (torch.bfloat16, 2, 8, 3)],
                         ids=["float8_pair", "bf16_cluster3"])
def test_narrow_cluster_compiles_for_sm90a(kv_dtype, q_len, heads, splits, monkeypatch):
    """The narrow MLA kernel (mla_narrow.py) with its splits merged in their cluster (mla.py's _cluster_merge on
    its staged fp32 rows), which the plan takes up to MLA_NARROW_CLUSTER_SPLITS of (raised here)."""
    from b12x_inductor.kernels.cute import plan as cute_plan

    monkeypatch.setattr(cute_plan, "MLA_NARROW_CLUSTER_SPLITS", 8)
    compile_ = cute_dsl.compile
    monkeypatch.setattr(cute_dsl, "compile", lambda *a, **k: compile_(*a, options="--gpu-arch sm_90a", **k))
    p = _problem(num_q_heads=heads, num_kv_heads=1, head_dim=576, v_head_dim=512, v_in_k=True, q_len=q_len,
                 page_size=64, kv_dtype=kv_dtype)
    plan = family_plan(p, "cute", **mla_narrow_tile(p), num_splits=splits)
    assert plan.block_m == 16 and plan.scratch_bytes == 0, plan  # merged in the cluster: no partials
    options = Options(kv_layout="NHD", causal=True, scale=0.1, window_left=-1, softcap=30.0 if splits == 3 else 0.0)
    assert cute.compile_kernel(p, plan, options) is not None


def test_kernel_ptx_configurations_are_compile_keys(monkeypatch):
    """benchmarks/kernel_ptx.py (PTX of fixed configurations, to check a refactor without device time) hands its
    configurations to `_compiled`, `_compiled_extend` and `_compiled_mla` as their keys: each must unpack and make
    its kernel (cute.compile stubbed, so nothing compiles here). Keys that gained a field left it unusable twice."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_ptx.py"
    spec = importlib.util.spec_from_file_location("kernel_ptx", path)
    kernel_ptx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_ptx)
    made = []
    monkeypatch.setattr(cute_dsl, "compile", lambda kernel, *a, **k: made.append(type(kernel).__name__))
    build = {"split": cute._compiled, "extend": cute._compiled_extend, "mla": cute._compiled_mla}
    configs = kernel_ptx.cute_configs()
    for kind, key in configs:
        build[kind].__wrapped__(key)
    assert len(made) == len(configs)
    assert {"SplitKernel", "MmaSplitKernel", "ExtendKernel", "MlaSplitKernel", "MlaSeesawKernel",
            "MlaNarrowKernel"} <= set(made), made


def _inputs_on_sm90(kw: dict):
    """(tensors, Problem) of one call on the CPU (make_inputs with `kw` over a small GQA default), its Problem as an
    sm_90 GPU of 132 SMs would have it, so that the CuTe family plans it."""
    from b12x_inductor import validate
    from tests.test_triton_kernels import make_inputs

    t = make_inputs(**{**dict(d=128, hq=8, hkv=2, page_size=16, lens=[100, 70]), **kw})
    problem = validate.check_paged_attention(
        t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"], kv_layout="NHD",
        causal=True, scale=None, window_left=-1, kv_start=t["kv_start"], sinks=t["sinks"], softcap=0.0,
        k_descale=t["k_descale"], v_descale=t["v_descale"], q_pe=t["q_pe"], out=None)
    return t, dataclasses.replace(problem, device_type="cuda", capability=(9, 0), sm_count=132)


@pytest.mark.parametrize("case", ["decode", "decode_splits_sinks", "verify_fp8_features", "extend_sinks",
                                  "packed_kv_start", "mla_decode",
                                  "mla_verify_one_split", "mla_decode_q_pe", "mla_decode_narrow_fp8",
                                  "mla_decode_cluster", "mla_verify_seesaw_cluster",
                                  "mla_decode_narrow_fp8_cluster"])
def test_launch_arguments_follow_the_kernel_signature(case, monkeypatch):
    """`run` builds each launch by name from the kernel's `__call__` signature (`_abi`): every argument is
    there, in order, each scalar of its annotated type. The compiled kernel and the GPU are replaced by a
    check of the arguments, and the Triton merge kernel's launch by a check of its names against the kernel's
    parameters."""
    import contextlib
    from unittest import mock

    from b12x_inductor import kernels
    from b12x_inductor.kernels.cute.decode import SplitKernel
    from b12x_inductor.kernels.cute.extend import ExtendKernel
    from b12x_inductor.kernels.cute.plan import mla_narrow_tile
    from b12x_inductor.kernels.triton import decode as triton_decode

    launched = []

    def checking(kernel_class):
        def launch(*args):
            abi = cute._abi(kernel_class)
            assert len(args) == len(abi)
            for (name, ann), arg in zip(abi, args):
                if ann in ("Int32", "Int64", "Float32"):
                    assert type(arg).__name__ == ann, (name, ann, type(arg))
            launched.append(kernel_class.__name__)
        return launch

    monkeypatch.setattr(cute, "_compiled", lambda key: checking(SplitKernel))
    monkeypatch.setattr(cute, "_compiled_extend", lambda key: checking(ExtendKernel))
    monkeypatch.setattr(cute, "_compiled_mla", lambda key: checking(cute.mla_kernel_class(*key[-3:-1])))
    monkeypatch.setattr(cute, "_check_aligned", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: mock.MagicMock(cuda_stream=0))
    real_merge = triton_decode.merge_kernel

    class Merge:  # the merge launch's arguments checked against the Triton kernel's own parameters
        def __getitem__(self, grid):
            def launch(*args, num_warps, num_stages, **constants):
                assert list(real_merge.arg_names) == [*real_merge.arg_names[:len(args)], *constants], constants
                assert constants["DV"] == t["v_cache"].shape[-1], constants
                # the partials in out's dtype (q's), their LSEs fp32 (split_partials)
                assert (args[0].dtype, args[1].dtype) == (t["q"].dtype, torch.float32), (args[0].dtype, args[1].dtype)
                launched.append("merge")
            return launch

    monkeypatch.setattr(triton_decode, "merge_kernel", Merge())
    if case == "mla_decode_narrow_fp8_cluster":  # the narrow kernel's pair, merged in its cluster
        from b12x_inductor.kernels.cute import plan as cute_plan

        monkeypatch.setattr(cute_plan, "MLA_NARROW_CLUSTER_SPLITS", 2)
    mla = dict(d=576, dv=512, hq=16, hkv=1, v_view=True)
    kw = {"decode": dict(q_len=1), "decode_splits_sinks": dict(q_len=1, sinks=True, lens=[3000, 70]),
          "verify_fp8_features": dict(q_len=4, kv_start=True, descale="bh", kv_dtype=F8),
          "extend_sinks": dict(q_len=40, sinks=True), "packed_kv_start": dict(packed=True, kv_start=True),
          "mla_decode": dict(mla, q_len=1, sinks=True, lens=[3000, 70]),
          "mla_verify_one_split": dict(mla, q_len=4, kv_start=True),
          "mla_decode_q_pe": dict(mla, q_len=1, split_q=True, lens=[3000, 70]),
          "mla_decode_narrow_fp8": dict(mla, q_len=1, kv_dtype=F8, descale="b", lens=[3000, 70]),
          "mla_decode_narrow_fp8_cluster": dict(mla, q_len=1, kv_dtype=F8, descale="b", lens=[3000, 70]),
          "mla_decode_cluster": dict(mla, q_len=1, sinks=True, lens=[3000, 70]),
          "mla_verify_seesaw_cluster": dict(mla, q_len=4, kv_start=True, lens=[3000, 70])}[case]
    t, problem = _inputs_on_sm90(kw)
    seesaw = dict(block_n=64, num_stages=2, num_warps=8)
    tiles = {"mla_verify_one_split": dict(seesaw, num_splits=1), "mla_decode_narrow_fp8": mla_narrow_tile(problem),
             "mla_decode_narrow_fp8_cluster": dict(mla_narrow_tile(problem), num_splits=2),
             "mla_decode": dict(num_splits=16),  # past a cluster pair: partials and the merge kernel
             "mla_decode_cluster": dict(num_splits=2), "mla_verify_seesaw_cluster": dict(seesaw, num_splits=2)
             }.get(case, {})
    plan = family_plan(problem, "cute", **tiles)
    q = t["q"]
    kernels.run(kernels.Call(
        **{k: t[k] for k in kernels.Call.INPUTS}, out=q.new_empty(q.shape[:-1] + t["v_cache"].shape[-1:]),
        lse=torch.empty(q.shape[:-1]), scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8),
        options=Options.of(problem.head_dim, kv_layout="NHD", causal=True, scale=None, window_left=-1, softcap=0.0),
        plan=plan))
    expected = {"mla_decode": ["MlaSplitKernel", "merge"], "mla_verify_one_split": ["MlaSeesawKernel"],
                "mla_decode_narrow_fp8": ["MlaNarrowKernel", "merge"],
                "mla_decode_narrow_fp8_cluster": ["MlaNarrowKernel"],
                "mla_decode_q_pe": ["MlaSplitKernel", "merge"], "mla_decode_cluster": ["MlaSplitKernel"],
                "mla_verify_seesaw_cluster": ["MlaSeesawKernel"]}.get(
        case, ["ExtendKernel"] if plan.mode == "extend" else ["SplitKernel"] + ["merge"] * (plan.num_splits > 1))
    assert launched == expected
    assert case != "decode_splits_sinks" or plan.num_splits > 1, plan
    assert (plan.scratch_bytes == 0) == (launched[-1] != "merge"), plan  # a merge reads scratch, nothing else does


@pytest.mark.parametrize("case", ["decode_fp8_sinks", "decode_bf16_splits", "extend_kv_start", "mla_narrow_fp8"])
def test_runtime_launch_passes_what_the_dsl_call_would(case, monkeypatch):
    """`_runtime.launch` hands a compiled kernel the C pointers its Args marshalled once; the DSL's own call would
    marshal the same values again (`generate_execution_args`). For real kernels compiled for sm_90a (no GPU: the
    program's run is replaced by a capture), each pointer the launch passes must point at the bytes the DSL's would:
    the same device address, stream handle and scalar of the parameter's width."""
    import contextlib
    import ctypes
    from unittest import mock

    from b12x_inductor import kernels
    from b12x_inductor.kernels.cute import _runtime
    from b12x_inductor.kernels.triton import decode as triton_decode

    compile_ = cute_dsl.compile
    monkeypatch.setattr(cute_dsl, "compile", lambda *a, **k: compile_(*a, options="--gpu-arch sm_90a", **k))
    monkeypatch.setattr(cute, "_check_aligned", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: mock.MagicMock(cuda_stream=0x5A5A00))

    class Merge:
        def __getitem__(self, grid):
            return lambda *a, **k: captured.append("merge")

    monkeypatch.setattr(triton_decode, "merge_kernel", Merge())
    mla = dict(d=576, dv=512, hq=16, hkv=1, v_view=True)
    kw = {"decode_fp8_sinks": dict(q_len=1, kv_dtype=F8, descale="bh", sinks=True),
          "decode_bf16_splits": dict(q_len=1, lens=[3000, 70]),
          "extend_kv_start": dict(q_len=40, kv_start=True),
          "mla_narrow_fp8": dict(mla, q_len=1, kv_dtype=F8, descale="b", lens=[3000, 70])}[case]
    t, problem = _inputs_on_sm90(kw)
    tiles = {"decode_bf16_splits": dict(num_splits=4), "mla_narrow_fp8": mla_narrow_tile(problem)}.get(case, {})
    plan = family_plan(problem, "cute", **tiles)
    options = Options.of(problem.head_dim, kv_layout="NHD", causal=True, scale=None, window_left=-1, softcap=0.0)
    compiled = cute.compile_kernel(problem, plan, options)
    captured = []
    monkeypatch.setattr(compiled, "run_compiled_program", lambda exe: captured.append(list(exe)), raising=False)
    real_launch, real_args = _runtime.launch, cute._launch_args
    launched, classes = [], []
    monkeypatch.setattr(_runtime, "launch", lambda c, args: (launched.append(args), real_launch(c, args)))
    monkeypatch.setattr(cute, "_launch_args", lambda kc, values: (classes.append(kc), real_args(kc, values))[1])
    for name in ("_compiled", "_compiled_extend", "_compiled_mla"):
        monkeypatch.setattr(cute, name, lambda key: compiled)
    q = t["q"]
    kernels.run(kernels.Call(
        **{k: t[k] for k in kernels.Call.INPUTS}, out=q.new_empty(q.shape[:-1] + t["v_cache"].shape[-1:]),
        lse=torch.empty(q.shape[:-1]), scratch=torch.empty(plan.scratch_bytes, dtype=torch.uint8),
        options=options, plan=plan))
    assert _runtime._direct(compiled)
    assert len(launched) == 1 and isinstance(captured[0], list), captured
    assert captured[1:] == (["merge"] if plan.scratch_bytes else []), (plan, captured)  # partials: a merge
    assert case not in ("decode_bf16_splits", "mla_narrow_fp8") or plan.scratch_bytes, plan
    args = launched[0]
    ours = captured[0]
    theirs, _ = compiled.execution_args.generate_execution_args(tuple(a.value for a in args), {})
    assert len(ours) == len(theirs) == len(args)

    def address(p):
        return p.value if isinstance(p, ctypes.c_void_p) else int(p)

    widths = {"Int32": 4, "Int64": 8, "Float32": 4}
    for (name, ann), a, mine, dsl in zip(cute._abi(classes[0]), args, ours, theirs):
        width = widths.get(ann, 8)  # the parameter's width; pointers and the stream: a 64-bit address or handle
        assert ann not in widths or type(a.value).__name__ == ann, (name, ann, a.value)  # marshalled at its width
        assert ctypes.string_at(address(mine), width) == ctypes.string_at(address(dsl), width), (name, a.value)
    streams = [a for a in args if type(a.value).__name__ == "CUstream"]
    assert len(streams) == 1 and ctypes.c_uint64.from_address(address(streams[0].c)).value == 0x5A5A00


def test_runtime_launch_falls_back_to_the_call_where_it_cannot_drive_the_function():
    """`_runtime.launch` runs the marshalled pointers only on a function that takes them as its call would: no
    recorded spec to check, no full argument check, no slot that converts Python addresses. Anything else (or a
    function without `run_compiled_program`) is called with the values, which marshals them itself. `arg` takes
    one C pointer a value and refuses more."""
    import types

    from b12x_inductor.kernels.cute import _runtime

    class Compiled:  # what `_direct` reads of the DSL's JIT-compiled function
        def __init__(self, spec=None, full=False, specs=(None, None)):
            self._pyir_spec = spec
            self.execution_args = types.SimpleNamespace(_full_arg_check=full, _pointer_address_arg_specs=list(specs))
            self.ran, self.called = [], []

        def run_compiled_program(self, exe):
            self.ran.append(exe)

        def __call__(self, *values):
            self.called.append(values)

    class Plain:
        def __init__(self):
            self.called = []

        def __call__(self, *values):
            self.called.append(values)

    args = [_runtime.Arg("q", 10), _runtime.Arg("stride", 11)]
    for fn, direct in ((Compiled(), True), (Compiled(spec=object()), False), (Compiled(full=True), False),
                       (Compiled(specs=(None, True)), False)):
        _runtime.launch(fn, args)
        assert (fn.ran, fn.called) == (([[10, 11]], []) if direct else ([], [("q", "stride")]))
    plain = Plain()
    _runtime.launch(plain, args)
    assert plain.called == [("q", "stride")]

    class Two:
        def __c_pointers__(self):
            return [1, 2]

    with pytest.raises(TypeError, match="one C pointer"):
        _runtime.arg(Two())
