"""Loss-scale states: no-op, static and dynamic, and the rule that updates them.

A loss-scale state is an immutable pytree. Its leaves are scalar arrays with fixed
dtypes (the scale in float32, counters in int32), so it can be passed to and
returned from `jax.jit` without recompiling. Its settings (growth interval,
factors, bounds) are static: they live in the pytree's auxiliary data, so they
survive `jax.jit`, `jax.tree.map` and flatten/unflatten round trips, and two
states with the same settings have the same tree structure.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

_INT32_MAX = int(np.iinfo(np.int32).max)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _field_property(slot: str, index: int, name: str) -> property:
    getter = operator.itemgetter(index)
    return property(
        lambda self: getter(getattr(self, slot)), doc=f"The `{name}` field."
    )


class LossScale:
    """Base class of the loss-scale states.

    Do not instantiate it: use `NoOpLossScale`, `StaticLossScale` or
    `DynamicLossScale`. Every loss-scale state has:

    * `scale`: the current loss scale, a float32 scalar array;
    * `skipped_steps`: int32 scalar, the number of steps whose gradients were
      not finite since the state was created (saturates at 2**31 - 1);
    * `consecutive_skips`: int32 scalar, the number of such steps in a row up
      to the latest one (0 when the latest step was finite);
    * `forward_overflows`: int32 scalar, how many of the skipped steps had a
      non-finite loss (an overflow in the forward pass, which no loss scale can
      fix; see `lossscale.update`'s `loss_finite`);
    * `stuck`: bool scalar, whether the latest step overflowed in the backward
      pass at the lowest scale this state can reach, so backing off could not help.

    States are immutable; `lossscale.update` returns the next one.

    Examples:
      >>> import lossscale
      >>> isinstance(lossscale.DynamicLossScale(), lossscale.LossScale)
      True
    """

    # The leaves and the settings live in two tuples, so flattening and
    # unflattening (which `jax.jit` does for every call, on the way in and out) are
    # a tuple hand-over each: a per-field loop cost ~20 us of dispatch per step.
    __slots__ = ("_arrays", "_settings")

    # Names of the array leaves and of the static settings, in flattening order;
    # each is a read-only property of the state.
    _array_fields: ClassVar[tuple[str, ...]] = (
        "skipped_steps",
        "consecutive_skips",
        "forward_overflows",
        "stuck",
    )
    _setting_fields: ClassVar[tuple[str, ...]] = ()

    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    forward_overflows: jax.Array
    stuck: jax.Array

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._array_index = {name: i for i, name in enumerate(cls._array_fields)}
        for fields, slot in (
            (cls._array_fields, "_arrays"),
            (cls._setting_fields, "_settings"),
        ):
            for index, name in enumerate(fields):
                setattr(cls, name, _field_property(slot, index, name))
        # Hand-written flattening, but generic over the field lists, so no field can
        # be forgotten (jmp's flattening drops `min_loss_scale`). Unflattening must
        # not run `__init__`: leaves may be tracers, shape structs or sentinels.
        jax.tree_util.register_pytree_with_keys(
            cls, cls._flatten_with_keys, cls._unflatten, cls._flatten
        )

    def __init__(self):
        raise TypeError(
            "`LossScale` is abstract: use `NoOpLossScale()`, `StaticLossScale(scale)`"
            " or `DynamicLossScale(...)`."
        )

    # -- pytree protocol -------------------------------------------------------

    def _flatten_with_keys(self):
        keys = (jax.tree_util.GetAttrKey(name) for name in self._array_fields)
        return tuple(zip(keys, self._arrays, strict=True)), self._settings

    def _flatten(self):
        return self._arrays, self._settings

    @classmethod
    def _unflatten(cls, settings, arrays):
        state = object.__new__(cls)
        object.__setattr__(state, "_arrays", tuple(arrays))
        object.__setattr__(state, "_settings", settings)
        return state

    def _replace(self, **arrays) -> LossScale:
        values = list(self._arrays)
        for name, value in arrays.items():
            values[self._array_index[name]] = value
        return self._unflatten(self._settings, values)

    def _initialise(self, settings: tuple[Any, ...], arrays: tuple[Any, ...]) -> None:
        """Sets the fields of a new state: its settings and leading array leaves."""
        counters = (
            jnp.zeros([], jnp.int32),  # skipped_steps
            jnp.zeros([], jnp.int32),  # consecutive_skips
            jnp.zeros([], jnp.int32),  # forward_overflows
            jnp.zeros([], jnp.bool_),  # stuck
        )
        object.__setattr__(self, "_arrays", (*arrays, *counters))
        object.__setattr__(self, "_settings", settings)

    def __reduce__(self):
        # Pickle and deepcopy through the pytree fields: the default protocol would
        # set slots with `setattr`, which immutability forbids.
        arrays, settings = self._flatten()
        return type(self)._unflatten, (settings, arrays)

    def __setattr__(self, name, value):
        raise AttributeError(
            f"`{type(self).__name__}` is immutable; use `lossscale.update` to get"
            " the next state."
        )

    def __repr__(self) -> str:
        fields = [
            f"{name}={_format_leaf(getattr(self, name))}" for name in self._array_fields
        ]
        # A private setting (`_scale`) is shown under its public name (`scale`).
        fields += [
            f"{name.lstrip('_')}={getattr(self, name)!r}"
            for name in self._setting_fields
        ]
        return f"{type(self).__name__}({', '.join(fields)})"

    # -- the rule --------------------------------------------------------------

    @property
    def scale(self) -> jax.Array:
        raise NotImplementedError

    @property
    def _lowest_scale(self) -> float:
        """The smallest scale this state can ever have (a static bound)."""
        raise NotImplementedError

    def _updated(self, grads_finite: jax.Array, loss_finite: jax.Array) -> LossScale:
        """The next state; subclasses extend it with their own leaves."""
        applied = grads_finite & loss_finite
        backward_overflow = loss_finite & ~grads_finite
        return self._replace(
            skipped_steps=jnp.where(
                applied,
                self.skipped_steps,
                optax.safe_increment(self.skipped_steps),
            ),
            consecutive_skips=jnp.where(
                applied,
                jnp.zeros([], jnp.int32),
                optax.safe_increment(self.consecutive_skips),
            ),
            forward_overflows=jnp.where(
                loss_finite,
                self.forward_overflows,
                optax.safe_increment(self.forward_overflows),
            ),
            stuck=backward_overflow & (self.scale <= self._lowest_scale),
        )


class NoOpLossScale(LossScale):
    """A loss scale of 1 that never changes.

    Use it to keep the train step and its skip of non-finite steps while turning
    loss scaling off, e.g. when computing in bfloat16 or float32. Wherever a loss
    scale is taken, `None` means `NoOpLossScale()`.

    Examples:
      >>> import lossscale
      >>> loss_scale = lossscale.NoOpLossScale()
      >>> print(loss_scale.scale)
      1.0
    """

    __slots__ = ()

    def __init__(self):
        self._initialise((), ())

    @property
    def scale(self) -> jax.Array:
        return jnp.ones([], jnp.float32)

    @property
    def _lowest_scale(self) -> float:
        return 1.0


class StaticLossScale(LossScale):
    """A fixed loss scale.

    The scale is a static setting (not a leaf): it is compiled into the train step
    and never changes. Wherever a loss scale is taken, a number `s` means
    `StaticLossScale(s)` (TF's `FixedLossScale`).

    Unlike TF's `FixedLossScale`, which applies non-finite gradients, `lossscale.wrap`
    skips a step whose gradients are not finite with every kind of loss scale: with
    a fixed scale there is nothing to recover from an update with infinities in it.

    Args:
      scale: the loss scale, a finite number > 0 (positive and finite in float32).

    Raises:
      TypeError: if `scale` is not a real number.
      ValueError: if `scale` is not positive and finite.

    Examples:
      >>> import lossscale
      >>> loss_scale = lossscale.StaticLossScale(1024)
      >>> print(loss_scale.scale)
      1024.0
    """

    __slots__ = ()
    _setting_fields = ("_scale",)

    def __init__(self, scale: float):
        self._initialise((_positive_float32("scale", scale, "StaticLossScale"),), ())

    @property
    def scale(self) -> jax.Array:
        return jnp.asarray(self._scale, jnp.float32)

    @property
    def _lowest_scale(self) -> float:
        return self._scale


class DynamicLossScale(LossScale):
    """A loss scale that grows after finite steps and backs off on overflow.

    The rule (with `hysteresis=1` it is TF/Keras' `DynamicLossScale`):

    * finite step: `counter += 1`; when `counter` reaches `growth_interval`,
      `scale = min(scale * growth_factor, max_scale)` and `counter = 0`: the scale
      grows on the `growth_interval`-th consecutive finite step.
    * non-finite step (the update is skipped): `counter = 0`, and once `hysteresis`
      non-finite steps have happened since the last growth, every further one backs
      off, `scale = max(scale * backoff_factor, min_scale)` (Megatron-LM's
      hysteresis).
    * non-finite loss (a forward overflow, reported with `lossscale.update`'s
      `loss_finite`): the update is skipped and counted, but the scale, `counter`
      and `overflows_since_growth` stay as they are: the scale did not cause it.

    The scale stays within `[min_scale, max_scale]`: it never becomes 0, inf or NaN.
    The rule computes in float32, and float settings are kept (and shown) as the
    float32 values it uses: `backoff_factor=0.7` reads back as 0.699999988.

    Args:
      initial_scale: the first scale, within `[min_scale, max_scale]`.
      growth_interval: number of consecutive finite steps after which the scale
        grows (TF's `dynamic_growth_steps`, `increment_period`); an int >= 1.
      growth_factor: factor applied on growth; > 1.
      backoff_factor: factor applied on backing off; in (0, 1).
      min_scale: the lowest scale; > 0.
      max_scale: the highest scale; finite in float32 and >= `min_scale`.
      hysteresis: number of non-finite steps since the last growth before the scale
        backs off; an int >= 1.

    Attributes:
      scale: float32 scalar array, the current loss scale.
      counter: int32 scalar array, consecutive finite steps since the scale last
        grew or since the last non-finite step.
      overflows_since_growth: int32 scalar array, non-finite steps since the last
        growth, capped at `hysteresis`.
      skipped_steps: int32 scalar array, non-finite (skipped) steps in total.
      consecutive_skips: int32 scalar array, non-finite steps in a row.
      forward_overflows: int32 scalar array, skipped steps whose loss was not
        finite.
      stuck: bool scalar array, whether the latest step overflowed in the
        backward pass at `min_scale`.

    Raises:
      TypeError: if a setting has the wrong type.
      ValueError: if a setting is out of range.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> loss_scale = lossscale.DynamicLossScale(initial_scale=8.0,
      ...                                         growth_interval=2)
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(False))
      >>> print(loss_scale.scale)  # backed off
      4.0
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(True))
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(True))
      >>> print(loss_scale.scale)  # grew after 2 finite steps
      8.0
    """

    _array_fields = (
        "scale",
        "counter",
        "overflows_since_growth",
        *LossScale._array_fields,
    )
    _setting_fields = (
        "growth_interval",
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
        "hysteresis",
    )
    __slots__ = ()

    counter: jax.Array
    overflows_since_growth: jax.Array

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
    ):
        owner = "DynamicLossScale"
        initial_scale = _positive_float32("initial_scale", initial_scale, owner)
        min_scale = _positive_float32("min_scale", min_scale, owner)
        max_scale = _positive_float32("max_scale", max_scale, owner)
        growth_factor = _positive_float32("growth_factor", growth_factor, owner)
        backoff_factor = _positive_float32("backoff_factor", backoff_factor, owner)
        if growth_factor <= 1.0:
            raise ValueError(
                f"`{owner}`: `growth_factor` must be > 1 (in float32), got"
                f" {growth_factor!r}."
            )
        if backoff_factor >= 1.0:
            raise ValueError(
                f"`{owner}`: `backoff_factor` must be in (0, 1) (in float32), got"
                f" {backoff_factor!r}."
            )
        if min_scale > max_scale:
            raise ValueError(
                f"`{owner}`: `min_scale` ({min_scale!r}) must be <= `max_scale`"
                f" ({max_scale!r})."
            )
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"`{owner}`: `initial_scale` ({initial_scale!r}) must be within"
                f" [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]."
            )
        settings = (  # in `_setting_fields` order
            _positive_int32("growth_interval", growth_interval, owner),
            growth_factor,
            backoff_factor,
            min_scale,
            max_scale,
            _positive_int32("hysteresis", hysteresis, owner),
        )
        arrays = (  # the leading `_array_fields`
            jnp.asarray(initial_scale, jnp.float32),  # scale
            jnp.zeros([], jnp.int32),  # counter
            jnp.zeros([], jnp.int32),  # overflows_since_growth
        )
        self._initialise(settings, arrays)

    @property
    def _lowest_scale(self) -> float:
        return self.min_scale

    def _updated(self, grads_finite: jax.Array, loss_finite: jax.Array) -> LossScale:
        updated = self._backward_rule(grads_finite)
        # A forward overflow leaves the rule's leaves as they were.
        rule_leaves = ("scale", "counter", "overflows_since_growth")
        return (
            super()
            ._updated(grads_finite, loss_finite)
            ._replace(
                **{
                    name: jnp.where(
                        loss_finite, getattr(updated, name), getattr(self, name)
                    )
                    for name in rule_leaves
                }
            )
        )

    def _backward_rule(self, grads_finite: jax.Array) -> DynamicLossScale:
        counter = self.counter + 1
        grow = grads_finite & (counter >= self.growth_interval)
        overflows = jnp.where(
            grads_finite,
            jnp.where(grow, 0, self.overflows_since_growth),
            jnp.minimum(self.overflows_since_growth + 1, self.hysteresis),
        ).astype(jnp.int32)
        back_off = ~grads_finite & (overflows >= self.hysteresis)
        # Settings are Python floats: as weak-typed operands they stay float32.
        grown = jnp.minimum(self.scale * self.growth_factor, self.max_scale)
        backed_off = jnp.maximum(self.scale * self.backoff_factor, self.min_scale)
        scale = jnp.where(grow, grown, jnp.where(back_off, backed_off, self.scale))
        return self._replace(
            scale=scale.astype(jnp.float32),
            counter=jnp.where(grads_finite & ~grow, counter, 0).astype(jnp.int32),
            overflows_since_growth=overflows,
        )


LossScaleLike = LossScale | float | int | str | None
"""A loss-scale state, a number (static scale), `"dynamic"` or `None` (no-op)."""


def update(
    loss_scale: LossScale,
    grads_finite: jax.typing.ArrayLike,
    loss_finite: jax.typing.ArrayLike = True,
) -> LossScale:
    """Returns the next loss-scale state after a step.

    Usable inside `jax.jit`; branch-free. For a `DynamicLossScale` this applies
    the growth/back-off rule; every kind counts skipped steps. The step is applied
    when both `grads_finite` and `loss_finite` hold; the caller must skip it
    otherwise.

    Args:
      loss_scale: the current loss-scale state.
      grads_finite: boolean scalar, whether every gradient of the step was finite
        (see `lossscale.all_finite`).
      loss_finite: boolean scalar, whether the (unscaled) loss was finite. A
        non-finite loss is an overflow in the forward pass: lowering the scale
        cannot fix it, so the scale does not back off, and the step is counted
        in `forward_overflows`.

    Returns:
      The next loss-scale state, with the same settings and tree structure.

    Raises:
      TypeError: if `loss_scale` is not a loss-scale state or `grads_finite` or
        `loss_finite` is not boolean.
      ValueError: if `grads_finite` or `loss_finite` is not a scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> import lossscale
      >>> loss_scale = lossscale.DynamicLossScale(initial_scale=2.0**15)
      >>> loss_scale = lossscale.update(loss_scale, jnp.array(False))
      >>> print(loss_scale.scale, loss_scale.skipped_steps)
      16384.0 1
    """
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "`loss_scale` must be a loss-scale state (`NoOpLossScale`,"
            " `StaticLossScale` or `DynamicLossScale`), got"
            f" {type(loss_scale).__name__}. To read one out of an optimizer state,"
            " use `lossscale.get_loss_scale(opt_state)`."
        )
    return loss_scale._updated(
        as_predicate("grads_finite", grads_finite),
        as_predicate("loss_finite", loss_finite),
    )


def as_predicate(name: str, value: jax.typing.ArrayLike) -> jax.Array:
    """Checks that `value` is a boolean scalar and returns it as an array."""
    if isinstance(value, bool | np.bool_):
        return jnp.asarray(value, jnp.bool_)
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"`{name}` must be a boolean scalar (a bool or a `jnp.bool_` array), got"
            f" {type(value).__name__}."
        )
    if shape != ():
        raise ValueError(
            f"`{name}` must be a scalar, got shape {tuple(shape)}; reduce it first,"
            " e.g. with `lossscale.all_finite`."
        )
    if dtype != jnp.bool_:
        raise TypeError(f"`{name}` must be boolean, got dtype {dtype}.")
    return jnp.asarray(value)


def as_loss_scale(value: LossScaleLike, name: str = "loss_scale") -> LossScale:
    """Turns a loss-scale spec into a state, as TF does.

    A state is returned as is; a number gives `StaticLossScale(number)`, the
    string `"dynamic"` a default `DynamicLossScale()` and `None` a
    `NoOpLossScale()`.
    """
    if isinstance(value, LossScale):
        return value
    if value is None:
        return NoOpLossScale()
    if isinstance(value, str):
        if value == "dynamic":
            return DynamicLossScale()
        raise ValueError(
            f"`{name}` must be a loss-scale state, a number, 'dynamic' or None; got"
            f" the string {value!r} (the only string allowed is 'dynamic')."
        )
    if _is_number(value):
        return StaticLossScale(value)
    raise TypeError(
        f"`{name}` must be a loss-scale state, a number, 'dynamic' or None; got"
        f" {type(value).__name__}."
    )


def get_loss_scale(opt_state: Any) -> LossScale:
    """Returns the loss-scale state held anywhere inside an optimizer state.

    It looks through any pytree: the state of `lossscale.wrap`, and chains,
    `optax.MultiSteps`, `optax.inject_hyperparams` or other containers around it.

    Args:
      opt_state: an optimizer state (any pytree), or a loss-scale state itself.

    Returns:
      The one loss-scale state found.

    Raises:
      ValueError: if there is none, or more than one (e.g. nested wraps).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import lossscale
      >>> tx = optax.chain(optax.clip(1.0), lossscale.wrap(optax.sgd(0.1)))
      >>> opt_state = tx.init(jnp.zeros(3))
      >>> print(lossscale.get_loss_scale(opt_state).scale)
      32768.0
    """
    return _the_one(find_loss_scales(opt_state), opt_state)


def _the_one(found: list[tuple[Any, LossScale]], opt_state: Any) -> LossScale:
    if not found:
        raise ValueError(
            "No loss-scale state found in `opt_state` (a"
            f" {type(opt_state).__name__}). Build the optimizer with"
            " `lossscale.wrap(inner, loss_scale=...)`, or pass the loss-scale state"
            " itself."
        )
    if len(found) > 1:
        paths = ", ".join(jax.tree_util.keystr(path) or "<root>" for path, _ in found)
        raise ValueError(
            f"`opt_state` holds {len(found)} loss-scale states, at {paths}; which"
            " one is meant is ambiguous. Wrap the optimizer once, or pass the"
            " loss-scale state itself."
        )
    return found[0][1]


def find_loss_scales(tree: Any) -> list[tuple[Any, LossScale]]:
    """The (key path, state) pairs of every loss-scale state inside `tree`."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda node: isinstance(node, LossScale)
    )
    return [(path, leaf) for path, leaf in leaves if isinstance(leaf, LossScale)]


def resolve_loss_scale(value: Any, name: str = "loss_scale") -> LossScale:
    """A loss-scale spec (see `as_loss_scale`) or an optimizer state holding one."""
    if value is None or isinstance(value, LossScale | str) or _is_number(value):
        return as_loss_scale(value, name)
    found = find_loss_scales(value)
    if found:
        return _the_one(found, value)
    raise TypeError(
        f"`{name}` must be a loss-scale state, a number, 'dynamic', None or an"
        f" optimizer state holding a loss-scale state; got {type(value).__name__}"
        " with no loss-scale state inside."
    )


# -- validation of settings -------------------------------------------------------


def _is_number(value: Any) -> bool:
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, numbers.Real):
        return True
    # A 0-d numpy or JAX array (possibly traced) of a real dtype.
    dtype = getattr(value, "dtype", None)
    return (
        getattr(value, "shape", None) == ()
        and dtype is not None
        and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))
    )


def _concrete_float(name: str, value: Any, owner: str) -> float:
    if not _is_number(value):
        raise TypeError(
            f"`{owner}`: `{name}` must be a real number, got {value!r}"
            f" ({type(value).__name__})."
        )
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            f"`{owner}`: `{name}` must be a concrete number, got a traced value."
            " Settings are static: pass a Python number. (With"
            " `optax.inject_hyperparams`, list loss-scale settings in `static_args`.)"
        ) from None


def _positive_float32(name: str, value: Any, owner: str) -> float:
    number = _concrete_float(name, value, owner)
    # The rule computes in float32: the setting must be positive and finite there.
    rounded = float(np.float32(number)) if abs(number) <= _FLOAT32_MAX else np.inf
    if not (np.isfinite(number) and np.isfinite(rounded) and rounded > 0):
        raise ValueError(
            f"`{owner}`: `{name}` must be positive and finite in float32 (within"
            f" (0, {_FLOAT32_MAX:.4g}]), got {value!r}."
        )
    return rounded


def _positive_int32(name: str, value: Any, owner: str) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{owner}`: `{name}` must be an int, got {value!r}"
            f" ({type(value).__name__})."
        )
    if not 1 <= int(value) <= _INT32_MAX:
        raise ValueError(
            f"`{owner}`: `{name}` must be an int in [1, {_INT32_MAX}], got {value!r}."
        )
    return int(value)


def _format_leaf(value: Any) -> str:
    try:
        return repr(np.asarray(value).item())
    except Exception:  # a tracer, a shape struct or another placeholder
        return repr(value)
