"""Privacy accountants by name (Opacus-style registry): ``rdp``, ``pld``, ``prv``.

Each accountant lives in its own module and implements :class:`~.base.Accountant`; callers look
one up with :func:`get_accountant` and never branch on names.

Which one by default (:func:`default_accountant`): the tightest accountant that is exact for the
mechanism's neighbouring relation, preferring PLD —

* ``add_remove`` (dpsgd, pdp): ``pld`` (dp-accounting). PRV is exact there too and agrees to
  ~0.01 ε, but needs Opacus' package init (torch) in every process that accounts; RDP is 5–15 %
  looser in ε (~4–7 % more σ at the same ε).
* ``replace_one`` (fdp, fpdp, maskdp): ``pld`` (dp-accounting's subsampled Gaussian under
  substitution). RDP bounds it by the visible-membership curve (loose); PRV (Opacus) does not handle it.
* ``replace_public_membership`` (FDP budgets written before the public sample was independent):
  ``pld`` with the closed-form privacy profile derived in :mod:`.pld` (with probability 1 − q
  nothing, with probability q a Gaussian of sensitivity 2C; membership visible).
"""

from __future__ import annotations

from typing import Literal

from fedpose.privacy.accountants.base import (
    ADD_REMOVE,
    RELATIONS,
    REPLACE_ONE,
    REPLACE_PUBLIC_MEMBERSHIP,
    Accountant,
    Event,
    bounds,
    check_relation,
)
from fedpose.privacy.accountants.pld import PldAccountant
from fedpose.privacy.accountants.prv import PrvAccountant
from fedpose.privacy.accountants.rdp import RdpAccountant

AccountantName = Literal["rdp", "pld", "prv"]

#: name → accountant; the order is the preference when choosing a default
ACCOUNTANTS: dict[str, Accountant] = {a.name: a for a in (PldAccountant(), PrvAccountant(), RdpAccountant())}


def get_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]
    except KeyError:
        raise ValueError(f"unknown accountant {name!r}; available: {', '.join(sorted(ACCOUNTANTS))}") from None


def default_accountant(relation: str) -> str:
    """The first accountant (in :data:`ACCOUNTANTS` order) exact for ``relation``; else one that supports it."""
    check_relation(relation)
    for accountant in ACCOUNTANTS.values():
        if relation in accountant.exact_for:
            return accountant.name
    return next(a.name for a in ACCOUNTANTS.values() if a.supports(relation))


__all__ = [
    "ACCOUNTANTS", "ADD_REMOVE", "REPLACE_ONE", "REPLACE_PUBLIC_MEMBERSHIP", "RELATIONS", "Accountant", "AccountantName", "Event",
    "bounds", "default_accountant", "get_accountant",
]
