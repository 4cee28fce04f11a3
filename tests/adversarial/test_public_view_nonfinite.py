"""Adversarial: one record must not make an FDP / MaskDP round fail after its spend.

FDP and MaskDP add a noise-free gradient of a public sample to each step. A record whose annotation
is finite but extreme (joints at 1e30: the targets overflow) has a non-finite loss there; had it
reached the sum, the step's weights would turn NaN and the round end "failed" after its ε was
spent — a status one record flips (docs/privacy.md: none can). Such a row is dropped from the public
gradient as a private row's non-finite gradient is zeroed, and an annotation that is not finite at
all (a null centre, head box or scale) is refused when the data loads, before any spend.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedpose.data.annotations import AnnotationError, PoseRecord
from site_round_helpers import global_model, make_site_data, site_config


@pytest.fixture(scope="module")
def extreme_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_site_data(tmp_path_factory.mktemp("clean"))
    data = tmp_path_factory.mktemp("extreme")
    shutil.copytree(root, data, dirs_exist_ok=True)
    path = data / "site-1" / "annotations.json"
    records = json.loads(path.read_text())
    for record in records[::3]:  # every third record: the public sample of a step holds some
        record["joints"] = [[1e30, 1e30] for _ in record["joints"]]
    path.write_text(json.dumps(records))
    return data


@pytest.mark.parametrize("mechanism", ["fdp", "maskdp"])
def test_a_record_with_extreme_joints_fails_no_round(extreme_data: Path, tmp_path: Path, mechanism: str) -> None:
    from fedpose.federation.local_training import run_site_round

    weights, spec = global_model()
    site = site_config(extreme_data, tmp_path / "state", mechanism=mechanism, local_steps=2)
    replies = [run_site_round(site, "run", round_id, weights, spec, 2).reply for round_id in (1, 2)]
    assert [(r.status, r.reason) for r in replies] == [("ok", None), ("ok", None)]


@pytest.mark.parametrize("field, value", [("center", [None, 10.0]), ("headbox", [[0, 0], [float("inf"), 5]]),
                                          ("scale", float("inf"))])
def test_a_non_finite_centre_head_box_or_scale_is_refused_when_the_data_loads(field: str, value: object) -> None:
    raw = {"image": "a.jpg", "joints": [[1.0, 2.0]] * 16, "center": [5.0, 5.0], "scale": 1.0, field: value}
    with pytest.raises(AnnotationError, match=f"record 7: '{field}'"):
        PoseRecord.from_json(raw, where="record 7")
