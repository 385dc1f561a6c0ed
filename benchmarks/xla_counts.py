"""What a compiled step runs, read from XLA's output: kernels, vector ops, bytes, temp.

Used by `compiled.py`. All figures are deterministic (no timing):

* H100: the kernels the GPU runtime launches, from XLA's thunk sequence (the dump
  `*.thunk_sequence*.txt`): kernels, library calls, memsets and device copies; the
  containers (CUDA graphs) and control thunks (conditionals, loops) are listed apart.
  A conditional that survives counts its busier branch as "applied" and the other as
  "skipped". Bytes: XLA's `HloCostAnalysis` of the GPU-optimized module, run through
  XLA:CPU's analysis (the GPU compile-only executable has no `cost_analysis()`).
* TPU: the passes over vector data in the optimized HLO: fusions, custom-calls,
  unfused non-scalar ops and copies; bytes: an HBM estimate from the HLO's memory
  spaces (operands and results in memory space 0), beside `cost_analysis()` (which
  counts VMEM traffic too).
* CPU: fusions and other non-trivial ops of the optimized HLO; `cost_analysis()`.

Adapted from the team's reference scripts `shared/aot/gpu_aot.py` and `tpu_aot.py`.
"""

from __future__ import annotations

import collections
import glob
import os
import re

import jax

NOT_WORK = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "domain",
}  # fmt: skip
_MARKS = {"command buffer", "cond", "while"}


def _is_copy(kind: str) -> bool:
    return "copy" in kind.lower() or "memcpy" in kind.lower()


def _work(counts: collections.Counter) -> int:
    return sum(n for k, n in counts.items() if not _is_copy(k) and k not in _MARKS)


# -- H100: the thunk sequence -------------------------------------------------------


def gpu_thunks(dump_dir: str) -> list[dict]:
    """The thunk tree of the dump: nodes with `kind`, `children`, `branches`."""
    paths = glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes.txt"))
    paths = paths or glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))
    (path,) = paths
    root = {"kind": "root", "children": [], "branches": []}
    stack = [(-1, root, root["children"])]
    for line in open(path).read().splitlines():
        thunk = re.match(r"^(\s*)\d+:\s+(k\w+)", line)
        label = re.match(r"^(\s*)([A-Za-z_][\w ]*\w):\s*$", line)
        if not (thunk or label):
            continue
        indent = len((thunk or label).group(1))
        while stack[-1][0] >= indent:
            stack.pop()
        if thunk:
            node = {"kind": thunk.group(2), "children": [], "branches": []}
            stack[-1][2].append(node)
            stack.append((indent, node, node["children"]))
        else:
            owner, branch = stack[-1][1], []
            owner["branches"].append(branch)
            stack.append((indent, owner, branch))
    return root["children"]


def count_thunks(nodes: list[dict], applied: bool) -> collections.Counter:
    counts = collections.Counter()
    for node in nodes:
        kind = node["kind"]
        if kind in ("kCommandBuffer", "kSequential"):
            counts["command buffer"] += kind == "kCommandBuffer"
            counts += count_thunks(node["children"], applied)
        elif kind == "kConditional":
            counts["cond"] += 1
            branches = sorted(
                (count_thunks(b, applied) for b in node["branches"]), key=_work
            )
            counts += branches[-1] if applied else branches[0]
        elif kind == "kWhile":
            counts["while"] += 1
            for branch in node["branches"]:
                counts += count_thunks(branch, applied)
        else:
            counts[kind] += 1
            counts += count_thunks(node["children"], applied)
    return counts


def gpu_summary(counts: collections.Counter) -> dict:
    return {
        "kernels": sum(n for k, n in counts.items() if k not in _MARKS),
        "copies": sum(n for k, n in counts.items() if _is_copy(k)),
        "conds": counts["cond"],
    }


def bytes_from_cpu_analysis(compiled) -> float:
    """XLA:CPU's `HloCostAnalysis` of another backend's optimized module."""
    from jax._src.lib import _jax

    (module,) = compiled.runtime_executable().hlo_modules()
    client = jax.devices("cpu")[0].client
    return float(_jax.hlo_module_cost_analysis(client, module)["bytes accessed"])


# -- the optimized HLO: TPU vector ops and HBM bytes; CPU fusions ----------------------


def _split(line: str) -> tuple[str, str]:
    """(result shape text, opcode) of one HLO instruction line."""
    i = line.index(" = ") + 3
    if line[i] == "(":  # a tuple shape
        depth = 0
        for j in range(i, len(line)):
            depth += {"(": 1, ")": -1}.get(line[j], 0)
            if depth == 0:
                break
        shape, i = line[line.index(" = ") + 3 : j + 1], j + 1
    else:
        k = line.index(" ", i)
        shape, i = line[i:k], k
    rest = line[i:].lstrip()
    return shape, rest[: rest.index("(")]


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        head = line.split("(")[0].split()
        if (
            line
            and not line[0].isspace()
            and line.rstrip().endswith("{")
            and head
            and head[-1].startswith("%")
        ):
            name = head[-1][1:]
            entry = name if head[0] == "ENTRY" else entry
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line)
    return comps, entry


def _is_scalar(shape: str) -> bool:
    dims = re.findall(r"\b\w+\[([^\]]*)\]", shape)
    return bool(dims) and all(d.strip() == "" for d in dims)


def _classify(shape: str, op: str, line: str) -> str | None:
    if op in NOT_WORK or op.endswith("-done"):
        return None
    if op.endswith("-start"):
        return "dma"
    if op == "custom-call":
        if 'custom_call_target="ConcatBitcast"' in line:
            return "concat-bitcast"
        return "custom-call"
    if op == "fusion":
        return "fusion"
    if _is_scalar(shape):
        return "scalar op"
    return "copy" if op == "copy" else f"vector op: {op}"


def _branches(line: str) -> list[str]:
    m = re.search(r"branch_computations=\{([^}]*)\}", line)
    if m:
        return [n.strip().lstrip("%") for n in m.group(1).split(",")]
    return [
        re.search(rf"{k}_computation=%?([\w.\-]+)", line).group(1)
        for k in ("true", "false")
    ]


def _vector_work(c: collections.Counter) -> int:
    return c["fusion"] + c["custom-call"] + c["vector op"] + c["copy"]


def _branch_key(c: collections.Counter) -> tuple[int, int]:
    return (c["fusion"] + c["custom-call"], _vector_work(c))


def count_hlo(text: str, applied: bool) -> collections.Counter:
    """Ops of the entry computation; a conditional's busier (or idler) branch."""
    comps, entry = computations(text)

    def walk(name):
        counts = collections.Counter()
        for line in comps[name]:
            shape, op = _split(line)
            if op == "conditional":
                counts["cond"] += 1
                branches = sorted((walk(n) for n in _branches(line)), key=_branch_key)
                counts += branches[-1] if applied else branches[0]
            elif op == "while":
                counts["while"] += 1
                counts += walk(re.search(r"body=%?([\w.\-]+)", line).group(1))
            elif op == "call":
                counts += walk(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
            else:
                _tally(counts, _classify(shape, op, line))
        return counts

    return walk(entry)


def hlo_summary(counts: collections.Counter) -> dict:
    return {
        "vector_ops": _vector_work(counts),
        "fusions": counts["fusion"],
        "unfused": {
            k.split(": ")[1]: n
            for k, n in counts.items()
            if k.startswith("vector op: ")
        }
        if counts["vector op"]
        else {},
        "copies": counts["copy"],
        "conds": counts["cond"],
    }


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")


def _prod(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def _hbm_bytes(shape: str) -> int:
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        if dtype in DTYPE_BYTES and not (space and space.group(1) != "0"):
            total += _prod(dims) * DTYPE_BYTES[dtype]
    return total


def _operands(line: str, op: str) -> list[str]:
    rest = line[line.index(f" {op}(") + len(op) + 2 :]
    depth, out = 1, ""
    for ch in rest:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
        out += ch
    return re.findall(r"%([\w.\-]+)", out)


def hbm_traffic(text: str, applied: bool) -> int:
    """Estimated HBM bytes of one TPU step: operands and results in HBM of each
    fusion, custom-call, unfused vector op and copy; what each DMA moves when one
    side is in HBM. Logical sizes (no tile padding); an estimate, not XLA's."""
    comps, entry = computations(text)

    def walk(name):
        shapes, total = {}, 0
        for line in comps[name]:
            shapes[line.split(" = ")[0].split()[-1].lstrip("%")] = _split(line)[0]
        for line in comps[name]:
            shape, op = _split(line)
            if op == "conditional":
                keyed = sorted(
                    (
                        (_branch_key(count_branch(comps, n)), walk(n))
                        for n in _branches(line)
                    ),
                    key=lambda t: t[0],
                )
                total += keyed[-1][1] if applied else keyed[0][1]
                continue
            if op in ("while", "call"):
                body = re.search(r"(?:body|to_apply)=%?([\w.\-]+)", line).group(1)
                total += walk(body)
                continue
            key = _classify(shape, op, line)
            if key is None or key in ("scalar op", "concat-bitcast"):
                continue
            if key == "dma":
                dest = shape if not shape.startswith("(") else _tuple_parts(shape)[1]
                moved = sum(
                    _prod(dims) * DTYPE_BYTES.get(t, 0)
                    for t, dims, _ in _ARRAY.findall(dest)
                )
                source = "".join(shapes.get(o, "") for o in _operands(line, op))
                if _hbm_bytes(dest) or _hbm_bytes(source):
                    total += moved
                continue
            total += _hbm_bytes(shape)
            total += sum(_hbm_bytes(shapes.get(o, "")) for o in _operands(line, op))
        return total

    return walk(entry)


def _tally(counts: collections.Counter, key: str | None) -> None:
    if key is not None:
        counts[key] += 1
        if key.startswith("vector op: "):
            counts["vector op"] += 1


def count_branch(comps, name) -> collections.Counter:
    counts = collections.Counter()
    for line in comps[name]:
        shape, op = _split(line)
        _tally(counts, _classify(shape, op, line))
    return counts


def _tuple_parts(shape: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in shape[1:-1]:
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p and not p.startswith("/*")]
