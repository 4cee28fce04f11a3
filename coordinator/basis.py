"""Basis service glue: which projection basis (version, payload) goes out with a round."""

from __future__ import annotations

from typing import Any

import numpy as np


def basis_for_round(coordinator: Any, round_id: int) -> tuple[int, dict[str, np.ndarray] | None]:
    """(-1, None) when the federation uses no coordinator-computed basis (no ``public_data``)."""
    if coordinator.cfg.public_data is None:
        return -1, None
    raise NotImplementedError("coordinator basis service: needs the public-gradient function of fedpose.privacy")
