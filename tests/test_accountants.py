"""Accountants by name (rdp, pld, prv): agreement with dp-accounting, the closed-form PLD of the
FDP-family relation, defaults, and budgets that say which accountant produced each ε."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from fedpose.cli import main
from fedpose.privacy.accountant import PrivacyLedger, epsilon_for, noise_multiplier_for
from fedpose.privacy.accountants import (
    ACCOUNTANTS,
    ADD_REMOVE,
    REPLACE_ONE,
    REPLACE_PUBLIC_MEMBERSHIP,
    Event,
    default_accountant,
    get_accountant,
)
from fedpose.privacy.accountants.base import effective
from fedpose.privacy.report import epsilon_digits
from fedpose.privacy.accountants.pld import gaussian_delta, replace_public_membership_delta


def google_pld_epsilon(events: list[tuple[float, float, int]], delta: float) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for sigma, q, steps in events:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("sigma, q, steps, delta", [(1.0, 0.01, 1000, 1e-5), (0.8, 0.01, 1000, 1e-5), (2.0, 0.05, 200, 4e-5)])
def test_cli_pld_agrees_with_dp_accounting_to_one_percent(capsys, sigma, q, steps, delta) -> None:
    code = main(["privacy", "epsilon", "--sample-rate", str(q), "--noise-multiplier", str(sigma), "--steps", str(steps),
                 "--delta", str(delta), "--accountant", "pld", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["accountant"] == "pld" and result["neighbouring_relation"] == ADD_REMOVE
    assert result["epsilon"] == pytest.approx(google_pld_epsilon([(sigma, q, steps)], delta), rel=0.01)


def test_facts_table_pld_and_prv_are_tighter_than_rdp() -> None:
    # FACTS.md: q = 0.01, T = 1000, δ = 1e-5 — RDP 2.101, PLD/PRV 1.828 at σ = 1.
    events = [Event(1.0, 0.01, 1000)]
    rdp = get_accountant("rdp").epsilon(events, ADD_REMOVE, 1e-5)
    pld = get_accountant("pld").epsilon(events, ADD_REMOVE, 1e-5)
    prv = get_accountant("prv").epsilon(events, ADD_REMOVE, 1e-5)
    assert rdp == pytest.approx(2.101, abs=0.002) and pld == pytest.approx(1.828, abs=0.003)
    assert prv == pytest.approx(pld, abs=0.02)  # PRV reports the upper end of its ±0.01 bracket
    assert pld < prv < rdp


def test_heterogeneous_events_compose_like_dp_accounting() -> None:
    history = [(1.1, 0.02, 100), (0.9, 0.01, 300), (1.1, 0.02, 50)]
    ledger = PrivacyLedger(accountant="pld")
    for sigma, q, steps in history:
        ledger.step(sigma, q, steps)
    assert ledger.get_epsilon(1e-5)[0] == pytest.approx(google_pld_epsilon(history, 1e-5), rel=0.01)



def test_rounds_of_one_sigma_and_q_are_composed_as_one_segment_with_the_same_epsilon() -> None:
    # a budget holds one segment per round; the accountants merge those of equal (σ, q) (composition
    # is commutative) and drop those that release nothing, keeping the first appearance's order
    history = [(1.1, 0.02, 100), (0.9, 0.01, 300), (1.1, 0.02, 50), (0.9, 0.0, 40), (0.9, 0.01, 0)]
    assert effective([Event(*e) for e in history]) == [Event(1.1, 0.02, 150), Event(0.9, 0.01, 300)]

    demo_rounds = [(1.05, 64 / 480, 10)] * 8  # the one-image demo's site (to 2026-12-04): 8 rounds of 10 steps
    for relation in (ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP):
        for name in ("pld", "rdp"):
            per_round = get_accountant(name).epsilon([Event(*e) for e in demo_rounds], relation, 1e-5)
            assert per_round == get_accountant(name).epsilon([Event(1.05, 64 / 480, 80)], relation, 1e-5)
    # and it is the ε dp-accounting composes round by round
    per_round = get_accountant("pld").epsilon([Event(*e) for e in demo_rounds], ADD_REMOVE, 1e-5)
    assert per_round == pytest.approx(google_pld_epsilon(demo_rounds, 1e-5), rel=1e-3)

@pytest.mark.parametrize("sigma, steps", [(3.0, 7), (8.0, 40)])
def test_visible_membership_pld_at_full_batch_is_the_gaussian_mechanism_with_sensitivity_2c(sigma, steps) -> None:
    # q = 1: every step is a Gaussian mechanism with sensitivity 2C, std σC ≡ sensitivity 1, std σ/2.
    google = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    google.compose(dp_accounting.GaussianDpEvent(sigma / 2), steps)
    ours = get_accountant("pld").epsilon([Event(sigma, 1.0, steps)], REPLACE_PUBLIC_MEMBERSHIP, 1e-5)
    assert ours == pytest.approx(google.get_epsilon(1e-5), rel=1e-3)


def test_visible_membership_pld_is_the_binomial_mixture_of_gaussians() -> None:
    # Two events with different σ: enumerate every (k1, k2) by hand.
    from scipy import stats

    events = [Event(2.0, 0.3, 3), Event(4.0, 0.5, 2)]
    epsilon = 1.5
    expected = 0.0
    for k1 in range(4):
        for k2 in range(3):
            weight = stats.binom.pmf(k1, 3, 0.3) * stats.binom.pmf(k2, 2, 0.5)
            mu = math.sqrt(4 * k1 / 2.0**2 + 4 * k2 / 4.0**2)
            expected += weight * float(gaussian_delta(epsilon, [mu])[0])
    assert replace_public_membership_delta(events, epsilon) == pytest.approx(expected, rel=1e-9)
    eps = get_accountant("pld").epsilon(events, REPLACE_PUBLIC_MEMBERSHIP, 1e-3)
    assert replace_public_membership_delta(events, eps) == pytest.approx(1e-3, rel=1e-6)


@pytest.mark.parametrize("sigma, q, steps", [(2.0, 0.1, 50), (14.0, 0.01, 1000), (1.0, 0.3, 5)])
def test_visible_membership_pld_never_exceeds_its_rdp_bound(sigma, q, steps) -> None:
    pld = epsilon_for(sigma, q, steps, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="pld")[0]
    rdp = epsilon_for(sigma, q, steps, 1e-5, relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="rdp")[0]
    dp = epsilon_for(sigma, q, steps, 1e-5, relation=ADD_REMOVE, accountant="pld")[0]
    assert dp < pld <= rdp


def test_defaults_are_the_tightest_exact_accountant_per_relation() -> None:
    assert default_accountant(ADD_REMOVE) == "pld"
    assert default_accountant(REPLACE_PUBLIC_MEMBERSHIP) == "pld"
    assert set(ACCOUNTANTS) == {"rdp", "pld", "prv"}
    assert not get_accountant("prv").supports(REPLACE_PUBLIC_MEMBERSHIP)
    with pytest.raises(ValueError, match="does not handle"):
        PrivacyLedger(relation=REPLACE_PUBLIC_MEMBERSHIP, accountant="prv")
    with pytest.raises(ValueError, match="unknown accountant"):
        get_accountant("moments")


def test_pld_calibration_needs_less_noise_and_meets_the_target() -> None:
    rdp = noise_multiplier_for(0.8, 0.01, 1000, 4e-5, accountant="rdp")
    pld = noise_multiplier_for(0.8, 0.01, 1000, 4e-5, accountant="pld")
    assert pld < 0.96 * rdp
    assert epsilon_for(pld, 0.01, 1000, 4e-5, accountant="pld")[0] <= 0.8
    assert epsilon_for(pld * 0.994, 0.01, 1000, 4e-5, accountant="pld")[0] > 0.8


def test_cli_prv_refuses_the_fdp_relation(capsys) -> None:
    code = main(["privacy", "epsilon", "--sample-rate", "0.1", "--noise-multiplier", "2", "--steps", "10", "--delta", "1e-5",
                 "--guarantee", "FDP", "--accountant", "prv"])
    assert code != 0 and "does not handle" in capsys.readouterr().err


# -- budgets ------------------------------------------------------------------------------------------
def _old_rdp_budget(state_dir) -> None:
    """A budget as written before accountants were selectable: RDP state, entries without 'accountant'."""
    import time

    from fedpose.federation.site_budget import GENESIS_FILE, STATE_FILE, _write_signed

    state_dir.mkdir(parents=True)
    ledger = PrivacyLedger()
    ledger.step(1.0, 0.01, 400)
    rdp_eps = ledger.get_epsilon(1e-5)[0]
    entry = {"run_id": "run", "round": 1, "status": "spent", "steps": 400, "noise_multiplier": 1.0, "sample_rate": 0.01,
             "epsilon_after": rdp_eps, "delta": 1e-5, "recorded_at": time.time(), "reason": ""}
    state = ledger.to_dict()
    assert state["accountant"] == "rdp"
    created = time.time()
    _write_signed(state_dir / STATE_FILE, {"format": "fedpose.site-budget/1", "site_id": "site-a", "guarantee": "DP",
                                           "delta": 1e-5, "accountant": state, "entries": [entry],
                                           "genesis_created_at": created})
    _write_signed(state_dir / GENESIS_FILE, {"format": "fedpose.site-state/1", "site_id": "site-a", "guarantee": "DP",
                                             "delta": 1e-5, "created_at": created})


def test_an_rdp_budget_keeps_saying_rdp_and_switches_only_deliberately(tmp_path, capsys) -> None:
    from fedpose.federation.site_budget import BudgetStateError, SiteBudget

    state = tmp_path / "site-a"
    _old_rdp_budget(state)
    rdp_eps = epsilon_for(1.0, 0.01, 400, 1e-5, accountant="rdp")[0]
    pld_eps = epsilon_for(1.0, 0.01, 400, 1e-5, accountant="pld")[0]
    budget = SiteBudget(state, "site-a", eps_max=10.0, delta=1e-5, guarantee="DP")  # config: no accountant
    assert budget.accountant_name == "rdp" and budget.epsilon == pytest.approx(rdp_eps, rel=1e-9)
    assert budget.report()["accountant"] == "rdp" and budget.entries[0].accountant == "rdp"
    # A config naming another accountant is refused, with both numbers and the deliberate way.
    with pytest.raises(BudgetStateError, match="privacy budget .* --accountant pld --apply"):
        SiteBudget(state, "site-a", eps_max=10.0, delta=1e-5, guarantee="DP", accountant="pld")

    # Without --apply nothing changes; the spend is shown by every accountant, each labelled.
    assert main(["privacy", "budget", str(state), "--accountant", "pld"]) == 0
    out = capsys.readouterr().out
    assert f"enforced: ε = {epsilon_digits(rdp_eps)} (DP, δ = 1e-05, RDP)" in out and "(DP, δ = 1e-05, PLD)" in out
    assert "not switched" in out
    assert SiteBudget(state, "site-a", eps_max=10.0, delta=1e-5, guarantee="DP").accountant_name == "rdp"

    assert main(["privacy", "budget", str(state), "--accountant", "pld", "--apply", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["applied"] and result["accountant"] == "pld" and result["epsilon"] == pytest.approx(pld_eps, rel=1e-9)
    assert result["events"] == [{"noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 400}]
    switched = SiteBudget(state, "site-a", eps_max=10.0, delta=1e-5, guarantee="DP", accountant="pld")
    assert switched.epsilon == pytest.approx(pld_eps, rel=1e-9) and pld_eps < rdp_eps
    [record] = switched.recomputations
    assert record["from"] == "rdp" and record["to"] == "pld" and record["epsilon_before"] == pytest.approx(rdp_eps)
    # The old entry still says what it was computed with; a new one says PLD.
    auth = switched.authorize_round("run", 2, 1.0, 0.01, 100)
    assert [e.accountant for e in switched.entries] == ["rdp", "pld"]
    assert auth.entry.epsilon_after == pytest.approx(epsilon_for(1.0, 0.01, 500, 1e-5, accountant="pld")[0], rel=1e-9)


def test_ledger_summary_labels_the_accountant_and_does_not_mix_them(tmp_path) -> None:
    from fedpose.federation.ledger import BudgetLedger, LedgerEntry

    with BudgetLedger(tmp_path / "ledger.sqlite") as ledger:
        ledger.record(LedgerEntry("a", 1, "ok", epsilon=2.1, delta=1e-5, guarantee="DP", accountant="rdp", steps=10))
        ledger.record(LedgerEntry("a", 2, "ok", epsilon=1.9, delta=1e-5, guarantee="DP", accountant="pld", steps=10))
        [summary] = ledger.site_summaries()
        assert (summary.epsilon, summary.accountant) == (1.9, "pld")
        assert [e.accountant for e in ledger.entries("a")] == ["rdp", "pld"]


def test_a_site_round_on_an_rdp_budget_calibrates_and_reports_with_rdp(tmp_path) -> None:
    from fedpose.federation.local_training import train_site_round
    from fedpose.federation.site_budget import SiteBudget
    from site_round_helpers import BATCH_SIZE, PER_SITE, global_model, make_site_data, site_config

    site = site_config(make_site_data(tmp_path / "data"), tmp_path / "state", noise_multiplier=None, target_epsilon=20.0)
    SiteBudget(site.state_dir, "site-1", eps_max=50.0, delta=1e-5, guarantee="DP", accountant="rdp")  # written with RDP
    weights, spec = global_model()
    result = train_site_round(site, "run", 1, weights, spec, local_steps=2)
    assert result.reply.status == "ok" and result.reply.privacy.accountant == "rdp"
    q = BATCH_SIZE / PER_SITE
    [entry] = SiteBudget(site.state_dir, "site-1", eps_max=50.0, delta=1e-5, guarantee="DP").entries
    assert entry.accountant == "rdp"
    assert entry.noise_multiplier == pytest.approx(noise_multiplier_for(20.0, q, 2, 1e-5, accountant="rdp"))
    assert entry.noise_multiplier > noise_multiplier_for(20.0, q, 2, 1e-5, accountant="pld")
