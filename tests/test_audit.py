"""One-run audit: the Steinke–Nasr–Jagielski bound, and `fedpose audit` through the real DP engine
and the real site-round code — it fires on missing or reused noise and stays below a correct claim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import special

from fedpose.privacy.audit_bound import best_lower_bound, epsilon_lower_bound, p_value
from site_round_helpers import BATCH_SIZE, INPUT_SIZE, make_site_data, site_config

STEPS = 10


# -- the bound ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("guesses", [100, 600, 1000])
def test_perfect_guesses_without_delta_match_the_closed_form(guesses) -> None:
    # δ = 0 and v = r: P[Binomial(r, p) ≥ r] = p^r = β  ⇔  ε = logit(β^(1/r)).
    expected = float(special.logit(0.05 ** (1 / guesses)))
    assert epsilon_lower_bound(1000, guesses, guesses, 0.0, 0.95) == pytest.approx(expected, rel=1e-6)


def test_the_delta_term_costs_a_little_and_grows_with_the_canary_count() -> None:
    # Inputs of the paper's code example (m = 1000 canaries, 600 guesses all correct, δ = 1e-5, 95 %);
    # 5.270 is this implementation's value (regression pin), 5.297 the δ = 0 closed form.
    with_delta = epsilon_lower_bound(1000, 600, 600, 1e-5, 0.95)
    assert with_delta == pytest.approx(5.270, abs=0.002)
    assert with_delta < epsilon_lower_bound(1000, 600, 600, 0.0, 0.95)
    assert epsilon_lower_bound(10**5, 600, 600, 1e-5, 0.95) < with_delta
    # p(ε) at the bound is the significance
    assert p_value(1000, 600, 600, with_delta, 1e-5) == pytest.approx(0.05, rel=1e-6)
    # chance-level guessing rejects nothing
    assert epsilon_lower_bound(1000, 1000, 500, 1e-5, 0.95) == 0.0


def randomized_response_audit(epsilon: float, m: int, rng: np.random.Generator) -> float:
    """Audit an exactly ε-DP mechanism: each canary's bit through ε-randomized response."""
    included = rng.random(m) < 0.5
    keep = rng.random(m) < special.expit(epsilon)
    reported = np.where(keep, included, ~included)
    scores = reported + 1e-3 * rng.standard_normal(m)  # ties broken at random
    return best_lower_bound(scores, included, 1e-5, 0.95).epsilon_lower


def test_bound_is_valid_for_an_exactly_dp_mechanism_and_has_power() -> None:
    rng = np.random.default_rng(0)
    bounds = [randomized_response_audit(2.0, 1000, rng) for _ in range(40)]
    assert sum(b > 2.0 for b in bounds) <= 4  # ≤ 5 % expected; 4/40 leaves room for chance
    assert np.median(bounds) > 1.0  # and it sees most of a large ε
    assert randomized_response_audit(8.0, 1000, rng) > 3.0


# -- audits of training runs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("audit-data"))


def central_config(data_root: Path, **privacy):
    from fedpose.config import RunConfig

    return RunConfig.model_validate({
        "data": {"train": str(data_root / "site-1"), "input_size": list(INPUT_SIZE)},
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "cosine": False},
        "train": {"batch_size": BATCH_SIZE, "steps": STEPS, "threads": 1, "seed": 1},
        "privacy": {"mechanism": "dpsgd", "max_grad_norm": 1.0, "delta": 1e-5, **privacy},
    })


def test_no_noise_gives_a_large_lower_bound(data_root) -> None:
    from fedpose.audit import DEFAULT_CANARIES, audit_central

    result = audit_central(central_config(data_root, noise_multiplier=0.0)).to_dict()
    assert result["canaries"] == DEFAULT_CANARIES and result["epsilon"] is None  # σ = 0: ε = ∞
    assert result["epsilon_lower"] >= 2.0 and not result["violation"]


def test_seeded_noise_reused_by_a_second_run_fires(data_root) -> None:
    from fedpose.audit import audit_central

    # σ = 3: the accountant claims ε < 2 for these 10 steps, but the twin run's identical noise cancels.
    cfg = central_config(data_root, noise_multiplier=3.0, insecure_seeded_noise=True)
    result = audit_central(cfg, reference_run=True).to_dict()
    assert result["epsilon"] < 2.0 <= result["epsilon_lower"]
    assert result["violation"] and result["guarantee_void"]


def test_fresh_noise_with_a_twin_run_stays_below_the_claim(data_root) -> None:
    from fedpose.audit import audit_central

    result = audit_central(central_config(data_root, noise_multiplier=3.0), reference_run=True).to_dict()
    assert result["epsilon_lower"] <= result["epsilon"] and not result["violation"]


@pytest.mark.parametrize("target", [2.0, 8.0])
def test_correct_dp_sgd_stays_below_its_claim(data_root, tmp_path, capsys, target) -> None:
    from fedpose.cli import main

    config = tmp_path / "audit.toml"
    config.write_text(f"""
[data]
train = "{data_root / 'site-1'}"
input_size = [64, 64]
[model]
backbone = "tiny_vit_test"
scenario = "scratch"
[optim]
name = "sgd"
lr = 0.01
momentum = 0.0
[train]
batch_size = {BATCH_SIZE}
steps = {STEPS}
threads = 1
seed = 1
[privacy]
mechanism = "dpsgd"
target_epsilon = {target}
delta = 1e-5
""")
    out = tmp_path / "out"
    code = main(["audit", "--config", str(config), "--json", "--out", str(out)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("epsilon_lower", "epsilon", "delta", "confidence", "canaries", "mechanism", "guarantee", "mode"):
        assert key in result, key
    assert (result["mechanism"], result["guarantee"], result["mode"], result["accountant"]) == ("dpsgd", "DP", "white-box", "pld")
    assert result["confidence"] == 0.95 and result["delta"] == 1e-5 and result["canaries"] == 1000
    assert result["epsilon"] <= target and result["epsilon_lower"] <= result["epsilon"]
    assert "(DP, δ = 1e-05, PLD)" in result["epsilon_text"]
    assert (out / "scores.png").stat().st_size > 0 and json.loads((out / "audit.json").read_text())["epsilon"] == result["epsilon"]


def test_site_round_audit_through_the_real_site_code(data_root, tmp_path) -> None:
    from fedpose.audit import audit_site_round

    # Almost no noise: the round's Δ shows the canaries (ε is huge but finite, so the budget allows it).
    leaky = site_config(data_root, tmp_path / "leaky", noise_multiplier=0.02, eps_max=1e9, local_steps=STEPS)
    result = audit_site_round(leaky, canaries=1000).to_dict()
    assert result["setting"] == "site-round" and result["epsilon_lower"] >= 2.0
    assert not (tmp_path / "leaky").exists()  # the audit spent a scratch budget, not the site's
    # Correct noise: below the site's own claim for the round.
    sound = site_config(data_root, tmp_path / "sound", noise_multiplier=1.0, eps_max=50.0, local_steps=STEPS)
    result = audit_site_round(sound, canaries=1000).to_dict()
    assert result["epsilon_lower"] <= result["epsilon"] and result["accountant"] == "pld"
    assert math.isfinite(result["epsilon"])
