"""Test configuration and fixtures: eight CPU devices, deterministic hypothesis runs."""

import os

# Eight simulated CPU devices for the multi-device tests; set before JAX starts.
# Other tests use the default device and are unaffected.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import DEVICES  # noqa: E402
from helpers import tree_equal  # noqa: E402
from hypothesis import HealthCheck  # noqa: E402
from hypothesis import settings  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

# Examples are fixed per run (no flaky CI); jit compiles make timing deadlines moot.
# 20 a test keeps the suite in its 10 minutes (each example compiles); a longer
# search: LOSSSCALE_HYPOTHESIS_EXAMPLES=200 python -m pytest -m "not slow".
settings.register_profile(
    "lossscale",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    max_examples=int(os.environ.get("LOSSSCALE_HYPOTHESIS_EXAMPLES", "20")),
)
settings.load_profile("lossscale")

# A user's code for the type checkers (test_typing.py), not tests: never imported.
collect_ignore = ["typing"]


# The files holding the longest tests (trainings, notebooks, processes) run first, so
# the two workers of `-n 2` end together instead of one waiting on a late long test.
# Whole files move, so module-scoped fixtures are still set up once.
_LONGEST_FIRST = (
    "test_notebooks.py",
    "test_demo.py",
    "test_language_model.py",
    "test_multiprocess.py",
    "test_flax_examples.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return (
            _LONGEST_FIRST.index(name)
            if name in _LONGEST_FIRST
            else len(_LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: each file keeps its own order


@pytest.fixture
def strict_promotion():
    """Our code must not rely on implicit dtype promotion (optax's code does)."""
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture
def assert_tree_equal():
    def check(a, b):
        assert tree_equal(a, b), f"trees differ:\n{a}\n{b}"

    return check


@pytest.fixture(scope="module")
def mesh():
    """A mesh of the eight simulated CPU devices, one axis `data`."""
    return Mesh(np.array(DEVICES[:8]), ("data",))


@pytest.fixture(params=["cpu", "gpu", "tpu"], ids=lambda name: f"{name}-form")
def backend_form(request, monkeypatch):
    """Runs the test with the step in the form lowered for that backend.

    The forms XLA:GPU and the TPU compiler get (stacked or per-leaf check, a
    select instead of a cond) are plain JAX: on the CPU they must give the CPU
    form's results, bit for bit.
    """
    from lossscale._src.step import finite

    def chosen(*args, cpu, gpu, tpu):
        return {"cpu": cpu, "gpu": gpu, "tpu": tpu}[request.param](*args)

    monkeypatch.setattr(finite, "per_backend", chosen)
    return request.param
