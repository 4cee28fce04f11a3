"""Which projection basis goes out with a round, and which site holds which version.

Version = the round the basis was computed in, at that round's global weights; recomputed every
``coordinator.basis.refresh_every_rounds`` rounds. A site counts as holding a version only once
it *reports* it (its reply), never when it was sent. A basis message is bound to the weights it
was computed at (sites check the digest; a compact recipe can only be rebuilt there), so when a
site lacking the current version is selected in a later round (late join, missed rounds) or after
a coordinator restart (the message is not persisted), a new version is computed for this round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedpose.federation.basis_transport import BasisMessage

NO_BASIS = -1


@dataclass
class BasisService:
    refresh_every_rounds: int
    current_version: int = NO_BASIS
    held: dict[str, int] = field(default_factory=dict)  #: site id → version the site reported
    message: BasisMessage | None = None  #: the current version's message (memory only)

    def needs_refresh(self, round_id: int) -> bool:
        """No basis yet, the current one is R or more rounds old, or its message was lost (restart)."""
        return self.current_version < 0 or self.message is None or round_id - self.current_version >= self.refresh_every_rounds

    def needs_basis(self, site_id: str | None) -> bool:
        """Whether a site (None: not yet identified) lacks the current version."""
        return self.current_version >= 0 and (site_id is None or self.held.get(site_id) != self.current_version)

    def for_round(self, round_id: int, selected_sites: Iterable[str | None],
                  compute: Callable[[int], BasisMessage]) -> tuple[int, BasisMessage]:
        """(version, message) to use this round; ``compute(version)`` builds a new one when needed."""
        lacking = any(self.needs_basis(site) for site in selected_sites)
        if self.needs_refresh(round_id) or (lacking and self.current_version != round_id):
            self.message = compute(round_id)
            self.current_version = round_id
        assert self.message is not None
        return self.current_version, self.message

    def mark_held(self, site_id: str, version: int) -> None:
        """What the site's reply says it holds (-1: nothing, e.g. a lost cache — it gets the next one)."""
        self.held[site_id] = int(version)

    def state_dict(self) -> dict[str, Any]:
        return {"refresh_every_rounds": self.refresh_every_rounds, "current_version": self.current_version, "held": dict(self.held)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], refresh_every_rounds: int) -> "BasisService":
        """From a coordinator checkpoint; the refresh period is the current config's."""
        return cls(int(refresh_every_rounds), int(state.get("current_version", NO_BASIS)),
                   {str(k): int(v) for k, v in dict(state.get("held", {})).items()})
