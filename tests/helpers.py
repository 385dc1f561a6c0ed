"""Helpers shared by the tests.

Tree comparisons, small models and steps, XLA figures, per-device trees, the
pure-Python reference of the dynamic rule, and the runner of Markdown code blocks.
"""

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import lossscale
import lossscale.flax

# Set by conftest.py when the run is the quick loop (`-m "not slow"`).
QUICK_LOOP = False


def examples(count):
    """A hypothesis test's examples: `count` in the whole suite, half in the quick
    loop (each example compiles; the quick loop tries the first half of them)."""
    return max(count // 2, 1) if QUICK_LOOP else count


def scaled_loss_step(tx, loss_fn):
    """A jitted train step: gradients of the scaled `loss_fn(p, x, y)`, then `tx`."""

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: lossscale.scale_loss(loss_fn(p, x, y), opt_state))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


# float16's epsilon, 2**-10: one float16 rounding moves a value by at most half of it.
FLOAT16_EPS = float(np.finfo(np.float16).eps)
FLOAT32_ULPS = 4  # the roundings of one float32 update: a few ulps of the value


def assert_one_step_close(before, want, got, name=""):
    """`got` is the tree `want`, one training step after `before`, up to rounding.

    For two programs that take one step from the same state `before` but are
    compiled differently (another fusion, another CPU): where XLA keeps float16
    intermediates in float32 (excess precision) and which products it contracts
    into fused multiply-adds differ, so float16 gradients may differ by float16's
    epsilon (2**-10) of their magnitude, and what a step computes from them (an
    Adam update, a momentum, a moment, a batch statistic) by that much of the
    step's change to a leaf. The tolerance is 2**-10 of the leaf's largest change,
    plus a few float32 ulps of the value; a leaf the step did not change must
    match to those ulps, and integer leaves (step counts) exactly. A wrong step
    (a gradient off by the scale, a skip applied) is off by far more.
    """
    leaves = [jax.tree_util.tree_leaves_with_path(tree) for tree in (before, want, got)]
    for (path, start), (_, expected), (_, actual) in zip(*leaves, strict=True):
        where = f"{name}{jax.tree_util.keystr(path)}"
        start, expected, actual = (np.asarray(x) for x in (start, expected, actual))
        if not np.issubdtype(expected.dtype, np.floating):
            np.testing.assert_array_equal(actual, expected, err_msg=where)
            continue
        start, expected, actual = (
            x.astype(np.float64) for x in (start, expected, actual)
        )
        change = np.abs(expected - start).max(initial=0.0)
        ulps = FLOAT32_ULPS * np.spacing(np.abs(expected).astype(np.float32))
        tolerance = FLOAT16_EPS * change + ulps
        difference = np.abs(actual - expected)
        worst = np.unravel_index(np.argmax(difference - tolerance), expected.shape)
        assert (difference <= tolerance).all(), (
            f"{where}: {actual[worst]!r}, expected {expected[worst]!r} at {worst}:"
            f" they differ by {difference[worst]:.3g} > tolerance"
            f" {tolerance[worst]:.3g} (the leaf's largest change this step:"
            f" {change:.3g})"
        )


def bitwise_equal(a, b):
    """Like `tree_equal`, but also tells -0.0 from +0.0."""
    leaves_a, def_a = jax.tree.flatten(a)
    leaves_b, def_b = jax.tree.flatten(b)
    return def_a == def_b and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = dict(dtype=jnp.float16, param_dtype=jnp.float32)
        x = nn.relu(nn.Dense(128, **dense)(x))
        x = nn.relu(nn.Dense(128, **dense)(x))
        return nn.Dense(10, **dense)(x)


def linen_state(loss_scale="dynamic", tx=None):
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
    return lossscale.flax.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx or optax.adam(1e-3),
        loss_scale=loss_scale,
    )


def linen_step_fn(state, x, y):
    def loss_fn(params):
        return cross_entropy(state.apply_fn({"params": params}, x), y)

    loss, grads = lossscale.value_and_grad(loss_fn)(state, state.params)
    return state.apply_gradients(grads=grads), loss


linen_step = jax.jit(linen_step_fn)


def save(directory, step, state):
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                loss_scale=ocp.args.JsonSave(state.loss_scale.get_config()),
            ),
        )
        manager.wait_until_finished()


def restore(directory, step, target):
    with ocp.CheckpointManager(directory) as manager:
        saved = manager.restore(
            step, args=ocp.args.Composite(loss_scale=ocp.args.JsonRestore())
        ).loss_scale
        lossscale.checkpoints.check_config(saved, target)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        ).state


def params_tree():
    return {
        "w": jnp.asarray(np.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.float32),
        "b": jnp.asarray([0.5, -0.25, 0.125], jnp.float32),
    }


def grads_like(params, seed, scale=1.0, bad=None):
    rng = np.random.default_rng(seed)
    grads = jax.tree.map(
        lambda p: jnp.asarray(rng.standard_normal(p.shape) * scale, p.dtype), params
    )
    if bad is not None:
        grads["w"] = grads["w"].at[1, 2].set(bad)
    return grads


def hlo_instructions(hlo_text):
    """(opcode, attributes) of every instruction, metadata stripped."""
    instructions = []
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\s([a-z][a-z0-9-]*)\(", line)
        if match:
            instructions.append((match.group(1), line.split(", metadata=")[0]))
    return instructions


def _bytes_and_temp(step, *args):
    """XLA's bytes accessed and temp buffer bytes of `step`, its first two donated."""
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"], compiled.memory_analysis().temp_size_in_bytes


def compiled_costs(tx, params, grads):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return _bytes_and_temp(step, params, tx.init(params), grads)


def cond_floor_costs(params, grads, *, apply_updates=True):
    """XLA's figures of the bare skip around plain Adam: a check, then a `lax.cond`.

    What any cond-based skip costs on this XLA (`(bytes, temp)`): the floor of the
    step's own figures. jax 0.10's XLA:CPU reads the gradients once more for the
    check (1.10x Adam's bytes); jax 0.6's also copies a gradient-sized tree
    across the cond (1.41x, and as much temp).
    """
    tx = optax.adam(1e-3)

    def step(params, opt_state, grads):
        finite = lossscale.all_finite(grads)

        def applied(operands):
            params, opt_state, grads = operands
            updates, opt_state = tx.update(grads, opt_state, params)
            return (
                optax.apply_updates(params, updates) if apply_updates else updates
            ), opt_state

        def skipped(operands):
            params, opt_state, grads = operands
            zeros = jax.tree.map(jnp.zeros_like, grads)
            return (params if apply_updates else zeros), opt_state

        new, opt_state = jax.lax.cond(
            finite, applied, skipped, (params, opt_state, grads)
        )
        if apply_updates:
            return new, opt_state
        return optax.apply_updates(params, new), opt_state

    return _bytes_and_temp(step, params, tx.init(params), grads)


DEVICES = jax.devices("cpu")


def init_params(key=0):
    keys = jax.random.split(jax.random.key(key), 3)
    return {
        "w1": jax.random.normal(keys[0], (16, 32)) * 0.3,
        "w2": jax.random.normal(keys[1], (32, 8)) * 0.3,
        "b": jnp.zeros((8,)),
    }


def per_device_grads(poison_device):
    """Eight different gradient trees, one per device; one has an inf."""
    grads = jax.tree.map(
        lambda p: jnp.stack([p * (i + 1) for i in range(8)]), init_params()
    )
    grads["w1"] = grads["w1"].at[poison_device, 0, 0].set(jnp.inf)
    return grads


def stacked(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * 8), tree)


def tree_equal(a, b):
    """True when two pytrees have the same structure and bit-identical leaves."""
    leaves_a, def_a = jax.tree.flatten(a)
    leaves_b, def_b = jax.tree.flatten(b)
    if def_a != def_b:
        return False
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


class ReferenceDynamicRule:
    def __init__(
        self,
        scale=2.0**15,
        growth_interval=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=1.0,
        max_scale=2.0**24,
        hysteresis=1,
    ):
        self.scale = np.float32(scale)
        self.growth_interval = growth_interval
        self.growth_factor = np.float32(growth_factor)
        self.backoff_factor = np.float32(backoff_factor)
        self.min_scale = np.float32(min_scale)
        self.max_scale = np.float32(max_scale)
        self.hysteresis = hysteresis
        self.counter = 0
        self.overflows = 0  # since the last growth, never capped
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.forward_overflows = 0
        self.stuck = False
        self.overflow_scale = np.float32(0.0)  # the latest skip's scale

    def step(self, finite: bool, loss_finite: bool = True) -> bool:
        """Advances one step; returns whether the update is applied."""
        self.stuck = False
        if not (finite and loss_finite):
            self.overflow_scale = self.scale  # before the rule moves it
        if not loss_finite:
            # A forward overflow: skipped and counted, the scale rule untouched.
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.forward_overflows += 1
            return False
        if finite:
            self.consecutive_skips = 0
            self.counter += 1
            if self.counter == self.growth_interval:
                grown = self.scale * self.growth_factor
                self.scale = grown if grown < self.max_scale else self.max_scale
                self.counter = 0
                self.overflows = 0
            return True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.stuck = self.scale == self.min_scale
        self.counter = 0
        self.overflows += 1
        if self.overflows >= self.hysteresis:
            reduced = self.scale * self.backoff_factor
            self.scale = reduced if reduced > self.min_scale else self.min_scale
        return False


def line_of(path, marker):
    """`"path:line"` of the line of file `path` that ends with `# marker`."""
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if line.rstrip().endswith(f"# {marker}"):
                return f"{path}:{number}"
    raise AssertionError(marker)


CONTINUES = "# Continues the"


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


# The namespace a block left, while the next block continues it: the test of that
# block takes it over instead of running the blocks before it again (each of those
# ran, and had its prints checked, in its own test). Taken, not copied: the next
# block runs on it as a reader's session would.
_LEFT_FOR_NEXT = {}


def run_block(blocks, index, name):
    """Runs `blocks[index]` (after the blocks it continues); checks its prints."""
    namespace = None
    if index and blocks[index].startswith(CONTINUES):
        namespace = _LEFT_FOR_NEXT.pop((name, index - 1, blocks[index - 1]), None)
    if namespace is None:
        namespace = {"__name__": "__main__"}  # as a script would run it
        start = index
        while start > 0 and blocks[start].startswith(CONTINUES):
            start -= 1
        with contextlib.redirect_stdout(io.StringIO()):
            for earlier in range(start, index):
                exec(compile(blocks[earlier], f"{name}[{earlier}]", "exec"), namespace)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(blocks[index], f"{name}[python block {index}]", "exec"), namespace)
    expected = [
        line.split("#", 1)[1].strip()
        for line in blocks[index].splitlines()
        if line.startswith("print(") and "#" in line
    ]
    printed = output.getvalue().split("\n")
    for want, got in zip(expected, printed, strict=False):
        assert got.strip() == want, (name, index)
    if index + 1 < len(blocks) and blocks[index + 1].startswith(CONTINUES):
        _LEFT_FOR_NEXT[name, index, blocks[index]] = namespace
