"""What every accountant shares: the events it composes, the neighbouring relations, the interface.

An accountant turns a list of :class:`Event` s — ``steps`` applications of the Poisson-subsampled
Gaussian mechanism with noise multiplier σ at sampling rate q — under one neighbouring relation
into ε at a given δ. The events are the accountant's whole input: a site persists them, so its
spend can be recomputed with any accountant later (``fedpose privacy budget``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

#: DP-SGD, PDP-SGD: neighbours differ by one record; sampling hides membership.
ADD_REMOVE = "add_remove"
#: FDP, FP-DP, MaskDP: neighbours replace one record's private part; its public part (ψ(x), label)
#: stays. The noise-free public gradient is taken on a sample drawn independently of the private
#: one, so it shows nothing about whether the record was sampled: the substitution relation of the
#: Poisson-subsampled Gaussian (Balle et al. 2018; dp-accounting's REPLACE_ONE).
REPLACE_ONE = "replace_one"
#: The same neighbours when the public gradient came from the private sample itself, so that it may
#: show whether the record was sampled: how FDP ran until 2026-11-27. Budgets written then keep it.
#: Every mechanism analysed under ``replace_one`` is also bounded by it (:func:`bounds`).
REPLACE_PUBLIC_MEMBERSHIP = "replace_public_membership"
RELATIONS: tuple[str, ...] = (ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP)


@dataclass(frozen=True)
class Event:
    """``steps`` Poisson-subsampled Gaussian steps: noise std σ·C, each unit sampled with prob. q."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        check_event(self.noise_multiplier, self.sample_rate, self.steps)


def check_event(noise_multiplier: float, sample_rate: float, steps: int) -> None:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not (isinstance(sample_rate, (int, float)) and 0 <= sample_rate <= 1):
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate!r}")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")


def check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def check_relation(relation: str) -> None:
    if relation not in RELATIONS:
        raise ValueError(f"unknown neighbouring relation {relation!r}; known: {sorted(RELATIONS)}")


def bounds(ledger_relation: str, mechanism_relation: str) -> bool:
    """Whether ε composed under ``ledger_relation`` is a valid bound for a mechanism whose own relation
    is ``mechanism_relation``: the same relation, or visible membership for ``replace_one`` (it grants
    the adversary the batch membership that ``replace_one`` keeps hidden, so its ε is never smaller)."""
    return ledger_relation == mechanism_relation or (
        ledger_relation == REPLACE_PUBLIC_MEMBERSHIP and mechanism_relation == REPLACE_ONE)


def effective(events: Sequence[Event]) -> list[Event]:
    """Events that release anything (zero steps or q = 0 change nothing), those with the same (σ, q)
    merged into one, in order of first appearance. Composition is commutative, so the merged list is
    the same mechanism; a budget holds one segment per round, and a PLD accountant composing eight
    rounds of one (σ, q) as one 80-fold self-composition instead of eight convolutions took 0.4 s
    instead of 4.6 s here (each site round asks several times), for the same ε to ~1e-10."""
    steps: dict[tuple[float, float], int] = {}
    for e in events:
        if e.steps > 0 and e.sample_rate > 0:
            key = (e.noise_multiplier, e.sample_rate)
            steps[key] = steps.get(key, 0) + e.steps
    return [Event(sigma, q, n) for (sigma, q), n in steps.items()]


class Accountant(Protocol):
    """One accountant: a name, the relations it handles, and ε of a list of events."""

    name: str  #: registry key and the label printed next to every ε ("rdp", "pld", "prv")
    title: str  #: one line for help texts and reports
    #: relations for which the accountant's ε is the tight (optimal) one up to its numerical error
    exact_for: frozenset[str]
    #: the largest target ε a σ may be calibrated to with this accountant (∞: no limit)
    largest_epsilon: float

    def supports(self, relation: str) -> bool: ...

    def epsilon(self, events: Sequence[Event], relation: str, delta: float) -> float:
        """ε (an upper bound: the guarantee) after all ``events`` under ``relation`` at ``delta``;
        0 when nothing was released, ∞ when some event has σ = 0."""
        ...
