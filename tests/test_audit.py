"""One-run audit: the Steinke–Nasr–Jagielski bound and its f-DP variant (Mahloujifar et al.), and
`fedpose audit` (white-box and black-box) through the real DP engine and the real site-round code —
it fires on missing or reused noise and stays below a correct claim."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import special

from fedpose.privacy.audit_bound import (
    best_lower_bound,
    epsilon_lower_bound,
    fdp_epsilon_lower_bound,
    fdp_rejects,
    gaussian_epsilon,
    p_value,
)
from site_round_helpers import BATCH_SIZE, INPUT_SIZE, PER_SITE, coordinator_config, make_site_data, site_config

STEPS = 10
#: what `fedpose audit --json` promises (issue 14), in both modes
JSON_KEYS = ("epsilon_lower", "epsilon_lower_steinke", "epsilon_lower_fdp", "epsilon", "delta", "confidence", "canaries",
             "mechanism", "guarantee", "mode")


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


def randomized_response_audit(epsilon: float, m: int, rng: np.random.Generator):
    """Audit an exactly ε-DP mechanism: each canary's bit through ε-randomized response."""
    included = rng.random(m) < 0.5
    keep = rng.random(m) < special.expit(epsilon)
    reported = np.where(keep, included, ~included)
    scores = reported + 1e-3 * rng.standard_normal(m)  # ties broken at random
    return best_lower_bound(scores, included, 1e-5, 0.95)


def test_bound_is_valid_for_an_exactly_dp_mechanism_and_has_power() -> None:
    rng = np.random.default_rng(0)
    bounds = [randomized_response_audit(2.0, 1000, rng).epsilon_lower_steinke for _ in range(40)]
    assert sum(b > 2.0 for b in bounds) <= 4  # ≤ 5 % expected; 4/40 leaves room for chance
    assert np.median(bounds) > 1.0  # and it sees most of a large ε
    assert randomized_response_audit(8.0, 1000, rng).epsilon_lower_steinke > 3.0


def test_the_fdp_bound_tests_a_gaussian_curve_not_any_dp_mechanism() -> None:
    # Randomized response is exactly (2, 0)-DP, but its tradeoff curve is not the Gaussian one through
    # (2, 1e-5): the f-DP bound rejects that curve. Why the audit uses it only for Gaussian mechanisms
    # (see test_dp_sgd_lies_above_the_gaussian_curve_through_its_claim).
    assert randomized_response_audit(2.0, 1000, np.random.default_rng(0)).epsilon_lower_fdp > 2.0


# -- the f-DP bound (Mahloujifar, Melis & Chaudhuri 2024) -------------------------------------------------
@pytest.mark.parametrize("epsilon", [0.5, 2.0, 8.0])
def test_gaussian_epsilon_inverts_dp_accounting(epsilon) -> None:
    import dp_accounting

    sigma = dp_accounting.get_sigma_gaussian(epsilon, 1e-5)  # Gaussian mechanism, sensitivity 1: μ = 1/σ
    assert gaussian_epsilon(1 / sigma, 1e-5) == pytest.approx(epsilon, rel=1e-6)
    assert gaussian_epsilon(1e-6, 1e-5) == 0.0  # δ_G(0; μ) = 2Φ(μ/2) − 1 < δ already


def test_fdp_bound_is_monotone() -> None:
    rejected = [fdp_rejects(1000, 500, 400, mu, 0.05) for mu in np.linspace(0.01, 5.0, 200)]
    assert rejected[0] and not rejected[-1] and rejected == sorted(rejected, reverse=True)  # one switch, in μ
    by_correct = [fdp_epsilon_lower_bound(1000, 200, v, 1e-5, 0.95) for v in (110, 140, 170, 200)]
    assert by_correct == sorted(by_correct) and by_correct[0] < by_correct[-1]
    by_confidence = [fdp_epsilon_lower_bound(1000, 200, 180, 1e-5, c) for c in (0.5, 0.9, 0.99)]
    assert by_confidence == sorted(by_confidence, reverse=True)
    assert fdp_epsilon_lower_bound(1000, 1000, 500, 1e-5, 0.95) == 0.0  # chance level rejects nothing


def gaussian_audit(mu: float, m: int, rng: np.random.Generator):
    """Audit the μ-GDP mechanism exactly: each canary's score is N(μ·included, 1)."""
    included = rng.random(m) < 0.5
    return best_lower_bound(rng.standard_normal(m) + mu * included, included, 1e-5, 0.95)


def test_fdp_bound_is_valid_for_the_gaussian_mechanism_and_tighter_than_steinke() -> None:
    rng = np.random.default_rng(1)
    mu = 1.0
    epsilon = gaussian_epsilon(mu, 1e-5)  # 4.38
    audits = [gaussian_audit(mu, 1000, rng) for _ in range(40)]
    fdp = np.array([a.epsilon_lower_fdp for a in audits])
    steinke = np.array([a.epsilon_lower_steinke for a in audits])
    assert (fdp > epsilon).sum() <= 2  # ≤ 5 %: valid for the mechanism it models
    # The paper's point: the whole curve sees more than one (ε, δ) point — here ~1.35× Steinke's bound.
    assert (fdp >= steinke).all() and np.median(fdp) > 1.2 * np.median(steinke)
    assert all(a.epsilon_lower == max(a.epsilon_lower_steinke, a.epsilon_lower_fdp) for a in audits)
    # Perfect guesses (the paper's code example, 600/600 of 1000): the f-DP bound roughly doubles.
    assert fdp_epsilon_lower_bound(1000, 600, 600, 1e-5, 0.95) > 1.9 * epsilon_lower_bound(1000, 600, 600, 1e-5, 0.95)


def tradeoff_least_fpr(epsilons: np.ndarray, deltas: np.ndarray, tpr: np.ndarray) -> np.ndarray:
    """Least false-positive rate at each true-positive rate of a test against a mechanism with
    privacy profile δ(ε): TPR ≤ e^ε FPR + δ(ε) and 1 − FPR ≤ e^ε (1 − TPR) + δ(ε) for every ε."""
    first = (tpr[:, None] - deltas[None, :]) * np.exp(-epsilons)[None, :]
    second = 1 - deltas[None, :] - np.exp(epsilons)[None, :] * (1 - tpr[:, None])
    return np.maximum(0.0, np.maximum(first.max(axis=1), second.max(axis=1)))


@pytest.mark.parametrize("relation", ["add_remove", "replace_one", "replace_public_membership"])
@pytest.mark.parametrize("target", [2.0, 8.0])
def test_dp_sgd_lies_above_the_gaussian_curve_through_its_claim(relation, target) -> None:
    # The audit reports max(Steinke, f-DP) against the accountant's ε. The f-DP bound rejects the Gaussian
    # curve through the claimed (ε, δ), so that is a check of the claim only if the mechanism's own curve
    # lies above it — which holds for the DP-SGD steps these tests audit (q = 1/4, 10 steps).
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution

    from fedpose.privacy.accountant import epsilon_for, noise_multiplier_for
    from fedpose.privacy.accountants.base import Event
    from fedpose.privacy.accountants.pld import replace_public_membership_delta
    from scipy import optimize, stats

    q, steps, delta = 0.25, STEPS, 1e-5
    sigma = noise_multiplier_for(target, q, steps, delta, relation=relation, accountant="pld")
    claimed, _ = epsilon_for(sigma, q, steps, delta, relation=relation, accountant="pld")
    epsilons = np.linspace(0.0, 30.0, 301)
    # dp-accounting's own curves; replace_one (FDP, MaskDP): ±C under hidden membership, sensitivity 2C
    dp_accounting_relation = {"add_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                              "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE}.get(relation)
    if dp_accounting_relation is not None:
        pld = privacy_loss_distribution.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=1e-3,
                                                                neighboring_relation=dp_accounting_relation)
        deltas = np.asarray(pld.self_compose(steps).get_delta_for_epsilon(epsilons))
    else:
        deltas = np.array([replace_public_membership_delta([Event(sigma, q, steps)], e) for e in epsilons])
    mu = optimize.brentq(lambda m: gaussian_epsilon(m, delta) - claimed, 1e-3, 20.0)
    tpr = np.linspace(0.001, 0.999, 999)
    gaussian_least_fpr = stats.norm.cdf(stats.norm.ppf(tpr) - mu)
    assert (tradeoff_least_fpr(epsilons, deltas, tpr) >= gaussian_least_fpr - 1e-9).all()


# -- audits of training runs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("audit-data"))


@pytest.fixture(scope="module")
def projection_data_root(tmp_path_factory) -> Path:
    """One site and 32 public images: a basis of k = 32 needs 32 public gradients."""
    from fedpose.data.synthetic import ensure_dataset

    root = tmp_path_factory.mktemp("audit-projection-data")
    ensure_dataset(root, sites=1, per_site=PER_SITE, public=32, test=4, size=INPUT_SIZE, seed=0, progress=False)
    return root


def central_config(data_root: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, data: dict | None = None, **privacy):
    from fedpose.config import RunConfig

    return RunConfig.model_validate({
        "data": {"train": str(data_root / "site-1"), "input_size": list(INPUT_SIZE), **(data or {})},
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"},
        "optim": {"name": "sgd", "lr": 0.01 if not data else 0.05, "momentum": 0.0, "weight_decay": 0.0, "cosine": False},
        "train": {"batch_size": batch_size, "steps": steps, "threads": 1, "seed": 1},
        # per record (the site-1 records name patients, so auto would be per patient: fewer, larger units)
        "privacy": {"mechanism": "dpsgd", "max_grad_norm": 1.0, "delta": 1e-5, "unit": "record", **privacy},
    })


def test_no_noise_gives_a_large_lower_bound(data_root) -> None:
    from fedpose.audit import DEFAULT_CANARIES, audit_central

    result = audit_central(central_config(data_root, noise_multiplier=0.0)).to_dict()
    assert result["canaries"] == DEFAULT_CANARIES and result["epsilon"] is None  # σ = 0: ε = ∞
    assert result["epsilon_lower"] >= 2.0 and not result["violation"]
    # the lower bound is stated like the claim: guarantee, δ, unit and adjacency
    assert f"per {result['protection_unit']}, add/remove-one-{result['protection_unit']} adjacency" in result["epsilon_lower_text"]


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
# per record, as central_config: per patient (auto) every step is 4 record rows per unit slot
unit = "record"
""")
    out = tmp_path / "out"
    code = main(["audit", "--config", str(config), "--json", "--out", str(out)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in JSON_KEYS:
        assert key in result, key
    assert result["epsilon_lower"] == max(result["epsilon_lower_steinke"], result["epsilon_lower_fdp"])
    assert (result["mechanism"], result["guarantee"], result["mode"], result["accountant"]) == ("dpsgd", "DP", "white-box", "pld")
    assert result["confidence"] == 0.95 and result["delta"] == 1e-5 and result["canaries"] == 1000
    assert result["epsilon"] <= target and result["epsilon_lower"] <= result["epsilon"]
    assert "(DP, δ = 1e-05, PLD)" in result["epsilon_text"]
    assert (out / "scores.png").stat().st_size > 0 and json.loads((out / "audit.json").read_text())["epsilon"] == result["epsilon"]


def test_site_round_audit_through_the_real_site_code(data_root, tmp_path) -> None:
    from fedpose.audit import audit_site_round

    # Little noise: the round's Δ shows the canaries (ε is huge but finite, so the budget allows it; at
    # σ below ~0.3 a record would move the output past the noise sampler's cut and no finite ε holds).
    leaky = site_config(data_root, tmp_path / "leaky", noise_multiplier=0.35, eps_max=1e9, local_steps=STEPS)
    result = audit_site_round(leaky, coordinator_config(), canaries=1000).to_dict()
    assert result["setting"] == "site-round" and result["epsilon_lower"] >= 2.0
    assert not (tmp_path / "leaky").exists()  # the audit spent a scratch budget, not the site's
    # Correct noise: below the site's own claim for the round.
    sound = site_config(data_root, tmp_path / "sound", noise_multiplier=1.0, eps_max=50.0, local_steps=STEPS)
    lines: list[str] = []
    result = audit_site_round(sound, coordinator_config(), canaries=1000, log=lines.append).to_dict()
    assert result["epsilon_lower"] <= result["epsilon"] and result["accountant"] == "pld"
    assert [line for line in lines if line.startswith("audit step")] == [f"audit step {s}/{STEPS}" for s in range(1, STEPS + 1)]
    assert math.isfinite(result["epsilon"])


# -- projecting mechanisms: canaries in the public subspace ----------------------------------------------
def test_projecting_canaries_lie_in_the_basis_and_take_turns() -> None:
    import torch

    from fedpose.privacy.canaries import CanarySet
    from fedpose.privacy.projection import Basis

    p, k = 200, 4
    basis = Basis(torch.linalg.qr(torch.randn(p, k))[0])
    canaries = CanarySet.create(10, p, "add_remove", 1.0, 1.0, seed=0, releases=3, basis=lambda: basis, basis_size=k)
    active = []
    for step in range(3):
        gradient = canaries.step_gradient(step)
        assert torch.allclose(basis.project(gradient), gradient, atol=1e-5)  # projection keeps it whole
        scores = canaries.scores(gradient, step)  # q = 1: every included canary of this step's group adds C·d_i
        active.append(np.flatnonzero(scores > 0.5))
        assert np.allclose(scores, np.isin(np.arange(10), active[-1]), atol=1e-5)  # and the rest score 0
    assert [a.tolist() for a in active] == [[i for i in g if canaries.included[i]] for g in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9])]
    with pytest.raises(ValueError, match="hold at most 12"):
        CanarySet.create(13, p, "add_remove", 1.0, 1.0, seed=0, releases=3, basis=lambda: basis, basis_size=k)


def projection_config(root: Path, mechanism: str = "pdp", **privacy):
    # k × steps = 1024 slots: room for the default 1000 canaries, one release each
    return central_config(root, steps=32, mechanism=mechanism, basis={
        "k": 32, "public_samples": 32, "refresh_every": 50, "public_data": str(root / "public")}, **privacy)


@pytest.mark.parametrize("mechanism", ["pdp", "fpdp"])
def test_projecting_audit_fires_without_noise(projection_data_root, mechanism) -> None:
    from fedpose.audit import DEFAULT_CANARIES, audit_central

    result = audit_central(projection_config(projection_data_root, mechanism, noise_multiplier=0.0)).to_dict()
    assert result["canaries"] == DEFAULT_CANARIES and result["mechanism"] == mechanism
    assert result["epsilon_lower"] >= 2.0  # random directions (outside span(V)) gave 0.02 for pdp here


def test_pdp_audit_stays_below_a_correct_claim(projection_data_root) -> None:
    from fedpose.audit import audit_central

    result = audit_central(projection_config(projection_data_root, target_epsilon=2.0)).to_dict()
    assert result["epsilon"] <= 2.0 and result["epsilon_lower"] <= result["epsilon"] and not result["violation"]


@pytest.mark.parametrize("mechanism", ["fdp", "maskdp"])
def test_feature_dp_audit_fires_without_noise_and_stays_below_a_correct_claim(data_root, mechanism) -> None:
    """Under replace_one (public gradient on its own sample) the white-box audit still sees an
    unprotected run, and a run at a correct FDP / MaskDP claim stays below it."""
    from fedpose.audit import audit_central

    blind = audit_central(central_config(data_root, mechanism=mechanism, noise_multiplier=0.0)).to_dict()
    assert blind["epsilon_lower"] >= 2.0 and not blind["violation"]
    result = audit_central(central_config(data_root, mechanism=mechanism, target_epsilon=2.0)).to_dict()
    assert result["epsilon"] <= 2.0 and result["epsilon_lower"] <= result["epsilon"] and not result["violation"]
    assert result["guarantee"] == ("FDP" if mechanism == "fdp" else "MaskDP")


# -- black-box: canary images scored by loss -------------------------------------------------------------
#: no augmentation and a larger step: the few steps a CI case can afford must be able to memorise a canary
BLACK_BOX_DATA = {"flip": False, "scale_jitter": 0.0, "rotation": 0.0}


def test_black_box_without_noise_sees_the_canaries(data_root) -> None:
    from fedpose.audit import audit_central

    cfg = central_config(data_root, steps=20, batch_size=8, data=BLACK_BOX_DATA, noise_multiplier=0.0)
    result = audit_central(cfg, canaries=64, mode="black-box").to_dict()
    assert (result["mode"], result["canaries"], result["epsilon"]) == ("black-box", 64, None)
    assert result["epsilon_lower"] > 0.5  # weak next to white-box, but it sees memorised canaries


@pytest.mark.parametrize("target", [2.0, 8.0])
def test_black_box_stays_below_a_correct_dp_sgd_claim(data_root, tmp_path, capsys, target) -> None:
    from fedpose.cli import main
    from fedpose.cli.audit import MODES
    import fedpose.audit

    assert MODES == fedpose.audit.MODES
    config = tmp_path / "audit.toml"
    config.write_text(f"""
[data]
train = "{data_root / 'site-1'}"
input_size = [64, 64]
flip = false
scale_jitter = 0.0
rotation = 0.0
[model]
backbone = "tiny_vit_test"
scenario = "scratch"
[optim]
name = "sgd"
lr = 0.05
momentum = 0.0
[train]
batch_size = 8
steps = 20
threads = 1
seed = 1
[privacy]
mechanism = "dpsgd"
target_epsilon = {target}
delta = 1e-5
# per record, as central_config: per patient (auto) every step is 4 record rows per unit slot
unit = "record"
""")
    code = main(["audit", "--config", str(config), "--mode", "black-box", "--canaries", "64", "--json", "--out", str(tmp_path / "out")])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and all(key in result for key in JSON_KEYS)
    assert result["mode"] == "black-box" and result["epsilon"] <= target
    assert result["epsilon_lower"] <= result["epsilon"] and not result["violation"]
    assert (tmp_path / "out" / "scores.png").stat().st_size > 0


def test_black_box_canaries_are_grey_where_only_grey_copies_train(data_root, tmp_path) -> None:
    """A model that trains only grey copies (the main job's scenario) is moved by grey images alone:
    colour canaries would have an exactly zero gradient, and the audit would measure nothing."""
    import torch
    from PIL import Image

    from fedpose.audit import _ood_canary_records, audit_central
    from fedpose.data.dataset import normalize
    from fedpose.model.grey_copies import grey_flags

    def flags(grey: bool) -> list[float]:
        records = _ood_canary_records(3, INPUT_SIZE, tmp_path / str(grey), np.random.default_rng(0), grey=grey)
        return grey_flags(torch.stack([normalize(np.asarray(Image.open(r.image).convert("RGB"))) for r in records])).tolist()

    assert flags(grey=True) == [1.0] * 3 and flags(grey=False) == [0.0] * 3
    cfg = central_config(data_root, steps=10, batch_size=8, data=BLACK_BOX_DATA, noise_multiplier=0.0)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"scenario": "grey_biases_norms"})})
    result = audit_central(cfg, canaries=16, mode="black-box")
    # training moved the sampled canaries' losses: they reached the grey copies
    assert np.abs(result.scores[result.included]).max() > 1e-4


def test_black_box_refuses_what_it_cannot_audit(data_root, tmp_path, capsys) -> None:
    from fedpose.audit import audit_central
    from fedpose.cli import main

    # MaskDP protects a record's private tokens, not its membership: an added/removed canary image is no neighbour.
    with pytest.raises(ValueError, match="audit it white-box"):
        audit_central(central_config(data_root, mechanism="maskdp", noise_multiplier=1.0), canaries=8, mode="black-box")
    with pytest.raises(ValueError, match="reference run"):
        audit_central(central_config(data_root, noise_multiplier=1.0), canaries=8, mode="black-box", reference_run=True)
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"  # a federation config: site rounds
    assert main(["audit", "--config", str(demo), "--mode", "black-box"]) != 0
    assert "audits central training" in capsys.readouterr().err


def test_audit_trains_on_the_input_privatized_copy_that_train_uses(tmp_path) -> None:
    """With input privacy on, `fedpose train` trains on the LDP-sliced copy; the audit audits that run,
    on that copy (made once, reused: no second release), and reports the input guarantee too."""
    from fedpose.audit import audit_central
    from fedpose.data.synthetic import ensure_dataset

    root = tmp_path / "data"
    ensure_dataset(root, sites=1, per_site=PER_SITE, public=1, test=1, size=INPUT_SIZE, seed=0, progress=False)
    cfg = central_config(root, steps=2, noise_multiplier=1.0)
    cfg = cfg.model_copy(update={"input_privacy": cfg.input_privacy.model_copy(update={"mechanism": "ldp-slicing",
                                                                                        "epsilon": 8.0})})
    result = audit_central(cfg, canaries=10)
    assert (root / "site-1.ldp-sliced").is_dir()
    assert result.privacy["input_privacy"]["mechanism"] == "ldp-slicing"
    assert result.privacy["input_privacy"]["epsilon_total"] == 8.0


@pytest.mark.parametrize("mode", ["white-box", "black-box"])
def test_audit_audits_the_unit_q_and_sigma_that_train_runs(data_root, tmp_path, capsys, mode) -> None:
    """Issue 27: on one config, `fedpose audit` and `fedpose train` account in the same unit (site-1
    records carry patient_id, so auto → patient), at the same q and σ, by the same accountant."""
    from fedpose.cli import main

    config = tmp_path / "same.toml"
    config.write_text(f"""
[data]
train = "{data_root / 'site-1'}"
input_size = [64, 64]
[model]
backbone = "tiny_vit_test"
scenario = "scratch"
[train]
batch_size = 3
steps = 2
threads = 1
out_dir = "{tmp_path / 'run'}"
[privacy]
mechanism = "dpsgd"
target_epsilon = 4.0
delta = 1e-5
""")
    assert main(["train", "--config", str(config), "--quiet"]) == 0
    trained = json.loads((tmp_path / "run" / "privacy.json").read_text())
    capsys.readouterr()
    assert main(["audit", "--config", str(config), "--canaries", "20", "--mode", mode, "--json"]) in (0, 3)
    audited = json.loads(capsys.readouterr().out)
    assert trained["protection_unit"] == audited["protection_unit"] == "patient"
    assert audited["accountant"] == trained["accountant"] and audited["steps"] == trained["steps"] == 2
    if mode == "white-box":  # the same training set: the same q and σ exactly
        assert audited["sample_rate"] == trained["sample_rate"] and audited["noise_multiplier"] == trained["noise_multiplier"]
    else:  # canaries join as units of their own, half of them expected: q = B / (N + m/2) over patients
        patients = round(3 / trained["sample_rate"])
        assert audited["sample_rate"] == pytest.approx(3 / (patients + 10))
    assert audited["epsilon_text"].endswith("per patient, add/remove-one-patient adjacency")
    if mode == "black-box":
        return
    # the console line names the unit, q and σ
    assert main(["audit", "--config", str(config), "--canaries", "20", "--mode", mode]) in (0, 3)
    out = capsys.readouterr().out
    assert "per patient" in out and "audited:   per patient (chosen automatically: the coarsest unit" in out


def test_the_guess_line_says_what_the_best_split_was_and_when_none_bounds_epsilon() -> None:
    from fedpose.cli.audit import guess_line

    scores = np.r_[np.full(20, 5.0), np.zeros(180)]
    included = np.r_[np.ones(20, dtype=bool), np.zeros(180, dtype=bool)]
    found = best_lower_bound(scores, included, 1e-5, 0.95)
    line = guess_line({"guesses": found.guesses, "correct": found.correct, "guesses_in": found.guesses_in,
                       "tests_tried": found.tried})
    assert found.epsilon_lower > 0 and line.startswith(f"best guesses: {found.correct} of {found.guesses} correct")
    nothing = best_lower_bound(np.zeros(200), np.arange(200) % 2 == 0, 1e-5, 0.95)  # scores tell nothing: half right
    line = guess_line({"guesses": nothing.guesses, "correct": nothing.correct, "guesses_in": nothing.guesses_in,
                       "tests_tried": nothing.tried})
    assert nothing.guesses == 0 and "0/0" not in line and f"none of the {nothing.tried} guess tests" in line
