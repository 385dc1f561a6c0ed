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
