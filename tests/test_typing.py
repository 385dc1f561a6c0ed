"""The types a user relies on, checked as a user checks them: mypy and pyright.

The files in `tests/typing/` are a user's code (copied out of the checkout, so the
checkers find `lossscale` as installed, as in a user's project): `*_usage.py`
must type-check, with `assert_type` on what users use, and each line of
`misuse.py` must be reported, or its ignore, unused, fails the check.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import lossscale

TYPING = pathlib.Path(__file__).with_name("typing")


@pytest.fixture
def user_project(tmp_path):
    for path in TYPING.iterdir():
        if path.suffix in (".py", ".ini", ".json"):
            shutil.copy(path, tmp_path)
    return tmp_path


def _environment() -> dict[str, str]:
    # This interpreter's search path, as the checkers ask it: `PYTHONPATH=.` in a
    # checkout means the checkout, wherever the checker runs.
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        parts = env["PYTHONPATH"].split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in parts if p)
    return env


def _check(command: list[str], project: pathlib.Path, checker: str) -> None:
    result = subprocess.run(
        command,
        cwd=project,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"{checker} finds type errors in a user's code (tests/typing/):\n"
        f"{result.stdout}{result.stderr}\n"
        "An error in a *_usage.py file: a call the docs show no longer type-checks,"
        " or `assert_type` sees another type than users rely on. An unused ignore"
        " in misuse.py: that misuse is no longer reported (a signature loosened, a"
        " hidden `__getattr__` exposed). `Cannot find implementation or library"
        ' stub for module named "lossscale"` / `Import "lossscale" could not be'
        " resolved`: the install is invisible to type checkers (pyproject.toml,"
        " [tool.setuptools] package-dir)."
    )


@pytest.mark.slow  # ~20 s of CPU: mypy reads JAX's and Flax's types afresh
def test_mypy_reads_the_types_users_rely_on(user_project):
    pytest.importorskip("mypy")
    files = sorted(p.name for p in user_project.glob("*.py"))
    _check(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", *files],
        user_project,
        "mypy",
    )


def test_pyright_reads_the_types_users_rely_on(user_project):
    pytest.importorskip("pyright")
    files = sorted(p.name for p in user_project.glob("*.py"))
    _check(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, *files],
        user_project,
        "pyright",
    )


def _checker_signatures() -> dict[str, list[tuple[str, str, object, str]]]:
    """The built-in kinds' `__init__` as type checkers read it (`if TYPE_CHECKING:`)."""
    import lossscale._src.state.kinds as module

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    found = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for block in cls.body:
            if not (
                isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            ):
                continue
            (init,) = [n for n in block.body if isinstance(n, ast.FunctionDef)]
            assert init.name == "__init__", init.name
            args = init.args
            params = [(a, "POSITIONAL_OR_KEYWORD") for a in args.args[1:]]
            params += [(a, "KEYWORD_ONLY") for a in args.kwonlyargs]
            defaults = [None] * (len(args.args) - 1 - len(args.defaults))
            defaults += list(args.defaults) + list(args.kw_defaults)
            found[cls.name] = [
                (
                    arg.arg,
                    kind,
                    inspect.Parameter.empty
                    if default is None
                    else eval(ast.unparse(default)),
                    ast.unparse(arg.annotation),
                )
                for (arg, kind), default in zip(params, defaults, strict=True)
            ]
    return found


@pytest.mark.parametrize(
    "name", ["DynamicLossScale", "StaticLossScale", "NoOpLossScale"]
)
def test_the_checkers_constructor_is_the_dataclass_one(name):
    # What type checkers read (`__init__` under `if TYPE_CHECKING:`) against the
    # constructor that runs: the same parameters, kinds and defaults; an array
    # field takes `ArrayLike` (a Python number is cast), a setting its own type.
    stub = _checker_signatures()[name]
    runtime = inspect.signature(getattr(lossscale, name)).parameters.values()
    expected = [
        (
            p.name,
            p.kind.name,
            p.default,
            "ArrayLike" if p.annotation == "jax.Array" else p.annotation,
        )
        for p in runtime
    ]
    expected = [
        (n, k, d, "ArrayLike | None" if (a, d) == ("ArrayLike", None) else a)
        for n, k, d, a in expected
    ]
    differences = [
        f"  checkers: {s}\n  runtime:  {e}"
        for s, e in itertools.zip_longest(stub, expected)
        if s != e
    ]
    assert not differences, (
        f"`{name}.__init__` for type checkers (lossscale/_src/state/kinds.py, under"
        " `if TYPE_CHECKING:`) differs from its dataclass constructor, the one that"
        " runs:\n" + "\n".join(differences)
    )
