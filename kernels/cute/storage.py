"""The shared memory of the CuTe DSL kernels, one `cute.struct` per kernel: each kernel allocates its struct
whole (`SmemAllocator().allocate(storage)`), and the host reads the byte count it checks against SMEM_LIMIT
and launches with from the same struct (`size_in_bytes()`, geometry functions in __init__.py), so the layout
the kernel uses and the size it is given are one declaration.

Field sizes follow a kernel's compile-time constants, so each struct is declared by a function of them (one
class per configuration, cached). Fields are laid out in declaration order, each at the next multiple of its
alignment: 1024 bytes for the swizzled K/V rings and tiles (TMA boxes and wgmma operands start on a
1024-byte boundary), 16 for the fp32 tensors, 8 (natural) for the mbarriers; the struct's size is rounded up
to its largest alignment. The dynamic shared memory it is allocated in starts on 1024 bytes (the DSL declares
it `.align 1024`).

No `from __future__ import annotations` in this module: cute.struct reads the field types from the class
annotations, which must therefore be evaluated. A field cannot share its name with a variable its
annotations read (the class body would look that name up in the class, not in the enclosing function).
"""

import functools

import cutlass.cute as cute
from cutlass import Float32, Int64, Uint8, Uint16

MemRange = cute.struct.MemRange
Align = cute.struct.Align


def _split_ring(*, d: int, kv_bits: int, tile_n: int, stages: int, partial_elems: int):
    """decode.py's K/V ring: `stages` K tiles then `stages` V tiles of tile_n x d kv_bits-wide elements
    (viewed in the cache's dtype by the kernel), and after the last tile the same bytes reused for
    `partial_elems` fp32 values of the epilogue's reduction."""

    @cute.union
    class Ring:
        kv: MemRange[{8: Uint8, 16: Uint16}[kv_bits], 2 * stages * tile_n * d]
        partials: MemRange[Float32, partial_elems]

    return Ring


@functools.cache
def split_storage(*, d: int, rows: int, kv_bits: int, tile_n: int, stages: int, parts: int, key_parts: int,
                  tma: bool):
    """decode.py's shared memory: the ring (its reduction: the key_parts P V partial sums of the rows), with
    TMA one mbarrier per stage, q in fp32, the scores of the head-dim parts, P, and per row alpha, the running
    max and the sum."""
    ring_type = _split_ring(d=d, kv_bits=kv_bits, tile_n=tile_n, stages=stages, partial_elems=key_parts * rows * d)

    @cute.struct
    class SharedStorage:
        ring: Align[ring_type, 1024]
        if tma:
            mbar: MemRange[Int64, stages]
        q: Align[MemRange[Float32, rows * d], 16]
        scores: Align[MemRange[Float32, parts * rows * tile_n], 16]
        p: Align[MemRange[Float32, tile_n * rows], 16]
        alpha: Align[MemRange[Float32, rows], 16]
        row_max: Align[MemRange[Float32, rows], 16]
        row_sum: Align[MemRange[Float32, rows], 16]

    return SharedStorage


@functools.cache
def mma_storage(*, d: int, rows: int, kv_bits: int, tile_n: int, stages: int, warps: int, tma: bool):
    """decode_mma.py's shared memory: the ring, with TMA one mbarrier per stage, each warp's rows x d partial
    output of an item's epilogue (the live rows of its m16 tile, beside the ring, which holds the CTA's next
    item's first tiles by then), and each warp's 16 row maxima and sums."""

    @cute.struct
    class Ring:
        kv: MemRange[{8: Uint8, 16: Uint16}[kv_bits], 2 * stages * tile_n * d]

    @cute.struct
    class SharedStorage:
        ring: Align[Ring, 1024]
        if tma:
            mbar: MemRange[Int64, stages]
        partials: Align[MemRange[Float32, warps * rows * d], 16]
        row_max: Align[MemRange[Float32, warps * 16], 16]
        row_sum: Align[MemRange[Float32, warps * 16], 16]

    return SharedStorage


@functools.cache
def extend_storage(*, block_m: int, d: int, tile_n: int, stages: int, q_bufs: int = 1):
    """extend.py's shared memory: `q_bufs` Q tiles (block_m x d each), the ring of `stages` K tiles then `stages`
    V tiles (tile_n x d), all 16-bit (viewed in q's dtype by the kernel), 3 x stages mbarriers (K full, V full,
    empty: common.full_barrier, empty_barrier), then a Q-full and a Q-empty mbarrier per Q tile and consumer
    warpgroup (block_m / 64 of them: extend.py's `_q_barrier`). Every tile starts on 1024 bytes (tile_n * d * 2
    is a multiple of 1024: tile_n % 16 == 0, d % 64 == 0)."""
    assert tile_n * d * 2 % 1024 == 0, (tile_n, d)

    @cute.struct
    class SharedStorage:
        q: Align[MemRange[Uint16, q_bufs * block_m * d], 1024]
        kv: Align[MemRange[Uint16, 2 * stages * tile_n * d], 1024]
        mbar: MemRange[Int64, 3 * stages + 2 * q_bufs * (block_m // 64)]

    return SharedStorage


@functools.cache
def mla_storage(*, block_m: int, d: int, tile_n: int, stages: int):
    """mla.py's shared memory: the Q tile (block_m x d), the ring of `stages` latent tiles (tile_n x d; V is
    the first 512 columns of each, and each tile's last 64 columns, the rope keys, hold the tile's P once its
    scores are taken), all 16-bit, 1024-byte aligned; 3 x stages mbarriers (only K full and empty are used:
    common.full_barrier, empty_barrier); each consumer warpgroup's published row maxima and final row sums.
    The ring directly follows the Q tile (both multiples of 1024 bytes): the epilogue stages the output rows
    from Q's tile on where the ring alone is too small for them. A float8 cache's tiles land, as stored, in the
    upper half of their stage and are widened in place."""
    assert tile_n * d * 2 % 1024 == 0 and block_m * d * 2 % 1024 == 0, (block_m, tile_n, d)

    @cute.struct
    class SharedStorage:
        q: Align[MemRange[Uint16, block_m * d], 1024]
        kv: Align[MemRange[Uint16, stages * tile_n * d], 1024]
        mbar: MemRange[Int64, 3 * stages]
        row_max: Align[MemRange[Float32, 2 * block_m], 16]
        row_sum: Align[MemRange[Float32, 2 * block_m], 16]

    return SharedStorage


@functools.cache
def mla_seesaw_storage(*, block_m: int, d: int, tile_n: int):
    """mla_seesaw.py's shared memory: the Q tile (block_m x d; its last 64 columns hold warpgroup 1's P once Q's
    rope columns are in registers), two latent tiles (tile_n x d; V is the first 512 columns of each) and
    warpgroup 0's P (block_m x tile_n), all 16-bit, 1024-byte aligned; one mbarrier per 128-byte slab of each
    latent tile; the running row maxima, each warpgroup's published rescale factors and final row sums."""
    assert tile_n * d * 2 % 1024 == 0, (tile_n, d)

    @cute.struct
    class SharedStorage:
        q: Align[MemRange[Uint16, block_m * d], 1024]
        kv: Align[MemRange[Uint16, 2 * tile_n * d], 1024]
        p0: Align[MemRange[Uint16, block_m * tile_n], 1024]
        mbar: MemRange[Int64, 2 * (d // 64)]
        row_max: Align[MemRange[Float32, block_m], 16]
        scale: Align[MemRange[Float32, 2 * block_m], 16]
        row_sum: Align[MemRange[Float32, 2 * block_m], 16]

    return SharedStorage


@functools.cache
def mla_narrow_storage(*, rows: int, d: int, tile_bytes: int, stages: int):
    """mla_narrow.py's shared memory: the ring of `stages` latent tiles of `tile_bytes` each (64 keys: 16-bit
    rows in the 128-byte swizzle, or float8 rows 608 bytes apart), the Q tile (rows x d, 16-bit), each consumer
    warpgroup's P^T (rows x 64 keys, 16-bit), all 1024-byte aligned; 3 x stages mbarriers (K full and empty are
    used: common.full_barrier, empty_barrier); each consumer's per-warp column maxima of its last two tiles
    (`red`), and at the end its running maxima and per-warp sums (`fin`). The epilogue stages the output rows
    (rows x 516 fp32) in the ring, free by then."""
    assert tile_bytes % 1024 == 0 and rows * d * 2 % 1024 == 0, (tile_bytes, rows, d)

    @cute.struct
    class SharedStorage:
        kv: Align[MemRange[Uint8, stages * tile_bytes], 1024]
        q: Align[MemRange[Uint16, rows * d], 1024]
        p: Align[MemRange[Uint16, 2 * rows * 64], 1024]
        mbar: MemRange[Int64, 3 * stages]
        red: Align[MemRange[Float32, 2 * 2 * 4 * rows], 16]
        fin: Align[MemRange[Float32, 2 * 5 * rows], 16]

    return SharedStorage
