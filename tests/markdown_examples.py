"""Running the `python` code blocks of a Markdown file, as the README and docs state.

A block that starts with `# Continues the` runs after the blocks before it in the
same file, in their namespace. A line `print(...)  # text` states what it prints.
Blocks fenced as `py` (other libraries' code, for comparison) do not run.
"""

import contextlib
import io
import re

CONTINUES = "# Continues the"


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def run_block(blocks, index, name):
    """Runs `blocks[index]` (after the blocks it continues); checks its prints."""
    namespace = {"__name__": "__main__"}  # as a script would run it
    start = index
    while start > 0 and blocks[start].startswith(CONTINUES):
        start -= 1
    with contextlib.redirect_stdout(io.StringIO()):
        for earlier in range(start, index):
            exec(compile(blocks[earlier], f"{name}[{earlier}]", "exec"), namespace)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(blocks[index], f"{name}[python block {index}]", "exec"), namespace)
    expected = [
        line.split("#", 1)[1].strip()
        for line in blocks[index].splitlines()
        if line.startswith("print(") and "#" in line
    ]
    printed = output.getvalue().split("\n")
    for want, got in zip(expected, printed, strict=False):
        assert got.strip() == want, (name, index)
