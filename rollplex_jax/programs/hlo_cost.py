"""What a compiled program costs per device, read from its optimized HLO: matmul FLOPs, memory traffic, kernels
and collective bytes, with every loop counted as many times as it runs.

Why not XLA's own ``cost_analysis()``: for the deviceless GPU compile (``targets.py``) both
``Compiled.cost_analysis()`` and ``Lowered.cost_analysis()`` answer None (jax 0.10.2, checked 2026-12-06), and
where XLA answers (the CPU) it counts a ``while`` body once: a 6-layer ``lax.scan`` of 128 x 256 x 256 matmuls
reports 16.8 MFLOP, one layer's, not 101 MFLOP. Every program here scans its layers, so that count is off by the
layer count. This reads the program XLA compiled (``Compiled.as_text()``) instead:

- FLOPs: 2 x output elements x contracted elements of every ``dot`` (inside fusions too: a GPU GEMM is a Triton
  ``gemm_fusion`` around a dot, or a ``__cublas$gemm`` custom call whose backend config carries the contracting
  dimensions); cuDNN fused attention (``__cudnn$fmha*``) 4 B H T S d forward, 10 B H T S d backward (its
  recomputed scores included; the causal half not skipped). Elementwise FLOPs are not counted (the simulator
  times them by their bytes).
- bytes: every kernel's operands and outputs (a fusion is one kernel: what it reads and writes, not its inside);
  a slice of a buffer counts the slice, an in-place update the update (read and written), as XLA's cost analysis
  does. Reshapes, bitcasts, tuples and parameters move nothing.
- kernels: those kernels' count (launches, for the per-op overhead).
- comm_bytes: bytes that collectives (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute)
  produce on this device.
- Loops: a ``while`` body and condition run ``known_trip_count`` times (XLA records it for every ``lax.scan``);
  a while without one counts once and is listed in ``unknown_loops``. Conditionals count their costliest branch.
"""

from __future__ import annotations

import dataclasses
import math
import re

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s*\(.*\{\s*$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain",
         "async-update"}  # and every *-done (an async op's wait)
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
                "ragged-all-to-all")


@dataclasses.dataclass
class HloCost:
    """Per-device costs of one compiled program (module doc)."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0
    comm_bytes: float = 0.0
    unknown_loops: int = 0
    by_kind: dict = dataclasses.field(default_factory=dict)  # bytes per kernel kind (op, or fusion's computation)

    def add(self, o: HloCost, k: float = 1.0) -> None:
        self.flops += k * o.flops
        self.bytes += k * o.bytes
        self.kernels += k * o.kernels
        self.comm_bytes += k * o.comm_bytes
        self.unknown_loops += o.unknown_loops
        for kind, b in o.by_kind.items():
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + k * b

    def to_dict(self, kinds: int = 8) -> dict:
        """The counts and the ``kinds`` kernel kinds that move the most bytes."""
        top = sorted(self.by_kind.items(), key=lambda kv: -kv[1])[:kinds]
        return {"flops": self.flops, "bytes": self.bytes, "kernels": self.kernels, "comm_bytes": self.comm_bytes,
                "unknown_loops": self.unknown_loops, "bytes_by_kind": dict(top)}


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str  # the result's shape text (an array or a tuple of arrays)
    op: str
    operands: tuple[str, ...]
    args: str  # the text between the parentheses (a parameter's number, a constant's value)
    attrs: str


def _close(s: str, i: int) -> int:
    """Index of the parenthesis closing the one opened at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return len(s) - 1


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple shape
        end = _close(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _close("(" + rest, 0)
    args, attrs = rest[:end - 1], rest[end:]
    operands = tuple(re.findall(r"%([^\s,()]+)", args))
    return _Instr(m.group(1), shape, op.strip(), operands, args, attrs)


def parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """(computation name -> its instructions, the entry computation's name) of an HLO module's text."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            current = h.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            current = None
        elif current is not None:
            ins = _parse_instr(line)
            if ins is not None:
                comps[current].append(ins)
    return comps, entry


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of each array in a shape text."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> float:
    return sum(_BYTES.get(t, 4) * math.prod(d) for t, d in arrays(shape))


def _attr_dims(attrs: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([0-9,]*)\}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _dot_flops(ins: _Instr, shapes: dict[str, str]) -> float:
    out = arrays(ins.shape)[0][1]
    lhs = arrays(shapes.get(ins.operands[0], ""))
    contract = _attr_dims(ins.attrs, "lhs_contracting_dims")
    return 2.0 * math.prod(out) * math.prod(lhs[0][1][i] for i in contract) if lhs else 0.0


def _custom_flops(ins: _Instr, shapes: dict[str, str]) -> float:
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    target = target.group(1) if target else ""
    ops = [arrays(shapes.get(o, "")) for o in ins.operands]
    if "cublas" in target and ops and ops[0]:
        out = arrays(ins.shape)[0][1]  # (result, workspace) or the result
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
        contract = [int(x.strip('"')) for x in m.group(1).split(",") if x.strip()] if m else []
        return 2.0 * math.prod(out) * math.prod(ops[0][0][1][i] for i in contract)
    if target.startswith("__cudnn$fmha") and len(ops) >= 2 and ops[0] and ops[1]:
        (b, t, h, d), s = ops[0][0][1][-4:], ops[1][0][1][-3]  # BTNH layout: q [B, T, H, d], k [B, S, K, d]
        return (10.0 if "Backward" in target else 4.0) * b * h * t * s * d
    return 0.0


def _param_reads(comp: list[_Instr]) -> dict[int, float]:
    """Bytes a fusion reads of each parameter that it only slices (the slices, not the buffer) or only updates
    in place (0: the update is counted with the output)."""
    users: dict[str, list[tuple[_Instr, int]]] = {}
    for ins in comp:
        for pos, o in enumerate(ins.operands):
            users.setdefault(o, []).append((ins, pos))
    reads = {}
    for p in (i for i in comp if i.op == "parameter"):
        us = users.get(p.name, [])
        if us and all(u.op in ("dynamic-slice", "slice") and pos == 0 for u, pos in us):
            reads[int(p.args)] = sum(nbytes(u.shape) for u, _ in us)
        elif us and all(u.op == "dynamic-update-slice" and pos == 0 for u, pos in us):
            reads[int(p.args)] = 0.0
    return reads


def _written(comp: list[_Instr], out_shape: str) -> float:
    """Bytes a fusion writes: an in-place update's update, else its whole output."""
    by_name = {i.name: i for i in comp}
    root = comp[-1] if comp else None
    roots = [by_name.get(o) for o in root.operands] if root is not None and root.op == "tuple" else [root]
    if roots and all(r is not None and r.op == "dynamic-update-slice" for r in roots):
        return sum(nbytes(_shape_of(by_name, r.operands[1])) for r in roots)
    return nbytes(out_shape)


def _shape_of(by_name: dict[str, _Instr], name: str) -> str:
    return by_name[name].shape if name in by_name else ""


class _Counter:
    def __init__(self, comps: dict[str, list[_Instr]]):
        self.comps, self.memo = comps, {}

    def cost(self, name: str, kernel_level: bool = True) -> HloCost:
        """The cost of running computation ``name`` once; ``kernel_level``: its instructions are kernels (not
        the inside of a fusion, whose traffic its fusion instruction counts)."""
        key = (name, kernel_level)
        if key not in self.memo:
            self.memo[key] = self._cost(self.comps.get(name, []), kernel_level)
        return self.memo[key]

    def _cost(self, comp: list[_Instr], kernel_level: bool) -> HloCost:
        c, shapes = HloCost(), {i.name: i.shape for i in comp}
        for ins in comp:
            if ins.op == "dot":
                c.flops += _dot_flops(ins, shapes)
            elif ins.op == "custom-call":
                c.flops += _custom_flops(ins, shapes)
            if ins.op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                n = int(trip.group(1)) if trip else 1
                c.unknown_loops += 0 if trip else 1
                for key in ("body", "condition"):
                    m = re.search(key + r"=%([^\s,]+)", ins.attrs)
                    if m:
                        c.add(self.cost(m.group(1)), n)
            elif ins.op == "conditional":
                branches = re.findall(r"%([^\s,{}]+)", ins.attrs.split("branch_computations=")[-1].split("}")[0]
                                      if "branch_computations" in ins.attrs else
                                      " ".join(re.findall(r"(?:true|false)_computation=(%[^\s,]+)", ins.attrs)))
                costs = [self.cost(b) for b in branches]
                if costs:
                    c.add(max(costs, key=lambda x: (x.flops, x.bytes)))
            elif ins.op == "call":
                m = re.search(r"to_apply=%([^\s,]+)", ins.attrs)
                if m:
                    c.add(self.cost(m.group(1)))
            elif ins.op == "fusion" or ins.op.endswith("-start") and "calls=" in ins.attrs:
                m = re.search(r"calls=%([^\s,]+)", ins.attrs)
                if m:
                    inner = self.cost(m.group(1), kernel_level=False)
                    c.flops += inner.flops
                    c.comm_bytes += inner.comm_bytes
            if kernel_level and ins.op not in _FREE and not ins.op.endswith("-done"):
                moved = self._traffic(ins, shapes)
                c.kernels += 1
                c.bytes += moved
                kind = _kind(ins)
                c.by_kind[kind] = c.by_kind.get(kind, 0.0) + moved
            if any(ins.op.startswith(k) for k in _COLLECTIVES) and not ins.op.endswith("-done"):
                c.comm_bytes += nbytes(arrays_last(ins.shape) if ins.op.endswith("-start") else ins.shape)
        return c

    def _traffic(self, ins: _Instr, shapes: dict[str, str]) -> float:
        if ins.op in ("dynamic-slice", "slice"):
            return 2 * nbytes(ins.shape)
        if ins.op == "dynamic-update-slice":
            return 2 * nbytes(shapes.get(ins.operands[1], ""))
        reads = [nbytes(shapes.get(o, "")) for o in ins.operands]
        if ins.op == "fusion":
            m = re.search(r"calls=%([^\s,]+)", ins.attrs)
            inner = self.comps.get(m.group(1), []) if m else []
            for k, b in _param_reads(inner).items():
                if k < len(reads):
                    reads[k] = b
            return sum(reads) + _written(inner, ins.shape)
        return sum(reads) + nbytes(ins.shape)


def _kind(ins: _Instr) -> str:
    """A kernel's kind: its op, or a fusion's computation name without its number (gemm_fusion_dot,
    fused_reduce, fused_transpose, ...)."""
    m = re.search(r"calls=%([^\s,]+)", ins.attrs) if ins.op == "fusion" else None
    return re.sub(r"([._]\d+)+(_computation)?$", "", m.group(1)) if m else ins.op


def arrays_last(shape: str) -> str:
    """The last array of a tuple shape (an async collective's result), or the shape itself."""
    found = _ARRAY.findall(shape)
    return f"{found[-1][0]}[{found[-1][1]}]" if found else ""


def program_cost(text: str) -> HloCost:
    """Per-device costs of one run of the compiled program whose optimized HLO text is ``text``
    (``Compiled.as_text()``)."""
    comps, entry = parse(text)
    return _Counter(comps).cost(entry)
