"""The public API: explicit exports, each documented with a runnable example."""

import inspect

import pytest

import lossscale
import lossscale.flax

MODULES = (lossscale, lossscale.flax)
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
