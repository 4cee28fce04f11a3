"""Tail averaging at a site (``optim.average_last_steps``): the released Δ is the mean of the round's
last k iterates minus the global weights — post-processing of the private iterates, so the spend and
the ε are those of the same round without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedpose.config import ConfigError, validate
from fedpose.federation.config import SiteConfig
from fedpose.federation.local_training import train_site_round
from site_round_helpers import global_model, make_site_data, site_config

STEPS = 3


def _round(tmp_path: Path, name: str, average_last_steps: int) -> tuple[object, list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """One real site round; (its result, every iterate w_1 … w_T of the trained weights, w_0)."""
    site = site_config(make_site_data(tmp_path / "data"), tmp_path / name, local_steps=STEPS)
    site = site.model_copy(update={"optim": site.optim.model_copy(update={"average_last_steps": average_last_steps})})
    weights, spec = global_model()
    seen: list[dict[str, np.ndarray]] = []
    holder: dict[str, object] = {}

    def watch(engine) -> None:  # the weights as each step begins: w_0 … w_{T−1}
        step = engine.step

        def observed(model, batch):
            holder["model"] = model
            seen.append({k: p.detach().numpy().copy() for k, p in model.trainable_parameters().items()})
            return step(model, batch)

        engine.step = observed

    result = train_site_round(site, "run", 1, weights, spec, STEPS, engine_hook=watch)
    final = {k: p.detach().numpy().copy() for k, p in holder["model"].trainable_parameters().items()}
    return result, [*seen[1:], final], seen[0]


@pytest.mark.parametrize("average_last_steps", [1, 2, 5])
def test_the_release_is_the_mean_of_the_last_k_iterates_at_the_same_spend(tmp_path: Path, average_last_steps: int) -> None:
    result, iterates, start = _round(tmp_path, "state", average_last_steps)
    assert result.reply.status == "ok" and len(iterates) == STEPS
    last = iterates[-min(average_last_steps, STEPS):]
    for name, delta in result.update.items():
        expected = np.mean([w[name].astype(np.float64) for w in last], axis=0) - start[name]
        np.testing.assert_allclose(delta, expected, rtol=1e-5, atol=1e-6)
    if average_last_steps > 1:  # not the last iterate: the average moved less than the steps did
        assert any(not np.allclose(result.update[n], iterates[-1][n] - start[n]) for n in result.update)
    # the spend is the round's: (σ, q, steps) and ε as without averaging
    (spend,) = result.reply.spends
    assert (spend.noise_multiplier, spend.steps) == (1.0, STEPS)
    if average_last_steps > 1:
        plain = _round(tmp_path / "plain", "state", 1)[0]
        assert result.reply.privacy.epsilon == pytest.approx(plain.reply.privacy.epsilon)


def test_k_below_one_is_refused_naming_the_key(tmp_path: Path) -> None:
    raw = site_config(make_site_data(tmp_path / "data"), tmp_path / "state").model_dump(mode="json")
    raw["optim"]["average_last_steps"] = 0
    with pytest.raises(ConfigError, match="average_last_steps"):
        validate(SiteConfig, raw, "site.toml")
