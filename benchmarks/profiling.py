"""Host time and device time of a jitted step, from a `jax.profiler` trace.

Wall-clock time mixes the host's work (Python, argument handling, dispatch) with the
device's (the kernels). The trace tells them apart:

* host dispatch per call: the duration of the outermost `PjitFunction(...)` event on
  the Python thread, i.e. what one call of the jitted function costs the host before
  it returns, on an accelerator (execution is asynchronous there). XLA:CPU runs part
  of the step inside the call, so there it is not reported (NaN); the host's own
  cost per call is measured by `dispatch.py` instead;
* device kernels per step and their summed time: on a GPU or TPU the events of the
  device's streams (`/device:...` processes); on XLA:CPU, where the "device" is the
  host's thread pool, the thunks XLA runs there (fusions and library calls), whose
  summed time can exceed the wall time when they run in parallel.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile

import jax
import numpy as np

# Bookkeeping events on XLA:CPU's threads, not work.
_CPU_BOOKKEEPING = ("ThreadpoolListener", "ThunkExecutor", "end: ", "Slinky", "$")


def profile(run_block, steps: int) -> dict[str, float]:
    """Traces `run_block(steps)` (which dispatches `steps` steps and waits).

    Returns:
      `dispatch_us` (median per call), `kernels_per_step`, `kernel_us_per_step`.
    """
    kernels, calls, on_device = _trace(run_block, steps)
    dispatch = np.median([e["dur"] for e in calls]) if calls and on_device else np.nan
    return {
        "dispatch_us": float(dispatch),
        "kernels_per_step": len(kernels) / steps,
        "kernel_us_per_step": sum(e.get("dur", 0.0) for e in kernels) / steps,
    }


def kernel_events(run_block, steps: int) -> list[dict]:
    """The device's kernel events (name, dur in us, args) over `run_block(steps)`."""
    return _trace(run_block, steps)[0]


def _trace(run_block, steps: int) -> tuple[list[dict], list[dict], bool]:
    """(kernel events, outermost jit-call events, whether a device was traced)."""
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            run_block(steps)
        (path,) = glob.glob(
            os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True
        )
        with gzip.open(path) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") != "M":
            continue
        name = event.get("args", {}).get("name", "")
        if event.get("name") == "process_name":
            processes[event["pid"]] = name
        elif event.get("name") == "thread_name":
            threads[(event["pid"], event.get("tid"))] = name
    work = [e for e in events if e.get("ph") == "X"]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    if devices:
        kernels = [e for e in work if e["pid"] in devices]
    else:
        kernels = [
            e
            for e in work
            if threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")
            and not e.get("name", "").startswith(_CPU_BOOKKEEPING)
        ]
    calls = _outermost(
        [e for e in work if e.get("name", "").startswith("PjitFunction(")]
    )
    return kernels, calls, bool(devices)


def _outermost(events):
    """The events not nested in another of the list on the same thread."""
    events = sorted(events, key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    kept, end = [], {}
    for event in events:
        if event["ts"] < end.get(event["tid"], -np.inf):
            continue
        kept.append(event)
        end[event["tid"]] = event["ts"] + event["dur"]
    return kept
