"""Sphinx configuration of lossscale's documentation.

Build it with `sphinx-build -W -b html docs docs/_build/html` (the tests do, with
warnings as errors, and run every `python` code block of every page). Names in
docstrings link to their API entries, here and (through intersphinx) in JAX's, Optax's
and Flax's docs. Intersphinx fetches those projects' inventories, so it needs the
network: with `LOSSSCALE_DOCS_OFFLINE=1` (set by the tests, which run offline) the
build leaves those links out instead of failing.
"""

import os
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import lossscale  # noqa: E402

project = "lossscale"
author = "The lossscale authors"
copyright = "2026, the lossscale authors"  # noqa: A001
release = lossscale.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "jax": ("https://docs.jax.dev/en/latest", None),
    "optax": ("https://optax.readthedocs.io/en/latest", None),
    "flax": ("https://flax.readthedocs.io/en/latest", None),
}
if os.environ.get("LOSSSCALE_DOCS_OFFLINE"):
    intersphinx_mapping = {}
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# `name` in a docstring links to that object's entry where one exists (ours, or
# JAX's, Optax's and Flax's through intersphinx), and renders as code otherwise.
default_role = "py:obj"
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = f"lossscale {release}"
html_theme_options = {"repository_url": "", "use_repository_button": False}


# Docstrings cite the guides by path, as a reader of the source sees them
# (`docs/design.md`); in the site those become links to the pages.
_PAGE = re.compile(r"`docs/([a-z_/]+)\.md`")


def _link_pages(app, what, name, obj, options, lines):
    lines[:] = [_PAGE.sub(r":doc:`docs/\1.md </\1>`", line) for line in lines]


def setup(app):
    """Sphinx's hook for this project's own extensions."""
    app.connect("autodoc-process-docstring", _link_pages)
