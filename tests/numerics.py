"""Floating-point tolerances derived from the dtype and the problem's size and scale.

Round-off differs between CPUs (AVX-512 or AVX2 kernels, ``ATEN_CPU_CAPABILITY=default``) and with
the thread count (the order of a parallel sum): a fixed tolerance tuned on one machine fails on
another. Where round-off is the only error in a comparison, tests take their tolerance from here.
"""

from __future__ import annotations

import math

import numpy as np

#: headroom over the typical (random-walk) error, so an unlucky CPU/order stays inside the bound
SAFETY = 16.0


def eps(dtype: object = np.float32) -> float:
    """Machine epsilon of a numpy or torch float dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return float(torch.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


def sum_tolerance(terms: int, scale: float = 1.0, dtype: object = np.float32) -> float:
    """Absolute round-off bound of a sum (or dot product) of ``terms`` values of magnitude ``scale``
    in ``dtype``: the random-walk error √n·eps·scale, times :data:`SAFETY`."""
    return SAFETY * math.sqrt(max(terms, 1)) * eps(dtype) * scale
