"""Compile-time plans: `select_plan` maps the static facts of a call to a frozen `Plan`.

This is the only place that decides how a call runs. The eager op and the Inductor lowering both build a
`Problem` (shapes, dtypes, layout, page size, device) and ask `select_plan`; the lowering writes the
returned plan's constants into the generated code as literal arguments of the plan's entry op.

Modes, from static shapes alone (D: q's and k's head dim; v and out have Dv, which may differ):
- decode:  q [B, 1, Hq, D]
- verify:  q [B, S, Hq, D] with 2 <= S <= 16 (speculative-decoding drafts checked in one pass)
- extend:  q [B, S, Hq, D] with S > 16, or packed q [T, Hq, D] with cu_seqlens_q (T is a capacity: the
           live token counts come from cu_seqlens_q on the device and are never read on the host)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# The one table of what the op takes (validate.py checks it; every family's `supports` and the substitution
# pass read it from here).
MAX_VERIFY_LEN = 16
# Head dims. q and k share the head dim D, v (and out) have the value head dim Dv:
#   D  (q, k)                 Dv (v, out)
#   64, 96, 128, 192, 256     64, 96, 128, 192, 256, 512   (any pair: Dv == D is plain GQA; DeepSeek-V3's
#                                                          non-absorbed MLA is D = 192, Dv = 128)
#   576                       512 only                     (absorbed MLA, DeepSeek-V3 / Kimi: k is the
#                                                          512-dim latent + 64-dim rope key, v the latent)
HEAD_DIMS = (64, 96, 128, 192, 256)
V_HEAD_DIMS = (64, 96, 128, 192, 256, 512)
MLA_HEAD_DIMS = {576: 512}  # D outside HEAD_DIMS -> the one Dv it pairs with
FP8 = torch.float8_e4m3fn
Q_DTYPES_CUDA = (torch.bfloat16, torch.float16)
Q_DTYPES_CPU = (torch.bfloat16, torch.float16, torch.float32)
MODES = ("decode", "verify", "extend")
FAMILIES = ("torch", "triton", "cute")


def head_dims_supported(head_dim: int, v_head_dim: int) -> bool:
    """Whether the op takes q/k head dim `head_dim` with value head dim `v_head_dim` (the table above)."""
    if head_dim in HEAD_DIMS:
        return v_head_dim in V_HEAD_DIMS
    return MLA_HEAD_DIMS.get(head_dim) == v_head_dim


@dataclass(frozen=True, kw_only=True)
class Problem:
    """The static facts of one paged-attention call: everything a plan may depend on."""

    batch: int  # B: rows of page_table
    q_len: int  # S of q [B, S, Hq, D]; for packed q [T, Hq, D], its capacity T
    packed: bool  # q is [T, Hq, D] with cu_seqlens_q
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # D: q's and k's head dim
    page_size: int
    max_pages: int  # columns of page_table: the static KV capacity is max_pages * page_size
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    kv_layout: str  # "NHD" or "HND"
    device_type: str  # "cpu" or "cuda"
    sm_count: int = 0  # streaming multiprocessors (cuda)
    capability: tuple[int, int] = (0, 0)  # compute capability (cuda)
    key_mask: bool = False  # a key_mask tensor is passed (the kernel reads it: families that do not, refuse)
    v_head_dim: int | None = None  # Dv: v's and out's head dim; None (the default) means head_dim
    window_left: int = -1  # the sliding window (a query at position i sees keys i - window_left .. i); -1: none
    v_in_k: bool = False  # v_cache is k_cache's first Dv columns: the same storage, offset and strides, only the
    #                       last dim narrower (mla_attention's view of the latent cache); False when not known

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def kv_capacity(self) -> int:
        return self.max_pages * self.page_size

    @property
    def kv_span(self) -> int:
        """The most keys one request's queries can see: the capacity, or with a window the window_left + S
        keys that S consecutive queries reach (what split-KV partitions; the kernels bound their key range
        by the window on the device)."""
        if self.window_left < 0 or self.packed:
            return self.kv_capacity
        return min(self.kv_capacity, self.window_left + self.q_len)

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
    scratch_bytes: int  # the splits' partial outputs (out's dtype) and fp32 LSEs, allocated by the caller
    v_from_k: bool = False  # V's tile is K's (no second load): only where Problem.v_in_k (the launch checks)

    @classmethod
    def of_entry(cls, mode: str, scratch_bytes: int, **constants) -> Plan:
        """The plan an entry op runs: its mode, its scratch's size and the constants it was called with."""
        return cls(mode=mode, scratch_bytes=scratch_bytes, **constants)

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
            v_from_k=self.v_from_k,
        )


def split_scratch_bytes(problem: Problem, num_splits: int) -> int:
    """Bytes of split-KV scratch: the splits' partial outputs [rows, Hq, splits, Dv] in out's dtype (q's), then
    their fp32 LSEs [rows, Hq, splits] (none for one split: every family's split kernel then writes out and lse
    itself). Each partial is normalized by its own row sum, a convex combination of V rows, so it
    fits out's dtype as out itself does; the merge adds them in fp32 (kernels/triton/__init__.py,
    split_partials, is the layout)."""
    if num_splits <= 1:
        return 0
    rows = problem.batch * problem.q_len * problem.num_q_heads * num_splits
    return partials_bytes(rows, problem.v_head_dim, problem.q_dtype)


def partials_bytes(rows: int, dv: int, dtype: torch.dtype) -> int:
    """Bytes of `rows` split partials of `dv` values in `dtype` followed by their fp32 LSEs (split_partials)."""
    return rows * (dv * dtype.itemsize + 4)


@functools.cache
def device_facts(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of a CUDA device; zeros elsewhere."""
    if device.type != "cuda":
        return 0, (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, (props.major, props.minor)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


def select_plan(problem: Problem) -> Plan:
    """The plan for a problem. Pure: the same Problem always gets the same Plan.

    The families are tried in `kernels.FAMILY_ORDER` (CuTe DSL, Triton, torch); the first that is installed,
    expresses the problem and is preferred for it (its measured-faster rule, beside its plan) plans it:
    - family: "torch" off CUDA (and for what no kernel expresses), else the fastest kernel family that
      supports the problem.
    - decode / verify: the S x (Hq / Hkv) query rows of one KV head share one tile (block_m rows) and one
      read of each KV tile; the KV range is split into num_splits partitions so that B x Hkv x splits
      programs fill the GPU, each partition sized on the device from the live length, then merged.
    - extend: 128 query rows per program, no split: a warp-specialized wgmma kernel (CuTe family) where it
      applies, FlashAttention-2-style tiles (Triton) elsewhere.
    """
    from b12x_inductor.kernels import FAMILY_ORDER, family

    for name in FAMILY_ORDER:
        fam = family(name)
        if fam.supports(problem) and fam.available() and fam.preferred(problem):
            return fam.plan(problem)
    raise AssertionError(f"the torch family takes every problem; none took {problem}")


def family_plan(problem: Problem, family: str, **tiles) -> Plan:
    """The plan of one kernel family for a problem, with `tiles` (num_splits, block_m, block_n, num_warps,
    num_stages, v_from_k) replacing its choices and the scratch sized for them. `select_plan` alone decides which
    family runs; this is what tests and benchmarks call to run a family, or tiles, it would not pick. A
    family whose `supports` refuses the problem raises: its kernels would not honor it."""
    from b12x_inductor.kernels import family as family_of

    chosen = family_of(family)
    if not chosen.supports(problem):
        raise ValueError(f"paged_attention: the {family} family does not express this problem ({problem}); "
                         f"select_plan picks a family that does")
    return chosen.plan(problem, **tiles)


def with_tiles(problem: Problem, plan: Plan, tiles: dict) -> Plan:
    """`plan` with `tiles` replacing its tile fields and its scratch sized for the split count they give."""
    if not tiles:
        return plan
    plan = dataclasses.replace(plan, **tiles)
    scratch = 0 if plan.mode == "extend" else split_scratch_bytes(problem, plan.num_splits)
    return dataclasses.replace(plan, scratch_bytes=scratch)


def split_count(problem: Problem, programs: int, *, programs_per_sm: int, min_split_keys: int,
                max_splits: int) -> int:
    """Split-KV partitions: the smallest power of two that brings `programs` x splits to about
    programs_per_sm per SM, each split keeping at least min_split_keys of the keys a query can see
    (`Problem.kv_span`: the capacity, or the window's keys)."""
    target = prev_pow2(programs_per_sm * max(problem.sm_count, 1))
    num_splits = 1
    while (programs * num_splits < target and num_splits < max_splits
           and problem.kv_span // (2 * num_splits) >= min_split_keys):
        num_splits *= 2
    return num_splits
