"""The Triton kernel family (CUDA): decode/verify (split-KV with GQA packing, decode.py) and extend (extend.py).

`FAMILY` is its KernelFamily (kernels/__init__.py); its plans are in plan.py. `run` launches the plan's kernels on torch's current stream and writes only `out`, `lse` and the plan's
`scratch`: no allocation, no host sync, lengths read on the device, so it is CUDA-graph safe. `precompile`
compiles the same kernels ahead from the static Problem (Triton's `warmup`), so that no JIT compile happens
inside a capture. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests use this); the
interpreter's bf16/fp16 `tl.dot` is wrong on CPU, so there the products run in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from typing import NamedTuple

import torch

from b12x_inductor.plan import FP8, Q_DTYPES_CUDA, head_dims_supported, next_pow2, partials_bytes, prev_pow2
from b12x_inductor.validate import cache_dims

from . import plan as _plan


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Compute capabilities the GPU tests (tests/test_triton_kernels.py -m gpu) have run and passed on: the H200.
VERIFIED_CAPABILITIES = frozenset({(9, 0)})
# The kernels are plain Triton, so they run on every CUDA GPU Triton generates code for from sm80 on: sm80/86/87
# (A100, A10, RTX 30), sm89 (L40, RTX 40), sm90 (H100/H200), sm100/103 (B200/B300), sm110, sm120/121 (RTX 50,
# DGX Spark). CI compiles every tile configuration the plans emit for sm80, sm89, sm90, sm100 and sm120
# (tests/test_triton_compile_targets.py) without a GPU; only sm90 has run them.
MIN_CAPABILITY = (8, 0)
MAX_MAJOR = 12
# float8_e4m3fn caches need a native e4m3 conversion (sm89+; Triton rejects float8e4nv for sm80-87). There the
# torch family runs instead (select_plan: correct, slower), not an error.
FP8_MIN_CAPABILITY = (8, 9)


def supports(problem) -> bool:
    """Whether the Triton kernels express this problem: CUDA from sm80 on (float8 caches from sm89 on), bf16/fp16
    q, the cache in q's dtype or float8_e4m3fn, every head-dim pair of plan.py's table (D 64-256 with Dv
    64-512, and MLA's D 576 with Dv 512), NHD or HND, any page size. Elsewhere the torch family runs (fail
    closed)."""
    cap = tuple(problem.capability)
    if problem.device_type != "cuda" or not MIN_CAPABILITY <= cap or cap[0] > MAX_MAJOR:
        return False
    if problem.q_dtype not in Q_DTYPES_CUDA or problem.kv_dtype not in (problem.q_dtype, FP8):
        return False
    if problem.kv_dtype == FP8 and cap < FP8_MIN_CAPABILITY:
        return False
    return (head_dims_supported(problem.head_dim, problem.v_head_dim) and problem.kv_layout in ("NHD", "HND")
            and problem.page_size >= 1)


def d_blocks(d: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DPE): the column blocks of the q.k product. One power of two covering D up to 256 (96
    and 192 read 128 and 256 columns, masked); above, a power of two and a tail block from column BLOCK_D on,
    two products instead of one mostly-padding power of two: D = 576 (MLA's 512 latent + 64 rope columns)
    is 512 + 64, not 1024 (the split vLLM's and SGLang's Triton MLA decode kernels make)."""
    if d <= 256:
        return next_pow2(d), 0
    main = prev_pow2(d)
    return main, (next_pow2(d - main) if d > main else 0)


def v_is_first_block(d: int, dv: int) -> bool:
    """Whether K's first column block (d_blocks(d)) is exactly Dv columns wide, every one inside D: where V's
    tile can be K's (plan.v_from_k), given that v_cache is k_cache's first Dv columns."""
    return d_blocks(d)[0] == dv <= d


def _dot_dtype(q_dtype, kv_dtype):
    """The operand dtype of both products: q's dtype; fp16 for float8 caches (e4m3 -> fp16 is one native
    conversion on sm89+, e4m3 -> bf16 is not; q and the probabilities fit fp16's range and gain precision);
    fp32 under the interpreter, whose bf16/fp16 `tl.dot` is wrong on CPU."""
    import triton.language as tl

    if _interpreting() or q_dtype == torch.float32:
        return tl.float32
    if kv_dtype == FP8:
        return tl.float16
    return tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16


def _cache_strides(stride: tuple, kv_layout: str) -> tuple[int, int, int]:
    """(page, slot, head) strides of a cache [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv,
    page_size, D] (HND)."""
    return (stride[0], stride[1], stride[2]) if kv_layout == "NHD" else (stride[0], stride[2], stride[1])


class DescaleLayout(NamedTuple):
    """A descale's strides over B and Hkv and its flag (0: absent, a valid dummy pointer with zero strides)."""

    stride_b: int = 0
    stride_h: int = 0
    present: int = 0


_NO_DESCALE = DescaleLayout()


def descale(ds, dummy) -> tuple[object, DescaleLayout]:
    """(pointer, layout) of a descale as the kernels take it: one that is None (`dummy` and no layout), a scalar,
    [B] or [B, Hkv]."""
    if ds is None:
        return dummy, _NO_DESCALE
    if ds.dim() == 0:
        return ds, DescaleLayout(0, 0, 1)
    if ds.dim() == 1:
        return ds, DescaleLayout(ds.stride(0), 0, 1)
    return ds, DescaleLayout(ds.stride(0), ds.stride(1), 1)


class Operands(NamedTuple):
    """The tensors of one launch (a run), or their dtypes (`warmup` and compile-only: Triton specializes on
    dtypes, not values). Absent optional tensors are valid dummy pointers whose flag in the Launch is 0, which
    masks every load of them."""

    q: object
    qpe: object  # the query's columns BLOCK_D.. where d_blocks(d) has a tail (q_pe, or a view of q's), else q
    k: object
    v: object
    pt: object
    seqlens: object
    cu: object
    kv_start: object
    sinks: object
    kds: object
    vds: object
    key_mask: object  # uint8 [B, S or 1, capacity] (a bool mask's bytes), or a dummy with has_key_mask 0
    out: object
    lse: object
    part_o: object  # split partials (decode/verify with splits > 1), else lse as a dummy
    part_l: object


class Launch(NamedTuple):
    """Everything static about one launch of a plan's kernels: sizes, strides, dtypes and flags (hashable:
    `_steps` turns it into the kernels' arguments once per distinct launch; a NamedTuple, which a launch makes
    and hashes faster than a dataclass). Build it by keyword."""

    batch: int
    q_len: int  # S, or the capacity T of packed q
    packed: bool
    hq: int
    hkv: int
    d: int  # q's and k's head dim
    dv: int  # v's and out's head dim
    page_size: int
    max_pages: int  # the page table's columns (lengths clamp to max_pages * page_size)
    num_pages: int  # pages both caches hold (page ids clamp to [0, num_pages - 1])
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    # strides, in elements
    q_strides: tuple[int, int, int]  # (request, token, head); request 0 for packed q
    qpe_strides: tuple[int, int, int]  # (request, token, head) of qpe; request 0 for packed q
    k_strides: tuple[int, int, int]  # (page, slot, head)
    v_strides: tuple[int, int, int]
    pt_stride: int
    kds: DescaleLayout  # the pointer is Operands.kds (descale)
    vds: DescaleLayout
    km_strides: tuple[int, int, int]  # (request, query row: 0 for one row per request, key)
    has_key_mask: bool  # a compile-time flag of the kernels
    has_kv_start: int
    has_sinks: int


# Each kernel's tensor arguments, in its signature's order (decode.py, extend.py)
_SPLIT_OPERANDS = ("q", "qpe", "k", "v", "pt", "seqlens", "kv_start", "sinks", "kds", "vds", "key_mask", "out", "lse",
                   "part_o", "part_l")
_EXTEND_OPERANDS = ("q", "qpe", "k", "v", "pt", "seqlens", "cu", "kv_start", "sinks", "kds", "vds", "key_mask", "out",
                    "lse")
_MERGE_OPERANDS = ("part_o", "part_l", "sinks", "out", "lse")


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """One kernel launch of a plan: `kernel[grid](*operands picked, *scalars, **consts, **tune)`."""

    kernel: object
    grid: tuple
    pick: operator.itemgetter  # its tensors, out of an Operands
    scalars: tuple  # its runtime scalar arguments, after the tensors
    consts: dict  # its compile-time arguments
    tune: dict  # num_warps, num_stages
    kwargs: dict  # consts and tune together (what a launch passes)
    # CUDA device index -> (launch, tail) of _compile_only.direct_launcher: the compiled kernel of launches whose
    # tensors are all 16-byte aligned. Every other argument's specialization is fixed by the Launch this step was
    # made for: its ints are `scalars`, and its tensors' dtypes are the ones Launch's dtypes imply (validate.py
    # checks them).
    direct: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, kernel, grid, names: tuple, scalars: tuple, consts: dict, tune: dict) -> _Step:
        return cls(kernel, grid, operator.itemgetter(*(Operands._fields.index(n) for n in names)), scalars, consts,
                   tune, {**consts, **tune})

    def args(self, operands: Operands) -> tuple:
        return (*self.pick(operands), *self.scalars)

    def launch(self, operands: Operands) -> None:
        self.launch_tensors(self.pick(operands))

    def launch_tensors(self, tensors: tuple) -> None:
        """Launches the kernel with its tensors (in its signature's order) on the current device's current stream:
        directly where they are CUDA tensors all 16-byte aligned (the launcher made once a device), else through
        Triton's JIT, which specializes a pointer on its alignment."""
        if (_interpreting() or not tensors[0].is_cuda
                or functools.reduce(operator.or_, map(torch.Tensor.data_ptr, tensors)) & 15):
            self.kernel[self.grid](*tensors, *self.scalars, **self.kwargs)
            return
        device = torch.cuda.current_device()
        direct = self.direct.get(device)
        if direct is None:
            from ._compile_only import direct_launcher

            direct = self.direct[device] = direct_launcher(self.kernel, self.grid, (*tensors, *self.scalars),
                                                           self.kwargs)
        launch, tail = direct
        launch(*tensors, *self.scalars, *tail)


@functools.lru_cache(maxsize=1024)
def _steps(x: Launch, plan, options) -> tuple[_Step, ...]:
    """The kernel launches of one plan (a Plan) with `options` (an Options) for one Launch: the split kernel
    and, with more than one split, the merge kernel (decode/verify), or the extend kernel."""
    from . import decode, extend

    g = x.hq // x.hkv
    window = options.window_left
    softcap = options.softcap
    common = (
        *x.q_strides, *x.qpe_strides, *x.k_strides, *x.v_strides, x.pt_stride,
        x.kds.stride_b, x.kds.stride_h, x.vds.stride_b, x.vds.stride_h, *x.km_strides,
        x.has_kv_start, x.has_sinks, x.kds.present, x.vds.present,
        max(window, 0), options.scale, softcap if softcap > 0 else 1.0,
        x.max_pages, x.num_pages,
    )
    block_d, block_dpe = d_blocks(x.d)
    flags = dict(CAUSAL=options.causal, USE_WINDOW=window >= 0, USE_SOFTCAP=softcap > 0,
                 DOT=_dot_dtype(x.q_dtype, x.kv_dtype), D=x.d, BLOCK_D=block_d, PAGE=x.page_size,
                 HAS_KEY_MASK=x.has_key_mask, BLOCK_DPE=block_dpe, DV=x.dv, BLOCK_DV=next_pow2(x.dv),
                 V_FROM_K=plan.v_from_k)
    tune = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.mode == "extend":
        tiles = -(-x.q_len // plan.block_m) + x.batch if x.packed else x.batch * -(-x.q_len // plan.block_m)
        consts = dict(B=x.batch, S=x.q_len, B_P2=next_pow2(x.batch + 1), G=g, HQ=x.hq, BLOCK_M=plan.block_m,
                      BLOCK_N=plan.block_n, PACKED=x.packed, **flags)
        return (_Step.of(extend.extend_kernel, (x.hq, tiles), _EXTEND_OPERANDS, common, consts, tune),)

    splits = plan.num_splits
    m_tiles = -(-(x.q_len * g) // plan.block_m)
    consts = dict(S=x.q_len, G=g, HKV=x.hkv, M_TILES=m_tiles, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                  NUM_SPLITS=splits, **flags)
    steps = [_Step.of(decode.split_kernel, (x.batch * x.hkv * m_tiles, splits), _SPLIT_OPERANDS, common, consts,
                      tune)]
    if splits > 1:
        steps.append(merge_step(decode.merge_kernel, x.batch * x.q_len * x.hq, x.hq, x.dv, splits, x.has_sinks,
                                x.q_dtype))
    return tuple(steps)


@functools.lru_cache(maxsize=256)
def merge_step(kernel, rows: int, hq: int, dv: int, splits: int, has_sinks: int, dtype: torch.dtype) -> _Step:
    """The merge kernel's launch (`kernel`: decode.merge_kernel) over `rows` = B x S x Hq rows of `splits`
    partials of Dv values, with or without sinks (both families' split kernels write the partials:
    split_partials). Its tensors, in order: part_o and out of `dtype` (out's), part_l, sinks (or a float32
    dummy) and lse float32 (_MERGE_OPERANDS)."""
    from . import decode

    del dtype  # a key only: the step's direct launcher is compiled for these dtypes
    grid, merge = decode.merge_launch(rows, hq, dv, splits)
    tune = {k: merge.pop(k) for k in ("num_warps", "num_stages")}
    return _Step.of(kernel, grid, _MERGE_OPERANDS, (has_sinks,), merge, tune)


def _launch(launch: Launch, operands: Operands, plan, options, *, warmup=False, compile_with=None):
    """Launches (or, with warmup, compiles and returns) the kernels of one plan (a Plan) with `options` (an
    Options). `compile_with(kernel, args, consts, tune)` replaces `kernel.warmup`
    (kernels/triton/_compile_only.py: compiles for another GPU)."""
    steps = _steps(launch, plan, options)
    if warmup:
        if compile_with:
            return [compile_with(s.kernel, s.args(operands), s.consts, s.tune) for s in steps]
        return [s.kernel.warmup(*s.args(operands), grid=s.grid, **s.kwargs) for s in steps]
    for s in steps:
        s.launch(operands)
    return None


def split_partials(scratch: torch.Tensor, rows: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_o [rows * d] of `dtype`, part_l [rows] fp32) views of a split-KV scratch (rows: B x S x Hq x splits;
    d: the value head dim Dv, the partial outputs' width; dtype: out's), the layout both families' split kernels
    write and the merge kernel reads (plan.split_scratch_bytes sizes it). part_o starts the scratch, so its rows
    are as aligned as the scratch; part_l follows on a 4-byte boundary (d is even)."""
    o_bytes, need = rows * d * dtype.itemsize, partials_bytes(rows, d, dtype)
    if scratch.numel() < need:
        raise ValueError(f"paged_attention: scratch must hold {need} bytes ({rows} split rows of {d} {dtype} values "
                         f"and an fp32 LSE each); got {scratch.numel()}")
    return scratch[:o_bytes].view(dtype), scratch[o_bytes: o_bytes + rows * 4].view(torch.float32)


def _launch_of(call) -> tuple[Launch, Operands]:
    """The Launch and the Operands of one Call."""
    q, k_cache, v_cache, pt = call.q, call.k_cache, call.v_cache, call.page_table
    layout = call.options.kv_layout
    page_size, hkv = cache_dims(k_cache.shape, layout)
    packed = q.dim() == 3
    batch, q_len = pt.shape[0], q.shape[0 if packed else 1]
    qs = q.stride()
    head_dim = call.head_dim
    block_d, block_dpe = d_blocks(head_dim)
    qpe = call.q_pe
    if qpe is None:  # the tail block's columns of q itself (a view), or q where there is no tail
        qpe = q[..., block_d:] if block_dpe else q
    elif q.shape[-1] != block_d:
        raise ValueError(f"paged_attention: the Triton family reads q_pe as the columns {block_d}.. of the query; "
                         f"got q of head dim {q.shape[-1]}")
    ps = qpe.stride() if qpe is not q else qs
    int_dummy, float_dummy = call.cache_seqlens, call.lse
    part_o = part_l = float_dummy
    km = call.key_mask
    km_strides = (0, 0, 0)
    if km is not None:
        km = km.view(torch.uint8)
        km_strides = (km.stride(0), km.stride(1) if km.shape[1] > 1 else 0, km.stride(2))
    hq, dv = q.shape[-2], v_cache.shape[-1]
    plan = call.plan
    if plan.mode != "extend" and plan.num_splits > 1:
        part_o, part_l = split_partials(call.scratch, batch * q_len * hq * plan.num_splits, dv, call.out.dtype)
    kds, kds_layout = descale(call.k_descale, float_dummy)
    vds, vds_layout = descale(call.v_descale, float_dummy)
    kv_start, sinks = call.kv_start, call.sinks
    launch = Launch(
        batch=batch, q_len=q_len, packed=packed, hq=hq, hkv=hkv, d=head_dim, dv=dv, page_size=page_size,
        max_pages=pt.shape[1], num_pages=min(k_cache.shape[0], v_cache.shape[0]), q_dtype=q.dtype,
        kv_dtype=k_cache.dtype, q_strides=(0, qs[0], qs[1]) if packed else qs[:3],
        qpe_strides=(0, ps[0], ps[1]) if packed else ps[:3],
        k_strides=_cache_strides(k_cache.stride(), layout), v_strides=_cache_strides(v_cache.stride(), layout),
        pt_stride=pt.stride(0), kds=kds_layout, vds=vds_layout, km_strides=km_strides,
        has_key_mask=km is not None, has_kv_start=int(kv_start is not None), has_sinks=int(sinks is not None))
    operands = Operands(
        q, qpe, k_cache, v_cache, pt, call.cache_seqlens, call.cu_seqlens_q if packed else int_dummy,
        int_dummy if kv_start is None else kv_start, float_dummy if sinks is None else sinks, kds, vds,
        int_dummy if km is None else km, call.out, call.lse, part_o, part_l)
    return launch, operands


def run(call) -> None:
    """Runs one plan's kernels: writes call.out, call.lse and call.scratch only. A plan with v_from_k runs only
    on a v_cache that is k_cache's first Dv columns (else ValueError: its kernels would read V from K)."""
    if call.plan.v_from_k:
        from b12x_inductor.validate import v_is_prefix_of_k

        if not (v_is_first_block(call.head_dim, call.v_cache.shape[-1])
                and v_is_prefix_of_k(call.k_cache, call.v_cache)):
            raise ValueError("paged_attention: the plan takes V's tile from K's (v_from_k=True), but v_cache is not "
                             "k_cache's first Dv columns with Dv the width of K's first column block: got k_cache "
                             f"{tuple(call.k_cache.shape)} strides {call.k_cache.stride()}, v_cache "
                             f"{tuple(call.v_cache.shape)} strides {call.v_cache.stride()}")
    with torch.cuda.device(call.q.device) if call.q.is_cuda else _no_device():
        _launch(*_launch_of(call), call.plan, call.options)


def _no_device():
    import contextlib

    return contextlib.nullcontext()


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def warmup_launch(problem, options) -> tuple[Launch, Operands]:
    """The Launch and Operands `precompile` compiles for: the standard (contiguous) strides of the problem's
    tensors, operands given as dtypes, runtime flags off (kv_start, sinks and descales are runtime flags, so
    one compile serves them all)."""
    b, s, hq, hkv, d, dv, ps = (problem.batch, problem.q_len, problem.num_q_heads, problem.num_kv_heads,
                                problem.head_dim, problem.v_head_dim, problem.page_size)
    cache = _contiguous_strides((1, ps, hkv, d) if problem.kv_layout == "NHD" else (1, hkv, ps, d))
    v_cache = _contiguous_strides((1, ps, hkv, dv) if problem.kv_layout == "NHD" else (1, hkv, ps, dv))
    q_strides = _contiguous_strides((s, hq, d) if problem.packed else (b, s, hq, d))
    q_strides = (0, q_strides[0], q_strides[1]) if problem.packed else q_strides[:3]
    f32, i32 = torch.float32, torch.int32
    launch = Launch(
        batch=b, q_len=s, packed=problem.packed, hq=hq, hkv=hkv, d=d, dv=dv, page_size=ps, max_pages=problem.max_pages,
        num_pages=1, q_dtype=problem.q_dtype, kv_dtype=problem.kv_dtype, q_strides=q_strides, qpe_strides=q_strides,
        k_strides=_cache_strides(cache, problem.kv_layout), v_strides=_cache_strides(v_cache, problem.kv_layout),
        pt_stride=problem.max_pages, kds=_NO_DESCALE, vds=_NO_DESCALE, km_strides=(0, 0, 0),
        has_key_mask=problem.key_mask, has_kv_start=0, has_sinks=0)
    q, kv = problem.q_dtype, problem.kv_dtype
    operands = Operands(q, q, kv, kv, i32, i32, i32, i32, f32, f32, f32, torch.uint8 if problem.key_mask else i32, q,
                        f32, q, f32)
    return launch, operands


def precompile(problem, plan, options) -> None:
    """Compiles the kernels of one plan ahead of any launch and loads them (kernels/triton/_compile_only.py:
    `load_now`), so neither happens at the first launch, which may be inside a capture."""
    if plan.family != "triton" or _interpreting() or problem.device_type != "cuda":
        return
    _precompiled(problem, plan, options)


@functools.cache
def _precompiled(problem, plan, options):
    from ._compile_only import load_now

    with torch.cuda.device(torch.cuda.current_device()):
        kernels = _launch(*warmup_launch(problem, options), plan, options, warmup=True)
        for k in kernels or ():
            load_now(k)
    return kernels


class TritonFamily:
    """The Triton family as a KernelFamily (kernels/__init__.py)."""

    name = "triton"

    def available(self) -> bool:
        return True  # a dependency of the package

    def supports(self, problem) -> bool:
        return supports(problem)

    def preferred(self, problem) -> bool:
        return True  # faster than the torch family wherever it runs

    def plan(self, problem, **tiles):
        return _plan.plan(problem, **tiles)

    def precompile(self, problem, plan, options) -> None:
        precompile(problem, plan, options)

    def run(self, call) -> None:
        run(call)


FAMILY = TritonFamily()
