"""The documentation site: it builds with warnings as errors, and its examples run.

Every `python` block of every page under `docs/` runs here, as the README's do, and
the API reference names every public symbol.
"""

import os
import pathlib
import subprocess
import sys

import pytest
from helpers import CONTINUES
from helpers import python_blocks
from helpers import run_block

import lossscale
import lossscale.flax

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
EXAMPLES = [
    (page, index)
    for page in PAGES
    for index in range(len(python_blocks(page.read_text())))
]


@pytest.mark.parametrize(
    "page, index", EXAMPLES, ids=[f"{p.relative_to(DOCS)}-{i}" for p, i in EXAMPLES]
)
def test_every_example_runs_and_prints_what_it_says(page, index):
    blocks = python_blocks(page.read_text())
    assert index or not blocks[0].startswith(CONTINUES)
    run_block(blocks, index, str(page.relative_to(DOCS)))


def test_the_api_reference_names_every_public_symbol():
    text = (DOCS / "api.md").read_text()
    for module in (lossscale, lossscale.flax):
        for name in module.__all__:
            assert f"{module.__name__}.{name}" in text, name


def test_every_page_is_in_a_table_of_contents():
    index = (DOCS / "index.md").read_text()
    for page in PAGES:
        name = page.relative_to(DOCS).with_suffix("").as_posix()
        assert name == "index" or f"\n{name}\n" in index, name


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
        + [str(DOCS), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LOSSSCALE_DOCS_OFFLINE": "1"},  # no intersphinx fetches
    )
    assert out.returncode == 0, out.stderr[-4000:]
    api = (tmp_path / "html" / "api.html").read_text()
    # Names in docstrings link to their entries, and cited pages to the pages.
    assert 'href="#lossscale.wrap"' in api
    assert '<a class="reference internal" href="design.html"><span class="doc">' in api
    assert (tmp_path / "html" / "api.html").exists()
