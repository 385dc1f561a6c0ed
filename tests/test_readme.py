"""Every Python example in the README runs, and prints what it says it prints."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


CONTINUES = "# Continues the"


def test_readme_continuations_follow_a_block():
    assert not BLOCKS[0].startswith(CONTINUES)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_and_prints_its_comment(index):
    code = BLOCKS[index]
    namespace = {}
    # A block saying it continues the previous one runs after it, in its namespace.
    start = index
    while start > 0 and BLOCKS[start].startswith(CONTINUES):
        start -= 1
    with contextlib.redirect_stdout(io.StringIO()):
        for earlier in range(start, index):
            exec(compile(BLOCKS[earlier], f"README.md[{earlier}]", "exec"), namespace)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, f"README.md[python block {index}]", "exec"), namespace)
    # A `print(...)  # expected` line states its output: check it.
    expected = [
        line.split("#", 1)[1].strip()
        for line in code.splitlines()
        if line.startswith("print(") and "#" in line
    ]
    printed = output.getvalue().split("\n")
    for want, got in zip(expected, printed, strict=False):
        assert got.strip() == want


def setup_lines():
    """The README's set-up block, as `.ci/run` reads it (comments dropped)."""
    text = README.read_text()
    block = re.search(r"<!-- setup:.*?-->\n```bash\n(.*?)```", text, flags=re.DOTALL)
    assert block, "README.md lost its set-up block (and .ci/run with it)"
    lines = [re.sub(r"\s+#.*", "", line) for line in block.group(1).splitlines()]
    return [line for line in lines if line.strip()]


def test_one_install_line_makes_both_commands_work():
    import tomllib

    lines = setup_lines()
    installs = [line for line in lines if line.startswith("pip install")]
    assert len(installs) == 1 and lines[0] == installs[0]
    assert "python -m lossscale.demo" in lines and lines[-1] == "python -m pytest"
    extras = re.search(r'"\.\[(.*?)\]"', installs[0]).group(1).split(",")
    pyproject = tomllib.loads((README.parent / "pyproject.toml").read_text())
    optional = pyproject["project"]["optional-dependencies"]
    installed = {req for extra in extras for req in optional[extra]}
    names = {re.split(r"[<>=\[ ]", req)[0] for req in installed}
    # What the demo and the tests import comes with that one line.
    needed = {re.split(r"[<>=\[ ]", req)[0] for req in optional["demo"]} | {"pytest"}
    assert needed <= names, needed - names
    assert "<!-- setup:" in (README.parent / ".ci" / "run").read_text()
