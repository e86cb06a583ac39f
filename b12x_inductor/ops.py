"""The `torch.ops.b12x` custom ops, their eager implementations and their fake (meta) implementations.

Public ops (what user code and graph passes call):
- b12x::paged_attention(...) -> (out, lse)           functional; lowered by lowering/paged_attention.py
- b12x::paged_attention_out(..., out) -> lse         writes a caller's `out`
- b12x::write_kv(k, v, k_cache, v_cache, slot_mapping, ...) -> ()   mutates the caches in place
- b12x::write_latent(ckv, kpe, kv_cache, slot_mapping, *, scale) -> ()   mutates MLA's latent cache in place
- b12x::refuse(exc, message) -> ()                   raises; how the public functions' checks fail under Dynamo

None has a backward: with grad mode on, an input that requires grad raises (their Autograd kernels).

Entry ops (one per plan mode; what the lowering emits, with the plan's constants as literals):
- b12x::paged_attention_{decode,verify,extend}(..., out, lse, scratch, *, options, plan constants) -> ()
  They write out, lse and scratch, which Inductor allocates, and hand the plan's family one typed
  `kernels.Call` (`_run_entry`; the eager op calls `_run_entry` itself, with the buffers it allocates).
"""

from __future__ import annotations

import functools

import torch

from b12x_inductor import kernels, validate
from b12x_inductor.kernels import Call, Options
from b12x_inductor.plan import MODES, Plan, select_plan

_lib = torch.library.Library("b12x", "DEF")

_ARGS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cache_seqlens, "
    "Tensor? cu_seqlens_q=None, *, str kv_layout=\"NHD\", bool causal=True, float? scale=None, "
    "int window_left=-1, Tensor? kv_start=None, Tensor? sinks=None, float softcap=0.0, "
    "Tensor? k_descale=None, Tensor? v_descale=None, Tensor? key_mask=None, Tensor? q_pe=None"
)
_ENTRY = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cache_seqlens, "
    "Tensor? cu_seqlens_q, Tensor? kv_start, Tensor? sinks, Tensor? k_descale, Tensor? v_descale, "
    "Tensor? key_mask, Tensor? q_pe, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) scratch, *, str kv_layout, bool causal, float scale, "
    "int window_left, float softcap, str family, int num_splits, int block_m, int block_n, int num_warps, "
    "int num_stages, bool v_from_k"
)
_lib.define(f"paged_attention({_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"paged_attention_out({_ARGS}, Tensor(a!) out) -> Tensor")
for _mode in MODES:
    _lib.define(f"paged_attention_{_mode}({_ENTRY}) -> ()")
_lib.define(
    "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, *, "
    "str kv_layout=\"NHD\", Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
)
_lib.define(
    "write_latent(Tensor ckv, Tensor kpe, Tensor(a!) kv_cache, Tensor slot_mapping, *, Tensor? scale=None) -> ()"
)

_lib.define("refuse(str exc, str message) -> ()")  # raises exc(message): validate.refuse, under Dynamo

plan_for = functools.lru_cache(maxsize=1024)(select_plan)


def _refuse(exc, message):
    raise validate.REFUSALS[exc](message)


torch.library.impl(_lib, "refuse", "CompositeExplicitAutograd")(_refuse)
torch.library.register_fake("b12x::refuse")(_refuse)


def _run_plan(plan: Plan, q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
              kv_start, sinks, k_descale, v_descale, key_mask, q_pe, out, options: Options) -> torch.Tensor:
    """Runs `plan` as its entry op would (`_run_entry`), called directly: the eager op's arguments are
    checked, so a second trip through the dispatcher would only add host time."""
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=q.device) if plan.scratch_bytes else \
        _no_scratch(q.device)
    _run_entry(Call(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_seqlens=cache_seqlens,
                    cu_seqlens_q=cu_seqlens_q, kv_start=kv_start, sinks=sinks, k_descale=k_descale,
                    v_descale=v_descale, key_mask=key_mask, q_pe=q_pe, out=out, lse=lse, scratch=scratch,
                    options=options, plan=plan))
    return lse


@functools.lru_cache(maxsize=16)
def _no_scratch(device: torch.device) -> torch.Tensor:
    """The scratch of a plan that needs none (no bytes: nothing reads or writes it), one per device."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def _run_entry(call: Call) -> None:
    """What an entry op runs: the device-value checks where B12X_DEBUG asks for them, then the plan's family."""
    if validate.debug_enabled():
        validate.check_device_values(call.q, call.k_cache, call.page_table, call.cache_seqlens, call.cu_seqlens_q,
                                     call.kv_start, call.options.kv_layout)
    kernels.run(call)


def _eager(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, *, kv_layout="NHD", causal=True,
           scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None, v_descale=None,
           key_mask=None, q_pe=None, out=None):
    problem = validate.check_paged_attention(
        q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_layout=kv_layout, causal=causal,
        scale=scale, window_left=window_left, kv_start=kv_start, sinks=sinks, softcap=softcap,
        k_descale=k_descale, v_descale=v_descale, key_mask=key_mask, q_pe=q_pe, out=out)
    if out is None:  # q's shape with the value head dim
        out = torch.empty(q.shape[:-1] + (v_cache.shape[-1],), dtype=q.dtype, device=q.device)
    lse = _run_plan(plan_for(problem), q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q,
                    kv_start, sinks, k_descale, v_descale, key_mask, q_pe, out,
                    Options.of(problem.head_dim, kv_layout=kv_layout, causal=causal, scale=scale,
                               window_left=window_left, softcap=softcap))
    return out, lse


@torch.library.impl(_lib, "paged_attention", "CompositeExplicitAutograd")
def _paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, **kw):
    return _eager(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, **kw)


@torch.library.impl(_lib, "paged_attention_out", "CompositeExplicitAutograd")
def _paged_attention_out(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, *, out, **kw):
    return _eager(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, out=out, **kw)[1]


def _fake_check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, out=None, *, kv_layout="NHD",
                causal=True, scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None,
                v_descale=None, key_mask=None, q_pe=None):
    validate.check_paged_attention(
        q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_layout=kv_layout, causal=causal,
        scale=scale, window_left=window_left, kv_start=kv_start, sinks=sinks, softcap=softcap,
        k_descale=k_descale, v_descale=v_descale, key_mask=key_mask, q_pe=q_pe, out=out, want_problem=False)


@torch.library.register_fake("b12x::paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, **kw):
    _fake_check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, **kw)
    out = q.new_empty(q.shape[:-1] + (v_cache.shape[-1],))  # contiguous; q's shape with the value head dim
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("b12x::paged_attention_out")
def _paged_attention_out_fake(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, *, out, **kw):
    _fake_check(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, out, **kw)
    return q.new_empty(q.shape[:-1], dtype=torch.float32)


@functools.lru_cache(maxsize=1024)
def _entry_constants(mode: str, scratch_bytes: int, kv_layout, causal, scale, window_left, softcap, family, num_splits,
                     block_m, block_n, num_warps, num_stages, v_from_k) -> tuple[Options, Plan]:
    """The Options and the Plan of an entry op's constants, made once per distinct set (an entry op is called with
    the same literals at every step of a compiled graph)."""
    return (Options(kv_layout=kv_layout, causal=causal, scale=scale, window_left=window_left, softcap=softcap),
            Plan.of_entry(mode, scratch_bytes, family=family, num_splits=num_splits, block_m=block_m,
                          block_n=block_n, num_warps=num_warps, num_stages=num_stages, v_from_k=v_from_k))


def _entry(mode: str):
    def impl(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start, sinks, k_descale, v_descale,
             key_mask, q_pe, out, lse, scratch, *, kv_layout, causal, scale, window_left, softcap, family, num_splits,
             block_m, block_n, num_warps, num_stages, v_from_k):
        options, plan = _entry_constants(mode, scratch.numel(), kv_layout, causal, scale, window_left, softcap, family,
                                         num_splits, block_m, block_n, num_warps, num_stages, v_from_k)
        _run_entry(Call(
            q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_seqlens=cache_seqlens,
            cu_seqlens_q=cu_seqlens_q, kv_start=kv_start, sinks=sinks, k_descale=k_descale, v_descale=v_descale,
            key_mask=key_mask, q_pe=q_pe, out=out, lse=lse, scratch=scratch, options=options, plan=plan))

    def fake(*args, **kwargs):
        return None

    torch.library.impl(_lib, f"paged_attention_{mode}", "CompositeExplicitAutograd")(impl)
    torch.library.register_fake(f"b12x::paged_attention_{mode}")(fake)


for _mode in MODES:
    _entry(_mode)


def _no_grad_kernel(name: str, op: str, tensor_args: tuple[str, ...]):
    """An Autograd kernel for b12x::<name>: the ops have no backward, so with grad mode on an input that
    requires grad raises (eagerly, and while Dynamo and AOTAutograd trace: their fake tensors carry
    requires_grad); otherwise it redispatches below autograd, so outputs never claim a gradient they
    would not get. Inference-mode tensors skip it."""
    overload = getattr(torch.ops.b12x, name).default
    positional = [a.name for a in overload._schema.arguments if not a.kwarg_only]

    def kernel(keyset, *args, **kwargs):
        from b12x_inductor.lowering._inductor import redispatch_below_autograd  # after the imports: no cycle

        if torch.is_grad_enabled():  # check_no_grad's own test, first: no_grad/inference calls skip the names
            named = dict(zip(positional, args), **kwargs)
            validate.check_no_grad(op, {a: named.get(a) for a in tensor_args})
        return redispatch_below_autograd(overload, keyset, *args, **kwargs)

    _lib.impl(name, kernel, "Autograd", with_keyset=True)


_ATTN_TENSORS = ("q", "q_pe", "k_cache", "v_cache", "sinks", "k_descale", "v_descale")
_no_grad_kernel("paged_attention", "paged_attention", _ATTN_TENSORS)
_no_grad_kernel("paged_attention_out", "paged_attention", _ATTN_TENSORS + ("out",))


@torch.library.impl(_lib, "write_kv", "CompositeExplicitAutograd")
def _write_kv(k, v, k_cache, v_cache, slot_mapping, *, kv_layout="NHD", k_scale=None, v_scale=None):
    validate.check_write_kv(k, v, k_cache, v_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale,
                            v_scale=v_scale)
    if validate.debug_enabled():
        validate.check_slots(k_cache, slot_mapping, validate.cache_dims(k_cache.shape, kv_layout)[0])
    from b12x_inductor.kernels.torch_impl import write_kv_torch

    write_kv_torch(k, v, k_cache, v_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)


@torch.library.register_fake("b12x::write_kv")
def _write_kv_fake(k, v, k_cache, v_cache, slot_mapping, *, kv_layout="NHD", k_scale=None, v_scale=None):
    validate.check_write_kv(k, v, k_cache, v_cache, slot_mapping, kv_layout=kv_layout, k_scale=k_scale,
                            v_scale=v_scale)


_no_grad_kernel("write_kv", "write_kv", ("k", "v", "k_cache", "v_cache", "k_scale", "v_scale"))


@torch.library.impl(_lib, "write_latent", "CompositeExplicitAutograd")
def _write_latent(ckv, kpe, kv_cache, slot_mapping, *, scale=None):
    validate.check_write_latent(ckv, kpe, kv_cache, slot_mapping, scale=scale)
    if validate.debug_enabled():
        validate.check_slots(kv_cache, slot_mapping, kv_cache.shape[1], "write_latent")
    from b12x_inductor.kernels.torch_impl import write_latent_torch

    write_latent_torch(ckv, kpe, kv_cache, slot_mapping, scale=scale)


@torch.library.register_fake("b12x::write_latent")
def _write_latent_fake(ckv, kpe, kv_cache, slot_mapping, *, scale=None):
    validate.check_write_latent(ckv, kpe, kv_cache, slot_mapping, scale=scale)


_no_grad_kernel("write_latent", "write_latent", ("ckv", "kpe", "kv_cache", "scale"))
