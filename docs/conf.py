"""Sphinx configuration of lossscale's documentation.

Build it with `sphinx-build -W -b html docs docs/_build/html` (the tests do, with
warnings as errors, and run every `python` code block of every page).
"""

import pathlib
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
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# `code` spans in docstrings (single backticks) render as code.
default_role = "code"
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
