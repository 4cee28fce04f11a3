"""fedpose.runtime: the allocator setting keeps a training loop's large buffers off fresh pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A "step" that allocates and frees two 64 MiB tensors, as a training step does with activations.
_LOOP = """
import json, resource, torch
from fedpose.runtime import tune_allocator
tuned = tune_allocator()
faults = []
for _ in range(32):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.ones(16 << 20); b = a * 2; float(b.sum()); del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": faults}))
"""
PAGES_PER_TENSOR = (64 << 20) // os.sysconf("SC_PAGE_SIZE")


def _run(tuning: str) -> dict:
    env = {**os.environ, "FEDPOSE_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", _LOOP], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_allocator_reuses_buffers_and_opt_out_keeps_defaults() -> None:
    tuned, default = _run("1"), _run("0")
    assert tuned["tuned"] is True and default["tuned"] is False
    # glibc default: every 64 MiB buffer is a fresh mmap, so every step faults it in again.
    assert all(f >= PAGES_PER_TENSOR for f in default["faults"][1:]), default
    # Tuned: after a few steps (glibc's aligned allocations fragment the heap at first) the heap has
    # room for the step's buffers and steps stop faulting. Not "never": on a busy machine a later step
    # was once seen to fault one buffer in again (CI, stop 43), so allow two of the last 20 steps.
    faulting_steps = [f for f in tuned["faults"][12:] if f >= PAGES_PER_TENSOR // 4]
    assert len(faulting_steps) <= 2, tuned


def test_configure_cpu_sets_threads() -> None:
    code = "import torch; from fedpose.runtime import configure_cpu; configure_cpu(1); print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


# Subnormal floats (|x| < 1.2e-38) are 40–130× slower on x86 unless flushed; a crafted global model
# could make a site's round time count images with some property (fedpose.runtime). Each case runs
# in a fresh process: the flag is per thread, copied by the threads torch starts.
_SUBNORMALS = """
import json, sys
import numpy as np, torch
torch.set_num_threads(2)
def main_thread_ieee():  # one small op runs on the calling thread; numpy's float64 too
    one = torch.tensor([0x000AE398], dtype=torch.int32).view(torch.float32)
    return bool((one * 0.5).any()) and bool(np.float64(1e-310) * 0.5 != 0)
if sys.argv[1] == "default":  # nothing of fedpose: the CPU's default
    subnormal = torch.full((1 << 20,), 0x000AE398, dtype=torch.int32).view(torch.float32)
    print(json.dumps({"flushed": not bool((subnormal * 0.5).any())}))
    sys.exit(0)
if sys.argv[1] == "pool-first":
    torch.full((1 << 20,), 1.0).sum()  # torch's worker threads start before fedpose is imported
else:  # what a site's ClientApp process does: load the app, then its train handler's first steps
    import sites.client_app
    sites.client_app.start_training_threads()
    import fedpose.federation.local_training
    torch.full((1 << 20,), 1.0).sum()  # work before the training block (model, data) runs on those threads
from fedpose.runtime import subnormals_as_zero, subnormals_flushed
with subnormals_as_zero() as every_thread:
    inside = subnormals_flushed()
print(json.dumps({"every_thread": every_thread, "inside": inside, "threads": torch.get_num_threads(),
                  "ieee_after": main_thread_ieee()}))
"""


def _subnormals(case: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SUBNORMALS, case], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_subnormals_are_slow_values_unless_flushed() -> None:
    assert _subnormals("default") == {"flushed": False}  # what the defence is for


def test_a_site_process_trains_with_every_thread_flushing_and_accounts_in_ieee() -> None:
    """Inside the block every thread flushes; after it the calling thread computes IEEE subnormals
    again (the flag changed dp-accounting's result at an extreme σ, so accounting stays outside)."""
    assert _subnormals("site-process") == {"every_thread": True, "inside": True, "threads": 2, "ieee_after": True}


def test_older_worker_threads_fall_back_to_one_flushed_thread() -> None:
    """Where torch's workers started without the flag, they cannot get it: the block computes on the
    calling thread alone."""
    assert _subnormals("pool-first") == {"every_thread": False, "inside": True, "threads": 1, "ieee_after": True}


def test_a_secure_aggregation_stage_loads_no_torch() -> None:
    """Each message is a fresh ClientApp process: a SecAgg stage (setup, share keys, unmask) needs
    no torch, and importing it cost 2.3 of the 3.5 s the process spent loading the app."""
    code = "import sys, sites.client_app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False"
