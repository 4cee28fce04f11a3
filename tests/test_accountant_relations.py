"""The FDP-family neighbouring relations: replace-one, membership hidden or visible.

FDP releases the public-loss gradient without noise. Taken on the private sample, it may show
whether a record was sampled (``replace_public_membership``: FDP budgets written before the change
keep it); taken on an independent sample it shows nothing about that (``replace_one``, the
substitution relation of the subsampled Gaussian). Either way the add/remove curve is not a valid
bound. These tests check each bound against exact numerical divergences, and that the 1-D pair
behind ``replace_one`` is the worst case of two clipped gradients in any direction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpose.privacy.accountant import (
    ADD_REMOVE,
    REPLACE_ONE,
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
    assert relation_of("FDP") == relation_of("MaskDP") == REPLACE_ONE
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
    ("fdp", REPLACE_ONE), ("fpdp", REPLACE_ONE), ("maskdp", REPLACE_ONE),
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
    # σ is calibrated by the default accountant, PLD: exact for every relation
    assert engine.accountant.accountant == engine.privacy_report()["accountant"] == "pld"
    assert epsilon_for(engine.noise_multiplier, 0.1, 20, 1e-5, relation=relation, accountant="pld")[0] <= 5.0


def test_site_budget_uses_the_guarantee_relation_and_rejects_a_mismatched_ledger(tmp_path) -> None:
    import json

    from fedpose.federation.site_budget import BudgetStateError, SiteBudget

    budget = SiteBudget(tmp_path, "site-a", eps_max=100.0, delta=1e-5, guarantee="FDP")
    budget.authorize_round("run", 1, noise_multiplier=2.0, sample_rate=0.1, steps=10)
    assert budget.accountant().relation == REPLACE_ONE
    assert budget.accountant_name == "pld"  # the default for a new budget: exact for this relation
    assert budget.epsilon == pytest.approx(epsilon_for(2.0, 0.1, 10, 1e-5, relation=REPLACE_ONE, accountant="pld")[0])
    assert budget.report()["relation"] == REPLACE_ONE

    # A ledger written under the add/remove curve for an FDP site would understate the spend.
    doc = json.loads(budget.path.read_text())
    doc["payload"]["accountant"]["relation"] = ADD_REMOVE
    from fedpose.federation.site_budget import _digest

    doc["sha256"] = _digest(doc["payload"])
    budget.path.write_text(json.dumps(doc))
    with pytest.raises(BudgetStateError, match="relation"):
        SiteBudget(tmp_path, "site-a", eps_max=100.0, delta=1e-5, guarantee="FDP")


def test_an_fdp_budget_written_with_visible_membership_keeps_it(tmp_path) -> None:
    """A budget from before the public sample was independent goes on under its own relation: it
    bounds the new mechanism too (it grants the adversary more), so nothing is reset or understated."""
    import json

    from fedpose.federation.site_budget import SiteBudget, _digest

    budget = SiteBudget(tmp_path, "site-a", eps_max=100.0, delta=1e-5, guarantee="FDP")
    budget.authorize_round("run", 1, noise_multiplier=2.0, sample_rate=0.1, steps=10)
    doc = json.loads(budget.path.read_text())
    doc["payload"]["accountant"]["relation"] = REPLACE_PUBLIC_MEMBERSHIP
    doc["sha256"] = _digest(doc["payload"])
    budget.path.write_text(json.dumps(doc))
    old = SiteBudget(tmp_path, "site-a", eps_max=100.0, delta=1e-5, guarantee="FDP")
    old.authorize_round("run", 2, noise_multiplier=2.0, sample_rate=0.1, steps=10)
    visible = epsilon_for(2.0, 0.1, 20, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="pld")[0]
    assert old.accountant().relation == REPLACE_PUBLIC_MEMBERSHIP and old.report()["relation"] == REPLACE_PUBLIC_MEMBERSHIP
    assert old.epsilon == pytest.approx(visible)
    assert old.epsilon > epsilon_for(2.0, 0.1, 20, 1e-5, relation=REPLACE_ONE, accountant="pld")[0]


def mixture_hockey_stick(q: float, sigma: float, epsilon: float, a: tuple[float, float], b: tuple[float, float],
                         grid: int = 501, reach: float = 8.0) -> float:
    """H_{e^ε}(P_a ‖ P_b) by quadrature in the plane of a and b, P_v = (1 − q)·N(0, σ²I) + q·N(v, σ²I):
    one step's release when the replaced record's clipped gradient is v (the rest of the batch and
    the noise outside the plane are the same in both worlds)."""
    x = np.linspace(-reach * sigma - 2, reach * sigma + 2, grid)
    dx = x[1] - x[0]
    u, w = np.meshgrid(x, x, indexing="ij")

    def normal(v: tuple[float, float]) -> np.ndarray:
        return np.exp(-((u - v[0]) ** 2 + (w - v[1]) ** 2) / (2 * sigma**2)) / (2 * math.pi * sigma**2)

    base = (1 - q) * normal((0.0, 0.0))
    p, r = base + q * normal(a), base + q * normal(b)
    return float(np.maximum(p - math.exp(epsilon) * r, 0.0).sum() * dx * dx)


@pytest.mark.parametrize("q", [0.15, 0.6])
def test_replace_one_worst_case_is_the_opposite_pair_in_any_direction(q: float) -> None:
    """dp-accounting's substitution pair puts the replaced record's clipped gradient at −C in one
    world and +C in the other (1-D). Over clipped gradients u, u' of norms ≤ C = 1 at any angle,
    no pair gives a larger hockey-stick divergence — so the 1-D PLD bounds the mechanism."""
    sigma = 1.0
    for epsilon in (0.3, 1.0, 2.5):
        worst = mixture_hockey_stick(q, sigma, epsilon, (-1.0, 0.0), (1.0, 0.0))
        assert worst > 1e-6
        for norm_a in (1.0, 0.6, 0.0):
            for norm_b in (1.0, 0.5):
                for angle in np.linspace(0.0, math.pi, 7):
                    b = (norm_b * math.cos(angle), norm_b * math.sin(angle))
                    assert mixture_hockey_stick(q, sigma, epsilon, (norm_a, 0.0), b) <= worst * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("q, sigma", [(0.1, 1.0), (0.4, 2.0)])
def test_replace_one_pld_bounds_the_exact_profile_of_one_step(q: float, sigma: float) -> None:
    """The accountant's one-step δ(ε) is an upper bound on, and close to, the exact hockey-stick
    divergence of the pair (1 − q)N(0, σ²) + qN(−1, σ²) vs (1 − q)N(0, σ²) + qN(1, σ²)."""
    from fedpose.privacy.accountants.base import Event
    from fedpose.privacy.accountants.pld import replace_one_epsilon

    x = np.linspace(-14 * sigma - 2, 14 * sigma + 2, 800_001)
    dx = x[1] - x[0]

    def density(shift: float) -> np.ndarray:
        base = np.exp(-(x**2) / (2 * sigma**2))
        return ((1 - q) * base + q * np.exp(-((x - shift) ** 2) / (2 * sigma**2))) / (sigma * math.sqrt(2 * math.pi))

    p, r = density(-1.0), density(1.0)
    for delta in (1e-2, 1e-4):
        epsilon = replace_one_epsilon([Event(sigma, q, 1)], delta)
        exact_delta = float(np.maximum(p - math.exp(epsilon) * r, 0.0).sum() * dx)
        assert exact_delta <= delta * (1 + 1e-6)  # the ε reported holds
        assert float(np.maximum(p - math.exp(0.97 * epsilon) * r, 0.0).sum() * dx) > delta  # and is tight to 3 %


def test_replace_one_sits_between_add_remove_and_visible_membership() -> None:
    q, steps, delta = 16 / 120, 80, 1e-5
    for sigma in (1.0, 1.43, 4.5):
        add_remove = epsilon_for(sigma, q, steps, delta, accountant="pld")[0]
        hidden = epsilon_for(sigma, q, steps, delta, relation=REPLACE_ONE, accountant="pld")[0]
        visible = epsilon_for(sigma, q, steps, delta, relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="pld")[0]
        assert add_remove < hidden < visible
        # RDP bounds it by the visible-membership curve: never below the PLD
        assert epsilon_for(sigma, q, steps, delta, relation=REPLACE_ONE, accountant="rdp")[0] >= hidden
    # the whole batch (q = 1): nothing to hide, both relations are the Gaussian mechanism with sensitivity 2C
    hidden = epsilon_for(3.0, 1.0, 5, delta, relation=REPLACE_ONE, accountant="pld")[0]
    visible = epsilon_for(3.0, 1.0, 5, delta, relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="pld")[0]
    assert hidden == pytest.approx(visible, rel=2e-3)
    # what the change buys at the sweep's setting (ε 8 per patient, q 16/120, 80 steps): σ 4.50 → 1.43
    sigma = noise_multiplier_for(8.0, q, steps, delta, relation=REPLACE_ONE, accountant="pld")
    assert 1.40 < sigma < 1.47
    assert epsilon_for(sigma, q, steps, delta, relation=REPLACE_ONE, accountant="pld")[0] <= 8.0
