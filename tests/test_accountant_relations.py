"""The FDP-family neighbouring relation: replace-one with public batch membership.

FDP releases the public-loss gradient without noise, so whether a record was sampled may be
visible; the add/remove subsampled-Gaussian curve is then not a valid bound. These tests check
the bound fedpose uses instead against an exact numerical Rényi divergence.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpose.privacy.accountant import (
    ADD_REMOVE,
    REPLACE_PUBLIC_MEMBERSHIP,
    RDPAccountant,
    add_remove_rdp,
    epsilon_for,
    noise_multiplier_for,
    replace_public_membership_rdp,
)
from fedpose.privacy.report import relation_of


def exact_mixture_rdp(alpha: float, q: float, sigma: float, public_shift: float) -> float:
    """D_α(P‖Q) in 1-D by quadrature: the record is sampled with prob. q and then adds its public
    gradient (public_shift, identical in both worlds) plus a clipped private gradient of +C or −C
    (C = 1, ‖u − u'‖ = 2); noise std σC."""
    x = np.linspace(-12 * sigma - 2, public_shift + 12 * sigma + 2, 400_001)
    dx = x[1] - x[0]

    def log_normal(mean: float) -> np.ndarray:
        return -0.5 * ((x - mean) / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))

    log_p = np.logaddexp(math.log1p(-q) + log_normal(0.0), math.log(q) + log_normal(public_shift + 1.0))
    log_q = np.logaddexp(math.log1p(-q) + log_normal(0.0), math.log(q) + log_normal(public_shift - 1.0))
    integrand = alpha * log_p + (1 - alpha) * log_q
    top = integrand.max()
    return (top + math.log(np.exp(integrand - top).sum() * dx)) / (alpha - 1)


@pytest.mark.parametrize("alpha", [2.0, 4.0, 8.0])
def test_bound_dominates_and_is_tight_when_membership_is_visible(alpha: float) -> None:
    q, sigma = 0.1, 2.0
    bound = replace_public_membership_rdp(q, sigma, 1, [alpha])[0]
    visible = exact_mixture_rdp(alpha, q, sigma, public_shift=80 * sigma)  # sampled ⇔ visible
    hidden = exact_mixture_rdp(alpha, q, sigma, public_shift=0.0)
    assert visible <= bound * (1 + 1e-6)
    assert visible >= 0.98 * bound  # the worst case reaches the bound
    assert hidden <= bound
    # ... and with membership visible, the add/remove curve would understate the loss.
    assert add_remove_rdp(q, sigma, 1, [alpha])[0] < 0.5 * visible


def test_full_batch_is_the_gaussian_mechanism_with_sensitivity_2c() -> None:
    orders = [1.5, 2.0, 10.0, 64.0]
    sigma, steps = 3.0, 7
    expected = [steps * a * 2.0**2 / (2 * sigma**2) for a in orders]
    assert replace_public_membership_rdp(1.0, sigma, steps, orders) == pytest.approx(expected, rel=1e-12)


def test_guarantees_map_to_relations_and_ledgers_keep_theirs() -> None:
    assert relation_of("DP") == ADD_REMOVE
    assert relation_of("FDP") == relation_of("MaskDP") == REPLACE_PUBLIC_MEMBERSHIP
    ledger = RDPAccountant(relation=REPLACE_PUBLIC_MEMBERSHIP)
    ledger.step(4.0, 0.1, 30)
    restored = RDPAccountant.from_dict(ledger.to_dict())
    assert restored.relation == REPLACE_PUBLIC_MEMBERSHIP
    assert restored.get_epsilon(1e-5) == ledger.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="cannot compose"):
        RDPAccountant().merge(ledger)
    with pytest.raises(ValueError, match="unknown neighbouring relation"):
        RDPAccountant(relation="add_or_remove")


def test_fdp_epsilon_exceeds_dp_epsilon_and_calibration_respects_the_relation() -> None:
    dp, _ = epsilon_for(1.0, 0.1, 50, 1e-5)
    fdp, _ = epsilon_for(1.0, 0.1, 50, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP)
    assert fdp > 3 * dp
    sigma = noise_multiplier_for(8.0, 0.1, 50, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP)
    assert epsilon_for(sigma, 0.1, 50, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP)[0] <= 8.0
    assert epsilon_for(sigma * 0.99, 0.1, 50, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP)[0] > 8.0


@pytest.mark.parametrize("mechanism, relation", [
    ("dpsgd", ADD_REMOVE), ("pdp", ADD_REMOVE),
    ("fdp", REPLACE_PUBLIC_MEMBERSHIP), ("fpdp", REPLACE_PUBLIC_MEMBERSHIP), ("maskdp", REPLACE_PUBLIC_MEMBERSHIP),
])
def test_engine_accounts_each_mechanism_under_its_guarantee_relation(mechanism: str, relation: str) -> None:
    from fedpose.config import ModelConfig, PrivacyConfig
    from fedpose.model import build_model
    from fedpose.privacy.engine import build_engine

    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="scratch"), (64, 64))
    privacy = PrivacyConfig(mechanism=mechanism, target_epsilon=5.0, delta=1e-5)
    engine = build_engine(privacy, model, dataset_size=100, batch_size=10, planned_steps=20, seed=0)
    assert engine.accountant.relation == relation
    assert engine.privacy_report()["neighbouring_relation"] == relation
    # σ is calibrated by the default accountant, PLD: exact for both relations
    assert engine.accountant.accountant == engine.privacy_report()["accountant"] == "pld"
    assert epsilon_for(engine.noise_multiplier, 0.1, 20, 1e-5, relation=relation, accountant="pld")[0] <= 5.0


def test_site_budget_uses_the_guarantee_relation_and_rejects_a_mismatched_ledger(tmp_path) -> None:
    import json

    from fedpose.federation.site_budget import BudgetStateError, SiteBudget

    budget = SiteBudget(tmp_path, "site-a", eps_max=100.0, delta=1e-5, guarantee="FDP")
    budget.authorize_round("run", 1, noise_multiplier=2.0, sample_rate=0.1, steps=10)
    assert budget.accountant().relation == REPLACE_PUBLIC_MEMBERSHIP
    assert budget.accountant_name == "pld"  # the default for a new budget: exact for this relation
    assert budget.epsilon == pytest.approx(epsilon_for(2.0, 0.1, 10, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="pld")[0])

    # A ledger written under the add/remove curve for an FDP site would understate the spend.
    doc = json.loads(budget.path.read_text())
    doc["payload"]["accountant"]["relation"] = ADD_REMOVE
    from fedpose.federation.site_budget import _digest

    doc["sha256"] = _digest(doc["payload"])
    budget.path.write_text(json.dumps(doc))
    with pytest.raises(BudgetStateError, match="relation"):
        SiteBudget(tmp_path, "site-a", eps_max=100.0, delta=1e-5, guarantee="FDP")
