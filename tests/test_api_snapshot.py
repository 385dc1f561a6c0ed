"""The public API against its committed snapshot (`tests/api_snapshot.json`).

Every name in the `__all__` of `lossscale` and of its public submodules (`MODULES`),
its kind, its parameters (name, kind, default) and, for a
class, its public members with theirs, as griffe inspects them. Renaming or removing a
public name or parameter, or changing a default, fails here until the snapshot and
CHANGELOG.md change with it:

    python tests/test_api_snapshot.py --write
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

SNAPSHOT = pathlib.Path(__file__).with_name("api_snapshot.json")
MODULES = (
    "lossscale",
    "lossscale.checkpoints",
    "lossscale.diagnostics",
    "lossscale.flax",
    "lossscale.tunix",
)


def _parameters(function) -> list[list[str | None]]:
    return [
        # A default's repr may hold an address (`<object at 0x...>`): not the API.
        [p.name, p.kind.value, None if p.default is None else _plain(str(p.default))]
        for p in function.parameters
        if p.name not in ("self", "cls")
    ]


def _plain(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _entry(obj) -> dict:
    obj = obj.final_target if obj.is_alias else obj
    entry: dict = {"kind": obj.kind.value}
    if obj.is_function:
        entry["parameters"] = _parameters(obj)
    if obj.is_class:
        entry["parameters"] = _parameters(obj)
        members = {}
        for name, member in sorted(obj.all_members.items()):
            if name.startswith("_"):
                continue
            try:
                members[name] = _entry(member)
            except Exception:  # an alias griffe cannot resolve: its kind only
                members[name] = {"kind": "alias"}
        entry["members"] = members
    return entry


def snapshot() -> dict:
    """The public API as it is now."""
    griffe = pytest.importorskip("griffe")
    api = {}
    for module in MODULES:
        loaded = griffe.load(module, force_inspection=True, resolve_aliases=False)
        names = __import__(module, fromlist=["__all__"]).__all__
        api[module] = {name: _entry(loaded[name]) for name in names}
    return api


def _differences(old: dict, new: dict, where: str = "") -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new), key=str):
        path = f"{where}.{key}" if where else str(key)
        if key not in new:
            lines.append(f"removed: {path}")
        elif key not in old:
            lines.append(f"added: {path}")
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            lines += _differences(old[key], new[key], path)
        elif old[key] != new[key]:
            lines.append(f"changed: {path}: {old[key]} -> {new[key]}")
    return lines


def test_the_public_api_is_the_snapshot():
    committed = json.loads(SNAPSHOT.read_text())
    differences = _differences(committed, snapshot())
    assert not differences, (
        "The public API differs from tests/api_snapshot.json:\n  "
        + "\n  ".join(differences)
        + "\nA removed or renamed name or parameter, or a changed default, needs a"
        " deprecation first. When the change is meant: record it in CHANGELOG.md and"
        " run `python tests/test_api_snapshot.py --write`."
    )


def test_the_snapshot_holds_every_public_name():
    # Guards the snapshot itself: a name in `__all__` that it left out would never
    # be compared.
    committed = json.loads(SNAPSHOT.read_text())
    for module in MODULES:
        names = __import__(module, fromlist=["__all__"]).__all__
        assert sorted(committed[module]) == sorted(names), module


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_api_snapshot.py --write")
    SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
