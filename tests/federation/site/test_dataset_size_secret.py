"""N stays secret at a site: add/remove DP protects the presence of one record, and N tells it.
A site declares q (and B normalises the noisy sum); nothing it computes for release reads N."""

from __future__ import annotations

import pytest

from fedpose.config import ConfigError, PrivacyConfig, validate
from fedpose.federation.config import SiteConfig
from fedpose.privacy.engine import build_engine
from test_dp_engine import make_model


def _site(**privacy) -> dict:
    return {"site_id": "site-1", "data": {"train": "data/site-1"}, "state_dir": "state", "eps_max": 8.0,
            "privacy": {"mechanism": "dpsgd", "noise_multiplier": 1.0, **privacy}}


def test_a_site_must_declare_its_sampling_rate() -> None:
    with pytest.raises(ConfigError, match="privacy.sample_rate"):
        validate(SiteConfig, _site(), "site.toml")
    assert validate(SiteConfig, _site(sample_rate=0.1), "site.toml").privacy.sample_rate == 0.1
    validate(SiteConfig, {**_site(), "privacy": {"mechanism": "none"}}, "site.toml")  # nothing to protect


def test_a_site_refuses_seeded_test_randomness() -> None:
    with pytest.raises(ConfigError, match="insecure_seeded_noise is for tests only"):
        validate(SiteConfig, _site(sample_rate=0.1, insecure_seeded_noise=True), "site.toml")
    raw = {**_site(sample_rate=0.1), "input_privacy": {"mechanism": "ldp-slicing", "epsilon": 4.0, "insecure_seed": 3}}
    with pytest.raises(ConfigError, match="insecure_seed is for tests only"):
        validate(SiteConfig, raw, "site.toml")


@pytest.mark.parametrize("dataset_size", [16, 17, 160])
def test_the_released_accounting_does_not_depend_on_n(dataset_size: int) -> None:
    # 90 unit slots: step timing stays data-independent up to 168 units at q = 0.25 (fedpose.privacy.fixed_shape)
    privacy = PrivacyConfig(mechanism="dpsgd", target_epsilon=3.0, sample_rate=0.25, max_grad_norm=1.0, max_batch_units=90)
    engine = build_engine(privacy, make_model(), dataset_size=dataset_size, batch_size=4, planned_steps=10)
    assert engine.sample_rate == 0.25 and engine.expected_batch_size == 4.0
    report = engine.privacy_report()
    assert "dataset_size" not in report and report["dataset_size_public"] is False
    reference = build_engine(privacy, make_model(), dataset_size=16, batch_size=4, planned_steps=10)
    assert engine.noise_multiplier == reference.noise_multiplier  # σ calibrated from declared values only


def test_central_training_without_a_declared_rate_says_n_is_public() -> None:
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0)
    report = build_engine(privacy, make_model(), dataset_size=16, batch_size=4, planned_steps=1).privacy_report()
    assert report["dataset_size_public"] is True and report["dataset_size"] == 16
    assert "N treated as public" in report["adjacency"] or "dataset size N treated as public" in report["adjacency"]


def test_privacy_report_cli_states_randomness_adjacency_unit_and_what_leaves(tmp_path, capsys) -> None:
    import json

    from fedpose.cli import main

    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, sample_rate=0.25)
    report = build_engine(privacy, make_model(), dataset_size=16, batch_size=4, planned_steps=1).privacy_report()
    path = tmp_path / "privacy.json"
    path.write_text(json.dumps(report))
    assert main(["privacy", "report", str(path)]) == 0
    text = capsys.readouterr().out
    for needle in ("randomness: AES-256-CTR", "unit protected: one record", "adjacency: add/remove one record",
                   "dataset size N: secret", "what leaves:", "(DP, δ = 1e-05, PLD)"):
        assert needle in text, (needle, text)
