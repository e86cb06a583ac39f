"""Inline PTX for the CuTe DSL family, in one module: the only place that uses the DSL's private MLIR
bindings (`cutlass._mlir`). Each helper is a `dsl_user_op` that emits one instruction.

- `mma_m16n8k16`: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32
- `pack2`: cvt.rn.{bf16x2,f16x2}.f32 (two fp32 into one register)
- `e4m3x4_to_f16x4`: cvt.rn.f16x2.e4m3x2 on the two halves of a 32-bit word (four float8_e4m3 into four fp16,
  sm89+; a mov and two cvt)
- `prmt`: prmt.b32 (four bytes picked from two words)
- `ld_dsmem_f32`, `ld_dsmem_v4`: mapa.shared::cluster then ld.shared::cluster (a cluster peer's shared memory at
  this CTA's address of the same object; the DSL's distributed-shared-memory tensors take no loads)
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, bf16: bool, loc=None, ip=None):
    """One warp's mma.sync m16n8k16 (row.col, fp32 accumulators): A in four, B in two 32-bit registers of
    packed bf16 or fp16 pairs, C and the result four fp32 (fragment layouts: decode_mma.py)."""
    kind = "bf16" if bf16 else "f16"
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
        [Uint32(a0).ir_value(loc=loc, ip=ip), Uint32(a1).ir_value(loc=loc, ip=ip),
         Uint32(a2).ir_value(loc=loc, ip=ip), Uint32(a3).ir_value(loc=loc, ip=ip),
         Uint32(b0).ir_value(loc=loc, ip=ip), Uint32(b1).ir_value(loc=loc, ip=ip),
         Float32(c0).ir_value(loc=loc, ip=ip), Float32(c1).ir_value(loc=loc, ip=ip),
         Float32(c2).ir_value(loc=loc, ip=ip), Float32(c3).ir_value(loc=loc, ip=ip)],
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, {{$8,$9}}, "
        "{$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def pack2(lo, hi, *, bf16: bool, loc=None, ip=None):
    """Two fp32 values -> one register of two 16-bit floats (lo in the lower half)."""
    kind = "bf16x2" if bf16 else "f16x2"
    return Uint32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def e4m3x4_to_f16x4(w, *, loc=None, ip=None):
    """Four float8_e4m3 values in a 32-bit word -> two registers of two fp16 each: bytes 0-1, then bytes 2-3
    (order kept)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]), [Uint32(w).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}",
        "=r,=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def prmt(a, b, sel: int, *, loc=None, ip=None):
    """prmt.b32: the four bytes `sel` picks (one hex digit each, lowest first) from the eight of a (0-3) and b
    (4-7). 0x5140 interleaves the low halves of a and b byte by byte, 0x7362 their high halves."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_dsmem_f32(addr, rank, *, loc=None, ip=None):
    """The fp32 at shared-memory address `addr` (this CTA's 32-bit address of it) in cluster CTA `rank`. Volatile:
    it stays after the cluster barrier that orders it."""
    return Float32(llvm.inline_asm(
        T.f32(), [Uint32(addr).ir_value(loc=loc, ip=ip), Uint32(rank).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 a;\nmapa.shared::cluster.u32 a, $1, $2;\nld.shared::cluster.f32 $0, [a];\n}", "=f,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_dsmem_v4(addr, rank, *, loc=None, ip=None):
    """The 16 bytes at shared-memory address `addr` (16-byte aligned; this CTA's 32-bit address) in cluster CTA
    `rank`, as four 32-bit words. Volatile, as ld_dsmem_f32."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Uint32(addr).ir_value(loc=loc, ip=ip), Uint32(rank).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 a;\nmapa.shared::cluster.u32 a, $4, $5;\nld.shared::cluster.v4.b32 {$0, $1, $2, $3}, [a];\n}",
        "=r,=r,=r,=r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc,
        ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def mbarrier_arrive_if(bar, pred, *, loc=None, ip=None):
    """mbarrier.arrive on the shared-memory mbarrier at `bar` (a pointer) where `pred` is nonzero, as one predicated
    instruction rather than a branch: ptxas serialized the wgmma of a kernel (C7520) for a warpgroup.arrive it put
    on a branch it could not prove uniform."""
    llvm.inline_asm(
        None, [Uint32(bar.toint()).ir_value(loc=loc, ip=ip), Uint32(pred).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.u32 p, $1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [$0];\n}", "r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
