"""The public API: explicit exports, each documented with a runnable example."""

import inspect

import pytest

import lossscale

PUBLIC = [name for name in lossscale.__all__ if name != "LossScaleLike"]


def test_all_lists_exactly_the_public_names():
    exported = {
        name
        for name, value in vars(lossscale).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert exported == set(lossscale.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_symbol_has_a_summary_and_an_example(name):
    doc = inspect.getdoc(getattr(lossscale, name))
    assert doc, name
    assert doc.splitlines()[0].endswith("."), name
    assert "Examples:" in doc and ">>>" in doc, name


@pytest.mark.parametrize("name", PUBLIC)
def test_public_symbols_live_in_private_modules(name):
    assert getattr(lossscale, name).__module__.startswith("lossscale._src."), name
