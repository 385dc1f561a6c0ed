"""The documentation site: it builds with warnings as errors, and its examples run.

Every `python` block of every page under `docs/` runs here, as the README's do, and
the API reference names every public symbol.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import warnings

import jax
import pytest
from helpers import CONTINUES
from helpers import python_blocks
from helpers import run_block

import lossscale
import lossscale.flax
import lossscale.tunix

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
    text = page.read_text()
    # A page about an optional package runs where it is installed (CI's
    # newest-versions stage installs google-tunix).
    needs = re.match(r"<!-- needs: (\w+) -->", text)
    if needs and importlib.util.find_spec(needs.group(1)) is None:
        pytest.skip(f"needs {needs.group(1)}")
    blocks = python_blocks(text)
    assert index or not blocks[0].startswith(CONTINUES)
    with warnings.catch_warnings():
        if needs:
            # That package's own deprecations (tunix's, of jax APIs). And the page
            # runs as a fresh program would: tunix's jitted helpers read settings
            # the page makes (its attention mask) when first traced.
            warnings.simplefilter("ignore", DeprecationWarning)
            jax.clear_caches()
        run_block(blocks, index, str(page.relative_to(DOCS)))


def test_the_api_reference_names_every_public_symbol():
    text = (DOCS / "api.md").read_text()
    modules = (lossscale.checkpoints, lossscale.diagnostics, lossscale.flax)
    for module in (lossscale, *modules, lossscale.tunix):
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
