"""The GPU RL run's verdicts (`examples/rl_float16/rl_long_run.py`), on made-up runs.

The benchmark runs once, on a GPU, where its `.md` says whether each precision ends
within float32's reward and where it departs from it: those sentences must say what
the numbers say. No compile here: the runs are numpy columns.
"""

import pathlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("flax")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "rl_float16"))
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


def test_a_missing_reference_gives_no_comparison():
    lines = rl_long_run.comparisons([run("bfloat16", 0, noisy(0.8))])
    assert lines == ["No float32 run: no comparison."]


def test_a_cut_reference_is_compared_over_the_steps_it_ran():
    # float32 cut at step 100 of 200; bfloat16 falls to 0.1 from step 150 on,
    # which float32 did not reach: over the first 100 steps they agree.
    cut = run("float32", 0, noisy(0.8, steps=100))
    cut["cut"] = True
    level = [0.8] * 150 + [0.1] * 50
    runs = [cut] + [run("bfloat16", s, noisy(level, seed=s + 1)) for s in (0, 1)]
    lines = rl_long_run.comparisons(runs)
    (line,) = [x for x in lines if x.startswith("bfloat16")]
    assert "over the first 100 steps" in line, line
    assert "within float32's reward in every tenth" in line, line
    assert "after 100 steps (cut)" in lines[0], lines


def args(**changes):
    values = {"margin": 0.6, "first_run_allowance": 5.0, "min_steps": 5}
    return SimpleNamespace(**{"max_steps": 2000, **values, **changes})


ORDER = [
    ("bfloat16", 0),
    ("float16 + lossscale", 0),
    ("bfloat16", 1),
    ("float16 + lossscale", 1),
    ("float32", 0),
]
# The first H200 run's calibration (seconds a step).
PER_STEP = {"bfloat16": 0.0161, "float16 + lossscale": 0.0185, "float32": 0.0321}


def test_the_plan_fills_the_time_left_with_the_margin():
    steps, need = rl_long_run.plan(85.0, PER_STEP, ORDER, 3.0, args())
    total = sum(need[p] for p, _ in ORDER) + 5.0
    # The largest step count whose runs, at 1.6x the calibration's pace, fit.
    assert total <= 85.0, (steps, total)
    one_more = total + 1.6 * sum(PER_STEP[p] for p, _ in ORDER)
    assert one_more > 85.0, (steps, one_more)
    assert need["float32"] == pytest.approx(steps * 0.0321 * 1.6 + 3.0)
    # Without time, the minimum; never more than the maximum.
    assert rl_long_run.plan(1.0, PER_STEP, ORDER, 3.0, args())[0] == 5
    assert rl_long_run.plan(1e6, PER_STEP, ORDER, 3.0, args())[0] == 2000


def test_each_run_leaves_the_later_runs_their_time():
    need = {"bfloat16": 10.0, "float16 + lossscale": 12.0, "float32": 20.0}
    deadlines = [
        rl_long_run.deadline_of(k, ORDER, need, 100.0) for k in range(len(ORDER))
    ]
    # bfloat16 0 must end by 100 - (12 + 10 + 12 + 20); float32, last, by 100.
    assert deadlines == [46.0, 58.0, 68.0, 80.0, 100.0]


def test_the_files_are_named_by_the_gpus_model():
    names = {
        "NVIDIA H200": "h200",
        "NVIDIA H100 80GB HBM3": "h100",
        "NVIDIA A100-SXM4-80GB": "a100",
        "NVIDIA GeForce RTX 4090": "4090",
    }
    for kind, name in names.items():
        assert rl_long_run.device_name(kind) == name, kind
