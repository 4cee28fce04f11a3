"""Process-level settings for training: the device, and on CPU torch threads and the C allocator.

``resolve_device(setting, key)`` turns a ``train.device`` / ``coordinator.device`` setting
(``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``) into a ``torch.device``; ``configure_device(device,
threads)`` is the one call a training process makes before its first step (``fedpose train``, a
site's round, the coordinator's warm start, the benchmarks). The CPU tuning below
(``configure_cpu``: threads and allocator) applies only when the device is the CPU; on CUDA it
allows TF32 matmuls instead (per-sample gradients, clipping and noise stay float32 tensors: TF32
only rounds the inputs of matrix products to a 10-bit mantissa, as the issue's precision rule allows).

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

Why subnormal floats flush to zero while a site trains: on x86 CPUs arithmetic on subnormals
(|x| < 1.2e-38 in float32) is 40–130× slower than on normal numbers, so a coordinator could craft a
finite global model whose activations turn subnormal exactly where an image has some property —
and a site's round time would count its images with it (a timing side channel outside the DP
guarantee; measured with the small backbone: 16 rows 0.20 s vs 2.4 s). Flush-to-zero makes every
float operation cost the same. It is a per-thread CPU flag, and a thread torch starts copies it
from the thread that starts it: ``configure_cpu`` starts torch's threads with it set, and a site
trains inside :func:`subnormals_as_zero` (which checks every thread and falls back to one thread
where an older worker lacks it). Only there: the flag also rounds numpy's float64 subnormals to
zero, which changed what dp-accounting computes at an extreme σ (ε 727 instead of its overflow),
so accounting runs with IEEE arithmetic, outside the block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import sys
from contextlib import contextmanager
from typing import Iterator

import torch

from fedpose.config import DEVICE_CHOICES, ConfigError

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
    """Set torch's intra-op threads (None: leave torch's default) and tune the allocator. The
    threads torch starts here flush subnormals to zero (the module docstring)."""
    start_cpu_threads(threads)
    tune_allocator()


_SUBNORMAL_BITS = 0x000AE398  # float32 ≈ 1.0e-39, below the smallest normal number (1.18e-38)


def subnormals_flushed() -> bool:
    """Whether every torch CPU thread of this process computes with subnormal floats as zeros, so no
    operation's time depends on whether its values are subnormal (the module docstring). False
    outside :func:`subnormals_as_zero`, where threads torch started without the flag work, or on a
    CPU without the mode."""
    # large enough that every intra-op thread takes a share: an element-wise product and a matrix
    # product (BLAS runs its own kernels); flushed, both are exactly zero
    subnormal = torch.full((1 << 20,), _SUBNORMAL_BITS, dtype=torch.int32).view(torch.float32)
    elementwise = subnormal * 0.5
    matrix = torch.mm(subnormal[: 256 * 4096].view(256, 4096), torch.ones(4096, 64))
    return not bool(elementwise.any()) and not bool(matrix.any())


def start_cpu_threads(threads: int | None = None) -> None:
    """Set torch's intra-op threads (None: torch's default) and start those it has not started yet,
    each flushing subnormals to zero (the module docstring); the calling thread keeps IEEE
    arithmetic. The first thing a site process does."""
    torch.set_flush_denormal(True)
    try:
        if threads:
            torch.set_num_threads(int(threads))
        subnormals_flushed()  # a parallel region: torch starts its missing threads now, with the flag
    finally:
        torch.set_flush_denormal(False)


@contextmanager
def subnormals_as_zero() -> Iterator[bool]:
    """Flush subnormal floats to zero on the calling thread for the block, IEEE arithmetic after;
    yields whether every torch CPU thread flushes them (the module docstring). Where older worker
    threads do not, the block computes on the calling thread alone (torch.set_num_threads(1):
    slower, never data-dependent) and yields False. RuntimeError on a CPU without the mode."""
    torch.set_flush_denormal(True)
    try:
        every_thread = subnormals_flushed()
        if not every_thread:
            torch.set_num_threads(1)
            if not subnormals_flushed():
                raise RuntimeError("this CPU cannot flush subnormal floats to zero: a crafted global model could make a "
                                   "round's time depend on the site's images")
        yield every_thread
    finally:
        torch.set_flush_denormal(False)


# -- devices ----------------------------------------------------------------------------------------
class DeviceUnavailable(ConfigError):
    """A device setting names a device this machine does not have; the message names the setting."""


class DeviceOutOfMemory(ConfigError):
    """The device ran out of memory; the message names the settings that size the work."""


def _cuda_missing_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "no CUDA GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")


def resolve_device(setting: str, key: str = "train.device") -> torch.device:
    """The torch device of a device setting: ``auto`` (the first CUDA GPU when one is visible, else
    the CPU), ``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N``. ``key`` is the setting's name, for
    the error raised when CUDA is asked for and not available (:class:`DeviceUnavailable`)."""
    value = str(setting).strip().lower()
    match = re.fullmatch(r"cuda(?::(\d+))?", value)
    if value not in ("auto", "cpu") and match is None:
        raise ConfigError(f"{key} = {setting!r}: must be {DEVICE_CHOICES}")
    if value == "cpu" or (value == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = int(match.group(1)) if match is not None and match.group(1) is not None else 0
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"{key} = {setting!r}: CUDA is not available here ({_cuda_missing_reason()}); "
                                f"set {key} = \"cpu\" (or \"auto\": CUDA when available, else the CPU)")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(f"{key} = {setting!r}: only {count} CUDA device(s) visible (cuda:0 … cuda:{count - 1})")
    return torch.device("cuda", index)


def describe_device(device: torch.device) -> str:
    """The device as reports print it: ``cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)`` or ``cpu (2 threads)``."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    threads = torch.get_num_threads()
    return f"{device} ({threads} thread{'' if threads == 1 else 's'})"


def cpu_model() -> str:
    """The CPU's model name, for benchmark conditions ("Intel(R) Xeon(R) ..."; ``platform.processor()``
    where /proc/cpuinfo is missing, which on Linux is often empty)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's parameters live on (every fedpose model keeps them on one device)."""
    return next(model.parameters()).device


def configure_device(device: torch.device, threads: int | None = None) -> None:
    """Process settings for training on ``device``: :func:`configure_cpu` on the CPU (threads and
    allocator: CPU-only tuning), TF32 matmuls on CUDA (``threads`` does not apply there)."""
    if device.type == "cpu":
        configure_cpu(threads)
    elif device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a wall-clock time around it
    measures the work; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def out_of_memory_hint(what: str, settings: str) -> Iterator[None]:
    """Re-raise a device out-of-memory error inside the block as :class:`DeviceOutOfMemory`, saying
    what ran out (``what``) and which settings to lower (``settings``)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeviceOutOfMemory(f"{what} ran out of device memory ({first_line}); lower {settings}") from exc
