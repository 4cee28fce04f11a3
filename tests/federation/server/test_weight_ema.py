"""coordinator.ema: the moving average of the global model is post-processing of the released
global models only — it equals a recomputation from that sequence — it is what the coordinator
evaluates and publishes, and a resumed run continues it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

import fedpose.federation.server.rounds as rounds_module
from fedpose.federation.config import CoordinatorConfig
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.server.rounds import RoundRunner
from fedpose.federation.weight_ema import EMA_CHECKPOINT, ema_step


@pytest.fixture(autouse=True)
def no_settle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)


class RecordingTransport:
    """The real in-process sites; records the global weights each round was sent (w_{r-1})."""

    def __init__(self, sites: list) -> None:
        from fedpose.federation.server.in_process import InProcessTransport

        self.inner, self.sent = InProcessTransport(sites), {}

    def node_ids(self) -> list[int]:
        return self.inner.node_ids()

    def send_and_receive(self, requests, timeout):
        for request in requests:
            self.sent[request.instruction.round] = {k: np.array(v, copy=True) for k, v in request.global_arrays.items()}
        return self.inner.send_and_receive(requests, timeout)


def _run(tmp_path: Path, rounds: int, data: Path) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "rounds": rounds, "min_sites": 1, "local_steps": 2,
        "data": {"input_size": [64, 64], "val": str(data / "test")}, "ema": {"decay": 0.6},
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}}})


@pytest.mark.slow  # three real DP site rounds, two coordinator processes' worth of set-up
def test_the_average_is_a_recomputation_from_the_released_global_models_and_survives_resume(tmp_path: Path) -> None:
    """Three rounds of a real DP site, the run stopped after round 1 and resumed: global_ema.npz is
    0.3·w1 + 0.3·w2 + 0.4·w3 of the global models the coordinator released (decay 0.6: the mean of
    rounds 1–2, then newest weight 1 − 0.6), computed here from those weights alone; the history's
    PCKh is the average's and its round lines say so, and the directory's published model is the average."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.federation.global_model import load_global_model
    from fedpose.federation.report import load_history, round_line
    from fedpose.train.evaluate import evaluate
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    transport = RecordingTransport([site_config(data, tmp_path / "site-1")])
    RoundRunner(_run(tmp_path, 1, data), echo=lambda _: None).run_rounds(transport)
    assert (tmp_path / "coordinator" / EMA_CHECKPOINT).is_file()
    resumed = RoundRunner(_run(tmp_path, 3, data), resume=True, echo=lambda _: None)
    assert resumed.ema is not None and resumed.ema.averaged == 1 and resumed.ema.round == 1
    resumed.run_rounds(transport)

    w1, w2, w3 = transport.sent[2], transport.sent[3], dict(resumed.global_state)
    float_names = [k for k in w3 if np.issubdtype(w3[k].dtype, np.floating)]
    moved = [k for k in float_names if not np.array_equal(w1[k], w3[k])]
    assert moved, "the sites' updates changed no weight: nothing to average"
    published = load_global_model(tmp_path / "coordinator")
    assert published.path.name == EMA_CHECKPOINT and published.round == 3
    assert published.describe().startswith("moving average (decay 0.6) of the global models of the last 3 rounds")
    state = {k: v.numpy() for k, v in published.model.state_dict().items()}
    for name in float_names:
        expected = 0.3 * w1[name].astype(np.float64) + 0.3 * w2[name] + 0.4 * w3[name]
        np.testing.assert_allclose(state[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not all(np.allclose(state[k], w3[k]) for k in moved)  # the average is not the iterate

    records, root = load_records(data / "test")
    scores = evaluate(published.model, PoseDataset(records, root, input_size=(64, 64), train=False), batch_size=16)
    history = load_history(tmp_path / "coordinator")
    assert history[-1].pckh["Mean"] == pytest.approx(scores["Mean"])
    assert [entry.averaged_from_round for entry in history] == [1, 1, 1]
    assert "(moving average" not in round_line(history[0])  # round 1's average is w1 itself
    assert f"PCKh@0.5 = {scores['Mean']:.2f} (moving average of rounds 1–3) |" in round_line(history[-1])
    report = json.loads((tmp_path / "coordinator" / "report.json").read_text())
    assert report["evaluated_model"] == {"decay": 0.6, "averaged_rounds": 3, "round": 3, "first_round": 1, "file": EMA_CHECKPOINT}


class SilentInRound(RecordingTransport):
    """Round ``silent``'s site never answers (it is not run: nothing spent): no update is accepted."""

    def __init__(self, sites: list, silent: int) -> None:
        super().__init__(sites)
        self.silent = silent

    def send_and_receive(self, requests, timeout):
        if any(request.instruction.round == self.silent for request in requests):
            return []
        return super().send_and_receive(requests, timeout)


@pytest.mark.slow  # two real DP site rounds
def test_a_round_that_leaves_the_global_model_unchanged_adds_nothing_to_the_average(tmp_path: Path) -> None:
    """Round 2 accepts no update (its site is silent): the global model after it is w1 again. Folding
    it in would move the published model back towards w1 with no new site data (seen when a finished
    run was resumed for more rounds than its sites could afford). The average stays w1 after round 2
    and is the mean of w1 and w3 after round 3 (the second model in it), also across a resume after
    round 2; the lines say which rounds."""
    from fedpose.federation.global_model import load_global_model
    from fedpose.federation.report import load_history, round_line
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    transport = SilentInRound([site_config(data, tmp_path / "site-1")], silent=2)
    RoundRunner(_run(tmp_path, 2, data), echo=lambda _: None).run_rounds(transport)
    said: list[str] = []
    runner = RoundRunner(_run(tmp_path, 3, data), resume=True, echo=said.append)  # after the silent round
    assert not any("coordinator.ema" in line for line in said), said  # the average is as saved: nothing to warn of
    runner.run_rounds(transport)
    w1, w3 = transport.sent[3], dict(runner.global_state)  # round 3 was sent the model round 2 left: w1
    history = load_history(tmp_path / "coordinator")
    assert [entry.aggregated for entry in history] == [True, False, True]
    assert runner.ema is not None and (runner.ema.averaged, runner.ema.first_round, runner.ema.round) == (2, 1, 3)
    published = load_global_model(tmp_path / "coordinator")
    state = {k: v.numpy() for k, v in published.model.state_dict().items()}
    for name in [k for k in w3 if np.issubdtype(w3[k].dtype, np.floating)]:
        np.testing.assert_allclose(state[name], 0.5 * w1[name].astype(np.float64) + 0.5 * w3[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert history[1].pckh == history[0].pckh  # round 2: still w1, scored again
    assert "(moving average" not in round_line(history[1])
    assert "(moving average of rounds 1–3) |" in round_line(history[2])


def test_an_ema_step_averages_floats_in_float64_and_copies_integer_buffers() -> None:
    ema = {"w": np.full(3, 1.0, np.float32), "idx": np.array([0, 1])}
    new = {"w": np.full(3, 2.0, np.float32), "idx": np.array([5, 6])}
    assert np.allclose(ema_step(ema, new, 0.9, 2)["w"], 1.5)  # second model: running mean
    out = ema_step(ema, new, 0.9, 50)  # steady state: newest weight 1 − 0.9
    assert out["w"].dtype == np.float32 and np.allclose(out["w"], 1.1) and out["idx"].tolist() == [5, 6]
    with pytest.raises(ValueError, match="different arrays"):
        ema_step(ema, {"w": new["w"]}, 0.9, 2)


@pytest.mark.parametrize("decay", [-0.1, 1.0])
def test_an_ema_decay_outside_zero_to_one_is_refused(decay: float) -> None:
    with pytest.raises(ValidationError, match="ema.decay"):
        CoordinatorConfig.model_validate({"ema": {"decay": decay}})
    assert not CoordinatorConfig().ema.on


def test_the_curves_title_says_from_which_round_the_pckh_is_of_the_moving_average() -> None:
    import matplotlib.pyplot as plt

    from fedpose.federation.report import RoundRecord, federation_figure

    def title(averaged_from: list[int | None]) -> str:
        rounds = [RoundRecord(round=r, pckh={"Mean": 50.0 + r}, averaged_from_round=a) for r, a in enumerate(averaged_from, 1)]
        figure = federation_figure(rounds, initial_pckh=49.0)
        text = figure.axes[0].get_title()
        plt.close(figure)
        return text

    assert title([None, None]) == "global model, held-out split"
    assert title([1, 1, 2]) == "global model (its moving average from round 2), held-out split"
    assert title([1]) == "global model, held-out split"  # one round: the average is that round's model
