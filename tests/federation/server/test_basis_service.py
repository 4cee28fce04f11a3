"""Basis bookkeeping: when a new version is computed and which sites get it."""

from __future__ import annotations

from fedpose.federation.basis_transport import encode_full
from fedpose.federation.server.basis_service import BasisService

import numpy as np


def test_versions_refresh_every_r_rounds_and_go_only_to_sites_lacking_them() -> None:
    computed: list[int] = []

    def compute(version: int):
        computed.append(version)
        return encode_full(np.eye(4, 2, dtype=np.float32), version, f"w{version}")

    service = BasisService(refresh_every_rounds=3)
    assert not service.needs_basis("a") and service.needs_refresh(1)
    assert service.for_round(1, ["a", "b"], compute)[0] == 1
    assert service.needs_basis("a") and service.needs_basis(None)  # nobody reported holding it yet
    service.mark_held("a", 1)
    service.mark_held("b", 1)
    assert service.for_round(2, ["a", "b"], compute)[0] == 1 and not service.needs_basis("a")
    service.mark_held("b", -1)  # b lost its cache: a fresh version, bound to this round's weights
    assert service.for_round(3, ["a", "b"], compute)[0] == 3 and service.needs_basis("a")
    service.mark_held("a", 3)
    service.mark_held("b", 3)
    assert service.for_round(5, ["a", "b"], compute)[0] == 3 and service.for_round(6, ["a"], compute)[0] == 6  # R = 3
    assert computed == [1, 3, 6]

    restored = BasisService.from_state(service.state_dict(), refresh_every_rounds=3)  # coordinator checkpoint / resume
    assert restored.current_version == 6 and restored.held == {"a": 3, "b": 3}
    assert restored.needs_refresh(7)  # the message itself is not persisted: recomputed after a restart
