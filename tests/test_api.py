"""The public API: explicit exports, each documented with a runnable example."""

import inspect
import re
import warnings

import pytest

import lossscale
import lossscale.flax
from lossscale._src.compat import moved

MODULES = (lossscale, lossscale.checkpoints, lossscale.diagnostics, lossscale.flax)
PUBLIC = [(module, name) for module in MODULES for name in module.__all__]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_lists_exactly_the_public_names(module):
    exported = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert exported == set(module.__all__)


@pytest.mark.parametrize("module, name", PUBLIC)
def test_every_public_symbol_has_a_summary_and_an_example(module, name):
    doc = inspect.getdoc(getattr(module, name))
    assert doc, name
    assert doc.splitlines()[0].endswith("."), name
    assert "Examples:" in doc and ">>>" in doc, name


@pytest.mark.parametrize("module, name", PUBLIC)
def test_public_symbols_live_in_private_modules(module, name):
    assert getattr(module, name).__module__.startswith("lossscale._src."), name


def test_importing_lossscale_does_not_import_flax():
    import subprocess
    import sys

    code = "import sys, lossscale; print('flax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(moved.MOVED))
def test_a_name_04_moved_is_its_new_home_with_a_warning_at_the_callers_line(name):
    module, new = moved.MOVED[name]
    with pytest.warns(DeprecationWarning, match=f"is `{module}.{new}`") as record:
        alias = getattr(lossscale, name)
    assert record[0].filename == __file__
    assert alias is getattr(__import__(module, fromlist=[new]), new)
    assert name not in lossscale.__all__


@pytest.mark.parametrize("name", sorted(moved.RETIRED))
def test_a_versioned_checkpoint_name_says_what_replaces_it(name):
    instead = moved.RETIRED[name][1]
    with pytest.warns(DeprecationWarning, match=re.escape(instead)):
        alias = getattr(lossscale, name)
    assert callable(alias) and alias.__name__ == name
    assert name not in lossscale.__all__


def test_a_moved_name_imports_from_the_top_level_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from lossscale import preflight
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "`lossscale.preflight` is `lossscale.diagnostics.preflight`"
    ]
    assert preflight is lossscale.diagnostics.preflight


def test_no_public_name_carries_a_version_number():
    for module in MODULES:
        assert not [n for n in module.__all__ if re.search(r"\d", n)], module
