"""Random paged-attention problems for tests: fresh random inputs, random page order, never zeros."""

from __future__ import annotations

import torch


def make_cache(num_pages, page_size, hkv, d, *, dtype=torch.float32, kv_layout="NHD", device="cpu", gen=None):
    shape = (num_pages, page_size, hkv, d) if kv_layout == "NHD" else (num_pages, hkv, page_size, d)
    k = torch.randn(shape, generator=gen).to(device)
    v = torch.randn(shape, generator=gen).to(device)
    if dtype == torch.float8_e4m3fn:
        return (k * 4).to(dtype), (v * 4).to(dtype)
    return k.to(dtype), v.to(dtype)


def make_problem(*, batch=3, q_len=1, hq=8, hkv=2, d=64, page_size=4, max_pages=8, packed=False,
                 dtype=torch.float32, kv_dtype=None, kv_layout="NHD", device="cpu", seed=0, new_lens=None):
    """A random problem. Returns a dict of paged_attention's positional arguments (q, k_cache, v_cache,
    page_table, cache_seqlens, cu_seqlens_q). Packed q has capacity q_len tokens for `new_lens` new
    tokens per request (padding rows past the total)."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    num_pages = batch * max_pages + 3
    k_cache, v_cache = make_cache(num_pages, page_size, hkv, d, dtype=kv_dtype, kv_layout=kv_layout,
                                  device=device, gen=gen)
    page_table = torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages)
    cap = max_pages * page_size
    cu = None
    if packed:
        new = torch.tensor(new_lens) if new_lens is not None else torch.randint(1, 5, (batch,), generator=gen)
        assert int(new.sum()) <= q_len
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(new, 0)
        q = torch.randn(q_len, hq, d, generator=gen)
    else:
        new = torch.full((batch,), q_len)
        q = torch.randn(batch, q_len, hq, d, generator=gen)
    lens = new + torch.randint(0, cap - int(new.max()) + 1, (batch,), generator=gen)
    return dict(
        q=q.to(dtype).to(device),
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table.int().to(device),
        cache_seqlens=lens.int().to(device),
        cu_seqlens_q=None if cu is None else cu.to(device),
    )


def poisoned_scratch(nbytes: int, device) -> torch.Tensor:
    """A split-KV scratch with every byte 0xFF: NaN as bf16, fp16 and fp32, so a partial output or LSE that a split
    kernel leaves unwritten reaches out as NaN (the scratch the ops allocate holds whatever its memory held)."""
    return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)


def run_family(t, options, family, out=None, overrides=None):
    """Runs one family's plan (with `overrides` of its tile fields) for the inputs through kernels.run (the
    entry ops' path), the scratch poisoned (poisoned_scratch). Returns out, lse, the plan and a zero-argument
    call that runs it again; call.scratch is its scratch (replay_with_new_lengths poisons it again)."""
    from b12x_inductor import kernels, validate
    from b12x_inductor.plan import family_plan

    problem = validate.check_paged_attention(
        t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"], t["cu_seqlens_q"],
        kv_layout=options.get("kv_layout", "NHD"), causal=options.get("causal", True), scale=options.get("scale"),
        window_left=options.get("window_left", -1), kv_start=t["kv_start"], sinks=t["sinks"],
        softcap=options.get("softcap", 0.0), k_descale=t["k_descale"], v_descale=t["v_descale"],
        key_mask=t.get("key_mask"), q_pe=t.get("q_pe"), out=None)
    plan = family_plan(problem, family, **(overrides or {}))
    q = t["q"]
    out = torch.full(q.shape[:-1] + t["v_cache"].shape[-1:], float("nan"), dtype=q.dtype, device=q.device) \
        if out is None else out
    lse = torch.full(q.shape[:-1], float("nan"), device=q.device)
    scratch = poisoned_scratch(plan.scratch_bytes, q.device)
    opts = kernels.Options.of(problem.head_dim, kv_layout=options.get("kv_layout", "NHD"),
                              causal=options.get("causal", True), scale=options.get("scale"),
                              window_left=options.get("window_left", -1), softcap=options.get("softcap", 0.0))
    the_call = kernels.Call(**{k: t.get(k) for k in kernels.Call.INPUTS}, out=out, lse=lse, scratch=scratch,
                            options=opts, plan=plan)

    def call():
        kernels.run(the_call)
    call.scratch = scratch
    call()
    return out, lse, plan, call


def direct_call(t: dict, mode: str, options: dict, tiles: dict):
    """A kernels.Call of the inputs `t` (make_inputs' dict) for the plan of `mode` with the given tile fields
    (Triton family), out, lse and the scratch poisoned with NaN, on q's device: what the interpreter workers (and
    the GPU's direct cases) run without a Problem."""
    from b12x_inductor import kernels
    from b12x_inductor.plan import Plan, partials_bytes

    q = t["q"]
    dv = t["v_cache"].shape[-1]
    splits = tiles.get("num_splits", 1)
    rows = q.shape[0] * q.shape[1] if q.dim() == 4 else 0
    scratch_bytes = partials_bytes(rows * q.shape[-2] * splits, dv, q.dtype) if splits > 1 else 0
    plan = Plan(mode=mode, family="triton", scratch_bytes=scratch_bytes, **tiles)
    return kernels.Call(
        **{k: t.get(k) for k in kernels.Call.INPUTS},
        out=torch.full(q.shape[:-1] + (dv,), float("nan"), dtype=q.dtype, device=q.device),
        lse=torch.full(q.shape[:-1], float("nan"), device=q.device),
        scratch=poisoned_scratch(scratch_bytes, q.device),
        options=kernels.Options(**options), plan=plan)


def replay_with_new_lengths(graph, t, out, lse, check, *, page_size=16, steps=3, min_len=45, scratch=None):
    """CUDA-graph replays with the outputs (and `scratch`, where given: the split-KV scratch the graph's call
    uses) poisoned and the lengths and page tables changed in place before each; check(step) compares out and
    lse with the reference after each replay."""
    gen = torch.Generator().manual_seed(3)
    cap = t["page_table"].shape[1] * page_size
    batch = t["page_table"].shape[0]
    for step in range(steps):
        t["cache_seqlens"].copy_(torch.randint(min_len, cap + 1, (batch,), generator=gen).int())
        perm = torch.randperm(t["k_cache"].shape[0], generator=gen)[: t["page_table"].numel()]
        t["page_table"].copy_(perm.reshape(t["page_table"].shape).int())
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if scratch is not None:
            scratch.fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        check(step)


def interpreter_worker_report(test_file: str) -> dict:
    """Runs `test_file --triton-interpreter-worker` in a subprocess with TRITON_INTERPRET=1 (the Triton
    family on CPU) and returns the JSON report its worker printed last; fails the test if it printed none."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(test_file)))
    proc = subprocess.run([sys.executable, os.path.abspath(test_file), "--triton-interpreter-worker"], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"worker failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def force_triton_family() -> set:
    """For an interpreter worker: every plan takes the Triton family, and the returned set collects the
    "mode:family" of each entry run."""
    import b12x_inductor.kernels as kernels

    kernels.FAMILY_ORDER = ("triton",)
    kernels.family("triton").supports = lambda problem: True
    seen, run = set(), kernels.run

    def spying(call):
        seen.add(f"{call.mode}:{call.plan.family}")
        return run(call)

    kernels.run = spying
    return seen


def one_thread():
    """Body of a module-scoped fixture: tiny models run no faster on more threads, and far slower when the
    cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def serve_counting_syncs(engine, requests):
    """engine.serve(requests) on CUDA under torch's sync debug mode "warn": (its report, the sync warnings)."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = engine.serve(requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return report, [w for w in caught if "synchroniz" in str(w.message)]
