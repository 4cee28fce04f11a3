"""RDP accountant: agrees with Google's dp-accounting, FACTS.md's table, and round-trips as JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import dp_accounting  # noqa: E402  (a runtime dependency: the RDP and PLD accountants use it)

from fedpose.cli import main  # noqa: E402
from fedpose.privacy.accountant import (  # noqa: E402
    DEFAULT_ORDERS,
    RDPAccountant,
    epsilon_for,
    noise_multiplier_for,
)


def google_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    for sigma, q, steps in history:
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    "sigma, q, steps, delta",
    [
        (0.8, 0.01, 1000, 1e-5),
        (1.0, 0.01, 1000, 1e-5),
        (2.0, 0.01, 1000, 1e-5),
        (5.0, 16 / 2000, 500, 4e-5),  # small-ε regime: optimum at a large order
        (1.3, 0.05, 37, 1e-6),
        (0.6, 1.0, 10, 1e-5),  # no subsampling
    ],
)
def test_matches_dp_accounting(sigma: float, q: float, steps: int, delta: float) -> None:
    ours, order = epsilon_for(sigma, q, steps, delta)
    google = google_epsilon([(sigma, q, steps)], delta)
    assert ours == pytest.approx(google, rel=0.005)
    assert order in DEFAULT_ORDERS


@pytest.mark.parametrize("sigma, expected", [(0.8, 3.696), (1.0, 2.101), (2.0, 0.686)])
def test_facts_table(sigma: float, expected: float) -> None:
    epsilon, _ = epsilon_for(sigma, 0.01, 1000, 1e-5)
    assert epsilon == pytest.approx(expected, abs=0.0015)


def test_composition_of_segments_matches_dp_accounting() -> None:
    history = [(1.1, 0.02, 100), (0.9, 0.01, 300), (1.1, 0.02, 50)]
    ledger = RDPAccountant()
    for sigma, q, steps in history:
        ledger.step(sigma, q, steps)
    assert ledger.steps == 450
    assert ledger.get_epsilon(1e-5)[0] == pytest.approx(google_epsilon(history, 1e-5), rel=0.005)


def test_step_by_step_equals_bulk_and_merges_segments() -> None:
    one_by_one = RDPAccountant()
    for _ in range(25):
        one_by_one.step(1.2, 0.03)
    assert one_by_one.history == [(1.2, 0.03, 25)]
    assert one_by_one.get_epsilon(1e-5) == epsilon_for(1.2, 0.03, 25, 1e-5)


def test_json_round_trip_preserves_epsilon() -> None:
    ledger = RDPAccountant()
    ledger.step(1.0, 0.01, 200)
    ledger.step(2.0, 0.02, 10)
    restored = RDPAccountant.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored.history == ledger.history
    assert restored.get_epsilon(1e-5) == ledger.get_epsilon(1e-5)


def test_empty_ledger_spends_nothing() -> None:
    assert RDPAccountant().get_epsilon(1e-5)[0] == 0.0


@pytest.mark.parametrize(
    "bad", [{"history": "x"}, {"history": [{"steps": 1}]}, {"accountant": "moments", "history": []}, []]
)
def test_from_dict_rejects_malformed_state(bad: object) -> None:
    with pytest.raises(ValueError):
        RDPAccountant.from_dict(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [(-1.0, 0.1, 1), (1.0, 1.5, 1), (1.0, 0.1, -3), (1.0, 0.1, 2.5)])
def test_step_rejects_invalid_parameters(args: tuple) -> None:
    with pytest.raises(ValueError):
        RDPAccountant().step(*args)


@pytest.mark.parametrize("target, q, steps, delta", [(0.8, 16 / 2000, 1000, 4e-5), (0.2, 0.01, 500, 4e-5), (3.0, 0.01, 1000, 1e-5)])
def test_calibration_is_tight_and_never_exceeds_target(target: float, q: float, steps: int, delta: float) -> None:
    sigma = noise_multiplier_for(target, q, steps, delta)
    assert epsilon_for(sigma, q, steps, delta)[0] <= target
    # 0.5% less noise would overspend: the returned σ is the smallest one to 0.5%.
    assert epsilon_for(sigma * (1 - 0.006), q, steps, delta)[0] > target
    # and Google's accountant agrees the target is met (to its own 0.5%).
    assert google_epsilon([(sigma, q, steps)], delta) <= target * 1.005


def test_calibration_reports_unreachable_target() -> None:
    with pytest.raises(ValueError, match="unreachable"):
        noise_multiplier_for(1e-3, 0.5, 1000, 1e-10, max_noise_multiplier=8)


def test_pld_calibration_stops_where_dp_accountings_epsilon_overflows() -> None:
    """Past ε ≈ 709 dp-accounting's PLD reports ∞ for some step counts: σ 0.0598 at q 1/15 is ε 996 over
    16 steps but ∞ over its first 8, so a σ calibrated to ε 1000 was refused by the guard of round 1.
    Calibration refuses such targets, names the way out, and at its limit every prefix stays finite."""
    q, delta = 32 / 480, 1e-5
    assert epsilon_for(0.0598, q, 8, delta, accountant="pld")[0] == math.inf  # the failure, as measured
    with pytest.raises(ValueError, match="beyond what the PLD accountant evaluates.*accountant 'rdp'"):
        noise_multiplier_for(1000.0, q, 16, delta, accountant="pld")
    assert epsilon_for(noise_multiplier_for(1000.0, q, 16, delta, accountant="rdp"), q, 16, delta, accountant="rdp")[0] <= 1000
    sigma = noise_multiplier_for(700.0, q, 16, delta, accountant="pld")
    spent = [epsilon_for(sigma, q, steps, delta, accountant="pld")[0] for steps in range(1, 17)]
    assert all(math.isfinite(e) for e in spent) and spent == sorted(spent) and spent[-1] <= 700


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["privacy", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_epsilon_json(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(capsys, "epsilon", "--sample-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "1000", "--delta", "1e-5",
                             "--accountant", "rdp", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["accountant"] == "rdp" and result["delta"] == 1e-5
    assert result["epsilon"] == pytest.approx(2.101, abs=0.0015)
    assert result["order"] in DEFAULT_ORDERS


def test_cli_noise_json_and_human_text(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(capsys, "noise", "--target-epsilon", "0.8", "--sample-rate", "0.01", "--steps", "1000", "--delta", "4e-5",
                             "--accountant", "rdp", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["epsilon"] <= 0.8
    assert result["noise_multiplier"] == pytest.approx(noise_multiplier_for(0.8, 0.01, 1000, 4e-5))
    _, text, _ = run_cli(capsys, "noise", "--target-epsilon", "0.8", "--sample-rate", "0.01", "--steps", "1000", "--delta", "4e-5",
                         "--accountant", "rdp")
    assert "DP, δ = 4e-05, RDP" in text  # never a bare ε


def test_cli_rejects_bad_sample_rate(capsys: pytest.CaptureFixture) -> None:
    code = main(["privacy", "epsilon", "--sample-rate", "1.5", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"])
    assert code == 2 and "sample rate" in capsys.readouterr().err


def test_accountant_import_skips_opacus_package_init():  # RDP and PLD come from dp-accounting (numpy/scipy only)
    """A deployed site imports the accountant in every ClientApp process: Opacus' package init
    (PrivacyEngine, optimizers, torch.distributed, ~2 s) must not come with it."""
    code = (
        "import sys, fedpose.privacy.accountant as a; "
        "assert 'opacus.privacy_engine' not in sys.modules, 'opacus package init ran'; "
        "assert 'torch' not in sys.modules, 'the accountant pulled in torch'; "
        "print(a.epsilon_for(1.1, 0.01, 1000, 1e-5)[0], a.epsilon_for(1.1, 0.01, 1000, 1e-5, accountant='pld')[0]); "
        "assert 'opacus.privacy_engine' not in sys.modules and 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[0]) > 0


def test_a_resumed_run_whose_spend_already_passed_its_target_is_refused_before_any_calibration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal names what the resumed run spent, and comes before the whole run's σ is calibrated
    (which, for a target far below the spend, would fail first with a message that does not say why)."""
    import fedpose.privacy.engine as engine
    from fedpose.config import PrivacyConfig
    from fedpose.privacy.accountant import PrivacyLedger

    spent = PrivacyLedger(accountant="rdp")
    spent.step(1.0, 0.25, 10)
    monkeypatch.setattr(engine, "noise_multiplier_for", lambda *a, **k: pytest.fail("calibrated before the refusal"))
    privacy = PrivacyConfig(mechanism="dpsgd", target_epsilon=1e-3, accountant="rdp", sample_rate=0.25)
    with pytest.raises(ValueError, match=r"target ε = 0.001 is unreachable for the 99990 steps left after the 10 the resumed run spent"):
        engine.resolve_noise_multiplier(privacy, 0.25, 100_000, spent=spent, unit="record")
