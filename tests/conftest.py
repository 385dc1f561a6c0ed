"""Test configuration and fixtures: eight CPU devices, deterministic hypothesis runs."""

import atexit
import os
import shutil
import tempfile

# Eight simulated CPU devices for the multi-device tests; set before JAX starts.
# Other tests use the default device and are unaffected.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}"

import jax  # noqa: E402

# Compiling is most of the suite's time, and about one program in six is one the
# same process compiled before (another test's step, a docs block's, a parametrized
# copy). Each test process keeps what it compiles in a persistent cache of its own:
# a fresh directory, deleted at exit, so every run starts cold, as CI's does, and no
# run depends on another. The xdist workers do not share one: JAX writes an entry in
# place, and a worker could read another's half-written file. A hit is the
# executable XLA made for the same program (JAX's key: the program without its
# source locations, the compile options, the devices, the versions): the same
# results bit for bit. jit's own caches (`_cache_size`, "compiles once") are not
# this one; a test counting compilations counts the cache's reads too
# (test_flax_examples.py). LOSSSCALE_TESTS_JAX_CACHE=0 turns it off (to rule it out
# when a test fails). Set before anything compiles: JAX decides once whether to use
# it.
if os.environ.get("LOSSSCALE_TESTS_JAX_CACHE", "1") != "0":
    _JAX_CACHE = tempfile.mkdtemp(prefix="lossscale-tests-jax-cache-")
    atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import helpers  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import DEVICES  # noqa: E402
from helpers import tree_equal  # noqa: E402
from hypothesis import HealthCheck  # noqa: E402
from hypothesis import settings  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

# Examples are fixed per run (no flaky CI); jit compiles make timing deadlines moot.
# Each example compiles: the whole suite tries 20 a test (or the count a test sets,
# through `helpers.examples`), the quick loop (`-m "not slow"`) the first half of
# them. A longer search: LOSSSCALE_HYPOTHESIS_EXAMPLES=200 python -m pytest.
_EXAMPLES = os.environ.get("LOSSSCALE_HYPOTHESIS_EXAMPLES")
for _name, _examples in (("lossscale", 20), ("lossscale-quick", 10)):
    settings.register_profile(
        _name,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
        max_examples=int(_EXAMPLES or _examples),
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


def pytest_configure(config):
    if config.option.markexpr.replace(" ", "") == "notslow" and not _EXAMPLES:
        settings.load_profile("lossscale-quick")
        helpers.QUICK_LOOP = True


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


# The TPU's form of each test runs in the whole suite; the quick loop runs the CPU's
# and XLA:GPU's (the same select, with the stacked check), and the TPU's per-leaf
# check in test_numerics.py's forms test and the catalogue's quick subset.
@pytest.fixture(
    params=["cpu", "gpu", pytest.param("tpu", marks=pytest.mark.slow)],
    ids=lambda name: f"{name}-form",
)
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
