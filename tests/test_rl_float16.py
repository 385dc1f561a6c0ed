"""RL fine-tuning in float16 (`examples/rl_float16/rl_float16.py`): parts, a short run.

The quick tests check the parts against independent references: the KV-cached
sampler against the trainer's forward in float32, the mismatch's KL against a
float64 sum, the reward and the advantages. The slow test is a short version of
`examples/rl_float16/rl_fine_tuning.py`: a brief pretraining, the mismatch at one
length, and a short float16 run with lossscale that must learn.
"""

import collections
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "rl_float16"))
import rl_float16 as rl  # noqa: E402


def random_params(model, seed=0):
    """Every parameter random, biases and norms included (Flax starts them at 0
    and 1, where a sampler that mishandled them would still agree)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), int))
    leaves, treedef = jax.tree.flatten(shapes["params"])
    rng = np.random.default_rng(seed)
    values = [0.3 * rng.normal(size=leaf.shape).astype(np.float32) for leaf in leaves]
    return jax.tree.unflatten(treedef, [jnp.asarray(v) for v in values])


def test_the_kv_cached_sampler_computes_the_trainers_probabilities_in_float32():
    model = rl.language_model.ByteLM(width=32, layers=2)
    params = random_params(model)
    prompts = jax.random.randint(jax.random.key(1), (4, 8), 0, 256)
    generated, sampler = rl.sample(
        params, prompts, jax.random.key(2), new_tokens=12, compute=jnp.float32
    )
    tokens = jnp.concatenate([prompts, generated], axis=1)
    # Jitted: eager, Flax's apply dispatches op by op, several times slower.
    trainer = jax.jit(rl.trainer_log_probs, static_argnums=(0, 3))(
        model, params, tokens, 8
    )
    assert sampler.shape == trainer.shape == (4, 12, 256)
    # Two code paths, one function: float32 rounding apart (log-probs near -6,
    # whose float32 spacing is 5e-7), where a wrong cache, mask or position would
    # be off by far more than 1e-4.
    difference = float(jnp.abs(sampler - trainer).max())
    assert difference < 1e-4, difference
    # The sampled bytes are the sampler's: each has a finite log-probability.
    assert np.isfinite(np.asarray(rl._take(generated, sampler))).all()


def test_the_mismatch_figures_match_a_float64_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 256)) * 3
    # Two distributions 1e-4 apart in log space, as float16 sampler and trainer.
    moved = logits + 1e-4 * rng.normal(size=logits.shape)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    sampler, trainer = log_softmax(logits), log_softmax(moved)
    generated = rng.integers(0, 256, size=(3, 5))
    got = rl.mismatch(
        jnp.asarray(sampler, jnp.float32), jnp.asarray(trainer, jnp.float32), generated
    )
    pick = np.take_along_axis
    d = (
        pick(trainer, generated[..., None], -1)
        - pick(sampler, generated[..., None], -1)
    )[..., 0]
    kl = (np.exp(sampler) * (sampler - trainer)).sum(-1)  # float64: no cancellation
    want = {
        "abs_log_prob_diff": np.abs(d).mean(),
        "kl_per_token": kl.mean(),
        "kl_per_sequence": kl.sum(-1).mean(),
        "max_ratio": np.exp(d.max()),
        "min_ratio": np.exp(d.min()),
        "abs_sequence_log_ratio": np.abs(d.sum(-1)).mean(),
    }
    for name, value in want.items():
        # float32 inputs: log-probs near -6 carry 5e-7 of rounding, 0.5% of d;
        # the KL (about 5e-9) comes out to 1%, where `sum p e` in float32 is noise.
        assert float(got[name]) == pytest.approx(value, rel=1e-2), (name, got, want)


def test_the_reward_is_one_exactly_without_the_letter_e():
    texts = [
        b"a lipogram, without it",
        b"a word with an e in it",
        b"a capital at the End!!",
    ]
    generated = jnp.asarray([list(t) for t in texts], jnp.int32)
    np.testing.assert_array_equal(rl.reward(generated), [1.0, 0.0, 0.0])


def words_reference(tokens, prompt_length):
    """`words_reward` in pure Python: regular expressions over the bytes."""
    data, _ = rl.language_model.corpus()
    counts = collections.Counter(
        w.lower() for w in re.findall(rb"[A-Za-z]+", data.tobytes())
    )
    known = {w for w, n in counts.items() if n >= 10 and len(w) >= 2 and b"e" not in w}
    rewards = []
    for row in np.asarray(tokens, np.uint8):
        text = bytes(row[prompt_length - 1 :].tolist())  # one byte of the prompt
        score, seen = 0.0, set()
        for m in re.finditer(rb"[A-Za-z]+", text):
            if m.start() == 0 or m.end() == len(text):  # cut by the prompt, the end
                continue
            word = m.group().lower()
            if b"e" in word:
                score -= 0.5
            elif word in known and word not in seen:
                score += 1.0
                seen.add(word)
        rewards.append(score)
    return np.array(rewards)


def test_the_words_reward_scores_whole_words_as_a_python_reference_does():
    texts = [
        # prompt (16 bytes) | continuation (32 bytes)
        b"the prompt says " + b"is of in to if it Is IS xq a E! ",
        b"...prompt endsIn" + b"to an int, or a list, or python ",
        b"in the middle of" + b"f the text: spaces at the end   ",
        b"0123456789abcdef" + b" " * 32,
        b"words that end i" + b"n pairs: if if if; none, no, NO ",
    ]
    rng = np.random.default_rng(0)
    data, _ = rl.language_model.corpus()
    starts = rng.integers(0, len(data) - 48, 59)
    rows = [list(t) for t in texts] + [data[s : s + 48].tolist() for s in starts]
    tokens = jnp.asarray(rows, jnp.int32)
    got = np.asarray(rl.words_reward(tokens, 16))
    want = words_reference(tokens, 16)
    np.testing.assert_array_equal(got, want)
    # The crafted rows, by hand. 1: "is of in to if it" +6; "Is", "IS" repeat,
    # "xq" is no word of the text, "a" too short: 0; "E" -1/2. 2: "to" continues
    # the prompt's "In": 0; "an int or list python" +5. 3: "f" ends the prompt's
    # "of": 0; "at" +1; "the text spaces the end" -1/2 each. 4: spaces, 0. 5: "n"
    # ends the prompt's "in"; "pairs" (not in the text 10 times) 0, "if" +1 once,
    # "none" -1/2, "no" +1 once.
    assert got[:5].tolist() == [5.5, 5.0, -1.5, 0.0, 1.5], got[:5]


def test_group_advantages_are_normalised_within_each_group():
    rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    advantages = np.asarray(rl.group_advantages(rewards, group=4))
    # The first group: mean 1/4, std sqrt(3)/4; the second: all equal, no signal.
    expected = (np.array([1.0, 0.0, 0.0, 0.0]) - 0.25) / (np.sqrt(3) / 4 + 1e-4)
    np.testing.assert_allclose(advantages[:4], expected, rtol=1e-6)
    np.testing.assert_array_equal(advantages[4:], 0.0)


@pytest.mark.slow
def test_float16_quarters_the_mismatch_and_learns_with_lossscale():
    import rl_fine_tuning

    # Over five seeds (`benchmarks/results/rl_fine_tuning_short.md`, the command in
    # it): the ratio 0.114-0.126, the reward's rise 0.406-0.508 (seed 0: 0.122 and
    # 0.406), 0 skipped steps, the scale at 2**15.
    run = rl_fine_tuning.short_run(seed=0)
    # float16 keeps 3 more mantissa bits than bfloat16: its roundings, and the drift
    # between two code paths that round differently, are about 8x smaller.
    assert run["ratio"] < 1 / 4, run
    # A margin of half the smallest rise measured.
    rise = run["final_reward"] - run["start_reward"]
    assert rise > 0.2, (rise, run["rewards"])
    assert run["skipped"] == 0 and run["final_scale"] == 2.0**15, run
