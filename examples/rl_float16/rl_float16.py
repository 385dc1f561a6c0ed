"""RL fine-tuning of a byte-level language model in float16, with loss scaling.

    python examples/rl_float16/rl_float16.py             # float16 + lossscale
    python examples/rl_float16/rl_float16.py --precision bfloat16  # float32, ...
    python examples/rl_float16/rl_float16.py --quick     # a smoke run
    python examples/rl_float16/rl_float16.py --help      # every flag, its default

The byte-level transformer of `lossscale/demo_language_model.py` (Flax linen, float32
parameters) is pretrained briefly in float32 on the Python documentation
(`pydoc_data.topics`), then fine-tuned with a policy gradient on a task whose reward
a program checks: continue a prompt from the documentation with 32 bytes that contain
no letter "e" (a lipogram; reward 1, else 0). `--task lipogram-words` grades the
continuation instead, word by word (`words_reward`): it cannot be won by leaving the
words out, and its rewards keep varying within a group for longer.

As in RL frameworks, two programs compute the policy's token probabilities from the
same float32 parameters, both in the run's precision: the sampler (`sample`), an
inference engine's prefill and token-by-token decode with a key-value cache, written
here in plain JAX and compiled on its own; and the trainer, the model's
full-sequence forward (`trainer_log_probs`). Their rounding differs, so their
probabilities differ: the training-inference mismatch (`mismatch`). The objective
weights each token by the importance ratio p_trainer / p_sampler (the sampler's
log-probs held fixed), clipped as in PPO, times its group-normalised advantage
(GRPO).

Both programs read the same float32 parameters and cast each dense layer's weights
to the compute dtype where they use them (the sampler in `_dense`, Flax's `Dense`
in the trainer); both keep the layer norms, the embeddings and the output
projection in float32. A cast rounds to nearest, so this gives the same 16-bit
weights as a copy cast once per weight sync, which is what an inference engine
holds: the mismatch does not come from the weights.

The step is lossscale's recipe: `lossscale.diagnostics.preflight` once on the first
batch (a dynamic scale starts where `start_scale` says), then
`lossscale.value_and_grad` and `lossscale.apply_gradients` in a jitted step. The
example prints the preflight report (stderr), then one line per step
(`--print-every`): the step, the mean reward, the mean |log p_trainer - log p_sampler|
of the sampled bytes, the largest importance ratio p_trainer / p_sampler, the global
norm of the unscaled gradients, the loss scale and the skipped steps so far; and a
summary at the end.
`rl_fine_tuning.py` (beside it) runs it over precisions and seeds and measures what
it does not: the gradients lost to underflow. `rl_long_run.py` runs it for hundreds
of steps on a larger model, on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import re
import sys
import time
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale

# The project's byte-level language model, defined once, in the package's demos.
from lossscale import demo_language_model as language_model  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# Each run: its compute dtype (sampler and trainer) and its loss scale. Parameters,
# the optimizer state, the loss and the log-softmax stay float32 in every run.
PRECISIONS = {
    "float32": (F32, None),
    "bfloat16": (BF16, None),
    "float16 + lossscale": (F16, "dynamic"),
    "float16, no loss scaling": (F16, None),
}
# Every program here (sampler, trainer, train step) rounds each operation's result
# to its dtype, as written. By default XLA may keep a fused chain of 16-bit
# operations in float32 ("excess precision"), and where it does depends on the
# fusion: on the CPU it did so for bfloat16 (not float16) in some shapes and not
# others, which moved the measured bfloat16 mismatch by 10-500x between programs.
# What is measured here is the formats, not those choices.
STRICT_ROUNDING = {"xla_allow_excess_precision": False}

# The names the command lines take.
SHORT_NAMES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16 + lossscale",
    "float16-unscaled": "float16, no loss scaling",
}
FORBIDDEN = b"eE"  # the lipogram's bytes
# The tasks (`--task`): what the reward of a continuation is.
TASKS = {
    "lipogram": "1 for 32 bytes without the letter e, else 0",
    "lipogram-words": "+1 for each distinct documentation word without an e, -1/2"
    " for each word with one (complete words only)",
}


def _matmul_precision(precision: str | None):
    """`jax.default_matmul_precision(precision)` while tracing; None: JAX's default.

    Inside a jitted function it sets the precision of that program's dots only: the
    eager operations around it keep their compiled forms (the precision is part of
    every jit's cache key, so a context around a whole loop compiles them again).
    """
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(precision)


def new_loss_scale(spec: str | None) -> lossscale.LossScale:
    """The loss-scale state a run starts from: dynamic, or none (a no-op)."""
    if spec == "dynamic":
        return lossscale.DynamicLossScale()
    return lossscale.NoOpLossScale()


# The sampler: an inference engine's code path, from the trainer's parameter dict.


def _layer_norm(x: jax.Array, layer: dict[str, jax.Array]) -> jax.Array:
    # float32, as the trainer's, but with the two-pass variance where Flax's is
    # one-pass: an inference engine's kernels are its own, not the trainer's.
    x = x.astype(F32)
    mean = x.mean(-1, keepdims=True)
    variance = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-6) * layer["scale"] + layer["bias"]


def _dense(x: jax.Array, layer: dict[str, jax.Array], compute) -> jax.Array:
    kernel, bias = layer["kernel"].astype(compute), layer["bias"].astype(compute)
    return x.astype(compute) @ kernel + bias


def _decoder(
    params: dict[str, Any],
    tokens: jax.Array,
    start: jax.Array | int,
    cache: jax.Array,
    *,
    compute,
    heads: int,
    attention: str,
) -> tuple[jax.Array, jax.Array]:
    """Logits of `tokens` at positions `start`, `start + 1`, ..., and the new cache.

    `cache` holds every layer's keys and values, `(layers, 2, batch, capacity,
    heads, head width)` in the compute dtype; this call writes its tokens' keys
    and values at their positions, and each token attends to the cached ones up to
    its own position: a prefill for a prompt, a decode step for one token.
    """
    batch, count = tokens.shape
    width = params["position"].shape[1]
    capacity = cache.shape[3]
    positions = start + jnp.arange(count)
    position = jax.lax.dynamic_slice_in_dim(params["position"], start, count)
    x = (params["Embed_0"]["embedding"][tokens] + position).astype(compute)
    visible = jnp.arange(capacity)[None, :] <= positions[:, None]  # (query, key)
    shape = (batch, count, heads, width // heads)
    for index in range(cache.shape[0]):
        block = params[f"Block_{index}"]
        h = _layer_norm(x, block["LayerNorm_0"]).astype(compute)
        qkv = block["Dense_0"]
        q, k, v = (
            _dense(h, {"kernel": kernel, "bias": bias}, compute).reshape(shape)
            for kernel, bias in zip(
                jnp.split(qkv["kernel"], 3, axis=1),
                jnp.split(qkv["bias"], 3),
                strict=True,
            )
        )
        keys = jax.lax.dynamic_update_slice_in_dim(cache[index, 0], k, start, 1)
        values = jax.lax.dynamic_update_slice_in_dim(cache[index, 1], v, start, 1)
        cache = cache.at[index].set(jnp.stack([keys, values]))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys) / np.sqrt(shape[-1])
        scores = jnp.where(visible, scores.astype(F32), -jnp.inf)
        if attention == "kernel":
            # An attention kernel's form (FlashAttention's): the weights, not yet
            # normalised, rounded to the compute dtype for the product with the
            # values, then divided by their float32 sum. The trainer normalises
            # first and rounds the probabilities: the two round other numbers.
            weights = jnp.exp(scores - scores.max(-1, keepdims=True))
            total = weights.sum(-1).transpose(0, 2, 1)[..., None]  # (b, q, h, 1)
            weights = weights.astype(compute)
            attended = jnp.einsum("bhqk,bkhd->bqhd", weights, values)
            attended = (attended.astype(F32) / total).astype(compute)
        else:  # "softmax": the trainer's form
            weights = jax.nn.softmax(scores, axis=-1).astype(compute)
            attended = jnp.einsum("bhqk,bkhd->bqhd", weights, values)
        x = x + _dense(attended.reshape(batch, count, width), block["Dense_1"], compute)
        h = _layer_norm(x, block["LayerNorm_1"]).astype(compute)
        # Flax names the layers in the order they are built: the outer one first.
        up = jax.nn.gelu(_dense(h, block["Dense_3"], compute), approximate=True)
        x = x + _dense(up, block["Dense_2"], compute)
    h = _layer_norm(x, params["LayerNorm_0"]).astype(compute).astype(F32)
    return h @ params["Embed_0"]["embedding"].T, cache


def sample(
    params: dict[str, Any],
    prompts: jax.Array,
    key: jax.Array,
    *,
    new_tokens: int,
    compute,
    heads: int = 4,
    attention: str = "kernel",
    matmul_precision: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples continuations token by token, as an inference engine does.

    A prefill of the prompts, then one decode step per new token against a
    key-value cache, computing in `compute` from the float32 parameters of
    `language_model.ByteLM`; tokens are drawn at temperature 1. The attention
    is computed as an inference kernel does (`attention="kernel"`), or as the
    trainer's forward does (`"softmax"`, for comparison).

    Args:
      params: the model's parameters (`ByteLM`'s dict, float32).
      prompts: `(batch, prompt length)` int32 bytes.
      key: a JAX random key.
      new_tokens: how many bytes to generate.
      compute: the compute dtype (float32, bfloat16 or float16).
      heads: the model's attention heads.
      attention: "kernel" or "softmax".
      matmul_precision: the dots' precision, as `jax.default_matmul_precision`
        takes it ("highest": float32 dots in float32 on a GPU, not TF32); None:
        JAX's default.

    Returns:
      `(generated, log_probs)`: the `(batch, new_tokens)` int32 bytes, and the
      sampler's float32 log-probabilities of every byte at each generated
      position, `(batch, new_tokens, 256)`.
    """
    # All by position: jit caches on the keywords as spelled, so a call that spelled
    # out a default would compile the sampler a second time.
    return _sample(
        params, prompts, key, new_tokens, compute, heads, attention, matmul_precision
    )


@functools.partial(
    jax.jit, static_argnums=(3, 4, 5, 6, 7), compiler_options=STRICT_ROUNDING
)
def _sample(params, prompts, key, new_tokens, compute, heads, attention, precision):
    with _matmul_precision(precision):
        return _sample_body(params, prompts, key, new_tokens, compute, heads, attention)


def _sample_body(params, prompts, key, new_tokens, compute, heads, attention):
    batch, prompt_length = prompts.shape
    layers = sum(name.startswith("Block_") for name in params)
    width = params["position"].shape[1]
    capacity = prompt_length + new_tokens
    cache = jnp.zeros((layers, 2, batch, capacity, heads, width // heads), compute)
    decode = functools.partial(
        _decoder, params, compute=compute, heads=heads, attention=attention
    )
    logits, cache = decode(prompts, 0, cache)

    def step(carry, key):
        log_probs, cache, position = carry
        token = jax.random.categorical(key, log_probs)
        # The last step's forward is not needed; one scan body keeps it simple.
        logits, cache = decode(token[:, None], position, cache)
        carry = (jax.nn.log_softmax(logits[:, 0]), cache, position + 1)
        return carry, (token, log_probs)

    first = jax.nn.log_softmax(logits[:, -1])
    keys = jax.random.split(key, new_tokens)
    _, (generated, log_probs) = jax.lax.scan(step, (first, cache, prompt_length), keys)
    return generated.T.astype(jnp.int32), log_probs.transpose(1, 0, 2)


# The trainer: the model's own full-sequence forward.


def trainer_log_probs(model, params, tokens: jax.Array, prompt_length: int):
    """The trainer's float32 log-probabilities at each generated position.

    Args:
      model: a `language_model.ByteLM` computing in the run's dtype.
      params: its parameters.
      tokens: `(batch, prompt length + new tokens)`, prompts and continuations.
      prompt_length: where the continuations start.

    Returns:
      `(batch, new tokens, 256)` float32 log-probabilities, as `sample`'s.
    """
    # Every position in, the last one's logits dropped: the model is causal, so
    # this is the forward of `tokens[:, :-1]`. But 16 + 32 positions tile where
    # 47 do not: XLA:GPU's GEMM emitter (jaxlib 0.10.2, compiled for an H100)
    # failed on 64 x 47 rows, "Couldn't find output tile sizes".
    logits = model.apply({"params": params}, tokens)[:, prompt_length - 1 : -1]
    return jax.nn.log_softmax(logits.astype(F32))


def mismatch(sampler_log_probs, trainer_log_probs, generated) -> dict[str, jax.Array]:
    """How far the sampler's probabilities are from the trainer's, on its samples.

    With `d = log p_trainer(token) - log p_sampler(token)` at each generated
    token (the log importance ratio):

    * `abs_log_prob_diff`: the mean of `|d|` over the generated tokens;
    * `kl_per_token` and `kl_per_sequence`: KL(sampler's next-byte distribution ||
      trainer's) at each generated position, averaged over the positions, and
      summed over a sequence's positions then averaged over the sequences;
    * `max_ratio` and `min_ratio`: the largest and smallest p_trainer / p_sampler
      over the tokens; `max_abs_log_ratio` the largest `|d|`;
    * `abs_sequence_log_ratio`: the mean over sequences of `|sum of d|`, the log
      of a sequence-level importance ratio.

    The KL is computed as the sum over bytes of `p (e + expm1(-e))`, with `e = log
    p_sampler - log p_trainer`: the same value as `sum p e` for two normalised
    distributions, but a sum of non-negative terms, free of the cancellation that
    makes `sum p e` in float32 noise at float16's mismatch (about 1e-8).

    Args:
      sampler_log_probs: `(batch, new tokens, 256)` float32, from `sample`.
      trainer_log_probs: the same, from `trainer_log_probs`.
      generated: `(batch, new tokens)` the sampled bytes.

    Returns:
      A dict of float32 scalars.
    """
    sampler_log_probs = sampler_log_probs.astype(F32)
    trainer_log_probs = trainer_log_probs.astype(F32)
    pick = functools.partial(_take, generated)
    d = pick(trainer_log_probs) - pick(sampler_log_probs)
    e = sampler_log_probs - trainer_log_probs
    kl = jnp.sum(jnp.exp(sampler_log_probs) * (e + jnp.expm1(-e)), axis=-1)
    return {
        "abs_log_prob_diff": jnp.abs(d).mean(),
        "kl_per_token": kl.mean(),
        "kl_per_sequence": kl.sum(-1).mean(),
        "max_ratio": jnp.exp(d.max()),
        "min_ratio": jnp.exp(d.min()),
        "max_abs_log_ratio": jnp.abs(d).max(),
        "abs_sequence_log_ratio": jnp.abs(d.sum(-1)).mean(),
    }


def _take(tokens, log_probs):
    return jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]


# The task and the objective.


def reward(generated: jax.Array) -> jax.Array:
    """1.0 for a continuation without the letter "e" (either case), else 0.0."""
    hit = jnp.zeros(generated.shape, bool)
    for byte in FORBIDDEN:
        hit = hit | (generated == byte)
    return 1.0 - hit.any(-1).astype(F32)


# `--task lipogram-words`. The binary lipogram above is won by a continuation of
# spaces (the first GPU run's policies found it within 50 steps, after which every
# group's rewards were equal and nothing trained); this one scores words.
WORDS_MIN_COUNT = 10  # uses in the documentation for a word to count
HASH_MULTIPLIER = 16777619  # odd: a word's hash, its bytes' polynomial mod 2**32


def word_hash(word: bytes) -> int:
    """A word's hash as `words_reward` computes it, from its lower-case bytes.

    `h * 16777619 + byte` over the bytes, from 0, modulo 2**32.
    """
    h = 0
    for byte in word.lower():
        h = (h * HASH_MULTIPLIER + byte) & 0xFFFFFFFF
    return h


@functools.cache
def vocabulary() -> np.ndarray:
    """The hashes of the words `words_reward` pays for, sorted, `uint32`.

    The words (runs of ASCII letters, lower-cased) of the training text
    (`language_model.corpus()`'s first part) with at least 2 letters, no "e" and
    at least `WORDS_MIN_COUNT` uses: 271 words, "is", "of", "in", ..., "python".
    """
    data, _ = language_model.corpus()
    counts = collections.Counter(
        word.lower() for word in re.findall(rb"[A-Za-z]+", data.tobytes())
    )
    words = {
        word
        for word, count in counts.items()
        if count >= WORDS_MIN_COUNT and len(word) >= 2 and b"e" not in word
    }
    return np.array(sorted({word_hash(word) for word in words}), np.uint32)


def words_reward(tokens: jax.Array, prompt_length: int) -> jax.Array:
    """`--task lipogram-words`: the continuations' words, scored.

    A word is a run of ASCII letters that the continuation holds whole: the byte
    before it (the prompt's last byte for the first) and the byte after it are not
    letters, so a word cut by the prompt or by the end counts for nothing. Each
    word with an "e" (either case) scores -1/2; each word without one, of at least
    2 letters, that the documentation uses at least `WORDS_MIN_COUNT` times
    (`vocabulary`), scores +1 the first time it appears (lower-cased) and 0 after.
    The reward is the sum: spaces score 0, the documentation's own text about 0.6
    on average (32-byte windows of it, from -3 to 7), and it rises with more and
    shorter distinct words without an e.

    Args:
      tokens: `(batch, prompt length + new tokens)` int32, prompts and
        continuations.
      prompt_length: where the continuations start (at least 1).

    Returns:
      `(batch,)` float32 rewards.
    """
    return _words_reward(tokens, vocabulary(), prompt_length)


@functools.partial(jax.jit, static_argnums=2)
def _words_reward(tokens, words, prompt_length):
    window = tokens[:, prompt_length - 1 :].astype(jnp.uint32)  # one prompt byte
    upper = (window >= ord("A")) & (window <= ord("Z"))
    letter = upper | ((window >= ord("a")) & (window <= ord("z")))
    lower = jnp.where(upper, window + 32, window)
    count = window.shape[1]
    index = jnp.arange(count)
    # The hash of the word so far at each byte: h -> h * multiplier + byte at a
    # letter, h -> 0 after any other byte. Affine maps compose, so an associative
    # scan gives them all without a loop of `count` steps.
    scale = jnp.where(letter, jnp.uint32(HASH_MULTIPLIER), jnp.uint32(0))
    shift = jnp.where(letter, lower, jnp.uint32(0))
    _, h = jax.lax.associative_scan(
        lambda f, g: (g[0] * f[0], g[0] * f[1] + g[1]), (scale, shift), axis=1
    )
    gap = jax.lax.cummax(jnp.where(letter, -1, index), axis=1)  # last non-letter
    length = index - gap  # letters in the word so far
    es = jnp.cumsum(letter & (lower == ord("e")), axis=1)
    before = jnp.where(gap >= 0, jnp.take_along_axis(es, gap.clip(0), axis=1), 0)
    has_e = es > before
    # A word ends at j if the next byte is no letter (the last byte: cut off), and
    # starts after the window's first byte (the prompt's) if length <= j.
    ends = letter & jnp.pad(~letter[:, 1:], ((0, 0), (0, 1)))
    whole = ends & (length <= index)
    known = (h[:, :, None] == words).any(-1) & (length >= 2) & ~has_e & whole
    # Repeats: the same known word at an earlier end.
    earlier = index[None, :] < index[:, None]  # (j, i)
    repeat = ((h[:, :, None] == h[:, None, :]) & known[:, None, :] & earlier).any(-1)
    score = (known & ~repeat).sum(-1) - 0.5 * (whole & has_e).sum(-1)
    return score.astype(F32)


def task_reward(task: str, tokens: jax.Array, prompt_length: int) -> jax.Array:
    """The reward of `TASKS[task]` for each continuation of `tokens`."""
    if task == "lipogram":
        return reward(tokens[:, prompt_length:])
    if task == "lipogram-words":
        return words_reward(tokens, prompt_length)
    raise ValueError(f"task={task!r} is not a task here; use one of {sorted(TASKS)}")


def group_advantages(rewards: jax.Array, group: int) -> jax.Array:
    """GRPO's advantages: each reward against its prompt's group of `group`.

    `(r - mean) / (std + 1e-4)` within each group of consecutive samples; a group
    whose rewards are all equal has advantages of 0 and teaches nothing.
    """
    grouped = rewards.reshape(-1, group)
    mean = grouped.mean(-1, keepdims=True)
    std = grouped.std(-1, keepdims=True)
    return ((grouped - mean) / (std + 1e-4)).reshape(-1)


def rl_loss(
    params,
    tokens,
    sampler_log_probs,
    advantages,
    *,
    model,
    prompt_length: int,
    clip: float = 0.2,
    tokens_averaged: int | None = None,
):
    """The clipped policy-gradient loss, with the sampler's log-probs in it.

    Per generated token, ratio = exp(log p_trainer - stop_gradient(log
    p_sampler)) and the objective min(ratio * A, clip(ratio, 1 - clip, 1 + clip) *
    A), A the sequence's group-normalised advantage; the loss is minus its mean
    over the tokens. With one update per batch the ratio is 1 up to the mismatch.

    Args:
      params: the policy's float32 parameters.
      tokens: `(batch, prompt length + new tokens)` int32.
      sampler_log_probs: `(batch, new tokens, 256)` float32, from `sample`.
      advantages: `(batch,)` float32.
      model: a `ByteLM` computing in the run's dtype.
      prompt_length: where the continuations start.
      clip: PPO's clipping range.
      tokens_averaged: the number of tokens the mean divides by, if not this
        batch's (a micro-batch of a larger batch is divided by that batch's
        count); for the underflow sweep.

    Returns:
      `(loss, mismatch)`: the float32 loss, and `mismatch`'s dict for this batch.
    """
    generated = tokens[:, prompt_length:]
    trainer = trainer_log_probs(model, params, tokens, prompt_length)
    sampler = jax.lax.stop_gradient(sampler_log_probs)
    ratio = jnp.exp(_take(generated, trainer) - _take(generated, sampler))
    advantage = advantages[:, None]
    objective = jnp.minimum(
        ratio * advantage, jnp.clip(ratio, 1 - clip, 1 + clip) * advantage
    )
    count = objective.size if tokens_averaged is None else tokens_averaged
    return -objective.sum() / count, mismatch(sampler, trainer, generated)


class Program(NamedTuple):
    """What one precision's run compiles once: the model, optimizer, loss, step."""

    model: Any
    tx: optax.GradientTransformation
    loss_fn: Any
    train_step: Any


@functools.cache
def program(
    compute,
    learning_rate: float,
    prompt_length: int,
    width: int,
    layers,
    heads=4,
    matmul_precision: str | None = None,
):
    """The trainer's model, Adam, the loss and the jitted step, for `compute`.

    Cached, so that runs of several seeds in one process compile the step once.
    The step returns the new `(params, opt_state, loss_scale)`, the loss, the
    mismatch dict and the global norm of the unscaled gradients (the norm the
    clip sees; not finite on a skipped step). Its dots run at `matmul_precision`
    (as `sample`'s).
    """
    model = language_model.ByteLM(
        width=width, layers=layers, heads=heads, compute=compute
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))
    loss_fn = functools.partial(rl_loss, model=model, prompt_length=prompt_length)

    @functools.partial(jax.jit, compiler_options=STRICT_ROUNDING)
    def train_step(params, opt_state, loss_scale, tokens, sampler_lp, advantages):
        with _matmul_precision(matmul_precision):
            (loss, aux), grads = lossscale.value_and_grad(loss_fn, has_aux=True)(
                loss_scale, params, tokens, sampler_lp, advantages
            )
            unscaled = jax.tree.leaves(lossscale.unscale_grads(grads, loss_scale))
            grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in unscaled))
            params, opt_state, loss_scale = lossscale.apply_gradients(
                tx,
                grads=grads,  # of the scaled loss
                params=params,
                opt_state=opt_state,
                loss_scale=loss_scale,
                value=loss,  # a non-finite loss is skipped without backing off
            )
        return params, opt_state, loss_scale, loss, aux, grad_norm

    return Program(model, tx, loss_fn, train_step)


def prompt_stream(data: np.ndarray, prompts: int, length: int, seed: int) -> Iterator:
    """Endless batches of `prompts` random windows of `length` bytes of `data`."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - length, prompts)
        yield jnp.asarray(np.stack([data[s : s + length] for s in starts]), jnp.int32)


def pretrain(
    steps: int,
    seed: int = 0,
    batch: int = 64,
    evals: int = 4,
    *,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
):
    """`lossscale/demo_language_model.py`'s float32 training: (params, held-out loss).

    `steps` of Adam on `batch` windows of 128 bytes, for a model of `layers`
    blocks of `width` with `heads` attention heads; the held-out loss (nats per
    byte) is the mean over `evals` batches of 64.
    """
    data, held_out = language_model.corpus()
    args = argparse.Namespace(
        steps=steps,
        batch=batch,
        context=128,
        learning_rate=3e-3,
        eval_batches=evals,
        float16_norms=False,
        width=width,
        layers=layers,
        heads=heads,
    )
    run = language_model.train("float32", args, data, held_out, seed)
    return run["params"], run["held_out_loss"]


def rollout(
    params,
    prompts,
    key,
    *,
    compute,
    group: int,
    new_tokens: int,
    heads: int = 4,
    task: str = "lipogram",
    matmul_precision: str | None = None,
):
    """One on-policy batch: `group` samples per prompt from the sampler.

    The rewards are `task`'s (a key of `TASKS`); `matmul_precision` is the
    sampler's (`sample`).

    Returns:
      `(tokens, sampler_log_probs, advantages, rewards)`: prompts and
      continuations, the sampler's log-probabilities, the group-normalised
      advantages and the rewards.
    """
    prompts = jnp.repeat(prompts, group, axis=0)
    generated, sampler_lp = sample(
        params,
        prompts,
        key,
        new_tokens=new_tokens,
        compute=compute,
        heads=heads,
        matmul_precision=matmul_precision,
    )
    tokens = jnp.concatenate([prompts, generated], axis=1)
    rewards = task_reward(task, tokens, prompts.shape[1])
    return tokens, sampler_lp, group_advantages(rewards, group), rewards


def shape_of(params) -> tuple[int, int]:
    """The width and the number of blocks of a `ByteLM`'s parameters."""
    layers = sum(name.startswith("Block_") for name in params)
    return params["position"].shape[1], layers


def start_scale(loss_scale: lossscale.LossScale, report) -> lossscale.LossScale:
    """Where a dynamic scale starts, from `preflight`'s report on the first batch.

    At lossscale's default (2**15), unless `report.scale` is lower, or
    `preflight` finds gradients lost to underflow at 2**15: then at
    `report.scale`. A start above the first overflow backs off one skipped step
    at a time, and in RL a skipped step is a rollout batch thrown away; a start
    higher than the default where nothing underflows gains nothing. Any other
    loss scale is returned as it is.
    """
    if not isinstance(loss_scale, lossscale.DynamicLossScale) or report.scale is None:
        return loss_scale
    if report.scale < float(loss_scale.scale) or "gradient-underflow" in report.codes:
        return lossscale.DynamicLossScale(scale=report.scale)
    return loss_scale


PROGRESS_HEADER = (
    f"{'step':>5} {'reward':>6} {'|dlogp|':>9} {'max ratio':>9} {'grad norm':>9}"
    f" {'scale':>7} {'skipped':>7}"
)


def progress_line(step: int, record: dict) -> str:
    """One step's line under `PROGRESS_HEADER`, from host values."""
    mismatch = record["mismatch"]
    return (
        f"{step:5d} {record['reward']:6.3f} {mismatch['abs_log_prob_diff']:9.2e}"
        f" {mismatch['max_ratio']:9.5f} {record['grad_norm']:9.3g}"
        f" {record['scale']:7g} {record['skipped']:7d}"
    )


def fine_tune(
    params,
    precision: str,
    *,
    steps: int,
    seed: int,
    prompts: int = 8,
    group: int = 8,
    prompt_length: int = 16,
    new_tokens: int = 32,
    learning_rate: float = 1e-4,
    heads: int = 4,
    run_preflight: bool = True,
    on_step=None,
    print_every: int = 0,
    task: str = "lipogram",
    matmul_precision: str | None = None,
):
    """RL fine-tuning from `params` in one precision; the per-step record.

    Args:
      params: the pretrained float32 parameters (kept float32: master weights).
      precision: a key of `PRECISIONS`.
      steps: RL steps (one sampled batch and one update each).
      seed: prompts and sampling.
      prompts: prompts per step.
      group: samples per prompt.
      prompt_length: bytes of each prompt.
      new_tokens: bytes sampled per continuation.
      learning_rate: Adam's.
      heads: the model's attention heads (its parameters do not say).
      run_preflight: run `lossscale.diagnostics.preflight` on the first batch (and
        print it); a dynamic scale then starts where `start_scale` says.
      on_step: called as `on_step(step, params, batch, loss_scale)` before each
        update, `batch` as `rollout` returns it (the benchmark measures the
        gradients lost to underflow there). If it returns True, the run ends
        there, before that step's update, and the record holds the steps done.
      print_every: print a line under `PROGRESS_HEADER` every this many steps
        and at the last (0: none). Each line waits for the device; the rollout
        that follows waits for the update anyway.
      task: the reward, a key of `TASKS`.
      matmul_precision: the sampler's and the trainer's dots' precision, as
        `jax.default_matmul_precision` takes it; None: JAX's default (on a GPU,
        float32 dots in TF32).

    Returns:
      A dict: the final `params`, the `preflight` report (or None), and per step
      the mean `reward`, the `loss`, the `mismatch` dict, the loss `scale`, the
      `skipped` steps so far and the unscaled gradients' global norm
      (`grad_norm`).
    """
    if task not in TASKS:
        raise ValueError(
            f"task={task!r} is not a task here; use one of {sorted(TASKS)}"
        )
    compute, scale_spec = PRECISIONS[precision]
    run = program(
        compute,
        learning_rate,
        prompt_length,
        *shape_of(params),
        heads,
        matmul_precision,
    )
    opt_state, loss_scale = run.tx.init(params), new_loss_scale(scale_spec)
    data, _ = language_model.corpus()
    stream = prompt_stream(data, prompts, prompt_length, seed)
    draw = functools.partial(
        rollout,
        compute=compute,
        group=group,
        new_tokens=new_tokens,
        heads=heads,
        task=task,
        matmul_precision=matmul_precision,
    )
    keys = jax.random.split(jax.random.key(seed), steps)
    batch = draw(params, next(stream), keys[0])
    report = None
    if run_preflight:
        # Once, before training, on a real batch: what in this program would fail
        # in float16, and where a dynamic scale should start.
        with _matmul_precision(matmul_precision):
            report = lossscale.diagnostics.preflight(
                run.loss_fn,
                params,
                *batch[:3],
                optimizer=run.tx,
                loss_scale=loss_scale,
                has_aux=True,
            )
        print(f"== preflight, {precision}\n{report}", file=sys.stderr)
        loss_scale = start_scale(loss_scale, report)
    names = ("reward", "loss", "mismatch", "scale", "skipped", "grad_norm")
    history = {name: [] for name in names}
    if print_every:
        print(PROGRESS_HEADER, flush=True)
    for step in range(steps):
        if step:
            batch = draw(params, next(stream), keys[step])
        tokens, sampler_lp, advantages, rewards = batch
        if on_step is not None and on_step(step, params, batch, loss_scale):
            break
        params, opt_state, loss_scale, loss, aux, grad_norm = run.train_step(
            params, opt_state, loss_scale, tokens, sampler_lp, advantages
        )
        metrics = lossscale.metrics(loss_scale)
        record = {
            "reward": rewards.mean(),
            "loss": loss,
            "mismatch": aux,
            "scale": metrics["loss_scale"],
            "skipped": metrics["skipped_steps"],
            "grad_norm": grad_norm,
        }
        for name, value in record.items():
            history[name].append(value)
        if print_every and (step % print_every == 0 or step == steps - 1):
            host = jax.tree.map(lambda x: x.item(), jax.device_get(record))
            print(progress_line(step, host), flush=True)
    # Without printing, one transfer at the end: the loop never waits for the
    # device.
    history = jax.tree.map(lambda x: x.item(), jax.device_get(history))
    return {"params": params, "preflight": report, **history}


def main(argv=None):
    """Pretrains, runs `preflight`, fine-tunes in one precision, prints each step."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--precision",
        default="float16",
        choices=SHORT_NAMES,
        help="the sampler's and the trainer's compute dtype; float16 is float16"
        " with a dynamic loss scale, float16-unscaled without",
    )
    parser.add_argument(
        "--task",
        default="lipogram",
        choices=TASKS,
        help="the reward: "
        + "; ".join(f"{name}: {text}" for name, text in TASKS.items()),
    )
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=200,
        help="float32 pretraining steps (64 windows of 128 bytes each)",
    )
    parser.add_argument(
        "--steps", type=int, default=60, help="RL steps: one rollout and one update"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the RL run's prompts and sampling (the pretraining's seed is 0)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument(
        "--group", type=int, default=8, help="samples per prompt (GRPO's group)"
    )
    parser.add_argument(
        "--learning-rate", type=float, default=1e-4, help="the RL step's Adam"
    )
    parser.add_argument("--width", type=int, default=64, help="the model's width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument(
        "--print-every",
        type=int,
        default=1,
        help="a progress line every this many steps (0: only the summary)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: --pretrain-steps 40 --steps 10",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.pretrain_steps, args.steps = 40, 10
    precision = SHORT_NAMES[args.precision]
    start = time.perf_counter()
    params, held_out = pretrain(
        args.pretrain_steps,
        seed=0,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
    )
    print(f"pretrained: held-out loss {held_out:.3f} nats/byte", file=sys.stderr)
    run = fine_tune(
        params,
        precision,
        steps=args.steps,
        seed=args.seed,
        prompts=args.prompts,
        group=args.group,
        learning_rate=args.learning_rate,
        heads=args.heads,
        print_every=args.print_every,
        task=args.task,
    )
    window = max(1, args.steps // 10)
    print(
        f"{precision}: reward {np.mean(run['reward'][:window]):.3f} ->"
        f" {np.mean(run['reward'][-window:]):.3f} (first and last {window} steps),"
        f" {run['skipped'][-1]} skipped, final scale {run['scale'][-1]:g}"
        f" ({time.perf_counter() - start:.0f} s)"
    )
    return run


if __name__ == "__main__":
    main()
