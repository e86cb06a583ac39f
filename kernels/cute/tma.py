"""Paged K/V tiles (and the extend kernel's Q rows: `copy_rows`) by TMA (Hopper's bulk tensor copy), shared by
the extend and decode kernels.

A cache [pages, PAGE, Hkv, D] (NHD) or [pages, Hkv, PAGE, D] (HND) is described to the TMA unit as a 4D tensor
(slot, d, KV head, page) with the cache's own strides (multiples of 16 bytes: `_check_aligned` in __init__.py).
One copy moves a box of BOX slots of one page (`tma_box` in __init__.py: the whole page, or a tile-sized part of
it) by 128 bytes of the head dim into shared memory, in the 128-byte swizzle that both the wgmma operands
(extend.py) and the decode kernels' swizzled rows use: 16-byte chunk c of row r at c ^ (r % 8), rows of 128
bytes, the box starting on a 1024-byte boundary. The copy completes on an mbarrier with its byte count
(expect-tx), so a kernel waits for a tile the same way whichever way it was loaded.

These helpers run while a kernel is traced (plain functions, no control flow of their own): `cache_tma` in
the host-side launch function, the others in the kernel.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.utils import LayoutEnum


def row_elems(dtype) -> int:
    """Elements of the head dim in one 128-byte box row."""
    return 1024 // dtype.width


def box_layout(dtype, box: int):
    """Shared-memory layout of one box: `box` rows x 128 bytes, 128-byte swizzle."""
    layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, box, row_elems(dtype)), dtype, 1)
    return cute.slice_(layout, (None, None, 0))


def cache_tma(ptr: cute.Pointer, pages: Int32, sp: Int64, so: Int64, sh: Int64, *, page: int, d: int, hkv: int,
              box: int):
    """(atom, coordinates): the TMA atom for one cache and its coordinate tensor (slot, d, KV head, page)."""
    dtype = ptr.dtype
    so, sh, sp = (cute.assume(x, divby=128 // dtype.width) for x in (so, sh, sp))  # 16-byte strides
    cache = cute.make_tensor(ptr, cute.make_layout((page, d, hkv, pages), stride=(so, 1, sh, sp)))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), cache, box_layout(dtype, box),
                                       (box, row_elems(dtype)))


def box_page(pt_row, j0: Int32, page: int, box: int, box_row: Int32):
    """The page id of box row `box_row` of the tile starting at key j0 (j0 on a box boundary); `pt_row` is the
    request's `PageRow` (kernels/cute/decode.py: ids clamped into the cache)."""
    return pt_row[(Uint32(j0) + Uint32(box_row * box)) // page]


def copy_box(atom, coords: cute.Tensor, dst: cute.Pointer, box: int, j0: Int32, page: int, slab, h, page_id,
             bar: cute.Pointer):
    """Issues one box copy (one elected lane of the calling warp; every argument warp-uniform): slots of page
    `page_id` from (j0 % page) on, head-dim slab `slab` (128 bytes), KV head h, to `dst` (1024-byte aligned),
    completing on `bar`."""
    _copy(atom, coords, dst, box, (Int32(Uint32(j0) % page) // box, slab, h, page_id), bar)


def copy_rows(atom, coords: cute.Tensor, dst: cute.Pointer, box: int, row, slab, h, batch, bar: cute.Pointer):
    """Issues one box copy (one elected lane of the calling warp; every argument warp-uniform) of `box` rows from
    row `row` of (row, d, head, batch) coordinates (`cache_tma` over rows: any int32 row, those outside the
    tensor landing as zeros), head-dim slab `slab` (128 bytes), head h, to `dst` (1024-byte aligned),
    completing on `bar`."""
    _copy(atom, cute.domain_offset((row, 0, 0, 0), coords), dst, box, (0, slab, h, batch), bar)


def _copy(atom, coords: cute.Tensor, dst: cute.Pointer, box: int, tile, bar: cute.Pointer):
    """The box at tile coordinates `tile` (box index, slab, head, page or batch) of `coords` into the swizzled
    box at `dst`, completing on `bar`."""
    layout = box_layout(dst.dtype, box)
    s_box = cute.make_tensor(cute.recast_ptr(dst, layout.inner, dtype=dst.dtype), layout.outer)
    g_box = cute.local_tile(coords, (box, row_elems(dst.dtype), 1, 1), tile)[None, None, 0, 0]
    t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_box, 0, 2),
                                     cute.group_modes(g_box, 0, 2))
    cute.copy(atom, t_g, t_s, tma_bar_ptr=bar)
