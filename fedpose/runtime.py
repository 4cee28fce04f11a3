"""Process-level CPU settings for training: torch threads and the C allocator.

``configure_cpu(threads)`` is the one call a training process makes before its first step
(``fedpose train``, a site's round, the coordinator's warm start, the benchmarks).

Why the allocator: glibc serves every allocation above its mmap threshold (128 KiB, adapting up
to 32 MiB) with fresh ``mmap`` pages and unmaps them on free. A training step allocates and frees
activations and per-sample gradients of tens to hundreds of MiB, so every step page-faults its
whole working set again; on these VMs that was most of the frozen prefix's time (measured at
256×192, batch 16: 0.72 s per forward, 0.21 s with the settings below) and ~0.85 s of system time
per non-private step (270 k page faults; none once tuned). Raising the mmap threshold to 512 MiB
and the trim threshold to 2 GiB keeps freed buffers in the heap for reuse. Not higher: torch
allocates 64-byte aligned, and glibc cannot hand an aligned request an exactly-sized freed chunk,
so buffers of ~1 GB in the heap fragment it and raise peak memory; the few buffers that large
(the basis workspace) are reused explicitly instead (see ``fedpose.privacy.projection``).
Measured peak memory (benchmarks/step_cost, 256×192, two runs): within 3 % of glibc's defaults for
none/dpsgd/fdp/maskdp, +3–5 % for pdp and +4–7 % for fpdp (6.0–6.1 vs 5.6–5.9 GiB).
Set ``FEDPOSE_MALLOC_TUNING=0`` to keep the C library's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import torch

# mallopt parameter numbers from <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 29  # 512 MiB
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int
OPT_OUT_VARIABLE = "FEDPOSE_MALLOC_TUNING"


def tune_allocator() -> bool:
    """Keep large freed buffers in glibc's heap (see the module docstring). True if applied.

    A no-op (False) off glibc/Linux or when ``FEDPOSE_MALLOC_TUNING=0``. Idempotent.
    """
    if os.environ.get(OPT_OUT_VARIABLE, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def configure_cpu(threads: int | None = None) -> None:
    """Set torch's intra-op threads (None: leave torch's default) and tune the allocator."""
    if threads:
        torch.set_num_threads(int(threads))
    tune_allocator()
