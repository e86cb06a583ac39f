"""`ServeConfig`: every knob of the serving loop, in one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from b12x_inductor.plan import MAX_VERIFY_LEN


def _pow2_buckets(first: int, last: int) -> tuple[int, ...]:
    """first, 2 * first, 4 * first, ... below `last`, then `last`."""
    out, b = [], first
    while b < last:
        out.append(b)
        b *= 2
    return (*out, last)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Static shape of the serving loop.

    num_pages x page_size token slots per layer hold the KV of all running requests (an MLA model's: its
    latent, kv_lora_rank + qk_rope_head_dim values a token and layer, 576 for DeepSeek-V3). A step runs at most
    `max_batch` requests and `token_budget` tokens. Compiled buckets: decode batches `decode_buckets`
    (default 1, 2, 4, ..., max_batch), the same batches for verify steps of 1 + num_draft tokens per
    request when num_draft > 0, and extend steps of `extend_buckets` packed tokens (default 128, 256, ...,
    token_budget). Each bucket compiles once, in `warmup`.

    Compilation: `compile_cache`, a directory that warm-up loads compiled artifacts from and saves them to
    (`serve.compile_cache`: copy it to another machine of the same kind and its engine starts warm).
    `regional_compile` compiles one decoder layer per bucket and layer kind and reuses it for every layer of
    that kind (`serve.runner`), instead of the whole model per bucket: less compile work by about the layer
    count, the same computation, and on CUDA still one CUDA graph per step (the runner captures the whole
    step). None (the default): regional where the decoder keeps its layers in a ModuleList `layers`, else
    the whole model; True requires it (warm-up raises where it cannot), False compiles the whole model.
    """

    num_pages: int = 256
    page_size: int = 16
    max_batch: int = 8
    token_budget: int = 256
    max_model_len: int = 1024
    num_draft: int = 0  # prompt-lookup draft tokens per request in verify steps (0: no speculation)
    max_ngram: int = 3
    eos_token_ids: tuple[int, ...] = ()
    decode_buckets: tuple[int, ...] | None = None
    extend_buckets: tuple[int, ...] | None = None
    compile: bool = True  # torch.compile(fullgraph=True) per bucket; False runs eagerly (debugging)
    cuda_graphs: bool = True  # mode="reduce-overhead" on CUDA
    recycle_window_pages: bool = True  # window layers in a pool of their own, out-of-window pages freed
    window_num_pages: int | None = None  # the window pool's pages (None: default_window_pages)
    compile_cache: str | None = None  # directory of compiled artifacts: loaded before warm-up, saved after
    regional_compile: bool | None = None  # one compiled decoder layer per bucket, reused for every layer

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_batch", "token_budget", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig: {name} must be >= 1; got {getattr(self, name)}")
        if self.window_num_pages is not None and self.window_num_pages < 1:
            raise ValueError(f"ServeConfig: window_num_pages must be >= 1 or None; got {self.window_num_pages}")
        if self.token_budget < self.max_batch:
            raise ValueError(f"ServeConfig: token_budget must be >= max_batch ({self.max_batch}); "
                             f"got {self.token_budget}")
        if not 0 <= self.num_draft < MAX_VERIFY_LEN:
            raise ValueError(f"ServeConfig: num_draft must be in 0..{MAX_VERIFY_LEN - 1}; got {self.num_draft}")
        for name, buckets, top in (("decode_buckets", self.decode_buckets, self.max_batch),
                                   ("extend_buckets", self.extend_buckets, self.token_budget)):
            if buckets is not None and (list(buckets) != sorted(set(buckets)) or buckets[-1] != top
                                        or buckets[0] < 1):
                raise ValueError(f"ServeConfig: {name} must be increasing, positive and end at {top}; "
                                 f"got {buckets}")

    @property
    def decode_sizes(self) -> tuple[int, ...]:
        return self.decode_buckets or _pow2_buckets(1, self.max_batch)

    @property
    def extend_sizes(self) -> tuple[int, ...]:
        return self.extend_buckets or _pow2_buckets(min(128, self.token_budget), self.token_budget)

    @property
    def max_pages(self) -> int:
        """Page-table columns: a request's positions plus the padding of a verify step."""
        return -(-(self.max_model_len + self.num_draft) // self.page_size)

    def window_pages_per_request(self, window: int) -> int:
        """The most window pages one request can need in a step: its queries of up to token_budget positions
        and the window - 1 keys before the first of them (a request needs no more pages than that)."""
        return min(self.max_pages, -(-(window - 1 + self.token_budget) // self.page_size) + 1)

    def default_window_pages(self, window: int) -> int:
        """The window pool's default size: every batch row decoding or verifying (a window of keys and the
        num_draft verify tokens each, over one page more at each end) plus one token_budget of prefill chunks;
        at least what one request needs, at most num_pages (what the window layers would take without
        recycling)."""
        per_row = -(-(window + self.num_draft) // self.page_size) + 2
        pages = self.max_batch * per_row + -(-self.token_budget // self.page_size) + 1
        return max(self.window_pages_per_request(window), min(self.num_pages, pages))

    def window_pool_pages(self, window: int) -> int:
        return self.window_num_pages if self.window_num_pages is not None else self.default_window_pages(window)
