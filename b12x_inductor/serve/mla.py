"""Absorbed multi-head latent attention (MLA) for the serving engine: transformers' DeepSeek-V3.

The engine's "b12x_serve" attention function (serve.runner) receives keys and values already decompressed
(kv_b_proj applied: per head 128 + 64 key and 128 value values a token), too late for a latent cache. This
module is a transform of the model instead, as gpt-fast's tp.py is one: `absorb_mla(model)` checks every
decoder layer's attention (refusing, with a ValueError naming it, anything it does not handle) and only then
replaces each DeepseekV3Attention's forward with `absorbed_forward` (the module's class becomes a subclass
that only overrides forward: `absorbed_class`), which keeps the paged cache compressed:

    per token, cached:  [c | k_pe]    c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])  (the latent)
                                      k_pe = rope(kv_a_proj_with_mqa(x)[kv_lora_rank:])           (one head)
    per query head h:   q_lat = q_nope @ W_UK[h]                      [kv_lora_rank]
                        scores_j = scaling * (q_lat . c_j + q_pe . k_pe_j)
                        out_lat = softmax(scores) @ c                 [kv_lora_rank]
                        out[h] = out_lat @ W_UV[h]^T                  [v_head_dim], then o_proj

with kv_b_proj.weight = [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank] split per head into W_UK [H,
qk_nope_head_dim, kv_lora_rank] (its key rows) and W_UV [H, v_head_dim, kv_lora_rank] (its value rows). Since
k_nope_j[h] = W_UK[h] @ c_j and v_j[h] = W_UV[h] @ c_j, q_nope . k_nope_j = (q_nope @ W_UK[h]) . c_j and
sum_j p_j v_j[h] = W_UV[h] @ sum_j p_j c_j: the scores are the original 192-dim q.k exactly (so `scaling` is
the module's own: 192 ** -0.5 times YaRN's mscale ** 2 when the config has rope scaling; it is read from the
module, never recomputed) and the output is the original attention's. W_UK is absorbed into the query
projection, W_UV into the output projection, as vLLM does; attention runs over one KV head of
kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3) values a token with values its first kv_lora_rank (512):
`b12x_inductor.mla_write_kv` then `b12x_inductor.mla_attention`.

W_UK and W_UV are views of kv_b_proj.weight, taken in each forward (free: no copy, no extra memory): the
absorbed weights are the model's own weights in its dtype, bit for bit, and they follow the module through
.to() and weight reloads (views stored at transform time would keep the old storage). Nothing is
precomputed: folding W_UK into q_b_proj (or W_UV into o_proj) would be a larger matrix (q_lora_rank x H *
kv_lora_rank against q_lora_rank x H * qk_nope_head_dim), more work per token, and its bf16 rounding would
differ from the model's, so the products stay two bmm-shaped matmuls in the model's dtype.

Everything else in the module runs as transformers' forward does (its q_a_proj / q_a_layernorm / q_b_proj or
q_proj, kv_a_proj_with_mqa, kv_a_layernorm, its own rotary functions with config.rope_interleave, o_proj), so
served tokens equal eager `generate`'s (tests/test_serve_mla.py).
"""

from __future__ import annotations

import functools

import torch

import b12x_inductor as b12x
from b12x_inductor.plan import head_dims_supported
from b12x_inductor.serve import runner as _runner  # (partly initialized while runner imports this module)

MLA_MODEL_TYPES = ("deepseek_v3",)
# Keyword arguments absorbed_forward honors (b12x_serve: the step's input; output_attentions: False/None only).
HONORED_KWARGS = ("b12x_serve", "output_attentions")


def is_mla(cfg) -> bool:
    """Whether a (text) config is an MLA model's: model_type deepseek_v3, or any config with a kv_lora_rank."""
    return getattr(cfg, "model_type", None) in MLA_MODEL_TYPES or getattr(cfg, "kv_lora_rank", None) is not None


def latent_width(cfg) -> int:
    """Values a token per layer in the latent cache: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _attention_class():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    return DeepseekV3Attention


@functools.cache
def absorbed_class() -> type:
    """AbsorbedDeepseekV3Attention: DeepseekV3Attention with `absorbed_forward` as its forward, the class
    `absorb_mla` gives each attention module (one class for all layers: Dynamo guards on a module's forward by
    its class, so regional compile shares one graph between layers; a per-module bound forward would be a
    guard per layer, a recompile each)."""
    modeling = _modeling()  # resolved here, outside any compiled region: Dynamo cannot trace transformers'
    #                         lazy-module import (transformers 5.17: "Bad import result ... _LazyModule")
    return type("AbsorbedDeepseekV3Attention", (_attention_class(),),
                {"forward": absorbed_forward, "__module__": __name__,
                 "rotary": staticmethod(modeling.apply_rotary_pos_emb),
                 "rotary_interleave": staticmethod(modeling.apply_rotary_pos_emb_interleave),
                 "__doc__": "DeepseekV3Attention absorbed over the engine's paged latent cache (serve.mla)."})


def _modeling():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    return modeling_deepseek_v3


def attention_modules(model) -> list:
    """Each decoder layer's attention module (`decoder.layers[i].self_attn`), checked (`check_attention`);
    ValueError for a model whose layers or attention this module does not handle."""
    cfg = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"absorb_mla: {name}'s decoder keeps no ModuleList `layers`; the MLA transform finds each "
                         "layer's attention there (decoder.layers[i].self_attn)")
    if len(layers) < cfg.num_hidden_layers:
        raise ValueError(f"absorb_mla: {name} has {len(layers)} decoder layers, fewer than config."
                         f"num_hidden_layers = {cfg.num_hidden_layers}")
    modules = []
    for i, layer in enumerate(layers[:cfg.num_hidden_layers]):
        module = getattr(layer, "self_attn", None)
        check_attention(module, i)
        modules.append(module)
    return modules


def check_attention(module, index: int) -> None:
    """ValueError unless `module` is a transformers DeepseekV3Attention (that class exactly: a subclass may
    compute something else) whose shapes the absorbed forward and the kernels take."""
    cls = _attention_class()
    where = f"absorb_mla: layer {index}'s attention"
    if type(module) not in (cls, absorbed_class()):
        raise ValueError(f"{where} is {type(module).__name__} ({type(module).__module__}); the MLA transform "
                         f"handles transformers' {cls.__name__} only (DeepSeek-V3, Kimi K2); serve this model "
                         "with transformers' generate instead")
    if module.layer_idx != index:
        raise ValueError(f"{where} has layer_idx {module.layer_idx}, not its position {index}")
    q_lora = module.q_lora_rank
    if q_lora is None:
        if module.q_proj is None:
            raise ValueError(f"{where}: q_lora_rank is None but the module has no q_proj")
    elif isinstance(q_lora, bool) or not isinstance(q_lora, int) or q_lora < 1:
        raise ValueError(f"{where}: q_lora_rank must be None (q_proj) or an int >= 1 (q_a_proj, q_a_layernorm, "
                         f"q_b_proj); got {q_lora!r}")
    elif module.q_proj is not None or any(getattr(module, n, None) is None
                                          for n in ("q_a_proj", "q_a_layernorm", "q_b_proj")):
        raise ValueError(f"{where}: q_lora_rank = {q_lora} needs q_a_proj, q_a_layernorm and q_b_proj and no "
                         "q_proj")
    h, nope, rope, vdim, rank = (module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim,
                                 module.v_head_dim, module.kv_lora_rank)
    if module.qk_head_dim != nope + rope:
        raise ValueError(f"{where}: qk_head_dim {module.qk_head_dim} != qk_nope_head_dim {nope} + "
                         f"qk_rope_head_dim {rope}")
    kv_b = module.kv_b_proj
    if kv_b.bias is not None or tuple(kv_b.weight.shape) != (h * (nope + vdim), rank):
        raise ValueError(f"{where}: kv_b_proj must be a bias-free [num_heads * (qk_nope_head_dim + v_head_dim), "
                         f"kv_lora_rank] = [{h * (nope + vdim)}, {rank}] projection (absorbed as W_UK and W_UV); "
                         f"got weight {list(kv_b.weight.shape)}, bias {kv_b.bias is not None}")
    if tuple(module.kv_a_proj_with_mqa.weight.shape[:1]) != (rank + rope,):
        raise ValueError(f"{where}: kv_a_proj_with_mqa must give kv_lora_rank + qk_rope_head_dim = {rank + rope} "
                         f"values a token; got {list(module.kv_a_proj_with_mqa.weight.shape)}")
    if not head_dims_supported(rank + rope, rank):
        raise ValueError(f"{where}: the latent cache of kv_lora_rank {rank} + qk_rope_head_dim {rope} = "
                         f"{rank + rope} values a token (values: its first {rank}) is not a head-dim pair the "
                         "kernels take (b12x_inductor.plan: D in HEAD_DIMS with Dv in V_HEAD_DIMS, or 576 with 512)")
    if not isinstance(module.scaling, (int, float)) or module.scaling <= 0:
        raise ValueError(f"{where}: scaling must be a positive number; got {module.scaling!r}")


def check_model(model, windows: list[int | None], *, compile: bool = False) -> list:
    """Everything `absorb_mla` refuses, before it touches the model: the attention modules
    (`attention_modules`), any sliding-window layer (`windows`, the runner's per-layer windows by config),
    output_attentions in the config; with `compile` (ServeConfig.compile), MoE experts run by transformers'
    "eager" experts implementation. Returns the attention modules."""
    cfg = model.config.get_text_config(decoder=True)
    name = type(cfg).__name__
    if compile and getattr(cfg, "n_routed_experts", None) and getattr(cfg, "_experts_implementation", None) == "eager":
        # Not attention, but DeepSeek-V3's MoE: transformers' eager experts loop over the experts a step's tokens
        # hit (`for expert_idx in expert_hit`, a data-dependent length), which torch.compile(fullgraph=True)
        # cannot trace. Its default, "grouped_mm", sorts tokens by expert into one grouped matmul (on CPU and for
        # non-bf16 dtypes an opaque custom op): static shapes, no host sync.
        raise ValueError(f"absorb_mla: {name}._experts_implementation is 'eager', whose loop over the experts hit "
                         "has a data-dependent trip count that torch.compile(fullgraph=True) cannot trace: load the "
                         "model with experts_implementation='grouped_mm' (transformers' default) or 'batched_mm' "
                         "(model.set_experts_implementation(...)), or serve with ServeConfig(compile=False)")
    for i, window in enumerate(windows):
        if window is not None:
            raise ValueError(f"absorb_mla: layer {i} of {name} is a sliding-window layer (window {window}); the MLA "
                             "path serves full-attention layers only (transformers' DeepSeek-V3 itself ignores "
                             "sliding windows): remove sliding_window / layer_types from the config")
    for c in {id(cfg): cfg, id(model.config): model.config}.values():
        if getattr(c, "output_attentions", False):
            raise ValueError(f"absorb_mla: {type(c).__name__}.output_attentions must be False (the latent "
                             "attention returns no attention weights)")
    return attention_modules(model)


def absorb_mla(model, windows: list[int | None] | None = None, *, compile: bool = False) -> list:
    """The transform: after `check_model` (which raises before anything changes), each decoder layer's
    DeepseekV3Attention forward becomes `absorbed_forward`: the module's class becomes `absorbed_class()`, a
    subclass that only replaces forward (its parameters, buffers and state dict are untouched; `restore_mla`
    gives it its class back). Idempotent. Returns the attention modules."""
    if windows is None:
        from b12x_inductor.integrations.hf_cache import layer_windows

        windows = layer_windows(model.config.get_text_config(decoder=True))[1]
    modules = check_model(model, windows, compile=compile)
    for module in modules:
        module.__class__ = absorbed_class()
    return modules


def restore_mla(model) -> None:
    """Undoes `absorb_mla`: every absorbed attention module is a DeepseekV3Attention again."""
    for module in model.modules():
        if type(module) is absorbed_class():
            module.__class__ = _attention_class()


def absorbed_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, qk_nope_head_dim, kv_lora_rank], W_UV [H, v_head_dim, kv_lora_rank]): views of
    kv_b_proj.weight (its rows per head: the key rows, then the value rows), in its dtype."""
    w = module.kv_b_proj.weight.view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim,
                                     module.kv_lora_rank)
    return w[:, :module.qk_nope_head_dim], w[:, module.qk_nope_head_dim:]


class _Where:
    """'absorbed MLA attention (layer i)', read from the module only when formatted: a traced read of layer_idx
    would specialize the graph on it, and regional compile shares one graph between layers."""

    def __init__(self, module) -> None:
        self.module = module

    def __format__(self, spec: str) -> str:
        return f"absorbed MLA attention (layer {getattr(self.module, 'layer_idx', '?')})"


def _check_call(module, attention_mask, cache, kwargs: dict) -> None:
    harmless, _describe = _runner.HARMLESS_KWARGS, _runner._describe
    where = _Where(module)  # formatted only in an error
    if attention_mask is not None:
        raise ValueError(f"{where}: attention_mask must be None (the engine derives causal visibility from its "
                         f"page table and lengths); got {_describe(attention_mask)}")
    if cache is not None:
        raise ValueError(f"{where}: cache must be None (the engine owns the latent cache); got {_describe(cache)}")
    for name, val in kwargs.items():
        if name not in HONORED_KWARGS and name not in harmless and val is not None:
            raise ValueError(f"{where}: argument {name!r} is not supported by the serving engine (supported: "
                             f"{sorted(HONORED_KWARGS + tuple(harmless))}, others only when None); got "
                             f"{name}={_describe(val)}")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{where}: output_attentions must be False or None (the latent attention returns no "
                         f"attention weights); got {_describe(kwargs['output_attentions'])}")
    if module.training and module.attention_dropout:
        raise ValueError(f"{where}: attention dropout must be off (the engine serves in eval mode: call "
                         f"model.eval()); got attention_dropout={module.attention_dropout} in training mode")


def absorbed_forward(module, hidden_states: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                     attention_mask: torch.Tensor | None = None, cache=None, **kwargs):
    """DeepseekV3Attention.forward over the engine's paged latent cache (the module docstring's math), with
    transformers' signature: hidden_states [B, S, hidden] -> (out [B, S, hidden], None). `b12x_serve` (from
    `ModelRunner._forward`) is the step's attention input of this layer (`runner.layer_view`: `kv` the layer's
    latent cache [num_pages, page_size, kv_lora_rank + qk_rope_head_dim], its slot mapping and page table,
    the step's lengths and cu_seqlens_q; extend steps: B == 1, tokens packed) or of all layers."""
    info = kwargs.get("b12x_serve")
    if info is None:
        raise ValueError("absorbed MLA attention runs only inside b12x_inductor.serve.ModelRunner (restore_mla "
                         "gives the model its own attention back)")
    if "layer" not in info:
        info = _runner.layer_view(info, module.layer_idx)
    _check_call(module, attention_mask, cache, kwargs)
    if position_embeddings is None:
        raise ValueError(f"absorbed MLA attention (layer {module.layer_idx}): position_embeddings (cos, sin) must "
                         "be given (the decoder's rotary embedding)")
    b, s = hidden_states.shape[:-1]
    h, nope, rope, rank = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank
    # -- as DeepseekV3Attention.forward: projections, norms, rotary embedding --
    if module.q_lora_rank is None:
        q_states = module.q_proj(hidden_states)
    else:
        q_states = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q_states = q_states.view(b, s, -1, module.qk_head_dim).transpose(1, 2)  # [B, H, S, nope + rope]
    q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
    compressed_kv = module.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed_kv, [rank, rope], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope)  # [B, S, rank]: the latent c
    k_rot = k_rot.view(b, 1, s, rope)
    cos, sin = position_embeddings
    # transformers' rotary functions, held by absorbed_class() (an un-absorbed module, in eager tests, imports them)
    name = "rotary_interleave" if module.config.rope_interleave else "rotary"
    rotary = getattr(type(module), name, None) or getattr(absorbed_class(), name)  # one of the two functions
    q_rot, k_rot = rotary(q_rot, k_rot, cos, sin)
    # -- the latent cache: the step's new tokens, then attention over one KV head --
    latent = info["kv"]
    b12x.mla_write_kv(kv_nope.reshape(b * s, rank), k_rot.reshape(b * s, rope), latent, info["slots"])
    w_uk, w_uv = absorbed_weights(module)
    q_lat = torch.matmul(q_pass, w_uk).transpose(1, 2)  # [B, H, S, nope] @ [H, nope, rank] -> [B, S, H, rank]
    q_pe = q_rot.transpose(1, 2)  # [B, S, H, rope]
    cu = info["cu_seqlens_q"]
    if cu is not None:  # packed [T, H, ...]
        q_lat, q_pe = q_lat.reshape(b * s, h, rank), q_pe.reshape(b * s, h, rope)
    out = b12x.mla_attention(q_lat, q_pe, latent, info["page_table"], info["seqlens"], cu, kv_lora_rank=rank,
                             scale=module.scaling)
    out = out.reshape(b, s, h, rank).transpose(1, 2)  # [B, H, S, rank]
    out = torch.matmul(out, w_uv.transpose(1, 2))  # [B, H, S, rank] @ [H, rank, v] -> [B, H, S, v]
    out = out.transpose(1, 2).reshape(b, s, h * module.v_head_dim)
    return module.o_proj(out), None
