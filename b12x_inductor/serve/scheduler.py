"""The scheduler: continuous batching with chunked prefill under a token budget.

Every step it decides which tokens of which requests run through the model:
1. every running request that is decoding gets its next token (with prompt-lookup drafts in a verify step);
2. running requests still prefilling get chunks of their prompt from what is left of the token budget;
3. waiting requests are admitted (first come, first served) while a batch row, budget and pages remain.
A step with any prefill chunk is an "extend" step (all spans packed, decodes included); otherwise it is a
"decode" step, or a "verify" step when some request has a draft. When the page pool runs dry the most
recently admitted running request is preempted: its pages are freed and it goes back to the front of the
waiting queue, to recompute its KV (prompt and output so far) when it is admitted again.

A request's KV is recomputed from `tokens` (prompt + output), so preemption never changes its output.

Two pools when the model's sliding-window layers recycle their pages (`ServeConfig.recycle_window_pages`):
`pages` (the full-attention layers; None for a model whose every layer has a window) and `window_pages` (the
window layers; None without recycling). A request holds window pages only from its first live column: the
first position that a query still to come can see is num_computed - window + 1 (num_computed only grows,
but for preemption, which frees everything: rejected drafts and chunked prefill re-query from it), so the
columns of pages wholly before it go back to the pool. Admission, growth and preemption take both pools into
account: a step runs a request only when both hold its pages.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from b12x_inductor.serve.config import ServeConfig
from b12x_inductor.serve.draft import NgramIndex
from b12x_inductor.serve.pages import PageAllocator

_ids = itertools.count()


@dataclass(eq=False, kw_only=True)
class Request:
    """One generation request and its serving state.

    prompt: token ids; max_new_tokens: output length limit; arrival: seconds after serving starts.
    tokens: prompt + output so far; num_computed: leading tokens of `tokens` whose KV is in the cache;
    pages: the request's page table (page ids in position order) in the full pool;
    window_pages: its live pages in the window pool, for columns window_base, window_base + 1, ... (position i
    in column i // page_size); columns before window_base were freed (no query to come sees them).
    """

    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    window_pages: list[int] = field(default_factory=list)
    window_base: int = 0
    num_preempted: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finished: bool = False
    ngrams: NgramIndex | None = None

    def __post_init__(self) -> None:
        self.prompt = [int(t) for t in self.prompt]
        if not self.prompt:
            raise ValueError("Request: prompt must hold at least one token; got []")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request: max_new_tokens must be >= 1; got {self.max_new_tokens}")
        self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def decoding(self) -> bool:
        """All tokens but the last are in the cache: the next step feeds the last one."""
        return self.num_computed == len(self.tokens) - 1


@dataclass(frozen=True, kw_only=True)
class Work:
    """What one request runs in a step: `tokens` at positions start, start + 1, ... of its sequence.

    sample: the last real token's logits give the request's next token (the span reaches its end);
    num_draft: how many of `tokens` (at the end) are prompt-lookup drafts (verify steps only).
    """

    request: Request
    start: int
    tokens: tuple[int, ...]
    sample: bool
    num_draft: int = 0


@dataclass(frozen=True, kw_only=True)
class Step:
    kind: str  # "decode" | "verify" | "extend"
    work: tuple[Work, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)


class Scheduler:
    """pages: the full pool's allocator (None: no full-attention pool); window_pages: the window pool's (None:
    window pages are not recycled), whose layers all have sliding window `window` (the largest, if they
    differ)."""

    def __init__(self, config: ServeConfig, pages: PageAllocator | None, window_pages: PageAllocator | None = None,
                 window: int | None = None) -> None:
        if pages is None and window_pages is None:
            raise ValueError("Scheduler: needs a page pool (pages, window_pages or both)")
        if window_pages is not None and (window is None or window < 1):
            raise ValueError(f"Scheduler: a window pool needs the layers' window (>= 1); got {window}")
        self.config = config
        self.pages = pages
        self.window_pages, self.window = window_pages, window
        self.pools = [a for a in (pages, window_pages) if a is not None]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        c = self.config
        total = len(request.prompt) + request.max_new_tokens
        if total > c.max_model_len:
            raise ValueError(f"Request {request.id}: prompt + max_new_tokens must be <= max_model_len "
                             f"({c.max_model_len}); got {total}")
        if self.pages is not None and self.pages.pages_for(total) > self.pages.num_pages:
            raise ValueError(f"Request {request.id}: needs {self.pages.pages_for(total)} pages; the pool has "
                             f"{self.pages.num_pages}")
        if self.window_pages is not None:
            need = min(self.window_pages.pages_for(total), c.window_pages_per_request(self.window))
            if need > self.window_pages.num_pages:
                raise ValueError(f"Request {request.id}: needs {need} window pages (window {self.window}, "
                                 f"token_budget {c.token_budget}); the window pool has "
                                 f"{self.window_pages.num_pages}")
        if c.num_draft:
            request.ngrams = NgramIndex(max_ngram=c.max_ngram)
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- deciding a step ------------------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        budget = self.config.token_budget
        work: list[Work] = []
        for r in list(self.running):  # decodes first, then prefill chunks, in admission order
            if r in self.running and r.decoding:
                budget -= self._take(r, 1, work)
        for r in list(self.running):
            if r in self.running and not r.decoding and budget > 0:
                budget -= self._take(r, min(budget, len(r.tokens) - r.num_computed), work)
        while self.waiting and len(self.running) < self.config.max_batch and budget > 0:
            r = self.waiting[0]
            n = min(budget, len(r.tokens))
            # keep a page per running request free for its next decode, or admission just makes preemptions
            if any(a.pages_for(n) + len(self.running) > a.num_free for a in self.pools):
                break
            grown = self._grow(r, n)  # nothing is freed yet: n positions from 0 need pages_for(n) in each pool
            assert grown
            self.waiting.popleft()
            self.running.append(r)
            taken = self._take(r, n, work)  # pages are already there: it takes n
            if not taken:
                break
            budget -= taken
        if not work:
            return None
        if any(not w.request.decoding or len(w.tokens) > 1 for w in work):
            return Step(kind="extend", work=tuple(work))
        if self.config.num_draft:
            work = [self._with_draft(w) for w in work]
            if any(w.num_draft for w in work):
                return Step(kind="verify", work=tuple(work))
        return Step(kind="decode", work=tuple(work))

    def _take(self, r: Request, n: int, work: list[Work]) -> int:
        """Schedules tokens num_computed .. num_computed + n - 1 of a running request, preempting the most
        recently admitted request without work in this step while pages run out (`r` itself last); returns
        the number of tokens taken (0 if `r` was preempted)."""
        self._release_window(r)
        while not self._grow(r, r.num_computed + n):
            busy = {id(w.request) for w in work}
            victim = next((v for v in reversed(self.running) if v is not r and id(v) not in busy), r)
            self.preempt(victim)
            if victim is r:
                return 0
        end = r.num_computed + n
        work.append(Work(request=r, start=r.num_computed, tokens=tuple(r.tokens[r.num_computed:end]),
                         sample=end == len(r.tokens)))
        return n

    def _with_draft(self, w: Work) -> Work:
        r = w.request
        room = min(self.config.num_draft, r.max_new_tokens - r.num_output - 1)  # drafts past the limit are waste
        draft = r.ngrams.draft(r.tokens, room) if room > 0 else []
        if draft and not self._grow(r, len(r.tokens) + len(draft)):
            draft = draft[:self._held(r) - len(r.tokens)]  # what the held pages fit
        return Work(request=r, start=w.start, tokens=w.tokens + tuple(draft), sample=True, num_draft=len(draft))

    # -- pages ----------------------------------------------------------------------------------------------
    def _grow(self, r: Request, end: int) -> bool:
        """Gives r pages for its positions < end in each pool (the window pool: from its first live column);
        False if a pool ran out (what was taken stays with r)."""
        if self.pages is not None and not self.pages.grow(r.pages, end):
            return False
        if self.window_pages is not None:
            extra = self.window_pages.allocate(max(0, self.window_pages.pages_for(end) - r.window_base
                                                   - len(r.window_pages)))
            if extra is None:
                return False
            r.window_pages.extend(extra)
        return True

    def _held(self, r: Request) -> int:
        """Positions below this have pages in every pool."""
        ps = self.config.page_size
        return min([len(r.pages) * ps] * (self.pages is not None)
                   + [(r.window_base + len(r.window_pages)) * ps] * (self.window_pages is not None))

    def _release_window(self, r: Request) -> None:
        """Frees r's window columns that no query to come can see: all their positions are before
        num_computed - window + 1 (every later query is at num_computed or after)."""
        if self.window_pages is None:
            return
        dead = max(0, r.num_computed - self.window + 1) // self.config.page_size - r.window_base
        if dead > 0:
            gone = r.window_pages[:dead]
            del r.window_pages[:dead]
            self.window_pages.free(gone)
            r.window_base += dead

    def _free_all(self, r: Request) -> None:
        if self.pages is not None:
            self.pages.free(r.pages)
        if self.window_pages is not None:
            self.window_pages.free(r.window_pages)
        r.window_base = 0

    def preempt(self, r: Request) -> None:
        self._free_all(r)
        r.num_computed = 0
        r.num_preempted += 1
        self.num_preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    # -- applying a step's results --------------------------------------------------------------------------
    def update(self, step: Step, sampled: list[list[int]], now: float = 0.0) -> list[Request]:
        """Applies a step's sampled tokens (per work item: the greedy token after each of its tokens, or after
        its last one) and returns the requests that finished."""
        finished = []
        eos = self.config.eos_token_ids
        for w, pred in zip(step.work, sampled):
            r = w.request
            if not w.sample:
                r.num_computed = w.start + len(w.tokens)
                self._release_window(r)
                continue
            real = len(w.tokens) - w.num_draft  # 1 in verify steps: pred[j] follows w.tokens[j]
            draft = w.tokens[real:]
            accepted = 0
            while accepted < len(draft) and draft[accepted] == pred[accepted]:
                accepted += 1
            r.num_drafted += len(draft)
            r.num_accepted += accepted
            new = list(pred[:accepted + 1])
            if r.first_token_time is None:
                r.first_token_time = now
            stop = next((i + 1 for i, t in enumerate(new) if t in eos), None)
            r.tokens.extend(new[:stop])
            if r.num_output >= r.max_new_tokens:
                del r.tokens[len(r.prompt) + r.max_new_tokens:]
                stop = 0
            r.num_computed = len(r.tokens) - 1
            if stop is not None:
                self._finish(r, now)
                finished.append(r)
            else:
                self._release_window(r)
        return finished

    def _finish(self, r: Request, now: float) -> None:
        self._free_all(r)
        self.running.remove(r)
        r.finished = True
        r.finish_time = now
