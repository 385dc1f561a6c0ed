"""Several real processes with JAX's distributed runtime (gloo CPU collectives).

Each test starts `examples/multiprocess_train/multiprocess_train.py` as 2 or 4
processes on 127.0.0.1 (a free port each time), each with several CPU devices, and
reads what they print after every step: the loss scale, the skipped steps and a
digest of the whole train state. Every child is killed and reaped when the test
ends, passing or not, and every run has a time limit.
"""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "multiprocess_train" / "multiprocess_train.py"
DEVICES_PER_PROCESS = {2: 4, 4: 2}
LINE = re.compile(
    r"process (\d+) step (\d+) scale (\S+) skipped (\d+) digest (\w+) (\S+)"
)
# Bounds for a run on a loaded 2-core machine; a run takes ~5 s.
RUN_TIMEOUT = 120
HEARTBEAT_TIMEOUT = 5

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="gloo CPU collectives on Linux"
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """`count` processes of the example; kills and reaps them all on exit."""

    def __init__(self, count, args, log_dir, kill_when=None):
        self.count, self.kill_when = count, kill_when
        self.lines = [[] for _ in range(count)]
        self.killed_at = None
        port = free_port()
        self.children = []
        for index in range(count):
            env = dict(
                os.environ,
                COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                NUM_PROCESSES=str(count),
                PROCESS_ID=str(index),
                XLA_FLAGS="--xla_force_host_platform_device_count="
                f"{DEVICES_PER_PROCESS[count]}",
            )
            stderr = open(log_dir / f"stderr-{port}-{index}.log", "w")  # noqa: SIM115
            child = subprocess.Popen(
                [sys.executable, str(EXAMPLE), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,  # its own process group, killed as one
            )
            child.stderr_file = stderr
            self.children.append(child)
        self.readers = [
            threading.Thread(target=self._read, args=(i,), daemon=True)
            for i in range(count)
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, index):
        for line in self.children[index].stdout:
            self.lines[index].append(line.strip())
            if self.kill_when is not None and self.kill_when(index, line):
                self.killed_at = time.monotonic()
                os.killpg(self.children[index].pid, signal.SIGKILL)

    def wait(self, timeout=RUN_TIMEOUT):
        """Return codes; None for a process still running at the deadline."""
        deadline = time.monotonic() + timeout
        for child in self.children:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        return [child.poll() for child in self.children]

    def close(self):
        for child in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            child.stdout.close()
            child.stderr_file.close()
        for reader in self.readers:
            reader.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def steps(self):
        """{step: [(scale, skipped, digest, copies) per process]}."""
        table = {}
        for index, lines in enumerate(self.lines):
            for line in lines:
                match = LINE.match(line)
                if match and int(match.group(1)) == index:
                    step = int(match.group(2))
                    table.setdefault(step, [None] * self.count)[index] = match.groups()[
                        2:
                    ]
        return table


def check_identical_everywhere(table, steps):
    assert sorted(table) == list(range(1, steps + 1)), sorted(table)
    for step, rows in table.items():
        assert None not in rows, (step, rows)
        assert len(set(rows)) == 1, (step, rows)  # bit-identical states
        assert rows[0][3] == "copies-agree", (step, rows)


# `wrap` on four processes, `apply_gradients` on two: each entry point, and more
# than two processes (two processes of `wrap` add nothing these two do not test).
@pytest.mark.parametrize("count, path", [(2, "apply"), (4, "wrap")], ids=str)
@pytest.mark.slow
def test_every_process_skips_and_keeps_identical_state(tmp_path, count, path):
    steps = 6 if count == 2 else 4
    with Run(
        count, ["--steps", str(steps), "--path", path, "--overflow-at", "2,4"], tmp_path
    ) as run:
        assert run.wait() == [0] * count
        table = run.steps()
    check_identical_everywhere(table, steps)
    # The inf went into one process's rows only, at the printed steps 2 and 4;
    # every process skipped exactly those.
    skipped = [int(table[step][0][1]) for step in range(1, steps + 1)]
    expected = [0, 1, 1, 2, 2, 2][:steps]
    assert skipped == expected


@pytest.mark.slow
def test_a_killed_process_stops_the_run_in_bounded_time_and_a_restart_resumes_exactly(
    tmp_path,
):
    args = ["--steps", "9", "--save-every", "3", "--heartbeat-timeout"]
    args.append(str(HEARTBEAT_TIMEOUT))
    logs = tmp_path / "logs"
    logs.mkdir()
    with Run(2, [*args, "--checkpoint-dir", str(tmp_path / "a")], logs) as run:
        assert run.wait() == [0, 0]
        uninterrupted = run.steps()
    check_identical_everywhere(uninterrupted, 9)

    # Kill process 1 (SIGKILL) once it reports step 7: the checkpoint of step 6 is
    # complete, step 7 is not saved.
    def after_step_7(index, line):
        return index == 1 and " step 7 " in line

    interrupted_dir = str(tmp_path / "b")
    with Run(
        2, [*args, "--checkpoint-dir", interrupted_dir], logs, kill_when=after_step_7
    ) as run:
        codes = run.wait()
        assert run.killed_at is not None, run.lines
        # JAX's coordination service misses the dead process's heartbeats and
        # aborts the survivor: no hang, within the heartbeat timeout and margin.
        stopped_after = time.monotonic() - run.killed_at
        assert codes[1] == -signal.SIGKILL
        assert codes[0] is not None and codes[0] != 0, codes
        assert stopped_after < HEARTBEAT_TIMEOUT + 30, stopped_after
        interrupted = run.steps()
    for step in range(1, 7):
        assert interrupted[step] == uninterrupted[step]

    with Run(2, [*args, "--checkpoint-dir", interrupted_dir], logs) as run:
        assert run.wait() == [0, 0]
        resumed = run.steps()
        restored = [line for lines in run.lines for line in lines if "restored" in line]
    assert sorted(restored) == [
        "process 0 restored step 6",
        "process 1 restored step 6",
    ]
    # The steps after the checkpoint are taken again, bit for bit as the run that
    # never stopped took them; nothing up to the checkpoint was lost.
    assert sorted(resumed) == [7, 8, 9]
    for step in (7, 8, 9):
        assert resumed[step] == uninterrupted[step]


@pytest.mark.slow
def test_the_readme_command_runs_locally():
    # The README's command, `... --local 2 --overflow-at 2,4`, with fewer steps.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--local", "2", "--overflow-at", "2,4"]
        + ["--steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [LINE.match(line) for line in out.stdout.splitlines()]
    assert sorted((int(m.group(1)), int(m.group(2))) for m in rows if m) == [
        (p, s) for p in (0, 1) for s in (1, 2, 3)
    ]
    # The printed step 2 is the one skipped, on both processes.
    skipped = {(int(m.group(1)), int(m.group(2))): int(m.group(4)) for m in rows if m}
    assert skipped == {(p, s): int(s >= 2) for p in (0, 1) for s in (1, 2, 3)}
    # Only the example's own lines: Gloo's connection lines are filtered out.
    assert all(m for m in rows), out.stdout[-2000:]
    readme = (ROOT / "README.md").read_text()
    command = (
        "examples/multiprocess_train/multiprocess_train.py --local 2 --overflow-at"
    )
    assert f"python {command} 2,4" in readme
