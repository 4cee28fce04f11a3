"""PRV accountant (Gopi, Lee & Wutschitz 2021): Opacus' maintained copy (``opacus.accountants.PRVAccountant``).

Opacus' copy has fixes the standalone ``prv-accountant`` lacks (FACTS.md). It reports the upper end
of its error bracket (``eps_error`` = 0.01), so its ε is a guarantee. Opacus analyses the
Poisson-subsampled Gaussian under add/remove only: for the FDP family's relation use ``pld``
(exact there) or ``rdp``. Opacus is imported on first use only: its package init loads torch.
"""

from __future__ import annotations

import math
from typing import Sequence

from fedpose.privacy.accountants.base import ADD_REMOVE, Event, check_delta, check_relation, effective

#: Opacus' default accuracy of the ε estimate; the reported ε is the upper end of the bracket
EPS_ERROR = 0.01


class PrvAccountant:
    name = "prv"
    title = "privacy random variables (Gopi et al. 2021; Opacus' PRVAccountant), add/remove only"
    exact_for: frozenset[str] = frozenset({ADD_REMOVE})
    largest_epsilon = math.inf

    def supports(self, relation: str) -> bool:
        return relation == ADD_REMOVE

    def epsilon(self, events: Sequence[Event], relation: str, delta: float) -> float:
        check_delta(delta)
        check_relation(relation)
        if not self.supports(relation):
            raise ValueError(
                f"the prv accountant (Opacus) handles only the add_remove relation, not {relation!r}; "
                "use 'pld' (exact for it) or 'rdp'"
            )
        events = effective(events)
        if not events:
            return 0.0
        if any(e.noise_multiplier == 0 for e in events):
            return math.inf
        from opacus.accountants import PRVAccountant

        accountant = PRVAccountant()
        accountant.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in events]
        return float(accountant.get_epsilon(delta, eps_error=EPS_ERROR))
