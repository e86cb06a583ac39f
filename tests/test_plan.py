"""select_plan's decision table."""

from __future__ import annotations

import expecttest
import torch

from b12x_inductor.plan import Problem, select_plan

H200 = dict(device_type="cuda", sm_count=132, capability=(9, 0))
BASE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, q_dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16, kv_layout="NHD", packed=False)


GPT_OSS = dict(num_q_heads=64, num_kv_heads=8, head_dim=64)
MLA = dict(num_kv_heads=1, head_dim=576, v_head_dim=512, page_size=64, v_in_k=True)  # v the latent's first 512


def _row(name, **kw):
    p = Problem(**{**BASE, **kw})
    plan = select_plan(p)
    fields = f"{plan.mode:7} {plan.family:6} splits={plan.num_splits:<3} m={plan.block_m:<3} n={plan.block_n:<3} " \
             f"warps={plan.num_warps} stages={plan.num_stages} scratch={plan.scratch_bytes}" \
             + (" v_from_k" if plan.v_from_k else "")
    return f"{name:28} {fields}".rstrip()


def table() -> str:
    rows = [
        _row("cpu decode 8x1", batch=8, q_len=1, max_pages=512, device_type="cpu"),
        _row("cpu verify 8x4", batch=8, q_len=4, max_pages=512, device_type="cpu"),
        _row("cpu extend 2x64", batch=2, q_len=64, max_pages=512, device_type="cpu"),
        _row("cpu packed T=256", batch=4, q_len=256, packed=True, max_pages=512, device_type="cpu"),
        _row("h200 decode 1x32768", batch=1, q_len=1, max_pages=2048, **H200),
        _row("h200 decode 8x8192", batch=8, q_len=1, max_pages=512, **H200),
        _row("h200 decode 32x4096", batch=32, q_len=1, max_pages=256, **H200),
        _row("h200 decode 64x2048", batch=64, q_len=1, max_pages=128, **H200),
        _row("h200 decode 128x1024", batch=128, q_len=1, max_pages=64, **H200),
        _row("h200 decode 16x16384", batch=16, q_len=1, max_pages=1024, **H200),
        _row("h200 decode fp8 32x4096", batch=32, q_len=1, max_pages=256, kv_dtype=torch.float8_e4m3fn, **H200),
        _row("h200 decode D=256 g=1", batch=8, q_len=1, max_pages=512, head_dim=256, num_q_heads=8, **H200),
        _row("h200 verify 8x8192 S=4", batch=8, q_len=4, max_pages=512, **H200),
        # 16 rows a KV head in one wave (one_wave_tile): unsplit on 64-key tiles for B x Hkv from 256 (the
        # two-an-SM target) to 396; below, 32-key tiles, splits halved until five programs an SM hold them all;
        # above, 2 splits on one K / V buffer at 397-511, unsplit on two to 660 and on one to 924; beyond a wave,
        # unsplit on 64-key tiles with one buffer
        _row("h200 decode 24x4096", batch=24, q_len=1, max_pages=256, **H200),
        _row("h200 verify 32x4096 S=4", batch=32, q_len=4, max_pages=256, **H200),
        # the bench's other verify lengths: S=2 pads to decode's 16-row tile, S=8 is 32 rows a KV head
        _row("h200 verify 32x4096 S=2", batch=32, q_len=2, max_pages=256, **H200),
        _row("h200 verify 32x4096 S=8", batch=32, q_len=8, max_pages=256, **H200),
        _row("h200 verify 8x8192 S=8", batch=8, q_len=8, max_pages=512, **H200),
        _row("h200 verify 64x2048 S=8", batch=64, q_len=8, max_pages=128, **H200),
        *[_row(f"h200 decode {b}x4096", batch=b, q_len=1, max_pages=256, **H200)
          for b in (49, 50, 64, 72, 96, 120, 128, 160)],
        _row("h200 decode 128x256", batch=128, q_len=1, max_pages=16, **H200),
        _row("h200 decode Hkv=4 32x4096", batch=32, q_len=1, max_pages=256, num_q_heads=28, num_kv_heads=4, **H200),
        _row("h200 verify 64x2048 S=16", batch=64, q_len=16, max_pages=128, **H200),
        # 8 query heads a KV head (Llama-3-70B): 32 rows at S=4, a tile that holds two programs an SM
        _row("h200 verify G=8 32x4096 S=4", batch=32, q_len=4, max_pages=256, num_q_heads=64, **H200),
        _row("h200 verify G=8 8x8192 S=8", batch=8, q_len=8, max_pages=512, num_q_heads=64, **H200),
        _row("h200 extend 4x4096", batch=4, q_len=4096, max_pages=256, **H200),
        _row("h200 packed T=16384", batch=1, q_len=16384, packed=True, max_pages=1024, **H200),
        _row("h200 extend D=256", batch=2, q_len=512, max_pages=64, head_dim=256, **H200),
        # a sliding window bounds the keys a query sees: the splits follow window_left + S, not the capacity
        _row("h200 swa127 decode 32x4096", batch=32, q_len=1, max_pages=256, window_left=127, **GPT_OSS, **H200),
        _row("h200 full decode 32x4096", batch=32, q_len=1, max_pages=256, **GPT_OSS, **H200),
        _row("h200 swa127 verify 32x4096", batch=32, q_len=4, max_pages=256, window_left=127, **GPT_OSS, **H200),
        _row("h200 swa1023 decode 8x16384", batch=8, q_len=1, max_pages=1024, window_left=1023, **GPT_OSS, **H200),
        # absorbed MLA (DeepSeek-V3: one 576-wide latent head, page 64)
        _row("h200 mla H128 decode 32x4096", batch=32, q_len=1, max_pages=64, **MLA, num_q_heads=128, **H200),
        _row("h200 mla H128 own v 32x4096", batch=32, q_len=1, max_pages=64, **{**MLA, "v_in_k": False},
             num_q_heads=128, **H200),
        _row("h200 mla H128 decode 1x32768", batch=1, q_len=1, max_pages=512, **MLA, num_q_heads=128, **H200),
        _row("h200 mla H16 decode 32x4096", batch=32, q_len=1, max_pages=64, **MLA, num_q_heads=16, **H200),
        _row("h200 mla H16 verify 32x4096", batch=32, q_len=4, max_pages=64, **MLA, num_q_heads=16, **H200),
        _row("l40 mla H128 decode 32x4096", batch=32, q_len=1, max_pages=64, **MLA, num_q_heads=128,
             device_type="cuda", sm_count=142, capability=(8, 9)),
        _row("h200 mla H128 extend 2x512", batch=2, q_len=512, max_pages=16, **MLA, num_q_heads=128, **H200),
    ]
    return "\n".join(rows)


# Other GPUs (compiled in CI for their targets, tests/test_triton_compile_targets.py; not run): the same tiles as
# sm90, the split count from their SM count; float8 caches take the torch family before sm89.
GPUS = dict(a100=dict(device_type="cuda", sm_count=108, capability=(8, 0)),
            l40=dict(device_type="cuda", sm_count=142, capability=(8, 9)),
            b200=dict(device_type="cuda", sm_count=148, capability=(10, 0)),
            rtx5090=dict(device_type="cuda", sm_count=170, capability=(12, 0)),
            spark=dict(device_type="cuda", sm_count=48, capability=(12, 1)))


def table_other_gpus() -> str:
    f8 = torch.float8_e4m3fn
    rows = []
    for name, dev in GPUS.items():
        rows += [
            _row(f"{name} decode 8x8192", batch=8, q_len=1, max_pages=512, **dev),
            _row(f"{name} decode fp8 32x4096", batch=32, q_len=1, max_pages=256, kv_dtype=f8, **dev),
            _row(f"{name} verify 8x8192 S=4", batch=8, q_len=4, max_pages=512, **dev),
            _row(f"{name} extend 4x4096", batch=4, q_len=4096, max_pages=256, **dev),
            _row(f"{name} extend fp8 1x16384", batch=1, q_len=16384, max_pages=1024, kv_dtype=f8, **dev),
        ]
    return "\n".join(rows)


def table_cute() -> str:
    """The rows where the CuTe family is in question, as select_plan decides with nvidia-cutlass-dsl installed."""
    f8 = torch.float8_e4m3fn
    rows = [
        _row("fp8 decode 1x32768", batch=1, q_len=1, max_pages=2048, kv_dtype=f8, **H200),
        _row("fp8 decode 8x8192", batch=8, q_len=1, max_pages=512, kv_dtype=f8, **H200),
        _row("fp8 decode 32x4096", batch=32, q_len=1, max_pages=256, kv_dtype=f8, **H200),
        _row("fp8 decode 64x2048", batch=64, q_len=1, max_pages=128, kv_dtype=f8, **H200),
        _row("fp8 decode 128x1024", batch=128, q_len=1, max_pages=64, kv_dtype=f8, **H200),
        _row("fp8 decode 16x16384", batch=16, q_len=1, max_pages=1024, kv_dtype=f8, **H200),
        _row("fp8 decode D=64 HND p=1", batch=8, q_len=1, max_pages=512, kv_dtype=f8, head_dim=64,
             kv_layout="HND", page_size=1, **H200),
        _row("fp8 decode D=96", batch=8, q_len=1, max_pages=512, kv_dtype=f8, head_dim=96, **H200),
        _row("fp8 decode G=8", batch=8, q_len=1, max_pages=512, kv_dtype=f8, num_q_heads=64, **H200),
        _row("fp8 decode sm80", batch=8, q_len=1, max_pages=512, kv_dtype=f8, device_type="cuda", sm_count=108,
             capability=(8, 0)),
        _row("fp8 verify 8x8192 S=4", batch=8, q_len=4, max_pages=512, kv_dtype=f8, **H200),
        _row("bf16 decode 32x4096", batch=32, q_len=1, max_pages=256, **H200),
        _row("bf16 extend 1x16384", batch=1, q_len=16384, max_pages=1024, **H200),
        _row("bf16 packed T=16384", batch=1, q_len=16384, packed=True, max_pages=1024, **H200),
        _row("bf16 extend D=64 8192:1024", batch=1, q_len=1024, max_pages=512, head_dim=64, **H200),
        _row("bf16 extend D=64 4x4096", batch=4, q_len=4096, max_pages=256, head_dim=64, **H200),
        _row("bf16 packed D=64 T=4096", batch=4, q_len=4096, packed=True, max_pages=256, head_dim=64, **H200),
        _row("bf16 extend D=256", batch=2, q_len=512, max_pages=64, head_dim=256, **H200),
        _row("bf16 extend D=256 page 64", batch=2, q_len=512, max_pages=16, head_dim=256, page_size=64, **H200),
        _row("fp8 extend 1x16384", batch=1, q_len=16384, max_pages=1024, kv_dtype=f8, **H200),
        # absorbed MLA (mla.py): decode/verify with pages that go by TMA; page 1, float8, extend: Triton
        _row("mla H128 decode 32x4096", batch=32, q_len=1, max_pages=64, **MLA, num_q_heads=128, **H200),
        _row("mla H128 decode 64x4096", batch=64, q_len=1, max_pages=64, **MLA, num_q_heads=128, **H200),
        _row("mla H128 decode 1x32768", batch=1, q_len=1, max_pages=512, **MLA, num_q_heads=128, **H200),
        _row("mla H16 decode 1x32768", batch=1, q_len=1, max_pages=512, **MLA, num_q_heads=16, **H200),
        _row("mla H16 verify 32x4096", batch=32, q_len=4, max_pages=64, **MLA, num_q_heads=16, **H200),
        _row("mla H16 decode page 1", batch=32, q_len=1, max_pages=4096, **{**MLA, "page_size": 1},
             num_q_heads=16, **H200),
        _row("mla H16 decode fp8", batch=32, q_len=1, max_pages=64, **MLA, num_q_heads=16, kv_dtype=f8, **H200),
        _row("mla H128 extend 2x512", batch=2, q_len=512, max_pages=16, **MLA, num_q_heads=128, **H200),
    ]
    return "\n".join(rows)


class TestPlanTable(expecttest.TestCase):
    def test_table(self):
        from unittest import mock

        from b12x_inductor.kernels import cute

        with mock.patch.object(cute, "available", lambda: False):  # the table without the CuTe DSL installed
            got = table()
        self.assertExpectedInline(got, """\
cpu decode 8x1               decode  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
cpu verify 8x4               verify  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
cpu extend 2x64              extend  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
cpu packed T=256             extend  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
h200 decode 1x32768          decode  triton splits=64  m=16  n=32  warps=4 stages=3 scratch=532480
h200 decode 8x8192           decode  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=532480
h200 decode 32x4096          decode  triton splits=1   m=16  n=64  warps=4 stages=3 scratch=0
h200 decode 64x2048          decode  triton splits=1   m=16  n=32  warps=4 stages=3 scratch=0
h200 decode 128x1024         decode  triton splits=1   m=16  n=64  warps=4 stages=2 scratch=0
h200 decode 16x16384         decode  triton splits=4   m=16  n=32  warps=4 stages=3 scratch=532480
h200 decode fp8 32x4096      decode  triton splits=1   m=16  n=128 warps=4 stages=3 scratch=0
h200 decode D=256 g=1        decode  triton splits=4   m=16  n=16  warps=4 stages=3 scratch=132096
h200 verify 8x8192 S=4       verify  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=2129920
h200 decode 24x4096          decode  triton splits=2   m=16  n=32  warps=4 stages=3 scratch=399360
h200 verify 32x4096 S=4      verify  triton splits=1   m=16  n=64  warps=4 stages=3 scratch=0
h200 verify 32x4096 S=2      verify  triton splits=1   m=16  n=64  warps=4 stages=3 scratch=0
h200 verify 32x4096 S=8      verify  triton splits=1   m=32  n=64  warps=4 stages=3 scratch=0
h200 verify 8x8192 S=8       verify  triton splits=4   m=32  n=64  warps=4 stages=3 scratch=2129920
h200 verify 64x2048 S=8      verify  triton splits=1   m=32  n=64  warps=4 stages=3 scratch=0
h200 decode 49x4096          decode  triton splits=1   m=16  n=64  warps=4 stages=3 scratch=0
h200 decode 50x4096          decode  triton splits=2   m=16  n=32  warps=4 stages=2 scratch=832000
h200 decode 64x4096          decode  triton splits=1   m=16  n=32  warps=4 stages=3 scratch=0
h200 decode 72x4096          decode  triton splits=1   m=16  n=32  warps=4 stages=3 scratch=0
h200 decode 96x4096          decode  triton splits=1   m=16  n=32  warps=4 stages=2 scratch=0
h200 decode 120x4096         decode  triton splits=1   m=16  n=64  warps=4 stages=2 scratch=0
h200 decode 128x4096         decode  triton splits=1   m=16  n=64  warps=4 stages=2 scratch=0
h200 decode 160x4096         decode  triton splits=1   m=16  n=64  warps=4 stages=2 scratch=0
h200 decode 128x256          decode  triton splits=1   m=16  n=64  warps=4 stages=2 scratch=0
h200 decode Hkv=4 32x4096    decode  triton splits=4   m=16  n=32  warps=4 stages=3 scratch=931840
h200 verify 64x2048 S=16     verify  triton splits=1   m=64  n=64  warps=8 stages=3 scratch=0
h200 verify G=8 32x4096 S=4  verify  triton splits=1   m=32  n=64  warps=4 stages=3 scratch=0
h200 verify G=8 8x8192 S=8   verify  triton splits=4   m=64  n=64  warps=8 stages=3 scratch=4259840
h200 extend 4x4096           extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
h200 packed T=16384          extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
h200 extend D=256            extend  triton splits=1   m=128 n=64  warps=8 stages=2 scratch=0
h200 swa127 decode 32x4096   decode  triton splits=1   m=16  n=64  warps=4 stages=3 scratch=0
h200 full decode 32x4096     decode  triton splits=2   m=16  n=64  warps=4 stages=3 scratch=540672
h200 swa127 verify 32x4096   verify  triton splits=1   m=32  n=64  warps=4 stages=3 scratch=0
h200 swa1023 decode 8x16384  decode  triton splits=4   m=16  n=64  warps=4 stages=3 scratch=270336
h200 mla H128 decode 32x4096 decode  triton splits=2   m=64  n=64  warps=8 stages=2 scratch=8421376 v_from_k
h200 mla H128 own v 32x4096  decode  triton splits=2   m=64  n=32  warps=8 stages=2 scratch=8421376
h200 mla H128 decode 1x32768 decode  triton splits=64  m=64  n=64  warps=8 stages=2 scratch=8421376 v_from_k
h200 mla H16 decode 32x4096  decode  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=4210688 v_from_k
h200 mla H16 verify 32x4096  verify  triton splits=4   m=64  n=64  warps=8 stages=2 scratch=8421376 v_from_k
l40 mla H128 decode 32x4096  decode  triton splits=1   m=16  n=32  warps=4 stages=2 scratch=0 v_from_k
h200 mla H128 extend 2x512   extend  triton splits=1   m=32  n=16  warps=8 stages=2 scratch=0""")

    def test_table_other_gpus(self):
        from unittest import mock

        from b12x_inductor.kernels import cute

        with mock.patch.object(cute, "available", lambda: True):  # installed or not: CuTe is sm90 only
            self.assertExpectedInline(table_other_gpus(), """\
a100 decode 8x8192           decode  triton splits=4   m=16  n=32  warps=4 stages=3 scratch=266240
a100 decode fp8 32x4096      decode  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
a100 verify 8x8192 S=4       verify  triton splits=4   m=16  n=32  warps=4 stages=3 scratch=1064960
a100 extend 4x4096           extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
a100 extend fp8 1x16384      extend  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
l40 decode 8x8192            decode  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=532480
l40 decode fp8 32x4096       decode  triton splits=1   m=16  n=128 warps=4 stages=3 scratch=0
l40 verify 8x8192 S=4        verify  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=2129920
l40 extend 4x4096            extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
l40 extend fp8 1x16384       extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
b200 decode 8x8192           decode  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=532480
b200 decode fp8 32x4096      decode  triton splits=1   m=16  n=128 warps=4 stages=3 scratch=0
b200 verify 8x8192 S=4       verify  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=2129920
b200 extend 4x4096           extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
b200 extend fp8 1x16384      extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
rtx5090 decode 8x8192        decode  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=532480
rtx5090 decode fp8 32x4096   decode  triton splits=1   m=16  n=128 warps=4 stages=3 scratch=0
rtx5090 verify 8x8192 S=4    verify  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=2129920
rtx5090 extend 4x4096        extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
rtx5090 extend fp8 1x16384   extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
spark decode 8x8192          decode  triton splits=2   m=16  n=32  warps=4 stages=3 scratch=133120
spark decode fp8 32x4096     decode  triton splits=1   m=16  n=128 warps=4 stages=3 scratch=0
spark verify 8x8192 S=4      verify  triton splits=2   m=16  n=32  warps=4 stages=3 scratch=532480
spark extend 4x4096          extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
spark extend fp8 1x16384     extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0""")

    def test_table_with_cute_installed(self):
        from unittest import mock

        from b12x_inductor.kernels import cute

        with mock.patch.object(cute, "available", lambda: True):
            self.assertExpectedInline(table_cute(), """\
fp8 decode 1x32768           decode  cute   splits=64  m=1   n=64  warps=4 stages=2 scratch=532480
fp8 decode 8x8192            decode  cute   splits=8   m=1   n=64  warps=4 stages=2 scratch=532480
fp8 decode 32x4096           decode  cute   splits=1   m=16  n=128 warps=4 stages=2 scratch=0
fp8 decode 64x2048           decode  cute   splits=1   m=16  n=128 warps=4 stages=2 scratch=0
fp8 decode 128x1024          decode  cute   splits=1   m=16  n=128 warps=4 stages=2 scratch=0
fp8 decode 16x16384          decode  cute   splits=2   m=16  n=128 warps=4 stages=2 scratch=266240
fp8 decode D=64 HND p=1      decode  triton splits=2   m=16  n=128 warps=4 stages=3 scratch=67584
fp8 decode D=96              decode  triton splits=4   m=16  n=128 warps=4 stages=3 scratch=200704
fp8 decode G=8               decode  triton splits=4   m=16  n=128 warps=4 stages=3 scratch=532480
fp8 decode sm80              decode  torch  splits=1   m=0   n=0   warps=0 stages=0 scratch=0
fp8 verify 8x8192 S=4        verify  triton splits=4   m=16  n=128 warps=4 stages=3 scratch=1064960
bf16 decode 32x4096          decode  triton splits=1   m=16  n=64  warps=4 stages=3 scratch=0
bf16 extend 1x16384          extend  cute   splits=1   m=128 n=128 warps=12 stages=3 scratch=0
bf16 packed T=16384          extend  cute   splits=1   m=128 n=128 warps=12 stages=3 scratch=0
bf16 extend D=64 8192:1024   extend  cute   splits=1   m=128 n=128 warps=12 stages=4 scratch=0
bf16 extend D=64 4x4096      extend  cute   splits=1   m=192 n=128 warps=16 stages=4 scratch=0
bf16 packed D=64 T=4096      extend  cute   splits=1   m=192 n=128 warps=16 stages=4 scratch=0
bf16 extend D=256            extend  cute   splits=1   m=128 n=48  warps=12 stages=3 scratch=0
bf16 extend D=256 page 64    extend  cute   splits=1   m=128 n=32  warps=12 stages=4 scratch=0
fp8 extend 1x16384           extend  triton splits=1   m=128 n=128 warps=8 stages=3 scratch=0
mla H128 decode 32x4096      decode  cute   splits=2   m=64  n=64  warps=8 stages=2 scratch=0 v_from_k
mla H128 decode 64x4096      decode  cute   splits=1   m=64  n=64  warps=8 stages=2 scratch=0 v_from_k
mla H128 decode 1x32768      decode  cute   splits=64  m=64  n=32  warps=12 stages=4 scratch=8421376 v_from_k
mla H16 decode 1x32768       decode  cute   splits=128 m=64  n=32  warps=12 stages=4 scratch=2105344 v_from_k
mla H16 verify 32x4096       verify  cute   splits=4   m=64  n=32  warps=12 stages=4 scratch=8421376 v_from_k
mla H16 decode page 1        decode  triton splits=8   m=16  n=32  warps=4 stages=3 scratch=4210688 v_from_k
mla H16 decode fp8           decode  cute   splits=4   m=16  n=64  warps=12 stages=5 scratch=2105344 v_from_k
mla H128 extend 2x512        extend  triton splits=1   m=32  n=16  warps=8 stages=2 scratch=0""")

    def test_modes_from_static_shapes(self):
        def mode(q_len, packed=False):
            return Problem(**{**BASE, "batch": 2, "q_len": q_len, "packed": packed, "max_pages": 4,
                              "device_type": "cpu"}).mode
        assert [mode(1), mode(2), mode(16), mode(17), mode(1, packed=True)] == \
            ["decode", "verify", "verify", "extend", "extend"]

    def test_pure(self):
        """select_plan reads nothing but its Problem: not the order of earlier calls, not the environment
        (B12X_* variables), not the machine's GPU (torch.cuda is made to raise). Each of those would change a
        plan of the table or raise here."""
        import os
        import random
        from unittest import mock

        rows = [dict(batch=b, q_len=s, packed=packed, max_pages=m, kv_dtype=kv, head_dim=d, num_q_heads=hq,
                     kv_layout=layout, page_size=ps, **dev)
                for b, s, packed, m in ((1, 1, False, 2048), (8, 1, False, 512), (64, 1, False, 128),
                                        (8, 4, False, 512), (64, 16, False, 128), (4, 4096, False, 256),
                                        (1, 16384, True, 1024))
                for kv in (torch.bfloat16, torch.float8_e4m3fn)
                for d, hq in ((128, 32), (64, 8), (256, 8))
                for layout, ps in (("NHD", 16), ("HND", 1))
                for dev in (H200, dict(device_type="cuda", sm_count=108, capability=(8, 0)),
                            dict(device_type="cpu"))]
        problems = [Problem(**{**BASE, **r}) for r in rows]
        expected = [select_plan(p) for p in problems]
        assert len({(e.family, e.num_splits, e.block_n) for e in expected}) > 5  # the rows do differ

        def gpu_query(*args, **kwargs):
            raise AssertionError("select_plan queried the machine's GPU")

        order = list(range(len(problems)))
        random.Random(0).shuffle(order)
        env = {k: v for k, v in os.environ.items() if not k.startswith("B12X")}
        env.update(B12X_DEBUG="1", B12X_FAMILY="torch", B12X_NUM_SPLITS="3")
        with mock.patch.dict(os.environ, env, clear=True), \
                mock.patch.object(torch.cuda, "get_device_properties", gpu_query), \
                mock.patch.object(torch.cuda, "is_available", gpu_query), \
                mock.patch.object(torch.cuda, "current_device", gpu_query), \
                mock.patch.object(torch.cuda, "device_count", gpu_query):
            again = {i: select_plan(Problem(**{**BASE, **rows[i]})) for i in order}  # equal, not identical, Problems
        assert [again[i] for i in range(len(problems))] == expected
        with self.assertRaises(Exception):  # a Plan cannot be changed after the fact by whoever holds it
            expected[0].num_splits = 99
