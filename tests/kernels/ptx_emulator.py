"""A bit-exact interpreter for the few PTX instructions rayinfer's inline-asm blocks use, so a
block's arithmetic is tested on the CPU (Triton's interpreter runs no PTX).

Registers are 32-bit unsigned ints. Supported: mov.b32, shl.b32, shr.b32 (logical), and.b32,
or.b32, lop3.b32 (immLut from F(0xF0, 0xCC, 0xAA)), prmt.b32 (default mode: selector nibble i
picks byte i of the result from {b, a}; bit 3 of a nibble replicates the picked byte's sign),
fma.rn.bf16x2 (per half: a * b + c rounded to nearest even, subnormals kept, as sm_80+ does);
the special registers %lanemask_lt and %lanemask_gt of the lane run_ptx is given.
"""

from __future__ import annotations

import re
import struct

MASK32 = 0xFFFFFFFF


def bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def float_to_bf16(value: float) -> int:
    """Round to nearest even, through float32 (exact for a product of two bf16 and a bf16)."""
    if abs(value) >= 2.0**128:  # past float32 (and bf16): infinity
        return 0xFF80 if value < 0 else 0x7F80
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:  # NaN
        return 0x7FC0
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16) & 0xFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    source = a | (b << 32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """Each set bit `index` of lut (index = a_bit << 2 | b_bit << 1 | c_bit) adds its minterm."""
    out = 0
    for index in range(8):
        if lut >> index & 1:
            term = MASK32
            for value, bit in ((a, 4), (b, 2), (c, 1)):
                term &= value if index & bit else ~value & MASK32
            out |= term
    return out


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for half in (0, 16):
        x, y, z = ((v >> half) & 0xFFFF for v in (a, b, c))
        result = bf16_to_float(x) * bf16_to_float(y) + bf16_to_float(z)
        out |= float_to_bf16(result) << half
    return out


_OPS = {
    "mov.b32": lambda a: a,
    "shl.b32": lambda a, n: (a << min(n, 32)) & MASK32,
    "shr.b32": lambda a, n: a >> min(n, 32),
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "lop3.b32": _lop3,
    "prmt.b32": _prmt,
    "fma.rn.bf16x2": _fma_bf16x2,
}


def lane_masks(lane: int) -> dict[str, int]:
    """A lane's %lanemask_lt (the lanes below it) and %lanemask_gt (those above it)."""
    return {"%lanemask_lt": (1 << lane) - 1, "%lanemask_gt": MASK32 & ~((2 << lane) - 1)}


def run_ptx(asm: str, operands: list[int], lane: int = 0) -> list[int]:
    """Runs an inline-asm block on `operands` ($0, $1, .. in order: outputs first, whose
    incoming values are ignored) as lane `lane` and returns every operand's final value."""
    registers = {f"${i}": value & MASK32 for i, value in enumerate(operands)}
    registers.update(lane_masks(lane))
    body = asm.strip()
    body = body[1:-1] if body.startswith("{") else body
    for statement in body.split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        opcode, _, rest = statement.partition(" ")
        if opcode not in _OPS:
            raise ValueError(f"the emulator has no {opcode!r}")
        dest, *args = (arg.strip() for arg in rest.split(","))
        values = [_value(arg, registers) for arg in args]
        registers[dest] = _OPS[opcode](*values) & MASK32
    return [registers[f"${i}"] for i in range(len(operands))]


def _value(arg: str, registers: dict) -> int:
    if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", arg):
        return int(arg, 0)
    if arg not in registers:
        raise ValueError(f"{arg!r} is read before it is written")
    return registers[arg]
