"""lossscale runs on JAX's public API: no internals, and no jaxprs outside diagnostics.

`jax.extend`, `jax._src` and `jax.interpreters` promise no compatibility across
releases. The step neither reads nor builds jaxprs; only `_src/diagnostics/`, whose
job is to read a program, may (through `jax.make_jaxpr`). Checked on the source's
syntax tree, so a new use fails here before it fails on the next JAX.
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "lossscale"
INTERNAL = ("jax.extend", "jax._src", "jax.interpreters", "jax.core.Jaxpr")
# Names that read or build a jaxpr, or bind a primitive: in diagnostics/ only.
JAXPR = {"make_jaxpr", "eqns", "jaxpr", "ClosedJaxpr", "Jaxpr"}
SOURCES = sorted(SRC.rglob("*.py"))


def dotted(node):
    """`a.b.c` of an attribute chain (or a name), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def uses(path):
    """(line, what) for each internal module or jaxpr name the file uses."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [dotted(node) or ""]
            if node.attr in JAXPR:
                found.append((node.lineno, f"jaxpr: .{node.attr}"))
            if node.attr == "bind" and (dotted(node.value) or "").endswith("_p"):
                found.append((node.lineno, f"jaxpr: {dotted(node)}"))
        found += [
            (node.lineno, name)
            for name in names
            if any(name == m or name.startswith(m + ".") for m in INTERNAL)
        ]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_lossscale_uses_jax_public_api_and_jaxprs_only_in_diagnostics(path):
    found = uses(path)
    if "diagnostics" in path.parts:
        # diagnostics/ reads jaxprs (its job), but through public JAX too, where
        # it can: what it still takes from jax.extend is listed in its modules.
        found = [(line, what) for line, what in found if not what.startswith("jaxpr")]
        found = [(line, what) for line, what in found if "jax.extend" not in what]
    assert not found, f"{path.relative_to(SRC)}: {found}"


def test_the_checker_finds_what_it_looks_for(tmp_path):
    # The reference: each kind of use, in a file of its own.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import jax.extend.core as jcore\n"
        "from jax._src import core\n"
        "closed = jax.make_jaxpr(f)(x)\n"
        "n = len(closed.jaxpr.eqns)\n"
        "out = cond_p.bind(x)\n"
        "args = inspect.signature(f).bind()\n"  # not a primitive's
    )
    found = {what for _, what in uses(sample)}
    want = {"jax.extend.core", "jax._src", "jaxpr: .make_jaxpr", "jaxpr: .eqns"}
    assert want | {"jaxpr: cond_p.bind"} <= found, found
    assert "jaxpr: inspect.signature.bind" not in found
