"""The CuTe DSL kernel family (Hopper): decode and verify on the CUDA cores (decode.py) or the tensor cores
(decode_mma.py); extend warp-specialized with wgmma (extend.py); absorbed-MLA decode and verify (D 576, Dv 512,
V a view of K) with wgmma, warp-specialized over a ring of 32-key tiles (mla.py), two warpgroups seesawing
over two 64-key tiles (mla_seesaw.py), or, for at most 16 query rows a request, with the products transposed
(keys as the wgmma's M) and a float8 cache widened in registers (mla_narrow.py). `FAMILY` is its KernelFamily
(kernels/__init__.py); its plans and where select_plan prefers it are in plan.py.

Optional: it needs nvidia-cutlass-dsl (`pip install b12x-inductor[cute]`); without it `available()` is False
and every plan runs on Triton. `run` launches the plan's kernel on torch's current stream (a CuTe launch
without an explicit stream is silently left out of a CUDA-graph capture): for decode/verify the split
kernel and then the Triton merge kernel, which combines the splits with the sink into `out` and `lse` (a
split kernel with one split writes them itself, as the MLA kernel does with splits merged in their cluster); for
extend one kernel that writes `out` and `lse`. A launch's values (pointers, scalars, the stream) are made and
marshalled once per value and handed to the compiled kernel through `_runtime.launch`. It writes
only out, lse and the plan's scratch, allocates nothing and never syncs. `precompile` compiles the kernel for
a plan ahead (in memory, and in the DSL's own file cache on disk), so no compile ever happens inside a capture.

The kernels also compile on a machine without a GPU, which catches DSL errors before any device time:
`cute.compile(SplitKernel(...), *fake_args, options="--gpu-arch sm_90a")` as `_compiled` builds it (without
a GPU the DSL targets sm_100a by default; CUTE_DSL_KEEP=ptx with CUTE_DSL_DUMP_DIR keeps the PTX).
"""

from __future__ import annotations

import functools
import inspect

import torch

from b12x_inductor.plan import FP8, MAX_VERIFY_LEN, Q_DTYPES_CUDA, device_facts
from b12x_inductor.validate import cache_dims

from . import _runtime
from . import plan as _plan

DECODE_HEAD_DIMS = (64, 128, 256)  # decode/verify (decode.py, decode_mma.py): a subset of plan.HEAD_DIMS
EXTEND_HEAD_DIMS = (64, 128, 256)  # extend.py: the P V accumulators take D / 2 fp32 registers per thread
MAX_ROWS = 16  # query rows (S x Hq / Hkv) per CTA: the per-thread accumulators are rows x 2-4 fp32
KEYS_PER_THREAD = 2  # score phase: keys per thread (each q read serves both)
MMA_M = 16  # a plan's block_m: 16 = the tensor-core kernel (one m16 tile of query rows), 1 = the CUDA-core one
MLA_BLOCK_M = 64  # mla.py: query rows per CTA (both consumer warpgroups take all 64)
MLA_NARROW_ROWS = _plan.MLA_NARROW_TILE["block_m"]  # mla_narrow.py: query rows per CTA (the wgmma's N), at most S x H
MLA_D, MLA_DV = 576, 512  # mla.py: the latent's key width (512 + 64 rope) and value width
SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90 (a kernel's is its struct's size: storage.py)

# Compute capabilities the GPU tests (tests/test_cute_kernels.py -m gpu) have passed on.
VERIFIED_CAPABILITIES = frozenset({(9, 0)})


@functools.cache
def available() -> bool:
    """Whether nvidia-cutlass-dsl imports (checked once per process)."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return False
    return True


def supports(problem) -> bool:
    """Whether this family expresses the problem: CUDA of a verified capability, bf16/fp16 q, NHD or HND, any
    page size; decode/verify with the cache in q's dtype or float8_e4m3fn, head dims 64/128/256 and at most 16
    query rows per KV head; extend (4D or packed q) with the cache in q's dtype and head dims 64/128/256; absorbed
    MLA decode/verify (`mla_supports`). No key_mask (the Triton family reads it).
    (Installed or not: `available()` says that.)"""
    if problem.device_type != "cuda" or problem.capability not in VERIFIED_CAPABILITIES or problem.key_mask:
        return False
    if problem.v_head_dim != problem.head_dim:  # Dv != D: absorbed MLA decode/verify only (mla.py)
        return mla_supports(problem)
    if problem.q_dtype not in Q_DTYPES_CUDA or problem.kv_layout not in ("NHD", "HND"):
        return False
    if problem.page_size < 1:
        return False
    if problem.packed or problem.q_len > MAX_VERIFY_LEN:
        return problem.kv_dtype == problem.q_dtype and problem.head_dim in EXTEND_HEAD_DIMS
    return (problem.kv_dtype in (problem.q_dtype, FP8) and problem.head_dim in DECODE_HEAD_DIMS
            and problem.q_len * problem.group <= MAX_ROWS)


def mla_supports(problem) -> bool:
    """Whether mla.py expresses the problem: absorbed MLA (D 576, Dv 512, one KV head, v_cache k_cache's first
    512 columns: Problem.v_in_k), decode or verify (4D q), the cache in q's dtype (16-bit) or float8_e4m3fn
    (with descales; the products then run in fp16), no window and no key mask (the caller checks CUDA, the
    capability and q's dtype). Any page size: tiles the page geometry gives no TMA box go by cp.async."""
    return (problem.head_dim == MLA_D and problem.v_head_dim == MLA_DV and problem.num_kv_heads == 1
            and problem.v_in_k and not problem.packed and problem.q_len <= MAX_VERIFY_LEN
            and problem.kv_dtype in (problem.q_dtype, FP8) and problem.window_left < 0 and not problem.key_mask)


def geometry(*, d: int, rows: int, kv_bits: int, tile_n: int, stages: int, num_warps: int,
             tma: bool = True) -> dict | None:
    """The split kernel's thread geometry and shared memory (decode.py), or None where the configuration does
    not fit.

    Score phase: thread t takes keys t % (tile_n / 2) and + tile_n / 2, and head-dim part t // (tile_n / 2)
    of `parts`. P V phase: thread t owns `cpt` adjacent columns (one 32-bit read of V) of column group
    t % col_groups, for keys t // col_groups + key_parts * i. `storage` is the kernel's shared memory
    (storage.split_storage), `smem_bytes` its size; `tma`: whether tiles may go by TMA, which adds the ring's
    stage mbarriers (the default: the larger layout)."""
    threads = 32 * num_warps
    vec = 128 // kv_bits  # elements per 16-byte chunk
    chunks = d // vec
    parts = threads // (tile_n // KEYS_PER_THREAD)
    cpt = 32 // kv_bits
    col_groups = d // cpt
    if d % vec or parts < 1 or chunks % parts or threads % col_groups or (tile_n * chunks) % threads:
        return None
    key_parts = threads // col_groups
    if tile_n % key_parts or tile_n % 32:
        return None
    from .storage import split_storage

    storage = split_storage(d=d, rows=rows, kv_bits=kv_bits, tile_n=tile_n, stages=stages, parts=parts,
                            key_parts=key_parts, tma=tma)
    smem_bytes = storage.size_in_bytes()
    if smem_bytes > SMEM_LIMIT:
        return None
    return dict(d=d, rows=rows, tile_n=tile_n, stages=stages, warps=num_warps, threads=threads, vec=vec,
                chunks=chunks, swizzle=min(chunks, 8) - 1, parts=parts, cpt=cpt, col_groups=col_groups,
                key_parts=key_parts, rows_per_warp=-(-rows // num_warps), storage=storage, smem_bytes=smem_bytes)


def mma_geometry(*, d: int, rows: int, kv_bits: int, tile_n: int, stages: int, num_warps: int,
                 tma: bool = True) -> dict | None:
    """The tensor-core split kernel's geometry (decode_mma.py), or None where it does not fit: one m16 tile
    of query rows, tile_n / num_warps = 16 or 32 keys per warp per tile, D <= 128 (the fp32 output fragments
    take D / 2 registers per thread). `storage` and `smem_bytes` as in `geometry` (storage.mma_storage)."""
    threads = 32 * num_warps
    vec = 128 // kv_bits
    chunks = d // vec
    if tile_n % num_warps or tile_n // num_warps not in (16, 32):
        return None
    if rows > 16 or d not in (64, 128) or (tile_n * chunks) % threads:
        return None
    from .storage import mma_storage

    storage = mma_storage(d=d, rows=rows, kv_bits=kv_bits, tile_n=tile_n, stages=stages, warps=num_warps, tma=tma)
    smem_bytes = storage.size_in_bytes()
    if smem_bytes > SMEM_LIMIT:
        return None
    return dict(d=d, rows=rows, tile_n=tile_n, keys_per_warp=tile_n // num_warps, stages=stages, warps=num_warps,
                threads=threads, vec=vec, chunks=chunks, swizzle=min(chunks, 8) - 1, storage=storage,
                smem_bytes=smem_bytes)


EXTEND_BLOCK_M = _plan.EXTEND_BLOCK_M  # extend.py: query rows per CTA (two consumer warpgroups of 64)


def extend_geometry(*, d: int, tile_n: int, stages: int, block_m: int = EXTEND_BLOCK_M) -> dict | None:
    """The extend kernel's shared memory (extend.py), or None where the configuration does not fit: `q_bufs`
    Q tiles of block_m x D (two where they fit beside the ring: D 64; else one) and `stages` K and V tiles of
    tile_n x D, 16-bit, 1024-byte aligned for the 128-byte swizzle, plus 3 x stages mbarriers (`storage`:
    storage.extend_storage; `smem_bytes` its size). None too for rows extend.py does not take at this D
    (plan.extend_rows_fit: 192 only up to D 64)."""
    if d not in EXTEND_HEAD_DIMS or tile_n % 16 or not 16 <= tile_n <= 256 or stages < 2:
        return None
    if not _plan.extend_rows_fit(block_m, d):
        return None
    from .storage import extend_storage

    # two Q tiles where they fit beside the ring (the producer loads the next item's Q a whole item ahead), else
    # one (loaded once every consumer's last S = Q K^T of the item is done: extend.py's _load_q)
    for q_bufs in (2, 1):
        storage = extend_storage(block_m=block_m, d=d, tile_n=tile_n, stages=stages, q_bufs=q_bufs)
        smem_bytes = storage.size_in_bytes()
        if smem_bytes <= SMEM_LIMIT:
            return dict(d=d, tile_n=tile_n, stages=stages, chunks=d // 8, storage=storage, smem_bytes=smem_bytes,
                        q_bufs=q_bufs)
    return None




def mla_geometry(*, tile_n: int, stages: int) -> dict | None:
    """The MLA kernel's shared memory (mla.py), or None where it does not fit: the Q tile (64 x 576) and
    `stages` latent tiles of tile_n x 576, 16-bit (`storage`: storage.mla_storage; `smem_bytes` its size).
    Each tile's rope columns hold its P (64 x tile_n 16-bit) after its scores: tile_n <= 64."""
    if tile_n not in (32, 64) or stages < 2:
        return None
    from .storage import mla_storage

    storage = mla_storage(block_m=MLA_BLOCK_M, d=MLA_D, tile_n=tile_n, stages=stages)
    smem_bytes = storage.size_in_bytes()
    if smem_bytes > SMEM_LIMIT:
        return None
    return dict(tile_n=tile_n, stages=stages, storage=storage, smem_bytes=smem_bytes)


def mla_narrow_geometry(*, fp8: bool, stages: int) -> dict | None:
    """The narrow MLA kernel's shared memory (mla_narrow.py), or None where it does not fit: `stages` tiles of
    64 keys (16-bit rows of 576, or float8 rows 608 bytes apart), the Q tile (16 x 576, 16-bit) and two P^T
    tiles (`storage`: storage.mla_narrow_storage; `smem_bytes` its size; `tile_bytes` a stage's)."""
    from .mla_narrow import FP8_ROW, ROWS, STAGE_ROW, TILE_N
    from .storage import mla_narrow_storage

    tile_bytes = TILE_N * (FP8_ROW if fp8 else MLA_D * 2)
    # the epilogue stages the output rows in the ring (fp32), then a cluster's log2-sum-exp and split weights (8)
    if stages < 2 or stages * tile_bytes < ROWS * (STAGE_ROW + 1 + 8) * 4:
        return None
    storage = mla_narrow_storage(rows=ROWS, d=MLA_D, tile_bytes=tile_bytes, stages=stages)
    smem_bytes = storage.size_in_bytes()
    if smem_bytes > SMEM_LIMIT:
        return None
    return dict(storage=storage, smem_bytes=smem_bytes, tile_bytes=tile_bytes)


def mla_seesaw_geometry() -> dict:
    """The seesaw MLA kernel's shared memory (mla_seesaw.py): Q (64 x 576), two 64-key latent tiles and one P
    tile (`storage`: storage.mla_seesaw_storage; `smem_bytes` its size, within SMEM_LIMIT)."""
    from .storage import mla_seesaw_storage

    storage = mla_seesaw_storage(block_m=MLA_BLOCK_M, d=MLA_D, tile_n=_plan.MLA_SEESAW_TILE["block_n"])
    smem_bytes = storage.size_in_bytes()
    assert smem_bytes <= SMEM_LIMIT, smem_bytes
    return dict(storage=storage, smem_bytes=smem_bytes)


def tma_box(*, page: int, tile_n: int) -> int:
    """Keys per TMA box (kernels/cute/tma.py) for the extend and decode kernels, or 0 where the page geometry
    allows none (every tile then gathers with cp.async): a box is min(page, tile_n) keys of one page, a whole
    number of 8-row swizzle atoms, and a tile is a whole number of boxes (or a page a whole number of tiles)."""
    box = min(page, tile_n)
    if box % 8 or max(page, tile_n) % box:
        return 0
    return box


@functools.cache
def _cutlass_dtype(dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, FP8: cutlass.Float8E4M3FN,
            torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}[dtype]


@functools.cache
def _compiled(key):
    """The compiled split kernel for one key (d, s, g, hkv, page, num_splits, block_m, block_n, stages, warps,
    q dtype, kv dtype, causal, use_window, use_softcap, sm_count): block_m 16 is the tensor-core kernel
    (decode_mma.py, persistent: its grid is two CTAs an SM), 1 the CUDA-core one (decode.py). cute.compile also
    keeps it in the DSL's file cache."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    from .decode import SplitKernel
    from .decode_mma import MmaSplitKernel

    (d, s, g, hkv, page, splits, block_m, tile_n, stages, warps, q_dtype, kv_dtype, causal, use_window,
     use_softcap, sm_count) = key
    qt, kvt = _cutlass_dtype(q_dtype), _cutlass_dtype(kv_dtype)
    kernel_class = MmaSplitKernel if block_m == MMA_M else SplitKernel
    kernel = kernel_class(d=d, s=s, g=g, hkv=hkv, page=page, num_splits=splits, tile_n=tile_n, stages=stages,
                          num_warps=warps, q_dtype=qt, kv_dtype=kvt, causal=causal, use_window=use_window,
                          use_softcap=use_softcap, sm_count=sm_count)
    gmem = cute.AddressSpace.gmem

    def ptr(dt, align=4):
        return make_ptr(dt, 1 << 20, gmem, assumed_align=align)

    pointers = dict(q_ptr=ptr(qt, q_dtype.itemsize), k_ptr=ptr(kvt, 16), v_ptr=ptr(kvt, 16), pt_ptr=ptr(Int32),
                    seqlens_ptr=ptr(Int32), kv_start_ptr=ptr(Int32), kds_ptr=ptr(Float32), vds_ptr=ptr(Float32),
                    part_o_ptr=ptr(qt, q_dtype.itemsize), part_l_ptr=ptr(Float32), sinks_ptr=ptr(Float32))
    return cute.compile(kernel, *_fake_args(type(kernel), pointers))


def _key(shapes, plan: dict, options: dict) -> tuple:
    softcap = float(options["softcap"])
    return (shapes["d"], shapes["q_len"], shapes["hq"] // shapes["hkv"], shapes["hkv"], shapes["page_size"],
            plan["num_splits"], plan["block_m"], plan["block_n"], plan["num_stages"], plan["num_warps"],
            shapes["q_dtype"],
            shapes["kv_dtype"], bool(options["causal"]) and shapes["q_len"] > 1, int(options["window_left"]) >= 0,
            softcap > 0, shapes["sm_count"])


def _check_aligned(name: str, t: torch.Tensor, elems: int) -> None:
    """16-byte cp.async chunks and TMA strides: rows must start on 16 bytes (pointer and every stride but the
    last)."""
    step = 16 // t.element_size()
    if t.data_ptr() % 16 or t.stride(-1) != 1 or any(st % step for st in t.stride()[:-1]) or elems % step:
        raise ValueError(f"paged_attention: the CuTe family needs {name} with 16-byte aligned rows (data_ptr and "
                         f"strides multiples of {step} elements, last stride 1); got data_ptr % 16 = "
                         f"{t.data_ptr() % 16}, strides {tuple(t.stride())}")


@functools.cache
def _compiled_extend(key):
    """The compiled extend kernel (extend.py) for one key (d, g, hq, batch, s, page, packed, block_n, stages,
    q dtype, causal, use_window, use_softcap, sm_count: its persistent CTAs, one per SM; block_m)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    from .extend import ExtendKernel

    d, g, hq, batch, s, page, packed, tile_n, stages, q_dtype, causal, use_window, use_softcap, sm_count, block_m = key
    qt = _cutlass_dtype(q_dtype)
    kernel = ExtendKernel(d=d, g=g, hq=hq, batch=batch, s=s, page=page, packed=packed, tile_n=tile_n,
                          stages=stages, q_dtype=qt, causal=causal, use_window=use_window, use_softcap=use_softcap,
                          sm_count=sm_count, block_m=block_m)
    gmem = cute.AddressSpace.gmem

    def ptr(dt, align=4):
        return make_ptr(dt, 1 << 20, gmem, assumed_align=align)

    pointers = dict(q_ptr=ptr(qt, 16), k_ptr=ptr(qt, 16), v_ptr=ptr(qt, 16), pt_ptr=ptr(Int32), seqlens_ptr=ptr(Int32),
                    cu_ptr=ptr(Int32), kv_start_ptr=ptr(Int32), sinks_ptr=ptr(Float32), kds_ptr=ptr(Float32),
                    vds_ptr=ptr(Float32), out_ptr=ptr(qt, 2), lse_ptr=ptr(Float32))
    return cute.compile(kernel, *_fake_args(ExtendKernel, pointers))


def mla_kernel_class(num_warps: int, block_m: int = MLA_BLOCK_M):
    """The MLA kernel a plan names by its rows and warps: 16 rows, the narrow kernel (mla_narrow.py: products
    transposed, at most 16 query rows a request); 64 rows and 8 warps, the seesaw kernel (mla_seesaw.py: 64-key
    tiles, two buffers, TMA only); 64 and 12, mla.py's (a producer warpgroup, a ring of 32-key tiles, cp.async
    where TMA cannot)."""
    if block_m == MLA_NARROW_ROWS:
        from .mla_narrow import MlaNarrowKernel

        return MlaNarrowKernel
    if num_warps == _plan.MLA_SEESAW_TILE["num_warps"]:
        from .mla_seesaw import MlaSeesawKernel

        return MlaSeesawKernel
    from .mla import MlaSplitKernel

    return MlaSplitKernel


@functools.cache
def _compiled_mla(key):
    """The compiled MLA split kernel (mla.py, mla_seesaw.py or mla_narrow.py: `mla_kernel_class`) for one key
    (s, hq, page, num_splits, block_n, stages, q dtype, causal, use_softcap, kv dtype, num_warps, block_m,
    cluster: plan.mla_cluster_merge)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    s, hq, page, splits, tile_n, stages, q_dtype, causal, use_softcap, kv_dtype, warps, block_m, cluster = key
    qt, kt = _cutlass_dtype(q_dtype), _cutlass_dtype(kv_dtype)
    cls = mla_kernel_class(warps, block_m)
    kernel = cls(s=s, hq=hq, page=page, num_splits=splits, tile_n=tile_n, stages=stages, q_dtype=qt,
                 causal=causal, use_softcap=use_softcap, kv_dtype=kt, cluster=cluster)
    gmem = cute.AddressSpace.gmem

    def ptr(dt, align=4):
        return make_ptr(dt, 1 << 20, gmem, assumed_align=align)

    pointers = dict(q_ptr=ptr(qt, 16), qpe_ptr=ptr(qt, 16), k_ptr=ptr(kt, 16), pt_ptr=ptr(Int32),
                    seqlens_ptr=ptr(Int32), kv_start_ptr=ptr(Int32), sinks_ptr=ptr(Float32), part_o_ptr=ptr(qt, 16),
                    part_l_ptr=ptr(Float32), out_ptr=ptr(qt, 2), lse_ptr=ptr(Float32), kds_ptr=ptr(Float32),
                    vds_ptr=ptr(Float32))
    return cute.compile(kernel, *_fake_args(cls, pointers))


def _mla_key(shapes, plan: dict, options: dict) -> tuple:
    return (shapes["q_len"], shapes["hq"], shapes["page_size"], plan["num_splits"], plan["block_n"],
            plan["num_stages"], shapes["q_dtype"], bool(options["causal"]) and shapes["q_len"] > 1,
            float(options["softcap"]) > 0, shapes["kv_dtype"], plan["num_warps"], plan["block_m"],
            _plan.mla_cluster_merge(plan["num_splits"], plan["block_m"]))


def _extend_key(shapes, plan: dict, options: dict) -> tuple:
    return (shapes["d"], shapes["hq"] // shapes["hkv"], shapes["hq"], shapes["batch"], shapes["q_len"],
            shapes["page_size"], shapes["packed"], plan["block_n"], plan["num_stages"], shapes["q_dtype"],
            bool(options["causal"]), int(options["window_left"]) >= 0, float(options["softcap"]) > 0,
            shapes["sm_count"], plan["block_m"])


def _run_extend(tensors: dict, *, out, lse, options: dict, plan: dict) -> None:
    from b12x_inductor.kernels.triton import _cache_strides

    q, k_cache, v_cache, pt = tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["page_table"]
    layout = options["kv_layout"]
    packed = q.dim() == 3
    page, hkv = cache_dims(k_cache.shape, layout)
    shapes = dict(d=q.shape[-1], hq=q.shape[-2], hkv=hkv, batch=pt.shape[0],
                  q_len=q.shape[0] if packed else q.shape[1], packed=packed, page_size=page, q_dtype=q.dtype,
                  sm_count=device_facts(q.device)[0])
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):  # out: rows as q's
        _check_aligned(name, t, shapes["d"])
    compiled = _compiled_extend(_extend_key(shapes, plan, options))
    q_strides = (0, q.stride(0), q.stride(1)) if packed else q.stride()[:3]
    kp, ko, kh = _cache_strides(k_cache.stride(), layout)
    vp, vo, vh = _cache_strides(v_cache.stride(), layout)
    int_dummy = tensors["cache_seqlens"]
    kds, kds_b, kds_h, has_kds = _descale(tensors["k_descale"], lse)
    vds, vds_b, vds_h, has_vds = _descale(tensors["v_descale"], lse)
    kv_start, sinks = tensors["kv_start"], tensors["sinks"]
    window, softcap = int(options["window_left"]), float(options["softcap"])
    stream = _stream(torch.cuda.current_stream(q.device).cuda_stream)
    with torch.cuda.device(q.device):
        from .extend import ExtendKernel

        _runtime.launch(compiled, _launch_args(ExtendKernel, dict(
            q_ptr=_ptr(q, 16), k_ptr=_ptr(k_cache, 16), v_ptr=_ptr(v_cache, 16), pt_ptr=_ptr(pt, 4, torch.int32),
            seqlens_ptr=_ptr(tensors["cache_seqlens"], 4, torch.int32),
            cu_ptr=_ptr(tensors["cu_seqlens_q"] if packed else int_dummy, 4, torch.int32),
            kv_start_ptr=_ptr(kv_start if kv_start is not None else int_dummy, 4, torch.int32),
            sinks_ptr=_ptr(sinks if sinks is not None else lse, 4, torch.float32),
            kds_ptr=_ptr(kds, 4, torch.float32), vds_ptr=_ptr(vds, 4, torch.float32), out_ptr=_ptr(out, 2),
            lse_ptr=_ptr(lse, 4),
            **_strides(q_strides, (kp, ko, kh), (vp, vo, vh), pt.stride(0)),
            kds_b=kds_b, kds_h=kds_h, vds_b=vds_b, vds_h=vds_h,
            has_kv_start=kv_start is not None, has_sinks=sinks is not None, has_kds=has_kds,
            has_vds=has_vds, window_left=max(window, 0), sm_scale=float(options["scale"]),
            softcap=softcap if softcap > 0 else 1.0, k_pages=k_cache.shape[0],
            v_pages=v_cache.shape[0], max_pages=pt.shape[1], stream=stream)))


@functools.cache
def _abi(kernel_class) -> tuple[tuple[str, str], ...]:
    """(name, annotation) of each launch argument of a kernel class's `__call__`, self dropped: the launch
    ABI is written once, in that signature; the fake arguments of a compile and the arguments of a launch
    are built from it by name."""
    return tuple((n, p.annotation) for n, p in inspect.signature(kernel_class.__call__).parameters.items())[1:]


def _fake_args(kernel_class, pointers: dict) -> list:
    """The arguments `cute.compile` traces a kernel with: `pointers` for its pointer parameters (dtype and
    alignment), a placeholder of its type for each scalar (runtime values, not specialized), a fake stream."""
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_stream

    scalar = {"Int32": Int32(0), "Int64": Int64(1), "Float32": Float32(1.0)}
    out = []
    for name, ann in _abi(kernel_class):
        out.append(make_fake_stream() if name == "stream" else pointers[name] if ann == "cute.Pointer"
                   else scalar[ann])
    return out


_SCALARS = {"Int32": int, "Int64": int, "Float32": float}  # a scalar parameter's annotation -> its Python value


def _launch_args(kernel_class, values: dict) -> list:
    """A launch's arguments in the kernel's `__call__` order (`_runtime.Arg`s; every name of the signature, and
    only those): pointers and the stream as `_ptr` and `_stream` make them, scalars as Python numbers, made the
    DSL type of their parameter's annotation here (so the marshalled value is of the parameter's width)."""
    abi = _abi(kernel_class)
    names = _abi_names(kernel_class)
    if values.keys() != names:
        raise AssertionError(f"CuTe launch of {kernel_class.__name__}: missing {sorted(names - set(values))}, "
                             f"unexpected {sorted(set(values) - names)}")
    return [_scalar(ann, _SCALARS[ann](values[n])) if ann in _SCALARS else values[n] for n, ann in abi]


@functools.cache
def _abi_names(kernel_class) -> frozenset:
    return frozenset(n for n, _ in _abi(kernel_class))


def _strides(q: tuple, k: tuple, v: tuple, pt: int) -> dict:
    """The ten Int64 element strides of a launch: q (request, token, head), the caches (page, slot, head),
    the page table's row."""
    names = ("q_sb", "q_ss", "q_sh", "k_sp", "k_so", "k_sh", "v_sp", "v_so", "v_sh", "pt_sb")
    return dict(zip(names, (*q, *k, *v, pt)))


def _ptr(t: torch.Tensor, align: int, dtype=None) -> _runtime.Arg:
    """A CuTe global pointer to a tensor's data (`dtype`: the element type to read it as)."""
    return _pointer(t.data_ptr(), dtype or t.dtype, align)


# A launch's DSL values are made and marshalled once per value, not per launch (about 11 pointers and 25 scalars
# a launch, a microsecond or more each to make and another to marshal): they are immutable, and a serving loop's
# caches, page tables and shapes repeat, so the eager op's host time a call shrinks by tens of microseconds.
@functools.lru_cache(maxsize=256)
def _pointer(address: int, dtype, align: int) -> _runtime.Arg:
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return _runtime.arg(make_ptr(_cutlass_dtype(dtype), address, cute.AddressSpace.gmem, assumed_align=align))


@functools.lru_cache(maxsize=4096)
def _scalar(kind: str, value) -> _runtime.Arg:
    """An Int32, Int64 or Float32 launch argument (`kind`) of a Python number."""
    import cutlass

    return _runtime.arg(getattr(cutlass, kind)(value))


@functools.lru_cache(maxsize=64)
def _stream(handle: int) -> _runtime.Arg:
    """The launch argument of a CUDA stream (torch's current stream's `cuda_stream`): every launch names its
    stream, or a CUDA-graph capture would leave it out."""
    from cuda.bindings.driver import CUstream

    return _runtime.arg(CUstream(handle))


def run(mode: str, tensors: dict, *, out, lse, scratch, options: dict, plan: dict) -> None:
    """Runs one plan. Extend: the extend kernel writes `out` and `lse`. Decode/verify: the split kernel writes
    each split's partials into `scratch`, the Triton merge kernel combines them (with the sink) into `out`
    and `lse`; with one split the split kernel writes `out` and `lse` itself (out is contiguous: validate)."""
    if mode == "extend":
        _run_extend(tensors, out=out, lse=lse, options=options, plan=plan)
        return
    if plan["v_from_k"]:  # absorbed MLA (the family's only V read from K's tiles: plan.py)
        _run_mla(tensors, out=out, lse=lse, scratch=scratch, options=options, plan=plan)
        return
    from b12x_inductor.kernels.triton import decode as triton_decode
    from b12x_inductor.kernels.triton import _cache_strides, merge_step, split_partials

    q, k_cache, v_cache, pt = tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["page_table"]
    layout = options["kv_layout"]
    batch, s, hq, d = q.shape
    page, hkv = cache_dims(k_cache.shape, layout)
    shapes = dict(d=d, q_len=s, hq=hq, hkv=hkv, page_size=page, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
                  sm_count=device_facts(q.device)[0])
    _check_aligned("k_cache", k_cache, d)
    _check_aligned("v_cache", v_cache, d)
    compiled = _compiled(_key(shapes, plan, options))
    splits = plan["num_splits"]
    part_o, part_l = (out, lse) if splits == 1 else split_partials(scratch, batch * s * hq * splits, d, out.dtype)
    sinks = tensors["sinks"]
    sinks_arg = sinks if sinks is not None else lse  # a valid float32 pointer where has_sinks is 0
    kp, ko, kh = _cache_strides(k_cache.stride(), layout)
    vp, vo, vh = _cache_strides(v_cache.stride(), layout)
    kds, kds_b, kds_h, has_kds = _descale(tensors["k_descale"], lse)
    vds, vds_b, vds_h, has_vds = _descale(tensors["v_descale"], lse)
    kv_start = tensors["kv_start"]
    window = int(options["window_left"])
    softcap = float(options["softcap"])
    stream = _stream(torch.cuda.current_stream(q.device).cuda_stream)
    with torch.cuda.device(q.device):
        from .decode import SplitKernel

        _runtime.launch(compiled, _launch_args(SplitKernel, dict(
            q_ptr=_ptr(q, q.element_size()), k_ptr=_ptr(k_cache, 16), v_ptr=_ptr(v_cache, 16),
            pt_ptr=_ptr(pt, 4, torch.int32), seqlens_ptr=_ptr(tensors["cache_seqlens"], 4, torch.int32),
            kv_start_ptr=_ptr(kv_start if kv_start is not None else lse, 4, torch.int32),
            kds_ptr=_ptr(kds, 4, torch.float32), vds_ptr=_ptr(vds, 4, torch.float32),
            part_o_ptr=_ptr(part_o, part_o.element_size()),
            part_l_ptr=_ptr(part_l, 4), sinks_ptr=_ptr(sinks_arg, 4, torch.float32),
            has_sinks=sinks is not None, batch=batch,
            **_strides(q.stride()[:3], (kp, ko, kh), (vp, vo, vh), pt.stride(0)),
            kds_b=kds_b, kds_h=kds_h, vds_b=vds_b, vds_h=vds_h,
            has_kv_start=kv_start is not None, has_kds=has_kds, has_vds=has_vds,
            window_left=max(window, 0), sm_scale=float(options["scale"]),
            softcap=softcap if softcap > 0 else 1.0, k_pages=k_cache.shape[0],
            v_pages=v_cache.shape[0], max_pages=pt.shape[1], stream=stream)))
        if splits > 1:
            merge = merge_step(triton_decode.merge_kernel, batch * s * hq, hq, v_cache.shape[-1], splits,
                               int(sinks is not None), out.dtype)
            merge.launch_tensors((part_o, part_l, sinks_arg, out, lse))


def _run_mla(tensors: dict, *, out, lse, scratch, options: dict, plan: dict) -> None:
    """The MLA split kernel (mla.py, mla_seesaw.py or mla_narrow.py) writes each split's partials into `scratch`
    and the Triton merge kernel combines them (with the sink) into `out` and `lse`; with one split, or splits
    that merge in their cluster (plan.mla_cluster_merge), the kernel writes `out` (rows on 16 bytes: its stores
    are 16 bytes wide) and `lse`. V is read from K's tiles: v_cache must be k_cache's
    first 512 columns (the same storage, offset and strides), which is checked here (fail closed)."""
    from b12x_inductor.kernels.triton import decode as triton_decode
    from b12x_inductor.kernels.triton import _cache_strides, merge_step, split_partials
    from b12x_inductor.validate import v_is_prefix_of_k

    q, k_cache, v_cache, pt = tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["page_table"]
    layout = options["kv_layout"]
    if v_cache.shape[-1] != MLA_DV or not v_is_prefix_of_k(k_cache, v_cache):
        raise ValueError("paged_attention: the cute family's MLA kernel reads V from K's tiles; v_cache must be "
                         f"k_cache[..., :{MLA_DV}] (the same storage and strides), got v_cache of shape "
                         f"{tuple(v_cache.shape)} and strides {tuple(v_cache.stride())}")
    fp8 = k_cache.dtype == FP8
    for name in ("k_descale", "v_descale"):
        ds = tensors[name]
        if ds is not None and (not fp8 or (ds.dim() == 2 and ds.shape[1] != 1)):
            raise ValueError(f"paged_attention: the cute family's MLA kernel takes {name} only with a float8 cache, "
                             f"as a scalar, [B] or [B, 1] (one KV head); got {name} of shape {tuple(ds.shape)} with "
                             f"a {k_cache.dtype} cache")
    batch, s, hq, _ = q.shape
    page, _ = cache_dims(k_cache.shape, layout)
    q_pe = tensors["q_pe"]
    if q_pe is None:  # the query in one tensor: its rope part is the view of its columns 512..
        q_pe = q[..., MLA_DV:]
    _check_aligned("q", q, MLA_DV)
    _check_aligned("q_pe", q_pe, MLA_D - MLA_DV)
    _check_aligned("k_cache", k_cache, MLA_D)
    splits = plan["num_splits"]
    merged = _plan.mla_writes_out(splits, plan["block_m"])  # the kernel writes out and lse itself
    if merged:
        _check_aligned("out", out, MLA_DV)  # the kernel writes out's rows in 16-byte stores
    shapes = dict(q_len=s, hq=hq, page_size=page, q_dtype=q.dtype, kv_dtype=k_cache.dtype)
    compiled = _compiled_mla(_mla_key(shapes, plan, options))
    part_o, part_l = (out, lse) if merged else split_partials(scratch, batch * s * hq * splits, MLA_DV, out.dtype)
    kp, ko, _ = _cache_strides(k_cache.stride(), layout)
    kv_start, sinks = tensors["kv_start"], tensors["sinks"]
    sinks_arg = sinks if sinks is not None else lse  # a valid float32 pointer where has_sinks is 0
    softcap = float(options["softcap"])
    kds, kds_b, _, has_kds = _descale(tensors["k_descale"], lse)
    vds, vds_b, _, has_vds = _descale(tensors["v_descale"], lse)
    stream = _stream(torch.cuda.current_stream(q.device).cuda_stream)
    with torch.cuda.device(q.device):
        _runtime.launch(compiled, _launch_args(mla_kernel_class(plan["num_warps"], plan["block_m"]), dict(
            q_ptr=_ptr(q, 16), qpe_ptr=_ptr(q_pe, 16), k_ptr=_ptr(k_cache, 16), pt_ptr=_ptr(pt, 4, torch.int32),
            seqlens_ptr=_ptr(tensors["cache_seqlens"], 4, torch.int32),
            kv_start_ptr=_ptr(kv_start if kv_start is not None else lse, 4, torch.int32),
            sinks_ptr=_ptr(sinks_arg, 4, torch.float32), part_o_ptr=_ptr(part_o, 16),
            part_l_ptr=_ptr(part_l, 4), out_ptr=_ptr(out, 2), lse_ptr=_ptr(lse, 4), kds_ptr=_ptr(kds, 4),
            vds_ptr=_ptr(vds, 4), kds_b=kds_b, vds_b=vds_b, has_kds=has_kds,
            has_vds=has_vds, batch=batch,
            q_sb=q.stride(0), q_ss=q.stride(1), q_sh=q.stride(2), pe_sb=q_pe.stride(0),
            pe_ss=q_pe.stride(1), pe_sh=q_pe.stride(2), k_sp=kp,
            k_so=ko, pt_sb=pt.stride(0), has_kv_start=kv_start is not None,
            has_sinks=sinks is not None, sm_scale=float(options["scale"]),
            softcap=softcap if softcap > 0 else 1.0, k_pages=k_cache.shape[0],
            max_pages=pt.shape[1], stream=stream)))
        if not merged:
            merge = merge_step(triton_decode.merge_kernel, batch * s * hq, hq, MLA_DV, splits, int(sinks is not None),
                               out.dtype)
            merge.launch_tensors((part_o, part_l, sinks_arg, out, lse))


def precompile(problem, plan, options) -> None:
    """Compiles the plan's kernels (decode/verify: also the Triton merge kernel) ahead of any launch."""
    if plan.family != "cute" or problem.device_type != "cuda":
        return
    compile_kernel(problem, plan, options)
    if plan.mode != "extend" and plan.num_splits > 1 and not (
            plan.v_from_k and _plan.mla_writes_out(plan.num_splits, plan.block_m)):
        _precompile_merge(problem, plan.num_splits)


def compile_kernel(problem, plan, options):
    """The plan's compiled CuTe kernel (the split or the extend kernel; not the Triton merge). Needs no GPU:
    without one the DSL compiles for the architecture `cute.compile`'s options name
    (tests/test_cute_compile_targets.py: sm_90a)."""
    options = options.as_kwargs()
    shapes = dict(d=problem.head_dim, q_len=problem.q_len, hq=problem.num_q_heads, hkv=problem.num_kv_heads,
                  page_size=problem.page_size, q_dtype=problem.q_dtype, kv_dtype=problem.kv_dtype,
                  batch=problem.batch, packed=problem.packed, sm_count=problem.sm_count)
    if plan.mode == "extend":
        return _compiled_extend(_extend_key(shapes, plan.constants(), options))
    if plan.v_from_k:
        return _compiled_mla(_mla_key(shapes, plan.constants(), options))
    return _compiled(_key(shapes, plan.constants(), options))


@functools.cache
def _precompile_merge(problem, splits: int) -> None:
    """Compiles and loads the merge launch `run` makes for the problem (merge_step: its grid and constants)."""
    from b12x_inductor.kernels.triton import decode as triton_decode
    from b12x_inductor.kernels.triton import merge_step
    from b12x_inductor.kernels.triton._compile_only import load_now

    hq = problem.num_q_heads
    step = merge_step(triton_decode.merge_kernel, problem.batch * problem.q_len * hq, hq, problem.v_head_dim, splits,
                      0, problem.q_dtype)
    k = step.kernel.warmup(  # partials in out's dtype (q's), LSEs, sinks, out, lse; has_sinks
        problem.q_dtype, torch.float32, torch.float32, problem.q_dtype, torch.float32, *step.scalars, grid=step.grid,
        **step.kwargs)
    load_now(k)


def _descale(ds, dummy):
    """(pointer, stride over B, stride over Hkv, flag) of a descale (kernels/triton: descale)."""
    from b12x_inductor.kernels.triton import descale

    ptr, layout = descale(ds, dummy)
    return (ptr, *layout)


class CuteFamily:
    """The CuTe DSL family as a KernelFamily (kernels/__init__.py)."""

    name = "cute"

    def available(self) -> bool:
        return available()

    def supports(self, problem) -> bool:
        return supports(problem)

    def preferred(self, problem) -> bool:
        return _plan.measured_faster(problem)

    def plan(self, problem, **tiles):
        return _plan.plan(problem, **tiles)

    def precompile(self, problem, plan, options) -> None:
        precompile(problem, plan, options)

    def run(self, call) -> None:
        mla = call.plan.v_from_k and call.k_cache.shape[-1] == MLA_D and call.mode != "extend"
        if call.key_mask is not None or (call.v_cache.shape[-1] != call.k_cache.shape[-1] and not mla):
            raise ValueError("paged_attention: the cute family takes no key_mask and no value head dim apart from "
                             "the key's but absorbed MLA's (supports() refuses them; select_plan picks the Triton "
                             "family)")
        if call.q_pe is not None and not mla:
            raise ValueError("paged_attention: of the cute family only the MLA decode/verify kernel takes q_pe "
                             f"(plan {call.plan})")
        run(call.mode, call.inputs(), out=call.out, lse=call.lse, scratch=call.scratch,
            options=call.options.as_kwargs(), plan=call.plan.constants())


FAMILY = CuteFamily()
