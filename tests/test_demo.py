"""The demo (the README's first command) trains for real and shows underflow."""

import pytest

pytest.importorskip("sklearn")

from lossscale import demo  # noqa: E402


def test_demo_float16_with_loss_scaling_matches_float32_and_stops_underflow(capsys):
    results = demo.main(["--steps", "150"])
    float32 = results["float32"]
    unscaled = results["float16, no loss scaling"]
    scaled = results["float16, dynamic loss scaling"]
    assert float32["accuracy"] > 0.9  # the model really learns
    assert abs(scaled["accuracy"] - float32["accuracy"]) <= 0.02
    # float16 without scaling loses gradient elements that float32 keeps; the
    # loss scale brings them back.
    assert unscaled["underflow"] > 0.005
    assert scaled["underflow"] < unscaled["underflow"] / 10
    assert float32["losses"][-20:].mean() < float32["losses"][:20].mean() / 5
    printed = capsys.readouterr().out
    for name in results:
        assert name in printed
