"""`lossscale.tunix` with the real google-tunix: SFT and GRPO in float16.

tunix's Qwen3 at toy size (two layers, no download) computes in float16 with its
attention mask set within float16's range (`docs/guides/tunix.md`), float32
parameters; every trainer is tunix's own, only its step replaced by
`lossscale.tunix.scale_trainer`. Runs where google-tunix is installed (CI's
newest-versions stage: `pip install -e ".[test,tunix]"`).
"""

import importlib.metadata
import inspect
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

# tunix 0.1.7 imports and calls APIs jax deprecates (`jax.experimental.shard_map`,
# `pxla.thread_resources`): its warnings, not lossscale's.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    tunix = pytest.importorskip("tunix")
    import orbax.checkpoint as ocp
    from flax import nnx
    from grain import python as grain
    from jax.interpreters import pxla
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import common as rl_common
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner as grpo_lib
    from tunix.rl.rollout import base_rollout
    from tunix.sft import peft_trainer
    from tunix.sft import utils as sft_utils
    from tunix.tests import test_common as tunix_common

import lossscale  # noqa: E402
import lossscale.tunix  # noqa: E402

F16, F32 = jnp.float16, jnp.float32
VOCAB = 256
# float16's unit roundoff: the budget for an update computed in float16 against
# float32's, for a two-layer model (measured: 2.2e-3 SFT, 1.4e-3 GRPO).
F16_BUDGET = 16 * 2.0**-11


TUNIX_MASK = -2.3819763e38  # tunix 0.1.7's `K_MASK`, -inf in float16


@pytest.fixture
def tunix_mask(monkeypatch):
    """tunix's own mask, whatever another test (or the guide's example) set."""
    jax.clear_caches()
    monkeypatch.setattr(qwen3, "K_MASK", TUNIX_MASK)


@pytest.fixture
def float16_mask(monkeypatch):
    """tunix's Qwen3 mask within float16's range, as the guide says to set it.

    Before anything is traced: tunix's jitted helpers read it when first traced,
    and would reuse a trace of another test's mask (cleared).
    """
    jax.clear_caches()
    monkeypatch.setattr(qwen3, "K_MASK", float(jnp.finfo(F16).min))


def toy_qwen3(dtype, vocab=VOCAB):
    config = qwen3.ModelConfig(
        num_layers=2,
        vocab_size=vocab,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        rope_theta=10000,
        norm_eps=1e-6,
        dtype=dtype,
        param_dtype=F32,
    )
    return qwen3.Qwen3(config, rngs=nnx.Rngs(0))


def batches(count, poison=(), nan=(), seed=0):
    """SFT batches of 8 sequences of 32 tokens, the last 5 partly padding.

    `poison`: batches whose loss adds 4 * sum(embedding in float16), whose
    cotangent (4 * scale) overflows float16: a backward overflow, the loss
    finite. `nan`: batches whose loss is NaN (bad data).
    """
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        tokens = rng.integers(1, VOCAB, size=(8, 32)).astype(np.int32)
        mask = np.ones((8, 32), bool)
        mask[:, -5:] = rng.random((8, 5)) < 0.5
        out.append(
            {
                "input_tokens": np.where(mask, tokens, 0),
                "input_mask": mask,
                "poison": np.float32(index in poison),
                "nan": np.float32(np.nan if index in nan else 0.0),
            }
        )
    return out


def model_input(batch):
    mask = jnp.asarray(batch["input_mask"])
    return {
        "input_tokens": batch["input_tokens"],
        "input_mask": mask,
        "positions": sft_utils.build_positions_from_mask(mask),
        "attention_mask": sft_utils.make_causal_attn_mask(mask),
        "poison": batch["poison"],
        "nan": batch["nan"],
    }


def sft_loss(model, input_tokens, input_mask, positions, attention_mask, poison, nan):
    loss = peft_trainer._default_loss_fn(
        model, input_tokens, input_mask, positions, attention_mask
    )
    embedding = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    overflow = 4.0 * jnp.sum(embedding.astype(F16)).astype(F32)
    return loss + poison * overflow + nan


def sft_trainer(dtype, tx, steps, **config):
    model = toy_qwen3(dtype)
    trainer = peft_trainer.PeftTrainer(
        model,
        tx,
        peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps, **config),
    )
    return trainer.with_gen_model_input_fn(model_input).with_loss_fn(sft_loss)


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in tree])


def params_of(model):
    return jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))


def change(before, model):
    return flat(params_of(model)) - flat(before)


def history(trainer, name):
    return [
        float(v)
        for v in trainer.metrics_logger.get_metric_history(
            trainer.metrics_prefix, name, "train"
        )
    ]


# -- SFT ---------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_sft_in_float16_matches_float32(inner, float16_mask):
    make = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-3)}[inner]
    data = batches(4)
    reference = sft_trainer(F32, make(), 4)
    before = params_of(reference.model)
    reference.train(data)
    want = change(before, reference.model)
    scaled = sft_trainer(F16, lossscale.tunix.wrap(make()), 4)
    lossscale.tunix.scale_trainer(scaled)
    before = params_of(scaled.model)
    scaled.train(data)
    got = change(before, scaled.model)
    gap = np.linalg.norm(got - want) / np.linalg.norm(want)
    if inner == "sgd":
        assert gap <= F16_BUDGET, (gap, F16_BUDGET)
    else:
        # Adam divides each element by its own size: one whose gradient float16
        # rounds near zero moves by up to the learning rate either way, so the
        # update agrees in direction (measured 0.9997), not to float16's budget.
        cosine = got @ want / np.linalg.norm(got) / np.linalg.norm(want)
        assert cosine >= 0.99, (cosine, gap)
    # tunix logged the unscaled loss and gradient norm, and the loss scale.
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            history(scaled, name), history(reference, name), rtol=F16_BUDGET
        )
    assert history(scaled, "loss_scale") == [2.0**15] * len(history(scaled, "loss"))
    assert history(scaled, "skipped_steps")[-1] == 0


def test_an_overflow_skips_and_backs_off_and_bad_data_skips_without(float16_mask):
    data = batches(4, poison={1}, nan={2})
    trainer = sft_trainer(F16, lossscale.tunix.wrap(optax.sgd(0.1)), 4)
    lossscale.tunix.scale_trainer(trainer)
    trainer.train(data[:1])
    kept = params_of(trainer.model)
    trainer.config.max_steps = 3
    trainer.train(data)  # resumes at step 1: the poisoned batch, then the NaN
    state = lossscale.get_loss_scale(trainer.optimizer)
    assert int(state.skipped_steps) == 2
    assert int(state.forward_overflows) == 1  # the NaN loss: `value=` told it
    assert float(state.scale) == 2.0**14  # backed off once, for the overflow
    assert all(
        np.array_equal(a, b)
        for a, b in zip(kept, params_of(trainer.model), strict=True)
    )
    # tunix's logs show each step's skips and scale, at that step's number.
    # tunix writes a step's metrics while the next runs: each at its own step.
    assert history(trainer, "skipped_steps") == [0, 1, 2]
    assert history(trainer, "loss_scale") == [2.0**15, 2.0**14, 2.0**14]
    assert np.isnan(history(trainer, "loss")[2])


class Float16Params(nnx.Module):
    """A float16 parameter vector: the model tunix's `grad_norm` overflowed in."""

    def __init__(self):
        self.w = nnx.Param(jnp.full((64,), 0.5, F16))


def test_grad_norm_of_float16_parameters_is_the_unscaled_norm():
    def loss_fn(model, x):
        return jnp.mean((model.w.astype(F32) * x) ** 2)

    trainer = peft_trainer.PeftTrainer(
        Float16Params(),
        lossscale.tunix.wrap(optax.sgd(0.01)),
        peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=1),
    ).with_loss_fn(loss_fn)
    lossscale.tunix.scale_trainer(trainer)
    trainer.train([{"x": np.ones(64, np.float32)}])
    # d/dw mean(w**2) = 2w/64 = 1/64 per element: a norm of 8/64, exact in
    # float16; scaled by 2**15, its square summed in float16 overflowed.
    assert history(trainer, "grad_norm") == [0.125]
    assert history(trainer, "skipped_steps") == [0]


def test_a_bad_micro_batch_under_accumulation_costs_one_micro_batch(float16_mask):
    # tunix wraps the optimizer in `optax.MultiSteps(tx, 2)`; optax's reset keeps a
    # NaN for good there (tests/test_accumulation.py). Inside the wrap, the
    # micro-batch is dropped and the scale backs off at once.
    data = batches(8, poison={3})
    trainer = sft_trainer(
        F16, lossscale.tunix.wrap(optax.sgd(0.1)), 4, gradient_accumulation_steps=2
    )
    lossscale.tunix.scale_trainer(trainer)
    before = params_of(trainer.model)
    trainer.train(data)
    opt_state = nnx.state(trainer.optimizer, nnx.optimizer.OptState)
    state = lossscale.get_loss_scale(trainer.optimizer)
    assert int(state.skipped_steps) == 1 and float(state.scale) == 2.0**14
    multi = jax.tree.map(
        lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
        trainer.optimizer.opt_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(multi.acc_grads))
    # 7 good micro-batches: 3 optimizer steps, and half a cycle pending.
    assert int(multi.gradient_step) == 3 and int(multi.mini_step) == 1
    moved = change(before, trainer.model)
    assert np.all(np.isfinite(moved)) and np.linalg.norm(moved) > 0
    assert opt_state is not None


def test_the_scale_is_saved_and_restored_by_tunix_checkpoints(tmp_path, float16_mask):
    def trainer(steps):
        return sft_trainer(
            F16,
            lossscale.tunix.wrap(optax.adam(1e-3)),
            steps,
            checkpoint_root_directory=str(tmp_path),
            checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1),
        )

    first = lossscale.tunix.scale_trainer(trainer(2))
    first.train(batches(2, poison={1}))
    saved = lossscale.get_loss_scale(first.optimizer)
    assert float(saved.scale) == 2.0**14 and int(saved.skipped_steps) == 1
    first.close()
    second = lossscale.tunix.scale_trainer(trainer(3))  # restores step 2
    restored = lossscale.get_loss_scale(second.optimizer)
    assert second.train_steps == 2
    for name in ("scale", "skipped_steps", "counter", "consecutive_skips"):
        assert np.array_equal(getattr(restored, name), getattr(saved, name)), name
    second.train(batches(3))
    assert int(lossscale.get_loss_scale(second.optimizer).counter) == 1


# -- GRPO --------------------------------------------------------------------------


def length_reward(prompts, completions, **kwargs):
    return [len(completion) / 10 for completion in completions]


def grpo_cluster(dtype, tx, **config):
    vocab = tunix_common.MockVocab()
    # tunix's own tests' mesh: the ambient one (empty: no sharding).
    mesh = pxla.thread_resources.env.physical_mesh
    roles = (
        rl_cluster_lib.Role.ACTOR,
        rl_cluster_lib.Role.REFERENCE,
        rl_cluster_lib.Role.ROLLOUT,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=toy_qwen3(dtype, vocab.GetPieceSize()),
        reference=toy_qwen3(dtype, vocab.GetPieceSize()),
        tokenizer=vocab,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=tx, eval_every_n_steps=1000, **config
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=64
            ),
        ),
    )
    grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=lambda prompts, completions, **kw: [
            len(c) / 10 for c in completions
        ],
        algo_config=grpo_lib.GRPOConfig(num_generations=2, beta=0.0),
    )
    return cluster


def train_example(vocab, seed=0):
    """A GRPO batch: left-padded prompts (rows with no key left), completions."""
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((4, 6), bool)
    prompt_mask[:, :2] = False
    completion_mask = np.ones((4, 8), bool)
    completion_mask[:, -3:] = rng.random((4, 3)) < 0.5
    return rl_common.TrainExample(
        prompt_ids=jnp.asarray(
            np.where(prompt_mask, rng.integers(3, vocab, (4, 6)), 0), jnp.int32
        ),
        prompt_mask=jnp.asarray(prompt_mask),
        completion_ids=jnp.asarray(rng.integers(3, vocab, (4, 8)), jnp.int32),
        completion_mask=jnp.asarray(completion_mask),
        advantages=jnp.asarray(rng.standard_normal(4), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=None,
    )


def test_a_grpo_actor_step_in_float16_matches_float32(float16_mask):
    # One actor update on one GRPO batch, so that both runs see the same
    # completions (sampled, they would differ with the numerics).
    vocab = tunix_common.MockVocab().GetPieceSize()
    example = train_example(vocab)
    changes = []
    for dtype, tx in (
        (F32, optax.sgd(1.0)),
        (
            F16,
            lossscale.tunix.wrap(optax.sgd(1.0), lossscale.DynamicLossScale(2.0**10)),
        ),
    ):
        cluster = grpo_cluster(dtype, tx, max_steps=1)
        if dtype == F16:
            lossscale.tunix.scale_trainer(cluster.actor_trainer)
        before = params_of(cluster.actor_trainer.model)
        cluster.actor_trainer.train([example])
        changes.append(change(before, cluster.actor_trainer.model))
    want, got = changes
    gap = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert gap <= F16_BUDGET, (gap, F16_BUDGET)


def test_grpo_trains_in_float16_through_the_learner(float16_mask):
    # The learner's own loop: rollouts, rewards, the actor's loss-scaled steps.
    tx = lossscale.tunix.wrap(optax.sgd(1e-2), lossscale.DynamicLossScale(2.0**10))
    cluster = grpo_cluster(F16, tx, max_steps=3)
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=lambda prompts, completions, **kw: [
            len(c) / 10 for c in completions
        ],
        algo_config=grpo_lib.GRPOConfig(num_generations=2, beta=0.0),
    )
    lossscale.tunix.scale_trainer(cluster.actor_trainer)
    before = params_of(cluster.actor_trainer.model)
    prompts = ["input string", "hello world", "My name", "hello there"] * 2
    learner.train(
        grain.MapDataset.source(prompts)
        .batch(2)
        .map(lambda x: {"prompts": x, "answer": x})
    )
    figures = lossscale.metrics(cluster.actor_trainer.optimizer)
    assert int(figures["skipped_steps"]) == 0, figures
    moved = change(before, cluster.actor_trainer.model)
    assert np.all(np.isfinite(moved)) and np.linalg.norm(moved) > 0


# -- the routes that failed silently, closed -------------------------------------


def test_tunix_own_step_with_the_wrapped_optimizer_is_refused():
    trainer = sft_trainer(F32, lossscale.tunix.wrap(optax.sgd(0.1)), 1)
    with pytest.raises(TypeError, match=r"lossscale.tunix.scale_trainer\(trainer\)"):
        trainer.train(batches(1))


def test_a_plain_wrap_under_tunix_accumulation_is_refused_at_init():
    with pytest.raises(ValueError, match="use `lossscale.tunix`"):
        sft_trainer(
            F32, lossscale.wrap(optax.sgd(0.1)), 1, gradient_accumulation_steps=2
        )


def test_scale_trainer_refuses_a_trainer_without_the_wrapped_optimizer():
    trainer = sft_trainer(F32, optax.sgd(0.1), 1)
    with pytest.raises(TypeError, match=r"lossscale.tunix.wrap\(tx\)"):
        lossscale.tunix.scale_trainer(trainer)
    with pytest.raises(TypeError, match="PeftTrainer"):
        lossscale.tunix.scale_trainer(object())


def test_an_untested_tunix_is_refused(monkeypatch):
    trainer = sft_trainer(F32, lossscale.tunix.wrap(optax.sgd(0.1)), 1)
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "0.0.1" if name == "google-tunix" else real(name),
    )
    with pytest.raises(ImportError, match="tested with google-tunix"):
        lossscale.tunix.scale_trainer(trainer)


def test_a_float16_model_with_tunix_mask_is_warned_about(tunix_mask):
    trainer = sft_trainer(F16, lossscale.tunix.wrap(optax.sgd(0.1)), 1)
    with pytest.warns(UserWarning, match=r"K_MASK = -2.3819763e\+38"):
        lossscale.tunix.scale_trainer(trainer)


def test_with_tunix_mask_a_float16_grpo_step_is_skipped_at_any_scale(tunix_mask):
    # The reference for the warning: tunix's mask in float16 over left padding
    # makes the per-token log-probabilities NaN, so no scale, down to 1, helps;
    # with the mask the guide gives, the same step applies
    # (test_a_grpo_actor_step_in_float16_matches_float32).
    vocab = tunix_common.MockVocab().GetPieceSize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tx = lossscale.tunix.wrap(optax.sgd(1.0), lossscale.DynamicLossScale(1.0))
        cluster = grpo_cluster(F16, tx, max_steps=1)
        lossscale.tunix.scale_trainer(cluster.actor_trainer)
    before = params_of(cluster.actor_trainer.model)
    cluster.actor_trainer.train([train_example(vocab)])
    figures = lossscale.metrics(cluster.actor_trainer.optimizer)
    assert int(figures["skipped_steps"]) == 1, figures
    assert not np.any(change(before, cluster.actor_trainer.model))


# -- what is pinned ------------------------------------------------------------------

# tunix 0.1.7's `PeftTrainer._train_step`, whose role the installed step takes: if
# tunix changes it, this fails, and the step (and TESTED_TUNIX) must be reviewed.
TUNIX_TRAIN_STEP = """
inputs = self.gen_model_input_fn(inputs)

grad_fn = nnx.value_and_grad(
    self.loss_fn,
    argnums=nnx.DiffState(0, nnx.LoRAParam) if self._lora_enabled else 0,
    has_aux=self._has_aux,
)
out, grads = grad_fn(model, **inputs)
grad_norm = optax.global_norm(grads)
optimizer.update(model, grads)
if self._has_aux:
  loss, aux = out
  return loss, aux, grad_norm
else:
  return out, None, grad_norm
"""


def test_the_tunix_step_taken_over_is_the_one_pinned():
    assert importlib.metadata.version("google-tunix") in lossscale.tunix.TESTED_TUNIX
    source = inspect.getsource(peft_trainer.PeftTrainer._train_step)
    body = textwrap.dedent(source.split('"""')[-1]).strip()
    assert body == TUNIX_TRAIN_STEP.strip(), body
    jit = inspect.getsource(peft_trainer.PeftTrainer.jit_train_and_eval_step)
    assert "train_step = self.create_train_step_fn()" in jit
    assert 'donate_argnames=("optimizer",)' in jit
