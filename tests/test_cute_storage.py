"""The CuTe kernels' shared memory (kernels/cute/storage.py), CPU only: the byte count the geometry functions
check against SMEM_LIMIT and the kernels launch with is the size of the struct the kernel allocates, and its
fields sit where the kernels need them (the ring at 0 on 1024 bytes, fp32 tensors on 16, mbarriers on 8)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("cutlass.cute")


def _aligned(storage, align: dict) -> bool:
    offsets = storage._offsets  # cute.struct's field offsets, in declaration order
    return all(off % align[name] == 0 for name, off in offsets.items())


def test_cute_split_storage_is_the_launch_size():
    from b12x_inductor.kernels.cute import SMEM_LIMIT, geometry

    align = dict(ring=1024, mbar=8, q=16, scores=16, p=16, alpha=16, row_max=16, row_sum=16)
    for d, bits, rows, tma in itertools.product((64, 128, 256), (8, 16), (1, 4, 16), (False, True)):
        geo = geometry(d=d, rows=rows, kv_bits=bits, tile_n=64, stages=2, num_warps=4, tma=tma)
        storage = geo["storage"]
        assert geo["smem_bytes"] == storage.size_in_bytes() <= SMEM_LIMIT
        assert ("mbar" in storage._offsets) == tma and storage._offsets["ring"] == 0
        assert _aligned(storage, align)
    # 64 keys x 128 x bf16 x 2 stages x K and V, then q, scores, P, and alpha, max, sum of 4 rows; rounded to 1024
    geo = geometry(d=128, rows=4, kv_bits=16, tile_n=64, stages=2, num_warps=4, tma=False)
    assert geo["storage"]._offsets == dict(ring=0, q=65536, scores=67584, p=71680, alpha=72704, row_max=72720,
                                           row_sum=72736)
    assert geo["smem_bytes"] == 73728


def test_cute_mma_and_extend_storage():
    from b12x_inductor.kernels.cute import SMEM_LIMIT, extend_geometry, mma_geometry

    geo = mma_geometry(d=128, rows=4, kv_bits=8, tile_n=128, stages=2, num_warps=4, tma=True)
    # the warps' partial outputs of the 4 live rows beside the ring (it holds the CTA's next item's tiles)
    assert geo["storage"]._offsets == dict(ring=0, mbar=65536, partials=65552, row_max=73744, row_sum=74000)
    assert geo["smem_bytes"] == geo["storage"].size_in_bytes() == 74752
    for d, stages in ((64, 4), (128, 3)):
        geo = extend_geometry(d=d, tile_n=128, stages=stages)
        storage = geo["storage"]
        assert geo["smem_bytes"] == storage.size_in_bytes() <= SMEM_LIMIT
        assert _aligned(storage, dict(q=1024, kv=1024, mbar=8)) and storage._offsets["q"] == 0
