"""The language-model benchmark, short: same batches, three runs, gradient fidelity.

The full run (`python -m lossscale.demo_language_model`) takes about ten minutes; this
runs 20 steps of one seed, on batches of 32 sequences (the default is 64: half the
compute per step, the same model, code path and comparisons), and checks what the
stored results rest on: the float16 run with loss scaling follows the float32 run,
and its gradients are closer to the float32 ones than unscaled float16 gradients
are. At batch 32 (seed 0): held-out loss 2.869 in all three runs (chance 5.55),
gradient relative error 0.08% scaled against 1.93% unscaled.
"""

import json

import pytest

pytest.importorskip("flax")
from lossscale import demo_language_model as language_model  # noqa: E402


@pytest.mark.slow
def test_the_short_run_reports_what_the_full_run_does(tmp_path):
    out = tmp_path / "lm"
    results = language_model.main(
        ["--steps", "20", "--seeds", "0", "--eval-batches", "2", "--quick"]
        + ["--batch", "32"]
        + ["--out", str(out)]
    )
    runs = results["runs"]
    float32 = runs["float32"][0]
    scaled = runs["float16, dynamic loss scaling"][0]
    unscaled = runs["float16, no loss scaling"][0]
    losses = {name: r[0]["held_out_loss"] for name, r in runs.items()}
    # The same seed and batches: the scaled float16 run follows float32 closely.
    assert abs(scaled["held_out_loss"] - float32["held_out_loss"]) < 0.02, losses
    assert scaled["skipped_steps"] == 0 and unscaled["skipped_steps"] == 0
    assert scaled["held_out_loss"] < 5.0 < 5.6, losses  # chance: ln 256 = 5.55
    fidelity = {
        name: results["fidelity"][name]["overall"] for name in ("scaled", "unscaled")
    }
    assert (
        fidelity["scaled"]["relative_error"]
        < fidelity["unscaled"]["relative_error"] / 5
    ), fidelity
    assert (
        fidelity["scaled"]["underflow_share"] <= fidelity["unscaled"]["underflow_share"]
    ), fidelity
    stored = json.loads((tmp_path / "lm.json").read_text())
    assert stored["runs"].keys() == runs.keys()
    assert "| float16, dynamic loss scaling |" in (tmp_path / "lm.md").read_text()
