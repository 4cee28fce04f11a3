"""Basis service glue: which projection basis (version, message) goes out with a round.

Version = the round the basis was computed in, at that round's global weights; recomputed every
``coordinator.basis.refresh_every_rounds`` rounds. A basis message is bound to the weights it was
computed at (sites check the digest; a compact recipe can only be rebuilt there), so when a site
lacking the current version is selected in a later round (late join, missed rounds) or after a
coordinator restart (the message is not persisted), a new version is computed for this round.
"""

from __future__ import annotations

from typing import Any

from fedpose.federation.basis_transport import BasisMessage


def basis_for_round(coordinator: Any, round_id: int, selected_sites: list[str | None]) -> tuple[int, BasisMessage | None]:
    """(-1, None) when the federation uses no coordinator basis (no ``coordinator.public_data``)."""
    cfg, state = coordinator.cfg, coordinator.state
    if cfg.public_data is None:
        return -1, None
    current = state.basis_version
    lacking = any(site is None or state.site_basis.get(site) != current for site in selected_sites)
    refresh = current < 0 or round_id - current >= cfg.basis.refresh_every_rounds
    refresh = refresh or coordinator.basis_message is None
    refresh = refresh or (lacking and current != round_id)
    if refresh:
        from fedpose.federation.public_basis import compute_basis

        coordinator.basis_message = compute_basis(
            coordinator._model(), cfg.public_data, k=cfg.basis.k, m=cfg.basis.public_samples, version=round_id,
            transport=cfg.basis.transport, dtype=cfg.basis.dtype,
        )
        state.basis_version = round_id
    return state.basis_version, coordinator.basis_message
