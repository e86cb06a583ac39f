"""Kernel families behind the plans' entry ops, and the one typed call they all take.

An entry op (`torch.ops.b12x.paged_attention_{decode,verify,extend}`), or the eager op directly, builds one
`Call` (its tensors, its `Options` and its `Plan`) and `run` hands it to the plan's family. A family is a
`KernelFamily`: whether it is installed, which problems it expresses, whether it is the one to prefer for a
problem, its plan, its ahead-of-time compile and its run. `FAMILY_ORDER` is the order `select_plan` tries them in.
- reference.py: the fp32 executable definition of the semantics (tests compare everything with it)
- torch_impl.py: the vectorized torch family (CPU, and CUDA where no kernel supports a problem)
- triton/: the Triton family (CUDA, sm80 on)
- cute/: the CuTe DSL family (Hopper)
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Protocol

import torch

FAMILY_ORDER = ("cute", "triton", "torch")  # select_plan's preference: the first that takes a problem runs it
_MODULES = {"torch": "b12x_inductor.kernels.torch_impl", "triton": "b12x_inductor.kernels.triton",
            "cute": "b12x_inductor.kernels.cute"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """A call's options as the entry ops take them (the scale already defaulted)."""

    kv_layout: str  # "NHD" or "HND"
    causal: bool
    scale: float
    window_left: int  # -1: no window
    softcap: float  # 0: no softcap

    @classmethod
    def of(cls, head_dim: int, *, kv_layout, causal, scale, window_left, softcap) -> Options:
        """The options of a public call: scale None becomes head_dim ** -0.5 (the eager op, the lowering and
        `warmup` all build them here)."""
        scale = float(head_dim) ** -0.5 if scale is None else float(scale)
        return cls(kv_layout=kv_layout, causal=bool(causal), scale=scale, window_left=int(window_left),
                   softcap=float(softcap))

    def as_kwargs(self) -> dict:
        """The fields as the entry ops' keyword arguments: a shallow copy (the values are flat; dataclasses.asdict's
        recursive copy was about 15 % of the eager op's own host time)."""
        return dict(vars(self))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Call:
    """One paged-attention call as every family runs it: read the inputs, write `out`, `lse` and `scratch`
    only. Shapes (validate.py checks them before a Call exists):
    q [B, S, Hq, D] or packed [T, Hq, D] (bf16/fp16, fp32 on CPU); k_cache, v_cache [num_pages, page_size,
    Hkv, D] (NHD) or [num_pages, Hkv, page_size, D] (HND), q's dtype or float8_e4m3fn, v_cache's last dim the
    value head dim Dv (which may differ from D: MLA); page_table int32 [B, max_pages]; cache_seqlens int32
    [B]; cu_seqlens_q int32 [B + 1] (packed q) or None; kv_start int32 [B] or None; sinks float32 [Hq] or
    None; k_descale, v_descale float32 scalar, [B] or [B, Hkv], or None; key_mask bool [B, S or 1, max_pages *
    page_size] (4-D q only; any strides) or None; q_pe None, or (D = 576, absorbed MLA) the query's last 64
    columns apart, q's leading dims with 64 last (last dim contiguous), q then holding its first 512: the query
    is cat(q, q_pe, dim=-1), D below is the concatenation's; out q's shape with Dv last, q's dtype; lse
    float32 q's shape without D; scratch uint8 [plan.scratch_bytes]."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    kv_start: torch.Tensor | None
    sinks: torch.Tensor | None
    k_descale: torch.Tensor | None
    v_descale: torch.Tensor | None
    key_mask: torch.Tensor | None
    q_pe: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor
    scratch: torch.Tensor
    options: Options
    plan: object  # b12x_inductor.plan.Plan

    INPUTS = ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q", "kv_start", "sinks",
              "k_descale", "v_descale", "key_mask", "q_pe")

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def packed(self) -> bool:
        return self.q.dim() == 3

    @property
    def head_dim(self) -> int:
        """D: the query's (and the keys') head dim, q_pe's columns included."""
        return self.q.shape[-1] + (0 if self.q_pe is None else self.q_pe.shape[-1])

    def inputs(self) -> dict:
        """The input tensors by name (the reference's and the torch family's keyword arguments)."""
        return {name: getattr(self, name) for name in self.INPUTS}


class KernelFamily(Protocol):
    """One kernel family. `plan` and `preferred` are pure functions of the Problem; `run` writes only the
    call's out, lse and scratch, allocates nothing and never syncs with the host."""

    name: str

    def available(self) -> bool: ...  # its software is installed

    def supports(self, problem) -> bool: ...  # it expresses the problem (device, dtypes, head dims, ...)

    def preferred(self, problem) -> bool: ...  # where it measured faster than the families after it

    def plan(self, problem, **tiles): ...  # its Plan for the problem (tiles: replaced choices), scratch included

    def precompile(self, problem, plan, options: Options) -> None: ...  # no JIT compile inside a capture

    def run(self, call: Call) -> None: ...


_FAMILIES: dict[str, KernelFamily] = {}  # name -> its module's FAMILY, imported at the first use


def family(name: str) -> KernelFamily:
    """The family object of a plan's family name."""
    found = _FAMILIES.get(name)
    if found is None:
        if name not in _MODULES:
            raise ValueError(f"paged_attention: plan family must be one of {FAMILY_ORDER}; got {name!r}")
        found = _FAMILIES[name] = importlib.import_module(_MODULES[name]).FAMILY
    return found


def run(call: Call) -> None:
    """Runs one plan (the entry ops' and the eager op's path to a kernel)."""
    family(call.plan.family).run(call)


def precompile(problem, plan, options: Options) -> None:
    """Compiles the plan's kernels ahead (called by the lowering while Inductor compiles the graph, and by
    `b12x_inductor.warmup`), so that no JIT compile ever happens inside a CUDA-graph capture."""
    family(plan.family).precompile(problem, plan, options)
