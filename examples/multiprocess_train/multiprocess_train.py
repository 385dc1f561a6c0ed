r"""Loss-scaled float16 training across processes with JAX's distributed runtime.

One process per host (here: per simulated host), a global device mesh, float32
parameters and float16 compute. Every process runs this same program; `jit` (or
`shard_map`) splits the work. Try it on one machine with two processes of four CPU
devices each:

    python examples/multiprocess_train/multiprocess_train.py --local 2

On a cluster, start one process per host with the coordinator's address, the number
of processes and each one's index (or nothing at all under SLURM, where
`jax.distributed.initialize()` reads them from the environment):

    COORDINATOR_ADDRESS=host0:1234 NUM_PROCESSES=4 PROCESS_ID=$RANK python \
        examples/multiprocess_train/multiprocess_train.py --checkpoint-dir /shared/run1

Each process prints, after every step, the step, the loss scale, the skipped steps
and a digest of the whole train state (parameters, optimizer state, loss-scale
state, gathered from every process): the digests are the same on every process.
`--overflow-at 3,7` puts an inf into the last process's part of the batch at those
steps (counted from 1, as printed): every process skips them. With
`--checkpoint-dir` the state is saved every `--save-every` steps with Orbax, and a
run restarts from the latest checkpoint. With `--local`, Gloo's connection lines
("[Gloo] Rank 0 is connected to 1 peer ranks...", jax-ml/jax#32673) are left out of
the output; on a cluster each process prints its own.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import threading

LOCAL_DEVICES = {1: 8, 2: 4, 4: 2, 8: 1}  # simulated CPU devices per process


def parse_args(argv=None):
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--path", choices=("wrap", "apply"), default="wrap")
    parser.add_argument(
        "--overflow-at", default="", help="steps as printed (from 1), e.g. 3,7"
    )
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=int, default=100)
    parser.add_argument(
        "--local", type=int, default=0, help="start this many processes here"
    )
    return parser.parse_args(argv)


def forward(stream) -> None:
    """Copies a child's lines to our stdout, line by line."""
    with stream:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()


def launch_locally(count: int, argv: list[str]) -> int:
    """Starts `count` processes of this script on 127.0.0.1; returns the worst rc."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children, pipes = [], []
    for index in range(count):
        env = dict(
            os.environ,
            COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            NUM_PROCESSES=str(count),
            PROCESS_ID=str(index),
            XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES[count]}",
        )
        # The child's own lines come through a pipe of their own. Its stdout,
        # where Gloo's C++ code writes a "[Gloo] Rank i is connected to n peer
        # ranks" line for every rank of every group it opens (16 a run here, from
        # several threads at once, interleaved), is left out.
        read, write = os.pipe()
        env["EXAMPLE_OUTPUT_FD"] = str(write)
        children.append(
            subprocess.Popen(
                [sys.executable, __file__, *argv],
                env=env,
                stdout=subprocess.DEVNULL,
                pass_fds=(write,),
            )
        )
        os.close(write)
        pipes.append(os.fdopen(read))
    forwarders = [
        threading.Thread(target=forward, args=(pipe,), daemon=True) for pipe in pipes
    ]
    for thread in forwarders:
        thread.start()
    try:
        rc = max(child.wait() for child in children)
        for thread in forwarders:
            thread.join()
        return rc
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def main(argv=None) -> None:
    """Starts local processes (`--local`), or joins the run and trains."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.local:
        if args.local not in LOCAL_DEVICES:
            raise SystemExit(f"--local takes one of {sorted(LOCAL_DEVICES)}")
        forwarded = [a for a in argv if not a.startswith("--local=")]
        if "--local" in forwarded:
            at = forwarded.index("--local")
            del forwarded[at : at + 2]
        sys.exit(launch_locally(args.local, forwarded))

    import jax

    # CPU collectives between processes; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize(
            os.environ["COORDINATOR_ADDRESS"],
            int(os.environ["NUM_PROCESSES"]),
            int(os.environ["PROCESS_ID"]),
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    else:  # SLURM, Open MPI, Cloud TPU...: read from the environment
        jax.distributed.initialize(heartbeat_timeout_seconds=args.heartbeat_timeout)
    train(args)


def train(args) -> None:
    """Trains on the global mesh, printing each step's state digest."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lossscale

    mesh = Mesh(np.array(jax.devices()), ("data",))
    devices = mesh.devices.size
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P("data"))
    batch_per_device, width = 8, 16
    overflow_at = {int(s) for s in args.overflow_at.split(",") if s}
    # A global row that lives on a device of the last process.
    poisoned_device = max(
        i
        for i, device in enumerate(mesh.devices)
        if device.process_index == jax.process_count() - 1
    )
    poisoned_row = poisoned_device * batch_per_device

    def global_array(values, sharding):
        # Every process computes the same global values and hands over its shards.
        return jax.make_array_from_callback(
            values.shape, sharding, lambda index: values[index]
        )

    def batch(step):
        rng = np.random.default_rng(step)
        x = rng.standard_normal((devices * batch_per_device, width)).astype(np.float32)
        y = np.tanh(x[:, :4] * 2.0).astype(np.float32)
        if step + 1 in overflow_at:  # steps count from 1, as printed
            x[poisoned_row] = np.inf
        return global_array(x, rows), global_array(y, rows)

    rng = np.random.default_rng(0)
    params = {
        # Sharded across every device, hence across processes.
        "w1": global_array(
            (rng.standard_normal((width, 32)) * 0.3).astype(np.float32), rows
        ),
        "w2": global_array(
            (rng.standard_normal((32, 4)) * 0.3).astype(np.float32), replicated
        ),
    }

    def loss_fn(params, x, y):
        h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
        out = h @ params["w2"].astype(jnp.float16)
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    tx = optax.adam(1e-2)
    loss_scale = lossscale.DynamicLossScale(scale=2.0**12, growth_interval=4)
    if args.path == "wrap":
        # Plain `jit` over global arrays: the check reduces whole arrays, XLA adds
        # the cross-process reduction, and no `axis_name` is needed.
        wrapped = lossscale.wrap(tx, loss_scale)
        state = wrapped.init(params)

        @jax.jit
        def step(params, state, x, y):
            loss, grads = lossscale.value_and_grad(loss_fn)(state, params, x, y)
            updates, state = wrapped.update(grads, state, params, value=loss)
            return optax.apply_updates(params, updates), state, loss

    else:
        # `shard_map`: each device sees its own rows; `axis_name` makes every
        # device, in every process, take the same skip decision.
        state = (tx.init(params), loss_scale)

        def local_step(params, state, x, y):
            opt_state, scale_state = state
            loss, grads = lossscale.value_and_grad(loss_fn)(scale_state, params, x, y)
            grads, loss = jax.lax.pmean((grads, loss), "data")
            params, opt_state, scale_state = lossscale.apply_gradients(
                tx,
                grads=grads,
                params=params,
                opt_state=opt_state,
                loss_scale=scale_state,
                value=loss,
                axis_name="data",
            )
            return params, (opt_state, scale_state), loss

        step = jax.jit(
            jax.shard_map(
                local_step,
                mesh=mesh,
                in_specs=(P(), P(), P("data"), P("data")),
                out_specs=(P(), P(), P()),
            )
        )
        params = jax.device_put(params, replicated)
        state = jax.device_put(state, replicated)

    state = jax.device_put(state, replicated)
    first = 0
    manager = None
    if args.checkpoint_dir:
        first, params, state, manager = restore_or_start(args, params, state)

    def digest(tree):
        # The whole state, gathered to every process, hashed; and whether every
        # local copy of each replicated array is the same.
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(multihost_utils.process_allgather(tree, True)):
            h.update(np.asarray(leaf).tobytes())
        copies_agree = all(
            all(
                np.array_equal(shard.data, leaf.addressable_shards[0].data)
                for shard in leaf.addressable_shards
            )
            for leaf in jax.tree.leaves(tree)
            if leaf.sharding.is_fully_replicated
        )
        agreement = "copies-agree" if copies_agree else "COPIES-DIFFER"
        return f"{h.hexdigest()[:16]} {agreement}"

    for index in range(first, args.steps):
        x, y = batch(index)
        params, state, loss = step(params, state, x, y)
        metrics = lossscale.metrics(state)
        if manager is not None and (index + 1) % args.save_every == 0:
            save(manager, index + 1, params, state)
        say(
            f"process {jax.process_index()} step {index + 1}"
            f" scale {float(metrics['loss_scale']):g}"
            f" skipped {int(metrics['skipped_steps'])}"
            f" digest {digest((params, state))}"
        )
    if manager is not None:
        manager.close()


def say(line: str) -> None:
    """Prints a line in one write, so lines of processes sharing a pipe don't mix.

    To stdout, or to the pipe `--local` gave this process (`EXAMPLE_OUTPUT_FD`).
    """
    fd = os.environ.get("EXAMPLE_OUTPUT_FD")
    os.write(int(fd) if fd else sys.stdout.fileno(), (line + "\n").encode())


def checkpoint_args(params, state, loss_scale_config=None):
    """Orbax's arguments: the train state, and the loss scale's config as JSON."""
    import orbax.checkpoint as ocp

    items = {"train": ocp.args.StandardSave({"params": params, "state": state})}
    if loss_scale_config is not None:
        items["loss_scale"] = ocp.args.JsonSave(loss_scale_config)
    return ocp.args.Composite(**items)


def save(manager, step, params, state):
    """Saves the step's state and its loss scale's config, from every process."""
    import lossscale

    config = lossscale.get_loss_scale(state).get_config()
    manager.save(step, args=checkpoint_args(params, state, config))
    manager.wait_until_finished()


def restore_or_start(args, params, state):
    """The latest checkpoint in `--checkpoint-dir`, or the given state at step 0."""
    import jax
    import orbax.checkpoint as ocp

    import lossscale

    manager = ocp.CheckpointManager(
        os.path.abspath(args.checkpoint_dir),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
    )
    latest = manager.latest_step()
    if latest is None:
        return 0, params, state, manager
    saved = manager.restore(
        latest, args=ocp.args.Composite(loss_scale=ocp.args.JsonRestore())
    ).loss_scale
    # The same kind and settings as the code's:
    lossscale.checkpoints.check_config(saved, state)
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"params": params, "state": state}
    )
    restored = manager.restore(
        latest, args=ocp.args.Composite(train=ocp.args.StandardRestore(target))
    ).train
    say(f"process {jax.process_index()} restored step {latest}")
    return latest, restored["params"], restored["state"], manager


if __name__ == "__main__":
    main()
