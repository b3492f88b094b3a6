"""What the object code of ggml-cpu's AMX path hands to ``ldtilecfg`` (tests/test_amx.py).

``ldtilecfg m512`` reads a 64-byte tile configuration. GCC 12's ``_tile_loadconfig`` is inline
asm whose memory operand is 8 bytes, so at -O3 the stores of the other 56 bytes may be dropped
as dead (patch 0028). This module checks the object code itself: it disassembles an object with
``objdump -dr``, finds each ``ldtilecfg``, and replays the straight-line code before it (back to
the last jump or jump target) on a 64-byte image of the configuration. A byte is known when an
immediate, a zeroed register or a register loaded from a read-only constant of the object is
stored there; anything else stored there is "unknown", and a byte nothing stores is "missing".
The caller compares the image with the configuration the source assigns.

Only the forms GCC emits for such code are understood; a store into the configuration in any
other form makes its bytes unknown (a failed check names the instruction), never a false pass.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

CONFIG_BYTES = 64
UNKNOWN = "unknown"  # a byte some store wrote with a value this replay cannot tell
Byte = Union[int, str, None]  # a value, UNKNOWN, or None: nothing stored it

# the architectural layout of the palette-1 configuration (Intel SDM, LDTILECFG)
PALETTE_ID, START_ROW, COLSB, ROWS = 0, 1, 16, 48


def expected_config(source: str) -> bytes:
    """The 64 bytes ``ggml_tile_config_init`` assigns in ``source`` (mmq.cpp): palette, start row,
    each tile's rows and bytes per row; the object is value-initialised, so the rest is zero."""
    m = re.search(r"ggml_tile_config_init\s*\(\s*(?:void)?\s*\)\s*\{(.*?)\n\}", source, re.S)
    if m is None:
        raise ValueError("no ggml_tile_config_init in the source")
    body = m.group(1)
    cfg = bytearray(CONFIG_BYTES)
    for field, value in re.findall(r"\btc\.(palette_id|start_row)\s*=\s*(\d+)\s*;", body):
        cfg[PALETTE_ID if field == "palette_id" else START_ROW] = int(value)
    for field, tile, value in re.findall(r"\btc\.(rows|colsb)\[(\d+)\]\s*=\s*(\d+)\s*;", body):
        if field == "rows":
            cfg[ROWS + int(tile)] = int(value)
        else:
            struct.pack_into("<H", cfg, COLSB + 2 * int(tile), int(value))
    if cfg[PALETTE_ID] == 0 or not any(cfg[ROWS:]):
        raise ValueError("ggml_tile_config_init assigns no palette or no tile shapes")
    return bytes(cfg)


# --------------------------------------------------------------------------------------------
# the object file: its disassembly, relocations, symbols and section bytes


@dataclasses.dataclass
class Insn:
    addr: int
    mnemonic: str
    operands: List[str]
    text: str
    end: Optional[int] = None  # the next instruction's address
    reloc: Optional[Tuple[int, str, int]] = None  # (where, symbol, addend)


_INSN = re.compile(r"^\s*([0-9a-f]+):\t(.*)$")
_RELOC = re.compile(r"^\s*([0-9a-f]+): (R_X86_64_\w+)\t(\S+?)(?:([+-])0x([0-9a-f]+))?$")


def _split_operands(text: str) -> List[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    return out + [cur.strip()] if cur.strip() else out


def disassemble(obj: Path, objdump: str = "objdump") -> List[List[Insn]]:
    """The object's code sections, each as its instructions with their relocations."""
    res = subprocess.run([objdump, "-dr", "--no-show-raw-insn", str(obj)],
                         capture_output=True, text=True, check=True)
    sections: List[List[Insn]] = []
    cur: List[Insn] = []
    for line in res.stdout.splitlines():
        if line.startswith("Disassembly of section"):
            if cur:
                sections.append(cur)
            cur = []
            continue
        r = _RELOC.match(line)
        if r and cur:
            addend = int(r.group(5), 16) * (-1 if r.group(4) == "-" else 1) if r.group(4) else 0
            cur[-1].reloc = (int(r.group(1), 16), r.group(3), addend)
            continue
        m = _INSN.match(line)
        if not m:
            continue
        text = m.group(2).split("#")[0].strip()
        if not text or text.startswith("(bad)"):
            continue
        parts = text.split(None, 1)
        # prefixes (rep, lock, notrack, data16, bnd) belong to the instruction after them
        while len(parts) == 2 and parts[0] in ("rep", "repz", "repnz", "lock", "notrack", "bnd", "data16"):
            parts = parts[1].split(None, 1)
        insn = Insn(int(m.group(1), 16), parts[0], _split_operands(parts[1]) if len(parts) > 1 else [], text)
        if cur:
            cur[-1].end = insn.addr
        cur.append(insn)
    if cur:
        sections.append(cur)
    return sections


class ObjectData:
    """Section bytes and symbol values of an ELF64 relocatable object (enough to read the
    read-only constants a relocated load refers to)."""

    def __init__(self, obj: Path, objdump: str = "objdump") -> None:
        self.data = obj.read_bytes()
        if self.data[:4] != b"\x7fELF" or self.data[4] != 2 or self.data[5] != 1:
            raise ValueError(f"{obj} is not a little-endian ELF64 object")
        shoff, = struct.unpack_from("<Q", self.data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", self.data, 0x3A)
        heads = [struct.unpack_from("<IIQQQQIIQQ", self.data, shoff + i * shentsize) for i in range(shnum)]
        names = heads[shstrndx][4]
        self.sections: Dict[str, Tuple[int, int]] = {}
        for h in heads:
            end = self.data.index(b"\0", names + h[0])
            name = self.data[names + h[0]:end].decode()
            if h[1] != 8:  # SHT_NOBITS has no bytes in the file
                self.sections.setdefault(name, (h[4], h[5]))
        # symbol -> (section, value), from objdump's symbol table
        self.symbols: Dict[str, Tuple[str, int]] = {}
        res = subprocess.run([objdump, "-t", str(obj)], capture_output=True, text=True, check=True)
        for line in res.stdout.splitlines():
            m = re.match(r"^([0-9a-f]{16}) .{7} (\S+)\t[0-9a-f]+ (\S+)$", line)
            if m:
                self.symbols.setdefault(m.group(3), (m.group(2), int(m.group(1), 16)))

    def read(self, symbol: str, offset: int, n: int) -> Optional[bytes]:
        """``n`` bytes at ``symbol + offset``, or None when they are not constant bytes here."""
        section, value = self.symbols.get(symbol, (symbol, 0))
        if not section.startswith(".rodata") or section not in self.sections:
            return None
        off, size = self.sections[section]
        start = value + offset
        if start < 0 or start + n > size:
            return None
        return self.data[off + start:off + start + n]


# --------------------------------------------------------------------------------------------
# replaying the stores before an ldtilecfg

_GPR64 = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp"] + [f"r{i}" for i in range(8, 16)]
_GPR: Dict[str, Tuple[str, int]] = {}
for _r in _GPR64:
    _GPR[_r] = (_r, 8)
    if _r.startswith("r") and _r[1:].isdigit():
        _GPR[_r + "d"], _GPR[_r + "w"], _GPR[_r + "b"] = (_r, 4), (_r, 2), (_r, 1)
    else:
        _GPR["e" + _r[1:]], _GPR[_r[1:]] = (_r, 4), (_r, 2)
for _a in "abcd":
    _GPR[_a + "l"] = ("r" + _a + "x", 1)
for _r in ("si", "di", "bp", "sp"):
    _GPR[_r + "l"] = ("r" + _r, 1)
_CALLER_SAVED = {"rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11"}
_VEC_WIDTH = {"xmm": 16, "ymm": 32, "zmm": 64}
_SUFFIX_WIDTH = {"b": 1, "w": 2, "l": 4, "q": 8}
_ZEROING = {"pxor", "vpxor", "vpxord", "vpxorq", "xorps", "xorpd", "vxorps", "vxorpd", "xor"}
_VEC_MOVES = re.compile(r"^v?(movdq[au](8|16|32|64)?|movap[sd]|movup[sd])$")
_MEM = re.compile(r"^(-?0x[0-9a-f]+|-?\d+)?\(%(\w+)(?:,%(\w+)(?:,(\d))?)?\)$")


def _reg(op: str) -> Optional[Tuple[str, int]]:
    """(canonical register, width in bytes) of a register operand."""
    if not op.startswith("%"):
        return None
    name = op[1:]
    m = re.match(r"^([xyz]mm)(\d+)$", name)
    if m:
        return f"v{m.group(2)}", _VEC_WIDTH[m.group(1)]
    return _GPR.get(name)


def _mem(op: str) -> Optional[Tuple[int, str, Optional[str]]]:
    """(displacement, base, index) of a memory operand."""
    m = _MEM.match(op.split("{")[0])
    if not m:
        return None
    return (int(m.group(1), 0) if m.group(1) else 0), m.group(2), m.group(3)


def _imm(op: str) -> Optional[int]:
    return int(op[1:], 0) if op.startswith("$") else None


@dataclasses.dataclass
class Replay:
    """The image of the configuration an ``ldtilecfg`` loads, as far as the code before it shows."""

    insn: Insn
    image: List[Byte]
    notes: List[str]  # the instructions whose stores made bytes unknown

    def differences(self, expected: bytes) -> List[str]:
        """The fields whose bytes do not hold the expected configuration: what each holds."""
        never, unknown, wrong = [], [], []
        for name, lo, n in _FIELDS:
            got = self.image[lo:lo + n]
            want = int.from_bytes(expected[lo:lo + n], "little")
            if got == list(expected[lo:lo + n]):
                continue
            if None in got:
                never.append(name)
            elif UNKNOWN in got:
                unknown.append(name)
            else:
                wrong.append(f"{name} = {int.from_bytes(bytes(got), 'little')} (the source assigns {want})")
        return ([f"never stored: {', '.join(never)}"] if never else []) + \
            ([f"stored from values not known here: {', '.join(unknown)}"] if unknown else []) + wrong


# (name, offset, size) of each field of the configuration
_FIELDS = ([("palette_id", PALETTE_ID, 1), ("start_row", START_ROW, 1), ("reserved", 2, COLSB - 2)]
           + [(f"colsb[{i}]", COLSB + 2 * i, 2) for i in range(16)]
           + [(f"rows[{i}]", ROWS + i, 1) for i in range(16)])


def _block_start(insns: Sequence[Insn], i: int, targets: set) -> int:
    """The first instruction of the straight-line code that reaches ``insns[i]``: after the
    last jump or return, at a jump target at the latest (calls do not end it)."""
    s = i
    while s > 0 and insns[s].addr not in targets:
        prev = insns[s - 1].mnemonic
        if (prev.startswith("j") or prev.startswith("ret") or prev in ("ud2", "int3", "hlt")):
            break
        s -= 1
    return s


def _branch_targets(insns: Sequence[Insn]) -> set:
    out = set()
    for insn in insns:
        if (insn.mnemonic.startswith("j") or insn.mnemonic.startswith("loop")) and insn.operands:
            m = re.match(r"^([0-9a-f]+)\b", insn.operands[-1])
            if m:
                out.add(int(m.group(1), 16))
    return out


def replay_ldtilecfg(insns: Sequence[Insn], i: int, obj: ObjectData, targets: set) -> Replay:
    """Replay the code before ``insns[i]`` (an ``ldtilecfg``) on its 64-byte operand."""
    load = insns[i]
    where = _mem(load.operands[0]) if load.operands else None
    if where is None or where[2] is not None:
        return Replay(load, [UNKNOWN] * CONFIG_BYTES, [f"operand not understood: {load.text}"])
    disp, base, _ = where
    image: List[Byte] = [None] * CONFIG_BYTES
    notes: List[str] = []
    regs: Dict[str, Optional[bytes]] = {}

    def set_reg(name: str, width: int, value: Optional[bytes], zero_upper: bool) -> None:
        full = 64 if name.startswith("v") else 8
        old = regs.get(name) or bytes(full)
        if value is None:
            regs[name] = None
        elif zero_upper or width == full:
            regs[name] = value + bytes(full - width)
        elif regs.get(name) is None:
            regs[name] = None
        else:
            regs[name] = value + old[width:]

    def store(mem: Tuple[int, str, Optional[str]], width: int, value: Optional[bytes], insn: Insn) -> None:
        d, b, idx = mem
        if b != base or idx is not None:
            return  # another object (an alias through another register is not followed)
        lo, hi = max(d, disp), min(d + width, disp + CONFIG_BYTES)
        if lo >= hi:
            return
        if value is None:
            notes.append(insn.text)
        for a in range(lo, hi):
            image[a - disp] = UNKNOWN if value is None else value[a - d]

    for insn in insns[_block_start(insns, i, targets):i]:
        mn, ops = insn.mnemonic, insn.operands
        if mn.startswith("call"):
            for r in list(regs):
                if r in _CALLER_SAVED or r.startswith("v"):
                    regs[r] = None
            continue
        dst = ops[-1] if ops else ""
        dreg, dmem = _reg(dst), _mem(dst)
        if dmem is not None and dmem[1] == base and mn not in ("lea",) and not mn.startswith("cmp") \
                and not mn.startswith("test"):
            src = ops[0] if len(ops) == 2 else None
            sreg, simm = (_reg(src), _imm(src)) if src else (None, None)
            m = re.match(r"^mov([bwlq])$", mn)
            if "{" in dst:  # a masked store: which bytes it writes is not known here
                store(dmem, CONFIG_BYTES, None, insn)
            elif simm is not None and m:
                width = _SUFFIX_WIDTH[m.group(1)]
                store(dmem, width, (simm & ((1 << (8 * width)) - 1)).to_bytes(width, "little"), insn)
            elif sreg is not None and (mn in ("mov", "movq", "vmovq", "movd", "vmovd")
                                       or _VEC_MOVES.match(mn)):
                width = {"movd": 4, "vmovd": 4, "movq": 8, "vmovq": 8}.get(mn, sreg[1])
                value = regs.get(sreg[0])
                store(dmem, width, value[:width] if value is not None else None, insn)
            else:
                width = CONFIG_BYTES  # a store this replay does not model: every byte it may reach
                store(dmem, width, None, insn)
            continue
        if dreg is None:
            continue
        name, width = dreg
        regs_src = [_reg(o) for o in ops[:-1]]
        if mn in _ZEROING and ops and all(r is not None and r[0] == name for r in regs_src):
            set_reg(name, width, bytes(width), True)
        elif len(ops) == 2 and _imm(ops[0]) is not None and mn in ("mov", "movabs", "movl", "movq"):
            set_reg(name, width, (_imm(ops[0]) & ((1 << (8 * width)) - 1)).to_bytes(width, "little"),
                    width >= 4)
        elif len(ops) == 2 and (mn in ("mov", "movq", "vmovq", "movd", "vmovd") or _VEC_MOVES.match(mn)):
            sreg, smem = _reg(ops[0]), _mem(ops[0])
            n = {"movd": 4, "vmovd": 4, "movq": 8, "vmovq": 8}.get(mn, width)
            zero_upper = mn.startswith("v") or n == 4 and not name.startswith("v")
            if sreg is not None:
                v = regs.get(sreg[0])
                set_reg(name, n, v[:n] if v is not None else None, zero_upper or n < width)
            elif smem is not None and smem[1] == "rip" and insn.reloc is not None and insn.end:
                where_, sym, addend = insn.reloc
                # the displacement is relative to the end of the instruction
                value = obj.read(sym, addend + (insn.end - where_) + smem[0], n)
                set_reg(name, n, value, zero_upper or n < width)
            else:
                set_reg(name, width, None, True)
        elif re.match(r"^vpbroadcast([bwdq])$", mn) and len(ops) == 2:
            elem = {"b": 1, "w": 2, "d": 4, "q": 8}[mn[-1]]
            sreg, smem = _reg(ops[0]), _mem(ops[0])
            v: Optional[bytes] = None
            if sreg is not None and regs.get(sreg[0]) is not None:
                v = regs[sreg[0]][:elem]
            elif smem is not None and smem[1] == "rip" and insn.reloc is not None and insn.end:
                where_, sym, addend = insn.reloc
                v = obj.read(sym, addend + (insn.end - where_) + smem[0], elem)
            set_reg(name, width, v * (width // elem) if v is not None else None, True)
        else:
            set_reg(name, width, None, True)  # anything else: the register's value is not known
    return Replay(load, image, notes)


def ldtilecfg_replays(obj: Path, objdump: str = "objdump") -> List[Replay]:
    """Every ``ldtilecfg`` of the object, each with the configuration image the code before it builds."""
    data = ObjectData(obj, objdump)
    out: List[Replay] = []
    for insns in disassemble(obj, objdump):
        targets = _branch_targets(insns)
        for i, insn in enumerate(insns):
            if insn.mnemonic == "ldtilecfg":
                out.append(replay_ldtilecfg(insns, i, data, targets))
    return out
