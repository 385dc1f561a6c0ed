"""tunix GRPO at toy size on the CPU: float16 + lossscale, bfloat16, float32.

    pip install -e ".[tunix]"
    python benchmarks/tunix_grpo.py [--steps 40] [--seeds 0,1] [--out ...]

tunix's own GRPO learner trains tunix's Qwen3 at toy size (two layers, 64 wide,
float32 parameters) with tunix's `MockVocab` (22 words, in its wheel: no download)
to write four of its words: the reward is the share of a completion's words that are
"Tunix", "Parallax", "library" or "training" (0.18 for a uniform policy). The model
computes in float32, in bfloat16 (no loss scaling, as bfloat16 is used), or in
float16 with `lossscale.tunix` (a dynamic scale; tunix's attention mask set within
float16's range). At each tenth of
the steps the mismatch is measured on 8 fixed prompts: the completions tunix's
sampler draws (the log-probabilities it sampled them with, decoding with a
key-value cache), against the same tokens'
log-probabilities from one full-sequence forward pass in the same precision (the
trainer's), as the mean |log p_sampler - log p_trainer| over the completion
tokens. Results: a table on stdout and `benchmarks/results/tunix_grpo_cpu.{md,json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

warnings.simplefilter("ignore", DeprecationWarning)  # tunix's own, of jax APIs

from flax import nnx  # noqa: E402
from grain import python as grain  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.sft import utils as sft_utils  # noqa: E402
from tunix.tests import test_common  # noqa: E402

import lossscale  # noqa: E402
import lossscale.tunix  # noqa: E402

PRECISIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PROMPTS = ["input string", "hello world", "My name", "hello there"]
EVAL_PROMPTS = ["My name is", "hello", "input", "there", "Hello world", "name",
                "training", "library"]  # fmt: skip
TARGETS = {"Tunix", "Parallax", "library", "training"}
MAX_TOKENS = 16


def reward(prompts, completions, **kwargs):
    """The share of each completion's words that are one of `TARGETS`."""
    return [
        sum(word in TARGETS for word in c.split()) / max(len(c.split()), 1)
        for c in completions
    ]


def toy(dtype, vocab, seed):
    config = qwen3.ModelConfig(
        num_layers=2, vocab_size=vocab, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=16, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, dtype=dtype,
        param_dtype=jnp.float32,
    )  # fmt: skip
    return qwen3.Qwen3(config, rngs=nnx.Rngs(seed))


def cluster_for(precision, seed, steps, learning_rate):
    dtype = PRECISIONS[precision]
    vocab = test_common.MockVocab()
    tx = optax.adam(learning_rate)
    if precision == "float16":
        tx = lossscale.tunix.wrap(tx, "dynamic")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (
        rl_cluster_lib.Role.ACTOR,
        rl_cluster_lib.Role.REFERENCE,
        rl_cluster_lib.Role.ROLLOUT,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=toy(dtype, vocab.GetPieceSize(), seed),
        reference=toy(dtype, vocab.GetPieceSize(), seed),
        tokenizer=vocab,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=tx, eval_every_n_steps=10**6, max_steps=steps
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=MAX_TOKENS,
                max_prompt_length=8,
                kv_cache_size=64,
                temperature=1.0,
                return_logprobs=True,
                seed=seed,
            ),
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=reward,
        algo_config=grpo_learner.GRPOConfig(num_generations=4, beta=0.0),
    )
    if precision == "float16":
        lossscale.tunix.scale_trainer(cluster.actor_trainer)
    return cluster, learner


def mismatch(cluster):
    """Mean |log p_sampler - log p_trainer| over the sampled completion tokens."""
    out = cluster.generate(EVAL_PROMPTS)
    model = cluster.actor_trainer.model
    pad, eos = cluster.tokenizer.pad_id(), cluster.tokenizer.eos_id()
    gaps = []
    for row, (sampled, tokens) in enumerate(zip(out.logprobs, out.tokens, strict=True)):
        # Up to a sampled pad (which the sampler's cache masks, and a forward pass
        # cannot mask the same way) or through the end of the sequence.
        tokens = np.asarray(tokens)
        stops = np.flatnonzero((tokens == pad) | (tokens == eos))
        if stops.size:
            tokens = tokens[: stops[0] + (tokens[stops[0]] == eos)]
        if not tokens.size:
            continue
        sampler = np.asarray(sampled, np.float64)[: tokens.size]
        prompt = np.asarray(out.left_padded_prompt_tokens[row])
        sequence = np.concatenate([prompt, tokens])[None]
        # The prompt's left padding only: a sampled token may be the pad id too.
        mask = jnp.asarray(np.concatenate([prompt != pad, np.ones(tokens.size, bool)]))
        mask = mask[None]
        logits_full, _ = model(
            jnp.asarray(sequence),
            sft_utils.build_positions_from_mask(mask),
            None,
            sft_utils.make_causal_attn_mask(mask),
        )
        trainer = jax.nn.log_softmax(jnp.asarray(logits_full[0], jnp.float32), -1)
        start = prompt.size - 1
        trainer = np.asarray(trainer)[start + np.arange(tokens.size), tokens]
        gaps.append(np.abs(sampler - trainer))
    return float(np.mean(np.concatenate(gaps))) if gaps else float("nan")


def run(precision, seed, steps, learning_rate):
    qwen3.K_MASK = (
        float(jnp.finfo(jnp.float16).min) if precision == "float16" else -2.3819763e38
    )
    jax.clear_caches()  # tunix's jitted helpers read K_MASK when traced
    cluster, learner = cluster_for(precision, seed, steps, learning_rate)
    tenth = max(steps // 10, 1)
    rng = np.random.default_rng(seed)
    records, start = [], time.perf_counter()
    for done in range(0, steps, tenth):
        prompts = [PROMPTS[i] for i in rng.integers(0, len(PROMPTS), 2 * tenth)]
        data = (
            grain.MapDataset.source(prompts)
            .batch(2)
            .map(lambda p: {"prompts": p, "answer": p})
        )
        gap = mismatch(cluster)
        learner.train(data)
        rewards = cluster._rl_metrics_logger.get_metric_history(  # tunix: no reader
            "rewards", "sum", "train"
        )
        figures = {"scale": None, "skipped": 0}
        if precision == "float16":
            state = lossscale.metrics(cluster.actor_trainer.optimizer)
            figures = {
                "scale": float(state["loss_scale"]),
                "skipped": int(state["skipped_steps"]),
            }
        records.append(
            {
                "step": done,
                "mismatch": gap,
                "reward": float(np.mean(rewards[-tenth:])) if len(rewards) else None,
                **figures,
            }
        )
    return {"records": records, "seconds": time.perf_counter() - start}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--out", default="benchmarks/results/tunix_grpo_cpu")
    args = parser.parse_args(argv)
    results = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for precision in PRECISIONS:
            result = run(precision, seed, args.steps, args.learning_rate)
            results[f"{precision}/{seed}"] = result
            last = result["records"][-1]
            print(f"{precision} seed {seed}: {last} ({result['seconds']:.0f} s)")
    lines = [
        "# tunix GRPO at toy size on the CPU",
        "",
        f"`python benchmarks/tunix_grpo.py --steps {args.steps} --seeds {args.seeds}`:"
        f" jax {jax.__version__}, google-tunix 0.1.7, {jax.devices()[0].platform},"
        f" {os.cpu_count()} CPUs. Reward: the mean over the tenth's steps of the"
        " rollouts' mean reward; mismatch: mean |log p_sampler - log p_trainer| on"
        " 8 fixed prompts before the tenth's steps (`benchmarks/tunix_grpo.py`).",
        "",
        "| run | step | reward | mismatch | scale | skipped |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for record in result["records"]:
            reward_text = "" if record["reward"] is None else f"{record['reward']:.3f}"
            lines.append(
                f"| {name} | {record['step']} | {reward_text} |"
                f" {record['mismatch']:.2e} | {record['scale'] or ''} |"
                f" {record['skipped']} |"
            )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
