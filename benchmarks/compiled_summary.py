"""The docs' compact tables, from the stored runs of `compiled.py`.

    python benchmarks/compiled_summary.py benchmarks/results/compiled_h100.json ...

Per tree and gradient dtype: plain Adam's work and each lossscale path's, beside the
best peer's (the fewest kernels or vector ops; the fewest bytes); bytes as a ratio to
Adam's and to the floor (Adam's plus one read of the gradients); temp in MB. Then the
whole train steps. Figures as `compiled.py` read them (what XLA would run).
"""

from __future__ import annotations

import json
import sys

OURS = {
    "lossscale.wrap(tx), dynamic": "wrap",
    "lossscale.apply_gradients (one call), dynamic": "apply_gradients",
    "lossscale.flax.TrainState (whole step), dynamic": "TrainState",
    "lossscale.wrap(adam), dynamic": "wrap",
    "lossscale.apply_gradients, dynamic": "apply_gradients",
    "lossscale.flax.TrainState, dynamic": "TrainState",
}
BASELINES = (
    "plain optax step (baseline)",
    "float16, no loss scaling (baseline)",
    "bfloat16, no loss scaling (baseline)",
)


def work(row: dict) -> int:
    applied = row["applied"]
    return applied.get("kernels", applied.get("vector_ops"))


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.3f}x"  # NaN: no peer to compare


def summarize(path: str) -> str:
    data = json.load(open(path))
    rows = [r for r in data["rows"] if "bytes" in r]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["part"], r["tree"], r["grads"]), []).append(r)
    unit = "kernels" if data["target"] == "h100" else "vector ops"
    tpu = data["target"].startswith("tpu")
    if data["target"] == "cpu":
        unit = "fusions and ops"
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    out = [
        f"{data['target']} ({versions})",
        "",
        f"| part | tree | grads | {unit}: baseline / wrap / apply_gradients /"
        " TrainState / best peer | bytes vs floor: ours (max) / best peer |"
        " temp MB: ours (max) / best peer | conds (ours) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (part, tree, grads), group in keyed.items():
        base = next(r for r in group if r["variant"] in BASELINES)
        ours = {OURS[r["variant"]]: r for r in group if r["variant"] in OURS}
        peers = [
            r
            for r in group
            if r["variant"] not in OURS
            and r["variant"] not in BASELINES
            and not r["variant"].startswith(("lossscale", "study"))
        ]
        if not ours:
            continue
        ours_work = " / ".join(
            str(work(ours[k])) if k in ours else "-"
            for k in ("wrap", "apply_gradients", "TrainState")
        )
        best = min((work(r) for r in peers), default=None)
        floor_ours = max(r["vs_floor"] for r in ours.values())
        # The TPU's HBM estimate misses the operands of a surviving cond's branches,
        # so a peer that keeps one is compared by vector ops only.
        comparable = [r for r in peers if not tpu or r["applied"]["conds"] == 0]
        floor_peer = min((r["vs_floor"] for r in comparable), default=float("nan"))
        temp_ours = max(r["temp_bytes"] for r in ours.values()) / 1e6
        temp_peer = min((r["temp_bytes"] for r in peers), default=float("nan")) / 1e6
        conds = max(r["applied"]["conds"] for r in ours.values())
        out.append(
            f"| {part} | {tree} | {grads} | {work(base)} / {ours_work} / {best} |"
            f" {floor_ours:.3f}x / {_ratio(floor_peer)} | {temp_ours:.2f} /"
            f" {temp_peer:.2f} | {conds} |"
        )
    if tpu:
        out += [
            "",
            "Best peer's bytes: among peers whose step keeps no cond (the HBM estimate"
            " misses the operands of a cond's branches).",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(summarize(path) for path in sys.argv[1:]))
