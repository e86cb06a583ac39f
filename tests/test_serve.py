"""The serving loop: page allocator, prompt-lookup drafts, scheduler (against a fake model that checks the
KV it would read), and the compiled engine against transformers' greedy generate on a tiny random Llama."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from b12x_inductor.serve import Engine, Request, ServeConfig
from b12x_inductor.serve.draft import NgramIndex, prompt_lookup
from b12x_inductor.serve.pages import PageAllocator
from b12x_inductor.serve.scheduler import Scheduler
from helpers import one_thread, serve_counting_syncs


_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


# -- page allocator ---------------------------------------------------------------------------------------------
def test_page_allocator():
    a = PageAllocator(5, 4)
    pages = a.allocate(2)
    assert len(set(pages)) == 2 and a.num_free == 3
    assert a.allocate(4) is None and a.num_free == 3  # all or nothing
    assert a.grow(pages, 12) and len(pages) == 3  # 12 slots of 4 -> 3 pages
    assert not a.grow(pages, 21) and len(pages) == 3
    other = a.allocate(2)
    assert not set(other) & set(pages)
    a.free(pages)
    assert pages == [] and a.num_free == 3
    assert a.peak_used == 5  # 3 + 2 pages held at once
    with pytest.raises(ValueError, match="not allocated"):
        a.free([other[0], other[0]])
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0, 4)


# -- prompt-lookup drafts -----------------------------------------------------------------------------------------
def test_prompt_lookup():
    assert prompt_lookup([1, 2, 3, 9, 1, 2], 2) == [3, 9]
    assert prompt_lookup([1, 2, 3, 9, 1, 2], 5) == [3, 9, 1, 2]
    assert prompt_lookup([5, 1, 7, 1], 2) == [7, 1]  # 1-gram fallback
    assert prompt_lookup([1, 2, 3], 2) == []
    assert prompt_lookup([1, 2, 1, 2], 0) == []


def test_ngram_index_matches_scan():
    rng = random.Random(0)
    for trial in range(30):
        index, seq = NgramIndex(max_ngram=3), [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        for _ in range(40):
            assert index.draft(seq, 4) == prompt_lookup(seq, 4, max_ngram=3), seq
            seq += [rng.randrange(4) for _ in range(rng.randint(1, 3))]


# -- scheduler, against a fake model ------------------------------------------------------------------------------
def _next_token(seq: list[int]) -> int:
    """A deterministic 'model' that falls into loops (as greedy decoding does): the token after a sequence."""
    return (seq[-1] * seq[-1] + (seq[-2] if len(seq) >= 2 else 0) % 2) % 13


class FakeRunner:
    """Runs steps like ModelRunner but in Python: keeps what each KV slot holds and checks that every token
    reads its own request's tokens at every earlier position (page tables, recompute, no sharing); with a
    window pool (`window`), also that every token reads its own request's tokens at every position inside its
    window there, through pages the request holds (freed columns are never read)."""

    def __init__(self, config: ServeConfig, full: bool = True, window: int | None = None):
        self.config, self.slots, self.wslots, self.steps = config, {}, {}, []
        self.full, self.window = full, window

    def run(self, step):
        ps, win = self.config.page_size, self.window

        def wslot(r, p):
            col = p // ps - r.window_base
            assert 0 <= col < len(r.window_pages), (r.id, p, r.window_base, len(r.window_pages))
            return r.window_pages[col] * ps + p % ps

        assert len(step.work) <= self.config.max_batch
        assert step.kind != "extend" or step.num_tokens <= self.config.token_budget
        out = []
        for w in step.work:
            r = w.request
            seq = r.tokens[:w.start] + list(w.tokens)
            real = len(w.tokens) - w.num_draft
            assert list(w.tokens[:real]) == r.tokens[w.start:w.start + real]  # drafts only at the end
            for i in range(len(w.tokens)):
                pos = w.start + i
                if self.full:
                    self.slots[r.pages[pos // ps] * ps + pos % ps] = (r.id, pos, seq[pos])
                    for p in range(pos + 1):
                        assert self.slots[r.pages[p // ps] * ps + p % ps] == (r.id, p, seq[p])
                if win is not None:
                    self.wslots[wslot(r, pos)] = (r.id, pos, seq[pos])
                    for p in range(max(0, pos - win + 1), pos + 1):
                        assert self.wslots[wslot(r, p)] == (r.id, p, seq[p])
            preds = [_next_token(seq[:w.start + i + 1]) for i in range(len(w.tokens))]
            out.append(preds if step.kind == "verify" else preds[-1:])
        self.steps.append(step.kind)
        return out


def _reference(r: Request, eos=()) -> list[int]:
    seq = list(r.prompt)
    while len(seq) - len(r.prompt) < r.max_new_tokens:
        seq.append(_next_token(seq))
        if seq[-1] in eos:
            break
    return seq[len(r.prompt):]


@pytest.mark.parametrize("num_draft", [0, 3])
@pytest.mark.parametrize("num_pages", [64, 12])
def test_scheduler(num_draft, num_pages):
    eos = (12,) if num_pages == 64 else ()  # EOS, or long outputs that outgrow the small pool
    config = ServeConfig(num_pages=num_pages, page_size=4, max_batch=4, token_budget=16, max_model_len=48,
                         num_draft=num_draft, eos_token_ids=eos)
    pages = PageAllocator(config.num_pages, config.page_size)
    sched, runner = Scheduler(config, pages), FakeRunner(config)
    rng = random.Random(num_pages + num_draft)
    pending = [Request(prompt=[rng.randrange(13) for _ in range(rng.randint(1, 30))],
                       max_new_tokens=rng.randint(1, 16)) for _ in range(12)]
    requests, step = list(pending), 0
    while pending or not sched.idle:
        if pending and (step % 3 == 0 or sched.idle):  # arrivals while others run
            sched.add(pending.pop(0))
        s = sched.schedule()
        if s is not None:
            sched.update(s, runner.run(s))
        step += 1
        assert step < 1000
    for r in requests:
        assert r.finished and r.output == _reference(r, eos=eos), r.id
    assert pages.num_free == num_pages
    assert "extend" in runner.steps and "decode" in runner.steps
    assert ("verify" in runner.steps) == bool(num_draft)
    if num_draft:
        assert sum(r.num_accepted for r in requests) > 0
    assert (sched.num_preemptions > 0) == (num_pages == 12)


@pytest.mark.parametrize("full", [True, False])  # a window pool beside the full pool, or alone (Mistral)
@pytest.mark.parametrize("num_draft", [0, 3])
@pytest.mark.parametrize("window_num_pages", [None, 8])  # the default (no preemption), or one that runs dry
def test_scheduler_window_pool(full, num_draft, window_num_pages):
    """Window pages recycled: outputs unchanged, every token reads its window through pages its request holds,
    a request holds at most ceil((window - 1 + its step's tokens) / page_size) + 1 window pages while its
    sequence grows far past the window, both pools return to empty, and a window pool that runs dry preempts
    (while the full pool has room) without changing outputs."""
    window = 6
    config = ServeConfig(num_pages=64, page_size=4, max_batch=4, token_budget=16, max_model_len=64,
                         num_draft=num_draft, window_num_pages=window_num_pages)
    pages = PageAllocator(config.num_pages, config.page_size) if full else None
    wpages = PageAllocator(config.window_pool_pages(window), config.page_size)
    sched, runner = Scheduler(config, pages, wpages, window), FakeRunner(config, full=full, window=window)
    rng = random.Random(7 + num_draft)
    pending = [Request(prompt=[rng.randrange(13) for _ in range(rng.randint(1, 30))],
                       max_new_tokens=rng.randint(10, 30)) for _ in range(12)]
    requests, step, most = list(pending), 0, 0
    per_request = -(-(window - 1 + config.token_budget) // config.page_size) + 1
    while pending or not sched.idle:
        if pending and (step % 3 == 0 or sched.idle):
            sched.add(pending.pop(0))
        s = sched.schedule()
        if s is not None:
            for w in s.work:
                assert len(w.request.window_pages) <= -(-(window - 1 + len(w.tokens)) // config.page_size) + 1
                most = max(most, len(w.request.window_pages))
            sched.update(s, runner.run(s))
        for r in sched.running:
            assert len(r.window_pages) <= per_request
        step += 1
        assert step < 2000
    for r in requests:
        assert r.finished and r.output == _reference(r), r.id
    assert wpages.num_free == wpages.num_pages and (pages is None or pages.num_free == config.num_pages)
    assert max(len(r.tokens) for r in requests) > 4 * window and most <= per_request
    assert wpages.peak_used < sum(-(-len(r.tokens) // 4) for r in requests[:4])  # less than the full pool needs
    if full:
        assert pages.peak_used > wpages.peak_used
    assert (sched.num_preemptions > 0) == (window_num_pages == 8)
    assert ("verify" in runner.steps) == bool(num_draft)


def test_request_and_config_errors():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(prompt=[1], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt"):
        Request(prompt=[], max_new_tokens=1)
    with pytest.raises(ValueError, match="token_budget"):
        ServeConfig(max_batch=8, token_budget=4)
    with pytest.raises(ValueError, match="num_draft"):
        ServeConfig(num_draft=16)
    with pytest.raises(ValueError, match="decode_buckets"):
        ServeConfig(max_batch=8, decode_buckets=(2, 4))
    sched = Scheduler(ServeConfig(max_model_len=32), PageAllocator(4, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Request(prompt=[1] * 30, max_new_tokens=3))
    with pytest.raises(ValueError, match="pages"):
        sched.add(Request(prompt=[1] * 10, max_new_tokens=10))
    with pytest.raises(ValueError, match="window_num_pages"):
        ServeConfig(window_num_pages=0)
    # window 6 with a token budget of 16 needs up to ceil(21 / 4) + 1 = 7 window pages in one step
    config = ServeConfig(max_model_len=64, page_size=4, max_batch=4, token_budget=16)
    assert config.window_pages_per_request(6) == 7
    sched = Scheduler(config, None, PageAllocator(6, 4), 6)
    sched.add(Request(prompt=[1] * 10, max_new_tokens=10))  # 20 positions: 5 pages will do
    with pytest.raises(ValueError, match="needs 7 window pages"):
        sched.add(Request(prompt=[1] * 30, max_new_tokens=10))
    with pytest.raises(ValueError, match="needs a page pool"):
        Scheduler(config, None)


# -- the compiled engine against transformers -----------------------------------------------------------------
_WORKLOAD = [(5, 12), (40, 10), (150, 6), (1, 9), (70, 16), (12, 3), (3, 14), (100, 8)]  # (prompt, new tokens)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def _requests(seed=1, rate=None):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i, (n, m) in enumerate(_WORKLOAD):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        if i % 2:  # repeated phrases give prompt lookup something to find
            prompt = (prompt[: max(1, n // 4)] * 4)[:n]
        reqs.append(Request(prompt=prompt, max_new_tokens=m, arrival=0.0 if rate is None else i / rate))
    return reqs


@pytest.fixture(scope="module")
def served():
    """(engine, reference outputs by prompt): one engine, compiled once (decode 4, verify 4x4, extend 128)."""
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ref = {}
    for r in _requests():
        out = reference.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        ref[tuple(r.prompt)] = out[0, len(r.prompt):].tolist()
    engine = Engine(model, ServeConfig(num_pages=48, page_size=16, max_batch=4, token_budget=128,
                                       max_model_len=256, num_draft=3, decode_buckets=(4,)))
    torch._dynamo.utils.counters.clear()
    engine.warmup()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == len(engine.runner.buckets) == 3
    return engine, ref


def _check(engine, ref, requests, eos=None):
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for r in requests:
        expected = ref[tuple(r.prompt)]
        if eos is not None and eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert r.finished and r.output == expected, (r.id, r.prompt[:8], r.output, expected, r.num_preempted)
    assert engine.pools_free  # every page of every pool back on its free list
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled while serving
    assert not torch._dynamo.utils.counters["graph_break"]


def test_serve_with_drafts_matches_generate(served):
    engine, ref = served
    engine.reset()
    requests = _requests(rate=50.0)  # arrivals spread over 0.14 s
    report = engine.serve(requests)
    _check(engine, ref, requests)
    assert report.output_tokens == sum(m for _, m in _WORKLOAD)
    assert report.draft_acceptance > 0 and report.preemptions == 0
    assert report.ttft_p50_s > 0 and report.tpot_p99_s >= report.tpot_p50_s > 0


def test_serve_without_drafts_with_eos(served):
    engine, ref = served
    # an EOS that first appears in the middle of some request's output: that request stops there
    eos, stopped = next((out[i], k) for k, r in enumerate(_requests()) for out in [ref[tuple(r.prompt)]]
                        for i in range(2, len(out) - 1) if out[i] not in out[:i])
    engine.reset(num_draft=0, eos_token_ids=(eos,))
    requests = _requests()
    report = engine.serve(requests)
    _check(engine, ref, requests, eos=eos)
    assert requests[stopped].output[-1] == eos and len(requests[stopped].output) < requests[stopped].max_new_tokens
    assert report.draft_acceptance != report.draft_acceptance  # nan: no drafts


def test_serve_through_preemption(served):
    engine, ref = served
    engine.reset(num_pages=12)  # 150 + 6 tokens alone need 10 pages of 16
    requests = _requests()
    report = engine.serve(requests)
    _check(engine, ref, requests)
    assert report.preemptions > 0


def test_recompile_fails_after_warmup(served):
    engine, _ = served
    runner = engine.runner
    meta = runner.metadata(None, "decode", 2, 1)  # a batch of 2: not a compiled bucket
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(Exception, match="ecompil"):
        runner._call(meta, "decode", 2, 1)


def test_reset_errors(served):
    engine, _ = served
    with pytest.raises(ValueError, match="num_pages"):
        engine.reset(num_pages=49)
    with pytest.raises(ValueError, match="num_draft"):
        engine.reset(num_draft=4)


def test_qwen2_eager_matches_generate():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).eval()
    reference = copy.deepcopy(model)
    requests = _requests()[:4]
    engine = Engine(model, ServeConfig(num_pages=32, page_size=16, max_batch=4, token_budget=128,
                                       max_model_len=256, num_draft=2, compile=False))
    engine.serve(requests)
    for r in requests:
        out = reference.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert r.output == out[0, len(r.prompt):].tolist(), r.id


def test_cli_demo_json(capsys):
    from b12x_inductor.serve.__main__ import main

    rc = main(["--demo", "--device", "cpu", "--requests", "3", "--output-lens", "2,4", "--prompt-lens", "4,20",
               "--no-compile", "--no-progress", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 3 and 6 <= report["output_tokens"] <= 12
    assert {"throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"} <= set(report)


@pytest.mark.gpu
def test_gpu_cuda_graphs_bf16():
    """On CUDA in bf16, with CUDA graphs: no cudagraph skip, nothing recompiles while serving, at most one
    synchronizing call per step, and every served token is transformers' (SDPA) greedy choice up to bf16
    near-ties, checked by teacher forcing."""
    from torch._dynamo.utils import counters

    model = _tiny_llama().to("cuda", torch.bfloat16)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    engine = Engine(model, ServeConfig(num_pages=48, page_size=16, max_batch=4, token_budget=128,
                                       max_model_len=256, num_draft=3, decode_buckets=(2, 4)))
    counters.clear()
    engine.warmup()
    graphs = counters["stats"]["unique_graphs"]
    requests = _requests(rate=50.0)
    report, syncs = serve_counting_syncs(engine, requests)  # one host read per step: the sampled tokens
    assert 0 < len(syncs) <= report.steps, [str(w.message) for w in syncs[:3]]
    assert counters["stats"]["unique_graphs"] == graphs == len(engine.runner.buckets)
    assert not counters["graph_break"] and not counters["inductor"]["cudagraph_skips"]
    assert engine.pages.num_free == engine.config.num_pages and report.draft_acceptance > 0
    for r in requests:
        assert len(r.output) == r.max_new_tokens
        ids = torch.tensor([r.tokens], device="cuda")
        with torch.no_grad():
            logits = reference(ids).logits[0, len(r.prompt) - 1:-1].float()  # the logits that chose each output
        chosen = logits.gather(1, torch.tensor(r.output, device="cuda")[:, None])[:, 0]
        gap = logits.max(1).values - chosen
        assert (gap <= 0.05 * logits.abs().max(1).values).all(), (r.id, gap.tolist())  # bf16 near-ties only
