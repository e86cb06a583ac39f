"""Compile-time plans: `select_plan` maps the static facts of a call to a frozen `Plan`.

This is the only place that decides how a call runs. The eager op and the Inductor lowering both build a
`Problem` (shapes, dtypes, layout, page size, device) and ask `select_plan`; the lowering writes the
returned plan's constants into the generated code as literal arguments of the plan's entry op.

Modes, from static shapes alone:
- decode:  q [B, 1, Hq, D]
- verify:  q [B, S, Hq, D] with 2 <= S <= 16 (speculative-decoding drafts checked in one pass)
- extend:  q [B, S, Hq, D] with S > 16, or packed q [T, Hq, D] with cu_seqlens_q (T is a capacity: the
           live token counts come from cu_seqlens_q on the device and are never read on the host)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_VERIFY_LEN = 16
HEAD_DIMS = (64, 96, 128, 192, 256)
MODES = ("decode", "verify", "extend")
FAMILIES = ("torch", "triton", "cute")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """The static facts of one paged-attention call: everything a plan may depend on."""

    batch: int  # B: rows of page_table
    q_len: int  # S of q [B, S, Hq, D]; for packed q [T, Hq, D], its capacity T
    packed: bool  # q is [T, Hq, D] with cu_seqlens_q
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_pages: int  # columns of page_table: the static KV capacity is max_pages * page_size
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_layout: str  # "NHD" or "HND"
    device_type: str  # "cpu" or "cuda"
    sm_count: int = 0  # streaming multiprocessors (cuda)
    capability: tuple[int, int] = (0, 0)  # compute capability (cuda)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def kv_capacity(self) -> int:
        return self.max_pages * self.page_size

    @property
    def mode(self) -> str:
        if self.packed or self.q_len > MAX_VERIFY_LEN:
            return "extend"
        return "decode" if self.q_len == 1 else "verify"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one bucket of calls runs; every field is a compile-time constant of the generated code."""

    mode: str  # "decode" | "verify" | "extend"
    family: str  # kernel family: "torch" (vectorized torch), "triton", "cute"
    num_splits: int  # split-KV partitions per (request, KV head); 1 = no split, no merge
    block_m: int  # query rows per tile (packed query heads x new tokens in decode/verify); cute: 1 = CUDA-core
    #               products per row, 16 = one m16 tensor-core tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    scratch_bytes: int  # fp32 partial outputs and LSEs of the splits, allocated by the caller

    @property
    def entry_op(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.b12x, f"paged_attention_{self.mode}").default

    def constants(self) -> dict:
        """The plan's fields as keyword arguments of its entry op."""
        return dict(
            family=self.family,
            num_splits=self.num_splits,
            block_m=self.block_m,
            block_n=self.block_n,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def split_scratch_bytes(problem: Problem, num_splits: int, always: bool = False) -> int:
    """Bytes of split-KV scratch: fp32 partial outputs [rows, Hq, splits, D] and LSEs [rows, Hq, splits]
    (none for one split, unless `always`: the CuTe family always writes partials and merges)."""
    if num_splits <= 1 and not always:
        return 0
    rows = problem.batch * problem.q_len
    return rows * problem.num_q_heads * num_splits * (problem.head_dim + 1) * 4


@functools.cache
def device_facts(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of a CUDA device; zeros elsewhere."""
    if device.type != "cuda":
        return 0, (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, (props.major, props.minor)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _family(problem: Problem) -> str:
    if problem.device_type != "cuda":
        return "torch"
    from b12x_inductor.kernels import cute as cute_kernels
    from b12x_inductor.kernels import triton as triton_kernels

    if cute_kernels.supports(problem) and cute_kernels.available() and _cute_measured_faster(problem):
        return "cute"
    return "triton" if triton_kernels.supports(problem) else "torch"


def select_plan(problem: Problem) -> Plan:
    """The plan for a problem. Pure: the same Problem always gets the same Plan.

    - family: "torch" off CUDA (and for what no kernel expresses), else the fastest kernel family that
      supports the problem.
    - decode / verify: the S x (Hq / Hkv) query rows of one KV head share one tile (block_m rows) and one
      read of each KV tile; the KV range is split into num_splits partitions so that B x Hkv x splits
      programs fill the GPU, each partition sized on the device from the live length, then merged.
    - extend: 128 query rows per program, no split: a warp-specialized wgmma kernel (CuTe family) where it
      applies, FlashAttention-2-style tiles (Triton) elsewhere.
    """
    return family_plan(problem, _family(problem))


def family_plan(problem: Problem, family: str) -> Plan:
    """The tiles of one kernel family for a problem. `select_plan` alone decides which family runs; this is
    also what tests and benchmarks call to run a family that select_plan would not pick."""
    if family == "torch":
        return Plan(mode=problem.mode, family="torch", num_splits=1, block_m=0, block_n=0, num_warps=0,
                    num_stages=0, scratch_bytes=0)
    if family == "cute":
        return _cute_plan(problem)
    return _triton_plan(problem)


# Triton tiles, measured on the H200 (benchmarks/results/h200.md, "## Kernels"). Decode/verify are bound by
# the KV bytes: split-KV programs (B x Hkv x M-tiles x splits) should number about 8 per SM, the split count
# a power of two (uneven splits and part waves cost up to 25 %), each split at least 256 keys of capacity.
# float8 caches take 128-key tiles (half the bytes per key).
_TRITON_PROGRAMS_PER_SM = 8
_TRITON_MIN_SPLIT_KEYS = 256
_TRITON_MAX_SPLITS = 64


def _prev_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _split_count(problem: Problem, programs: int) -> int:
    """Split-KV partitions: the smallest power of two that brings `programs` x splits to about
    _TRITON_PROGRAMS_PER_SM per SM, each split keeping at least _TRITON_MIN_SPLIT_KEYS keys of capacity."""
    target = _prev_pow2(_TRITON_PROGRAMS_PER_SM * max(problem.sm_count, 1))
    num_splits = 1
    while (programs * num_splits < target and num_splits < _TRITON_MAX_SPLITS
           and problem.kv_capacity // (2 * num_splits) >= _TRITON_MIN_SPLIT_KEYS):
        num_splits *= 2
    return num_splits


def _triton_plan(problem: Problem) -> Plan:
    """The Triton family's tiles and split count: a pure function of the Problem."""
    mode, d = problem.mode, problem.head_dim
    fp8 = problem.kv_dtype == torch.float8_e4m3fn
    if mode == "extend":
        if d <= 128:
            return Plan(mode=mode, family="triton", num_splits=1, block_m=128, block_n=128, num_warps=8,
                        num_stages=3, scratch_bytes=0)
        return Plan(mode=mode, family="triton", num_splits=1, block_m=64, block_n=32, num_warps=4, num_stages=2,
                    scratch_bytes=0)
    rows = problem.q_len * problem.group  # query rows packed per KV head
    block_m = min(max(16, _next_pow2(rows)), 64 if d > 128 else 128)
    m_tiles = -(-rows // block_m)
    block_n = (128 if fp8 else 64) if d <= 128 else (64 if fp8 else 32)
    num_splits = _split_count(problem, problem.batch * problem.num_kv_heads * m_tiles)
    return Plan(mode=mode, family="triton", num_splits=num_splits, block_m=block_m, block_n=block_n,
                num_warps=4 if block_m <= 32 else 8, num_stages=2,
                scratch_bytes=split_scratch_bytes(problem, num_splits))


# CuTe DSL decode/verify tiles: one CTA per (request, KV head, split) with all S x G query rows, a cp.async
# ring of `num_stages` tiles of `block_n` keys. Split count: the Triton rule. block_m 1 selects the CUDA-core
# kernel (decode.py), 16 the tensor-core one (decode_mma.py). Measured on the H200 (h200.md, "CuTe DSL"):
# CUDA cores with 64-key tiles, 2 stages and 4 warps beat 128-key tiles, 3 stages and 8 warps; for float8
# decode the tensor cores with 128-key tiles beat them by 0-9 % once a split spans >= 1024 keys of capacity
# (and lose 10 % at 512).
_CUTE_TILE = dict(block_m=1, block_n=64, num_stages=2, num_warps=4)
_CUTE_MMA_TILE = dict(block_m=16, block_n=128, num_stages=2, num_warps=4)
_CUTE_MMA_MIN_SPLIT_KEYS = 1024


def _cute_plan(problem: Problem) -> Plan:
    if problem.mode == "extend":
        # kernels/cute/extend.py: 128 query rows (two consumer warpgroups) and a producer warpgroup; 128-key
        # tiles, as many stages as shared memory holds (Q 32 KB + 64 KB per stage at D = 128: 3 stages;
        # kernels/cute/__init__.py: extend_geometry). 2 stages, or 64-key tiles with 4, measured 10-13 %
        # slower (h200.md, "CuTe DSL extend", run 11).
        return Plan(mode="extend", family="cute", num_splits=1, block_m=128, block_n=128, num_warps=12,
                    num_stages=3 if problem.head_dim > 64 else 4, scratch_bytes=0)
    num_splits = _split_count(problem, problem.batch * problem.num_kv_heads)
    tile = _CUTE_TILE
    if (problem.mode == "decode" and problem.kv_dtype == torch.float8_e4m3fn and problem.head_dim <= 128
            and problem.kv_capacity // num_splits >= _CUTE_MMA_MIN_SPLIT_KEYS):
        tile = _CUTE_MMA_TILE
    return Plan(mode=problem.mode, family="cute", num_splits=num_splits, **tile,
                scratch_bytes=split_scratch_bytes(problem, num_splits, always=True))


def _cute_measured_faster(problem: Problem) -> bool:
    """Where the CuTe family measured faster than Triton on the H200 (benchmarks/results/h200.md, "CuTe
    DSL"):
    - decode from a float8 cache with D = 128 and at most 4 query heads per KV head (1.09-1.15x on all six
      benchmark rows; 1.11-1.20x with the 128-key tensor-core tiles on the four largest);
    - extend, wherever the family expresses it (D 64 or 128, the cache in q's dtype: `supports`):
      1.12-1.38x on all ten rows measured (D 128 and 64; prefills of 1024-16384 tokens, chunked prefills of
      512-1024 new tokens on 8192 keys; causal, page 16, 4 query heads per KV head).
    bf16 decode (0.84-0.89x) and verify (0.3-0.4x) stay on Triton, whose products run on tensor cores; decode
    configurations not measured (other head dims, larger groups) stay on Triton too."""
    if problem.mode == "extend":
        return True
    return (problem.mode == "decode" and problem.kv_dtype == torch.float8_e4m3fn and problem.head_dim == 128
            and problem.group <= 4)
