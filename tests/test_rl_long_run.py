"""The GPU RL benchmark's verdicts (`benchmarks/rl_long_run.py`), on made-up runs.

The benchmark runs once, on a GPU, where its `.md` says whether each precision ends
within float32's reward and where it departs from it: those sentences must say what
the numbers say. No compile here: the runs are numpy columns.
"""

import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import rl_long_run  # noqa: E402


def columns(rewards, dlogp=1e-3):
    steps = len(rewards)
    return {
        "reward": list(rewards),
        "abs_log_prob_diff": [dlogp] * steps,
        "max_ratio": [1.01] * steps,
        "min_ratio": [0.99] * steps,
        "kl_per_token": [1e-6] * steps,
        "grad_norm": [0.5] * (steps - 1) + [float("inf")],
        "scale": [32768.0] * steps,
        "skipped": [0] * (steps - 1) + [1],
        "loss": [0.0] * steps,
    }


def run(precision, seed, rewards):
    data = columns(rewards)
    return {
        "precision": precision,
        "seed": seed,
        "steps": len(rewards),
        "cut": False,
        "summary": rl_long_run.summarise(data),
        "per_step": data,
    }


def noisy(level, steps=200, seed=0):
    """Per-step mean rewards of 64 samples around `level` (a list or a number)."""
    rng = np.random.default_rng(seed)
    level = np.broadcast_to(np.asarray(level, float), (steps,))
    return (rng.binomial(64, level) / 64).tolist()


def test_summarise_takes_tenths_and_ends_as_numpy_does():
    rewards = np.linspace(0.0, 1.0, 95)
    summary = rl_long_run.summarise(columns(rewards))
    parts = np.array_split(rewards, 10)
    np.testing.assert_allclose(summary["reward_tenths"], [p.mean() for p in parts])
    assert summary["start_reward"] == pytest.approx(rewards[:9].mean())
    assert summary["final_reward"] == pytest.approx(rewards[-9:].mean())
    # The skipped step's norm (inf) is left out of the median, not propagated.
    assert summary["grad_norm_median"] == 0.5
    assert summary["skipped"] == 1


def test_a_run_like_float32_stays_within_it():
    rewards = noisy(0.8, seed=0)
    reference = run("float32", 0, rewards)
    # float32's steps, off by a tenth of a step's noise (0.05): within, whatever
    # the draw. (Independent draws of the same level are out somewhere in about
    # 3% of runs, by the 3-standard-error rule: a seed could make this test luck.)
    shifted = [[r + sign * 0.005 for r in rewards] for sign in (1, -1)]
    runs = [reference] + [run("bfloat16", s, shifted[s]) for s in (0, 1)]
    lines = rl_long_run.comparisons(runs)
    (line,) = [line for line in lines if line.startswith("bfloat16")]
    assert "within float32's range" in line, lines
    assert "within float32's reward in every tenth" in line, lines


def test_a_run_that_collapses_departs_where_it_does():
    reference = run("float32", 0, noisy(0.8, seed=0))
    # From step 120 of 200 (the start of the 7th tenth) the reward falls to 0.1.
    level = [0.8] * 120 + [0.1] * 80
    runs = [reference] + [run("bfloat16", s, noisy(level, seed=s + 1)) for s in (0, 1)]
    (line,) = [x for x in rl_long_run.comparisons(runs) if x.startswith("bfloat16")]
    assert "outside float32's range" in line, line
    assert "departs from float32's reward from tenth 7 on (step 120 of 200)" in line


def test_a_cut_or_missing_reference_gives_no_comparison():
    cut = run("float32", 0, noisy(0.8))
    cut["cut"] = True
    lines = rl_long_run.comparisons([cut, run("bfloat16", 0, noisy(0.8))])
    assert lines == ["No complete float32 run: no comparison."]
