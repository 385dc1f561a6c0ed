"""Every Python example in the README runs, and prints what it says it prints."""

import pathlib
import re

import pytest
from helpers import CONTINUES
from helpers import python_blocks
from helpers import run_block

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = python_blocks(README.read_text())


def test_readme_has_examples():
    assert len(BLOCKS) >= 1


def test_readme_continuations_follow_a_block():
    assert not BLOCKS[0].startswith(CONTINUES)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_and_prints_its_comment(index):
    run_block(BLOCKS, index, "README.md")


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


def test_readme_links_every_guide_and_migration_page():
    docs = pathlib.Path(__file__).resolve().parents[1] / "docs"
    pages = [docs / "getting_started.md", docs / "design.md"]
    pages += sorted((docs / "guides").glob("*.md"))
    pages += sorted((docs / "migration").glob("*.md"))
    text = README.read_text()
    for page in pages:
        assert f"(docs/{page.relative_to(docs).as_posix()})" in text, page.name


def test_which_entry_point_is_said_once_in_the_same_words_everywhere():
    # Issue 42: the README, getting started and the Flax guide each opened with
    # another recipe; each says when to use which, in one paragraph, the same.
    root = README.parent
    found = {}
    for name in ("README.md", "docs/getting_started.md", "docs/guides/flax.md"):
        text = (root / name).read_text()
        paragraphs = re.findall(r"\*\*Which entry point\.\*\*.*?\n\n", text, re.S)
        assert len(paragraphs) == 1, (name, len(paragraphs))
        found[name] = paragraphs[0]
    assert len(set(found.values())) == 1, found
    for name in ("value_and_grad", "apply_gradients", "wrap(tx)", "TrainState"):
        assert name in found["README.md"], name


def test_what_the_readme_says_the_demo_test_runs_is_what_it_runs():
    # Issue 50: the README said the suite runs the demo "as above (2000 steps)"
    # after the test had moved to 1000.
    import ast

    text = " ".join(README.read_text().split())
    said = re.search(
        r"The test suite runs the demo at seed (\d+) for (\d+) steps, (\w+) of the"
        r" above",
        text,
    )
    assert said, "README.md lost its sentence on what the demo test runs"
    seed, steps, share = int(said.group(1)), int(said.group(2)), said.group(3)
    source = (README.parent / "tests" / "test_demo.py").read_text()
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    assert steps == constants["STEPS"], (steps, constants["STEPS"])
    # The test passes `--steps` and no `--seed`: the demo's default seed.
    assert '"--steps", str(STEPS)' in source and "--seed" not in source
    demo = (README.parent / "lossscale" / "demo.py").read_text()
    defaults = dict(
        re.findall(r'add_argument\("--(\w+)", type=int, default=(\d+)\)', demo)
    )
    assert seed == int(defaults["seed"]), (seed, defaults)
    # "as above": the README's run is the demo's default step count.
    above = re.search(r"One run here \((\d+) steps, seed (\d+)", text)
    assert above and int(above.group(1)) == int(defaults["steps"]), above
    assert {"half": 2}[share] * steps == int(defaults["steps"]), (share, steps)
