"""The substitution on published decoders whose attention masks are runtime values (b12x_inductor.substitution).

Forms (tests/published_models.py, written after the published sources it cites; tests/hf_models.py):
- gpt-fast's model.py (SDPA version): the mask is `self.causal_mask[None, None, input_pos]`, a bool tril
  tensor kept on the module; prefill and decode compiled with fullgraph (gpt-fast's --compile and
  --compile_prefill).
- torchtune's KVCache + MultiHeadAttention + TransformerDecoder driven by torchtune's generate loop: the
  decode step `generate_next_token` compiled with fullgraph, its mask argument a bool [B, 1, max_seq_len]
  row of the static cache's causal mask with each prompt's padding hidden.
- transformers with attn_implementation="sdpa" and a static cache (Llama, Qwen3, Gemma 3 text with sliding
  layers, Mistral with a window on every layer): (i) generate's compiled decode step (compile_config), (ii) a
  plain torch.compile of model.forward over a StaticCache; the mask reads the user's 2D padding mask.

Each form runs several mask scenarios through the same compiled graphs, compiled once with the pass off and
once with it on (the graphs read the mask, so its values change between calls without a recompile). The
scenarios are masks a pass that ignored the mask would get wrong: a hidden key in the middle, right padding,
left padding, and a row or a whole request that sees no key (SDPA then returns zeros on CPU). Checked:
outputs of the pass on equal the pass off (fp32: 1e-5; bf16 on the GPU: the pass on at most twice as far
from eager as the pass off, + 0.03, and each mask moves the logits by more than that), the pass off is close to eager (the reference is
sane), each scenario's mask changes eager's result (so it can catch a pass that ignores it), every attention
call of every compiled decode graph is substituted, the generated code calls `torch.ops.b12x.paged_attention_*`
and no SDPA (the pass-off code the other way round), no graph break, no recompile across the scenarios.

Everything is computed once per form by a module-scoped fixture (compiles are the cost: about 2-5 s per
graph on CPU); the tests read the results. The decisions of each compiled graph are collected by a spy run
after the pass in `cache.GRAPH_PASS` (last_decisions() only keeps the latest graph's) and printed in the
assertion messages.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

import b12x_inductor
import published_models as pm
from b12x_inductor.lowering import cache as graph_pass_cache

PAGED = "torch.ops.b12x.paged_attention_"  # the plan's entry op in the generated code (decode/verify/extend)
SDPA_IN_CODE = "_scaled_dot_product"
CPU = dict(device="cpu", dtype=torch.float32, rtol=1e-5, atol=1e-5, exact_tokens=True)
# bf16 (GPU): on and off are each measured against eager (SDPA, the same backend and so the same treatment of
# rows that see no key; an fp32 model would run another backend); the substitution may be at most twice as far
# as Inductor's own compile of SDPA, plus `atol`.
GPU = dict(device="cuda", dtype=torch.bfloat16, rtol=3e-2, atol=3e-2, ref_atol=0.2, exact_tokens=False)


# ---- shared machinery ----

class GraphDecisions:
    """While active, the substitution's decisions of every graph Inductor compiles: a spy appended to
    cache.GRAPH_PASS runs after the pass and reads last_decisions(). `compiled` counts the graphs, `graphs`
    holds (label, decisions) for those with attention calls; `label` names what is running."""

    def __init__(self):
        self.compiled, self.graphs, self.label = 0, [], ""

    def _spy(self, graph) -> None:
        self.compiled += 1
        decisions = b12x_inductor.last_decisions()
        if decisions is not self._previous:
            self.graphs.append((self.label, decisions))
            self._previous = decisions

    def __enter__(self):
        self._previous = b12x_inductor.last_decisions()
        graph_pass_cache.GRAPH_PASS.rewrites.append(self._spy)
        return self

    def __exit__(self, *exc):
        graph_pass_cache.GRAPH_PASS.rewrites.remove(self._spy)

    def labeled(self, label: str, fn):
        def call(*args, **kwargs):
            self.label = label
            return fn(*args, **kwargs)
        return call


@dataclasses.dataclass
class Run:
    tokens: torch.Tensor  # [B, n] generated tokens
    logits: list  # logits[i] produced tokens[:, i]


@dataclasses.dataclass
class Results:
    """One form's runs: outputs[variant][scenario] for variant "off", "on" (compiled) and "eager", with the
    decisions, code and counters of the compiles."""
    layers: int
    outputs: dict = dataclasses.field(default_factory=dict)
    graphs: dict = dataclasses.field(default_factory=dict)  # variant -> [(label, decisions)]
    compiled: dict = dataclasses.field(default_factory=dict)  # variant -> graphs compiled
    codes: dict = dataclasses.field(default_factory=dict)  # variant -> [generated code]
    graph_breaks: dict = dataclasses.field(default_factory=dict)
    unique_graphs: int = 0

    def decisions_text(self) -> str:
        lines = []
        for variant, graphs in self.graphs.items():
            for label, decisions in graphs:
                lines += [f"{variant} {label}:"] + [f"  {d}" for d in decisions]
        return "\n".join(lines) or "no decisions recorded (did the pass run?)"


@contextlib.contextmanager
def compiling():
    """A fresh Dynamo, cleared counters, no FX graph cache (a cached graph is not analyzed again), no grad."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=16))
        stack.enter_context(torch.no_grad())
        yield counters
    torch._dynamo.reset()


def compile_variants(res: Results, scenarios, run_all) -> None:
    """run_all(substitute, recorder) -> {scenario: Run}, compiling what it calls; once with the pass off, once
    on, each under run_and_get_code."""
    from torch._inductor.utils import run_and_get_code

    for variant in ("off", "on"):
        with b12x_inductor.substituting(variant == "on"), GraphDecisions() as rec:
            outputs, codes = run_and_get_code(lambda: run_all(rec))
        assert list(outputs) == list(scenarios)
        res.outputs[variant], res.codes[variant] = outputs, codes
        res.graphs[variant], res.compiled[variant] = rec.graphs, rec.compiled


def finish(res: Results, counters) -> Results:
    res.graph_breaks = dict(counters["graph_break"])
    res.unique_graphs = counters["stats"]["unique_graphs"]
    return res


def assert_substituted(res: Results, labels=None, graphs_per_variant=None) -> None:
    """Every compiled graph of the pass on (with the given labels) had its attention calls decided, and every
    call was substituted: one decision per layer."""
    msg = res.decisions_text()
    graphs = [(label, d) for label, d in res.graphs["on"] if labels is None or label in labels]
    assert res.compiled["on"] >= 1, "nothing was compiled with the pass on"
    assert graphs, f"no graph{' of ' + str(labels) if labels else ''} reported decisions:\n{msg}"
    if labels is None:
        assert len(res.graphs["on"]) == res.compiled["on"], f"a compiled graph reported no decisions:\n{msg}"
    if graphs_per_variant is not None:
        assert len(res.graphs["on"]) == graphs_per_variant, msg
    for label, decisions in graphs:
        assert len(decisions) == res.layers, f"{label}: {len(decisions)} attention calls, {res.layers} layers\n{msg}"
        assert all(d.substituted for d in decisions), f"{label}: not every attention call substituted:\n{msg}"


def assert_code(res: Results) -> None:
    msg = res.decisions_text()
    assert res.codes["off"] and res.codes["on"], "no generated code captured"
    for code in res.codes["off"]:  # the reference really is SDPA
        assert PAGED not in code and SDPA_IN_CODE in code, "a graph compiled with the pass off is not SDPA's"
    for code in res.codes["on"]:
        assert PAGED in code, f"a graph compiled with the pass on calls no {PAGED}*:\n{msg}"
        assert SDPA_IN_CODE not in code, f"a graph compiled with the pass on still calls SDPA:\n{msg}"


def assert_no_graph_break(res: Results, max_graphs: int) -> None:
    assert not res.graph_breaks, res.graph_breaks
    assert res.unique_graphs <= max_graphs, f"{res.unique_graphs} graphs compiled, at most {max_graphs} expected " \
                                            f"(a recompile across the scenarios?)"


def assert_same_run(got: Run, want: Run, *, rtol, atol, exact_tokens: bool, msg: str = "") -> None:
    """Tokens equal and logits close; without exact_tokens (bf16), up to and including the first step whose
    greedy tokens differ (from there the two runs decode different sequences)."""
    n = got.tokens.shape[1]
    assert want.tokens.shape == got.tokens.shape and len(got.logits) == len(want.logits) == n
    if exact_tokens:
        torch.testing.assert_close(got.tokens, want.tokens, rtol=0, atol=0, msg=lambda m: f"{m}\n{msg}")
    for i in range(steps_agreeing(want, got)):
        torch.testing.assert_close(got.logits[i].float(), want.logits[i].float(), rtol=rtol, atol=atol,
                                   equal_nan=True, msg=lambda m, i=i: f"step {i}: {m}\n{msg}")


def assert_mask_matters(res: Results, scenario: str, against: str = "causal") -> None:
    """The scenario's mask changes eager's result: a pass that ignored it would fail the comparison."""
    got, plain = res.outputs["eager"][scenario], res.outputs["eager"][against]
    same = all(torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3) for a, b in zip(got.logits, plain.logits))
    assert not same, f"scenario {scenario}: eager gives the {against} mask's logits; the test would not see a " \
                     f"pass that ignores the mask"


def steps_agreeing(*runs: Run) -> int:
    """The number of leading steps whose logits compare: up to and including the first step where any run's
    greedy tokens differ from the first run's (from there they decode different sequences)."""
    n = runs[0].tokens.shape[1]
    firsts = [int(d[0]) + 1 for r in runs[1:] if len(d := (r.tokens != runs[0].tokens).any(0).nonzero())]
    return min(firsts, default=n)


def max_error(got: Run, ref: Run, steps: int) -> float:
    return max(float((got.logits[i].float() - ref.logits[i].float()).abs().max()) for i in range(steps))


def assert_no_worse_than_sdpa(res: Results, scenario: str, cfg: dict, against: str | None) -> None:
    """bf16: the pass on is at most twice as far from eager as the pass off (Inductor's compile of SDPA), plus
    atol; and the scenario's mask moves eager's logits by more than that bound plus the pass off's distance,
    so a substitution that ignored the mask could not pass. `against`: the outputs variant or scenario that
    ignores the mask (None: no such check)."""
    ref, on, off = (res.outputs[v][scenario] for v in ("eager", "on", "off"))
    steps = steps_agreeing(ref, on, off)
    err_on, err_off = max_error(on, ref, steps), max_error(off, ref, steps)
    bound = 2 * err_off + cfg["atol"]
    assert err_on <= bound, (f"{scenario}: pass on is {err_on:.4f} from eager, pass off {err_off:.4f}: more "
                             f"than the bound {bound:.4f} (steps {steps})\n{res.decisions_text()}")
    if against is None or scenario in (against, "causal"):
        return
    plain = res.outputs[against][scenario] if against in res.outputs else res.outputs["eager"][against]
    moved = max_error(plain, ref, min(steps, steps_agreeing(ref, plain)))
    assert moved > bound + err_off, f"{scenario}: its mask moves eager's logits by {moved:.4f} only, within " \
                                    f"the bound {bound:.4f} + {err_off:.4f}: the test could not fail"


def check_scenario(res: Results, scenario: str, cfg: dict, matters_against: str | None = "causal",
                   power_against: str | None = "causal") -> None:
    if cfg["exact_tokens"]:
        assert_same_run(res.outputs["on"][scenario], res.outputs["off"][scenario], rtol=cfg["rtol"],
                        atol=cfg["atol"], exact_tokens=True, msg=f"pass on vs off, {scenario}\n{res.decisions_text()}")
    else:
        assert_no_worse_than_sdpa(res, scenario, cfg, power_against)
    # The pass-off graph against eager checks Inductor's own compile of SDPA, not the substitution: in bf16 its
    # fusions round differently from eager's kernels (up to 0.1 on these logits on the H200), hence ref_atol.
    ref_tol = dict(rtol=1e-4, atol=1e-4) if cfg["exact_tokens"] else dict(rtol=cfg["rtol"], atol=cfg["ref_atol"])
    assert_same_run(res.outputs["off"][scenario], res.outputs["eager"][scenario], **ref_tol,
                    exact_tokens=cfg["exact_tokens"], msg=f"pass off vs eager, {scenario}")
    if matters_against is not None and scenario != matters_against:
        assert_mask_matters(res, scenario, matters_against)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    from helpers import one_thread

    yield from one_thread()


def _needs_cuda():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- gpt-fast ----

GF_BATCH, GF_LEN, GF_PROMPT, GF_STEPS = 2, 32, 6, 4
GF_SCENARIOS = ("causal", "hole", "left_padding", "right_padding", "empty_rows")


def gpt_fast_masks(length: int, device) -> dict:
    """Contents for the model's causal_mask [L, L] (shared by the batch), by scenario. Prefill is at
    positions 0..5, decode at 6..9."""
    tril = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    masks = {name: tril.clone() for name in GF_SCENARIOS}
    masks["hole"][5:, 3] = False  # key 3 hidden from every later query (prefill row 5 and every decode step)
    masks["left_padding"][2:, :2] = False  # the first 2 prompt tokens are padding (they see themselves)
    masks["right_padding"][6:, 4:6] = False  # the prompt's last 2 tokens are padding: decode never sees them
    masks["empty_rows"][2] = False  # prefill query 2 sees no key
    masks["empty_rows"][7] = False  # nor does the second decode step (position 7)
    return masks


def gpt_fast_run(model, prefill, decode, mask, prompt) -> Run:
    """gpt-fast's generate: prefill at arange(T), then decode_one_token at an int32 position advanced in place."""
    device = prompt.device
    for block in model.layers:
        block.attention.kv_cache.k_cache.zero_()
        block.attention.kv_cache.v_cache.zero_()
    model.causal_mask.copy_(mask)
    t = prompt.shape[1]
    token, logits = prefill(model, prompt, torch.arange(0, t, device=device))
    tokens, all_logits = [token.clone()], [logits.clone()]
    input_pos = torch.tensor([t], device=device, dtype=torch.int)
    for _ in range(GF_STEPS):
        token, logits = decode(model, token.clone(), input_pos)
        input_pos += 1
        tokens.append(token.clone())
        all_logits.append(logits.clone())
    return Run(torch.cat(tokens, dim=1), all_logits)


def gpt_fast_results(device: str, dtype: torch.dtype) -> Results:
    base = pm.make_gpt_fast(batch=GF_BATCH, max_seq_length=GF_LEN, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, base.config.vocab_size, (GF_BATCH, GF_PROMPT), generator=gen).to(device)
    masks = gpt_fast_masks(base.max_seq_length, device)
    res = Results(layers=base.config.n_layer)
    with compiling() as counters:
        def run_all(rec):
            model = copy.deepcopy(base)
            prefill = rec.labeled("prefill", torch.compile(pm.gpt_fast_prefill, fullgraph=True))
            decode = rec.labeled("decode", torch.compile(pm.gpt_fast_decode_one_token, fullgraph=True))
            return {name: gpt_fast_run(model, prefill, decode, masks[name], prompt) for name in GF_SCENARIOS}

        compile_variants(res, GF_SCENARIOS, run_all)
        eager = copy.deepcopy(base)
        res.outputs["eager"] = {name: gpt_fast_run(eager, pm.gpt_fast_prefill, pm.gpt_fast_decode_one_token,
                                                   masks[name], prompt) for name in GF_SCENARIOS}
        return finish(res, counters)


@pytest.fixture(scope="module")
def gpt_fast():
    return gpt_fast_results("cpu", torch.float32)


def test_gpt_fast_decode_graph_substituted(gpt_fast):
    """Both attention calls of gpt-fast's compiled decode_one_token (mask: causal_mask[None, None, input_pos])."""
    assert_substituted(gpt_fast, labels={"decode"})


def test_gpt_fast_prefill_graph_substituted(gpt_fast):
    """The compiled prefill (6 queries at arange(6), the same buffer mask)."""
    assert_substituted(gpt_fast, labels={"prefill"})


def test_gpt_fast_code_no_graph_break_no_recompile(gpt_fast):
    assert_code(gpt_fast)
    assert_no_graph_break(gpt_fast, max_graphs=4)  # prefill and decode, pass off and on


@pytest.mark.parametrize("scenario", GF_SCENARIOS)
def test_gpt_fast_outputs_equal_pass_off(gpt_fast, scenario):
    check_scenario(gpt_fast, scenario, CPU)


# ---- torchtune ----

TT_BATCH, TT_LEN, TT_PROMPT, TT_NEW = 3, 32, 8, 5
TT_SCENARIOS = ("causal", "left_padding", "right_padding", "hole", "empty_request")


def torchtune_scenarios(vocab: int, device) -> dict:
    """(prompt, masks_hook) by scenario. torchtune's generate hides pad tokens (pad_id 0) wherever they are
    and lets each pad token see itself; with no pad at all it uses one [1, total, L] tril mask (another
    graph: a [1, 1, L] mask row)."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, (TT_BATCH, TT_PROMPT), generator=gen)
    left = ids.clone()
    left[1, :3] = 0
    left[2, :6] = 0
    right = left.clone()
    right[0, -2:] = 0  # request 0's prompt ends with 2 pad tokens

    def hole(masks):  # request 0: key 4 hidden from every later row
        masks = masks.clone()
        masks[0, 5:, 4] = False
        return masks

    def empty(masks):  # request 2: its decode steps see no key at all
        masks = masks.clone()
        masks[2, TT_PROMPT:, :] = False
        return masks

    return {"causal": (ids, None), "left_padding": (left, None), "right_padding": (right, None),
            "hole": (left, hole), "empty_request": (left, empty)}


def torchtune_run(model, prompt, hook, step) -> Run:
    model.reset_caches()
    tokens, logits = pm.torchtune_generate(model, prompt, max_generated_tokens=TT_NEW, pad_id=0, top_k=1,
                                           compiled_generate_next_token=step, masks_hook=hook)
    return Run(tokens[:, prompt.shape[1]:], list(logits.unbind(1)))


def plain_causal(masks):
    """What a pass that ignored the mask would compute with: every key up to the slot visible."""
    return torch.ones_like(masks[0]).tril().expand_as(masks).clone()


def torchtune_results(device: str, dtype: torch.dtype) -> Results:
    base = pm.make_torchtune(batch=TT_BATCH, decoder_max_seq_len=TT_LEN, device=device, dtype=dtype)
    scenarios = {k: (p.to(device), h) for k, (p, h) in
                 torchtune_scenarios(base.tok_embeddings.num_embeddings, device).items()}
    res = Results(layers=len(base.layers))
    with compiling() as counters:
        def run_all(rec):
            model = copy.deepcopy(base)
            step = rec.labeled("decode", torch.compile(pm.generate_next_token, fullgraph=True))
            return {name: torchtune_run(model, p, h, step) for name, (p, h) in scenarios.items()}

        compile_variants(res, TT_SCENARIOS, run_all)
        eager = copy.deepcopy(base)
        res.outputs["eager"] = {name: torchtune_run(eager, p, h, None) for name, (p, h) in scenarios.items()}
        # the same prompts under a plain causal mask: what ignoring each scenario's mask would give
        res.outputs["eager_ignoring_mask"] = {name: torchtune_run(eager, p, plain_causal, None)
                                              for name, (p, h) in scenarios.items()}
        return finish(res, counters)


@pytest.fixture(scope="module")
def torchtune():
    return torchtune_results("cpu", torch.float32)


def test_torchtune_decode_graphs_substituted(torchtune):
    """Every attention call of both compiled decode graphs (mask [1, 1, L] without padding, [B, 1, L] with)."""
    assert_substituted(torchtune, graphs_per_variant=2)


def test_torchtune_code_no_graph_break_no_recompile(torchtune):
    assert_code(torchtune)
    assert_no_graph_break(torchtune, max_graphs=4)  # two mask shapes, pass off and on


def _torchtune_mask_matters(res: Results, scenario: str) -> None:
    if scenario == "causal":
        return
    got, ignoring = res.outputs["eager"][scenario], res.outputs["eager_ignoring_mask"][scenario]
    same = all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(got.logits, ignoring.logits))
    assert not same, f"{scenario}: the mask does not change eager's result"


@pytest.mark.parametrize("scenario", TT_SCENARIOS)
def test_torchtune_outputs_equal_pass_off(torchtune, scenario):
    check_scenario(torchtune, scenario, CPU, matters_against=None)
    _torchtune_mask_matters(torchtune, scenario)


# ---- transformers: attn_implementation="sdpa", static cache ----

HF_ARCHS = ("llama", "qwen3", "gemma3_text", "mistral")
HF_SLIDING = {"gemma3_text", "mistral"}  # window 8 < prompt: transformers' StaticSlidingWindowLayer
HF_BATCH, HF_PROMPT, HF_LEN, HF_NEW, HF_STEPS = 3, 12, 32, 6, 4
HF_SCENARIOS = ("causal", "left_padding", "hole", "right_padding", "empty_request")


def make_hf(arch: str, device: str, dtype: torch.dtype):
    transformers = pytest.importorskip("transformers")
    from hf_models import COMMON, make_model

    if arch == "qwen3":  # not in hf_models' families: Qwen3's q/k norms on the common tiny shape
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model("qwen3", **COMMON, num_hidden_layers=2)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        model.generation_config.pad_token_id = 0
    else:
        model = make_model(arch)
    model.set_attn_implementation("sdpa")
    return model.to(device=device, dtype=dtype)


def hf_compile_config(arch: str, device: str):
    """generate's compile config: fullgraph; dynamic=None for the window layers, whose Python int offset would
    recompile every step under dynamic=False (see tests/test_hf_models.py)."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=None if arch in HF_SLIDING else False)
    config._compile_all_devices = True  # generate auto-compiles on CUDA only, unless told
    return config


def hf_prompt(device):
    """A left-padded batch (as tests/test_hf_models.py): requests 1 and 2 have 3 and 7 pads."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (HF_BATCH, HF_PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def hf_generate_run(model, ids, mask, compile_config) -> Run:
    kw = dict(compile_config=compile_config, disable_compile=False) if compile_config is not None \
        else dict(disable_compile=True)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=HF_NEW,
                         cache_implementation="static", max_cache_len=HF_LEN, return_dict_in_generate=True,
                         output_logits=True, **kw)
    return Run(out.sequences[:, ids.shape[1]:], list(out.logits))


def hf_generate_results(arch: str, device: str, dtype: torch.dtype) -> Results:
    base = make_hf(arch, device, dtype)
    ids, mask = hf_prompt(device)
    res = Results(layers=base.config.num_hidden_layers)
    with compiling() as counters:
        def run_all(rec):
            model = copy.deepcopy(base)
            rec.label = "generate decode"
            return {"left_padding": hf_generate_run(model, ids, mask, hf_compile_config(arch, device))}

        compile_variants(res, ("left_padding",), run_all)
        res.outputs["eager"] = {"left_padding": hf_generate_run(copy.deepcopy(base), ids, mask, None)}
        return finish(res, counters)


@pytest.fixture(scope="module", params=HF_ARCHS)
def hf_generate(request):
    return hf_generate_results(request.param, "cpu", torch.float32)


def test_hf_generate_decode_graphs_substituted(hf_generate):
    """Every attention call of generate's compiled decode step(s) (two graphs for the window archs)."""
    assert_substituted(hf_generate)


def test_hf_generate_code_no_graph_break(hf_generate):
    assert_code(hf_generate)
    assert_no_graph_break(hf_generate, max_graphs=4)


def test_hf_generate_tokens_equal_pass_off(hf_generate):
    check_scenario(hf_generate, "left_padding", CPU, matters_against=None)


def hf_masks(device) -> dict:
    """2D attention masks [B, max_cache_len] by scenario (the same ids for all): 1 = attend. The prompt is
    slots 0..11, decode steps at 12..15."""
    masks = {name: torch.ones(HF_BATCH, HF_LEN, dtype=torch.long) for name in HF_SCENARIOS}
    masks["left_padding"][1, :3] = 0
    masks["left_padding"][2, :7] = 0
    masks["hole"][0, 9] = 0  # request 0: key 9 hidden (inside every decode step's window of 8)
    masks["right_padding"][1, 9:HF_PROMPT] = 0  # request 1's prompt ends with 3 pads; decode continues at 12
    masks["empty_request"][2] = 0  # request 2 sees no key at all, its own new tokens included
    return {k: v.to(device) for k, v in masks.items()}


def hf_forward_run(model, cache, step, ids, mask) -> Run:
    """An eager prefill, then HF_STEPS decode steps through `step` (model.forward, compiled or not) with the
    full-length 2D mask, cache_position and generate's position ids (cumsum of the mask - 1)."""
    from hf_models import cache_kwarg

    cache.reset()
    t = ids.shape[1]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask[:, :t], position_ids=position_ids[:, :t],
                cache_position=torch.arange(t, device=ids.device), use_cache=True, **cache_kwarg(model, cache))
    token = out.logits[:, -1:].argmax(-1)
    tokens, logits = [], []
    for i in range(HF_STEPS):
        p = t + i
        out = step(input_ids=token, attention_mask=mask, position_ids=position_ids[:, p:p + 1],
                   cache_position=torch.tensor([p], device=ids.device), use_cache=True, **cache_kwarg(model, cache))
        step_logits = out.logits[:, -1].clone()
        token = step_logits.argmax(-1, keepdim=True)
        tokens.append(token)
        logits.append(step_logits)
    return Run(torch.cat(tokens, dim=1), logits)


def hf_forward_results(arch: str, device: str, dtype: torch.dtype) -> Results:
    from transformers import StaticCache

    base = make_hf(arch, device, dtype)
    ids, _ = hf_prompt(device)
    masks = hf_masks(device)
    res = Results(layers=base.config.num_hidden_layers)
    dynamic = None if arch in HF_SLIDING else False
    with compiling() as counters:
        def run_all(rec):
            model = copy.deepcopy(base)
            cache = StaticCache(config=model.config, max_cache_len=HF_LEN)
            step = rec.labeled("forward decode", torch.compile(model.forward, fullgraph=True, dynamic=dynamic))
            return {name: hf_forward_run(model, cache, step, ids, masks[name]) for name in HF_SCENARIOS}

        compile_variants(res, HF_SCENARIOS, run_all)
        eager = copy.deepcopy(base)
        cache = StaticCache(config=eager.config, max_cache_len=HF_LEN)
        res.outputs["eager"] = {name: hf_forward_run(eager, cache, eager.forward, ids, masks[name])
                                for name in HF_SCENARIOS}
        return finish(res, counters)


@pytest.fixture(scope="module", params=HF_ARCHS)
def hf_forward(request):
    return hf_forward_results(request.param, "cpu", torch.float32)


def test_hf_forward_decode_graphs_substituted(hf_forward):
    assert_substituted(hf_forward)


def test_hf_forward_code_no_graph_break_no_recompile(hf_forward):
    assert_code(hf_forward)
    assert_no_graph_break(hf_forward, max_graphs=4)  # window archs: the offset int turns symbolic once


@pytest.mark.parametrize("scenario", HF_SCENARIOS)
def test_hf_forward_logits_equal_pass_off(hf_forward, scenario):
    check_scenario(hf_forward, scenario, CPU)


# ---- the same forms on the GPU, bf16 (marker gpu; skipped without CUDA) ----

def _check_all(res: Results, scenarios, matters_against="causal", graphs=None, power_against="causal") -> None:
    assert_substituted(res, graphs_per_variant=graphs)
    assert_code(res)
    assert not res.graph_breaks, res.graph_breaks
    for scenario in scenarios:
        check_scenario(res, scenario, GPU, matters_against=matters_against, power_against=power_against)


@pytest.mark.gpu
@_needs_cuda()
def test_gpu_gpt_fast():
    _check_all(gpt_fast_results("cuda", torch.bfloat16), GF_SCENARIOS)


@pytest.mark.gpu
@_needs_cuda()
def test_gpu_torchtune():
    res = torchtune_results("cuda", torch.bfloat16)
    _check_all(res, TT_SCENARIOS, matters_against=None, graphs=2, power_against="eager_ignoring_mask")
    for scenario in TT_SCENARIOS:
        _torchtune_mask_matters(res, scenario)


@pytest.mark.gpu
@_needs_cuda()
@pytest.mark.parametrize("arch", HF_ARCHS)
def test_gpu_transformers_sdpa_static_cache(arch):
    _check_all(hf_generate_results(arch, "cuda", torch.bfloat16), ("left_padding",), matters_against=None,
               power_against=None)
    _check_all(hf_forward_results(arch, "cuda", torch.bfloat16), HF_SCENARIOS)
