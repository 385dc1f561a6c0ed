"""optax's optimizers, enumerated from optax itself, and the tree they train.

`catalogue()` lists every public function of optax's aliases (`optax._src.alias`,
as exported at optax's top level) and of `optax.contrib`: one that takes a
learning rate and needs nothing else is built with `LEARNING_RATE` and its
defaults, so an optimizer added to optax is tested without editing this file;
`ARGUMENTS` gives the others what they need; `EXCLUDED` says why the rest are left
out. `COMBINATORS` adds optax's combinators and two transformations of the kinds
users write. The steps that run them are in `catalogue_steps.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from optax._src import alias

LEARNING_RATE = 0.1  # large enough that two steps move the parameters visibly

# Shapes of the parameters: a matrix sharded by rows, one by columns, and a scalar
# (where XLA:CPU's split step hoists work out of the skip). A vector too would cost
# a fifth more compile time.
SHAPES = {"w": (8, 4), "v": (4, 8), "s": ()}

SCHEDULE = optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=LEARNING_RATE, warmup_steps=1, decay_steps=10
)


def _targets():
    rng = np.random.default_rng(0)
    return {
        name: (
            jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32),  # curvature
            jnp.asarray(rng.standard_normal(shape), jnp.float32),  # minimum
        )
        for name, shape in SHAPES.items()
    }


_TARGETS = _targets()


def initial_params():
    rng = np.random.default_rng(1)
    return {
        name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for name, shape in SHAPES.items()
    }


def loss(params):
    """A quadratic with a random minimum and curvature per element: finite gradients."""
    return sum(
        0.5 * jnp.sum(curvature * (params[name] - minimum) ** 2)
        for name, (curvature, minimum) in _TARGETS.items()
    )


loss_and_grad = jax.jit(jax.value_and_grad(loss))


# -- what an optimizer's `update` needs besides the gradients -------------------------

# The extra arguments of `tx.update`, by kind: built from the loss value and the
# unscaled gradients of the step.
EXTRA_ARGUMENTS: dict[str, Callable[[Any, Any], dict]] = {
    "none": lambda value, grads: {},
    "value": lambda value, grads: {"value": value},
    # `optax.lbfgs`'s zoom line search: the value, the gradients and the function.
    "line search": lambda value, grads: {
        "value": value,
        "grad": grads,
        "value_fn": loss,
    },
    # `optax.contrib.sophia`'s Hutchinson estimator differentiates the objective.
    "objective": lambda value, grads: {"obj_fn": loss},
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """An optimizer of the catalogue: its name, how to build it, what it needs."""

    name: str
    build: Callable[[], Any]  # a GradientTransformation, or an optax.MultiSteps
    extra: str = "none"  # a key of EXTRA_ARGUMENTS

    def extra_args(self, value, grads) -> dict:
        return EXTRA_ARGUMENTS[self.extra](value, grads)

    def transformation(self) -> optax.GradientTransformation:
        """The optimizer as plain optax and `apply_gradients` take it."""
        tx = self.build()
        return tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx


@dataclasses.dataclass(frozen=True)
class Excluded:
    """Why an optimizer of optax is not in the catalogue.

    With `fails_on_the_tree`, plain optax fails on the test's parameters too (a
    test asserts it); otherwise `reason` says why it cannot run there.
    """

    reason: str
    fails_on_the_tree: bool = False


def _sophia_estimator():
    # A typed PRNG key in the state: a skipped step must keep it bit for bit.
    return optax.contrib.hutchinson_estimator_diag_hessian(
        random_seed=jax.random.key(0)
    )


# Constructor arguments beyond the learning rate, by qualified name (a callable:
# built when the optimizer is).
ARGUMENTS: dict[str, Callable[[], dict]] = {
    "noisy_sgd": lambda: {"key": jax.random.key(0)},
    "polyak_sgd": lambda: {"max_learning_rate": LEARNING_RATE},
    "contrib.mechanize": lambda: {"base_optimizer": optax.adam(LEARNING_RATE)},
    "contrib.reduce_on_plateau": lambda: {"patience": 1, "cooldown": 1},
    "contrib.sam": lambda: {
        "optimizer": optax.sgd(LEARNING_RATE),
        "adv_optimizer": optax.sgd(LEARNING_RATE),
    },
    "contrib.schedule_free": lambda: {"base_optimizer": optax.sgd(LEARNING_RATE)},
    "contrib.split_real_and_imaginary": lambda: {"inner": optax.adam(LEARNING_RATE)},
    "contrib.sophia": lambda: {"hessian_diagonal_fn": _sophia_estimator()},
    "contrib.dpsgd": lambda: {"l2_norm_clip": 1.0, "noise_multiplier": 0.1, "seed": 0},
    "contrib.differentially_private_aggregate": lambda: {
        "l2_norm_clip": 1.0,
        "noise_multiplier": 0.1,
        "key": jax.random.key(0),
    },
    "contrib.scale_by_muon": lambda: {},
}

# What `update` needs besides the gradients, by qualified name (default: nothing).
NEEDS: dict[str, str] = {
    "lbfgs": "line search",
    "polyak_sgd": "value",
    "contrib.momo": "value",
    "contrib.momo_adam": "value",
    "contrib.reduce_on_plateau": "value",
    "contrib.sophia": "objective",
}

_PER_EXAMPLE = (
    "clips per-example gradients: every gradient leaf needs a leading batch axis,"
    " which the scalar leaf has not"
)

EXCLUDED: dict[str, Excluded] = {
    "sm3": Excluded(
        "its statistics index the leaf's axes: a scalar leaf has none", True
    ),
    "contrib.dpsgd": Excluded(_PER_EXAMPLE, True),
    "contrib.differentially_private_aggregate": Excluded(_PER_EXAMPLE, True),
    "contrib.scale_by_muon": Excluded(
        "Muon's orthogonalization is for matrices (`contrib.muon` routes the"
        " other leaves to Adam and is in the catalogue)",
        True,
    ),
    "contrib.hutchinson_estimator_diag_hessian": Excluded(
        "not an optimizer: it estimates the Hessian's diagonal for"
        " `contrib.sophia`, which is in the catalogue with it"
    ),
    "contrib.schedule_free_eval_params": Excluded(
        "not a transformation: it returns the parameters to evaluate from a"
        " schedule-free state"
    ),
    "contrib.normalize": Excluded(
        "not an optimizer: the normalization of `contrib.sam`'s adversarial step,"
        " which is in the catalogue"
    ),
    **{
        f"contrib.scale_by_{name}": Excluded(
            f"not an optimizer: the transformation of `contrib.{optimizer}`, which"
            " is in the catalogue with it"
        )
        for name, optimizer in [
            ("acprop", "acprop"),
            ("ademamix", "ademamix"),
            ("simplified_ademamix", "simplified_ademamix"),
            ("adopt", "adopt"),
            ("cocob", "cocob"),
            ("galore", "galore"),
            ("madgrad", "madgrad"),
        ]
    },
}


def public_functions() -> dict[str, Callable]:
    """optax's aliases and `optax.contrib`'s public functions, by qualified name."""
    functions = {}
    for name in dir(optax):
        value = getattr(optax, name)
        if inspect.isfunction(value) and value.__module__ == alias.__name__:
            functions[name] = value
    for name in dir(optax.contrib):
        value = getattr(optax.contrib, name)
        if not name.startswith("_") and inspect.isfunction(value):
            functions[f"contrib.{name}"] = value
    return functions


def _required(function: Callable) -> set[str]:
    return {
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def builder(function: Callable, name: str) -> Callable[[], Any] | None:
    """How to build optax's `function`, or None if it needs what nobody gave it."""
    takes_rate = "learning_rate" in inspect.signature(function).parameters
    if not takes_rate and name not in ARGUMENTS:
        return None  # not an optimizer by optax's convention, unless listed
    arguments = ARGUMENTS.get(name, dict)
    given = set(arguments()) | ({"learning_rate"} if takes_rate else set())
    if not _required(function) <= given:
        return None

    def build():
        kwargs = arguments()
        if takes_rate:
            kwargs.setdefault("learning_rate", LEARNING_RATE)
        with warnings.catch_warnings():
            # optax's own deprecations (`optimistic_adam`, `dpsgd`'s `seed`):
            # still optimizers users run.
            warnings.simplefilter("ignore", DeprecationWarning)
            return function(**kwargs)

    return build


def unclassified() -> list[str]:
    """Public functions that are neither buildable nor excluded (a new optax name)."""
    return sorted(
        name
        for name, function in public_functions().items()
        if name not in EXCLUDED and builder(function, name) is None
    )


# -- the combinators, and transformations users write ---------------------------------


def _labels(params):
    return {name: "freeze" if name == "s" else "train" for name in params}


def asarray_state_beside_a_global_norm():
    """A user's transformation: a state scalar written `jnp.asarray(1.0)` (weak).

    It divides the gradients by the larger of their global norm and the last
    step's, and keeps the norm in its state, which comes back strongly typed.
    """

    def init(params):
        del params
        return {"norm": jnp.asarray(1.0)}

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        divisor = jnp.maximum(norm, state["norm"])
        return jax.tree.map(lambda g: g / divisor, updates), {"norm": norm}

    return optax.chain(
        optax.GradientTransformation(init, update), optax.sgd(LEARNING_RATE)
    )


def halving_while_loop():
    """A user's transformation with a `lax.while_loop` over the scalar's gradient.

    It halves the scalar leaf's gradient until it is below 1: on an inf, the loop
    never ends, so it must not run on a skipped step.
    """

    def update(updates, state, params=None):
        del params
        scalar = jax.lax.while_loop(
            lambda x: jnp.abs(x) >= 1.0, lambda x: x * 0.5, updates["s"]
        )
        return {**updates, "s": scalar}, state

    return optax.chain(
        optax.GradientTransformation(lambda params: optax.EmptyState(), update),
        optax.sgd(LEARNING_RATE),
    )


COMBINATORS = [
    Entry(
        "multi_transform(adam,set_to_zero)",
        lambda: optax.multi_transform(
            {"train": optax.adam(LEARNING_RATE), "freeze": optax.set_to_zero()},
            _labels,
        ),
    ),
    Entry(
        "masked(adam)",
        lambda: optax.masked(
            optax.adam(LEARNING_RATE), lambda p: {name: name != "s" for name in p}
        ),  # fmt: skip
    ),
    Entry(
        "inject_hyperparams(adam,schedule)",
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE),
    ),
    Entry(
        "MultiSteps(adam,2)",
        lambda: optax.MultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=2),
    ),
    Entry(
        "chain(clip_by_global_norm,adamw(schedule))",
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE)),
    ),
    Entry(
        "chain(add_decayed_weights,adam,schedule)",
        lambda: optax.chain(
            optax.add_decayed_weights(1e-2),
            optax.scale_by_adam(),
            optax.scale_by_learning_rate(SCHEDULE),
        ),
    ),
    Entry("asarray_state(global_norm)", asarray_state_beside_a_global_norm),
]


def catalogue() -> list[Entry]:
    """Every optimizer the tests run: optax's, enumerated, then the combinators."""
    entries = []
    for name, function in sorted(public_functions().items()):
        build = None if name in EXCLUDED else builder(function, name)
        if build is not None:
            entries.append(Entry(name, build, NEEDS.get(name, "none")))
    return entries + COMBINATORS


def by_name(names) -> list[Entry]:
    entries = {entry.name: entry for entry in catalogue()}
    return [entries[name] for name in names]
