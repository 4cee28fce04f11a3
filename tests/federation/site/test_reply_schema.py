"""Every reply kind the real site code produces carries exactly the fields of the typed schema, and
the schema holds only fields whose values are public (see the justification beside each).

Adding a field to :class:`fedpose.federation.protocol.SiteReply` or ``PrivacyReport`` fails this
test until it is added below with the reason it may leave a site."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedpose.federation import protocol
from fedpose.federation.local_training import run_site_round
from site_round_helpers import PER_SITE, global_model, make_site_data, site_config

#: field → why a coordinator learns nothing about a patient from it
SITE_REPLY_FIELDS = {
    "site_id": "configured id of the site",
    "run_id": "echo of the coordinator's instruction",
    "round": "echo of the coordinator's instruction",
    "status": "set by the budget guard (declared values) and by post-processing of the noisy update",
    "reason": "a fixed code determined by the status",
    "error_class": "an exception class name (operational failure), no message text",
    "privacy": "cumulative accounting of declared σ, q, δ over the steps run",
    "basis_version": "version of the public basis the site holds",
    "local_steps": "min(asked, configured cap)",
    "aggregation_weight": "declared in the site's config",
    "spends": "per spent round of this run: declared σ, q and the steps run (min(asked, cap))",
    "signature": "Ed25519 (deterministic) by the site's identity key over this reply and the digest of its update: "
                 "a function of values that leave anyway",
}
PRIVACY_REPORT_FIELDS = {
    "guarantee", "unit", "adjacency", "accountant", "epsilon", "delta", "eps_max", "steps", "rounds_spent",
    "orders", "rdp", "next_round_affordable",
    "protection_unit",  # record / image / patient: the site's declared unit (config, or pinned in its budget state)
    "update_clip_range",  # secure aggregation: the public r of the round's setup, echoed (None otherwise)
    "input_privacy",  # LDP-Slicing on the site's inputs: its declared mechanism, ε_total and LL pruning (config)
}


def test_the_input_privacy_statement_holds_only_declared_settings() -> None:
    assert set(protocol.InputPrivacyStatement.model_fields) == {"mechanism", "epsilon_total", "ll_prune"}


def test_the_schema_has_only_justified_fields() -> None:
    assert set(protocol.SiteReply.model_fields) == set(SITE_REPLY_FIELDS)
    assert set(protocol.PrivacyReport.model_fields) == PRIVACY_REPORT_FIELDS


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("site-data"))


def _check(reply: protocol.SiteReply) -> dict:
    wire = json.loads(protocol.encode_reply(reply)[protocol.REPLY_KEY])
    assert set(wire) == set(SITE_REPLY_FIELDS), set(wire) ^ set(SITE_REPLY_FIELDS)
    if wire["privacy"] is not None:
        assert set(wire["privacy"]) == PRIVACY_REPORT_FIELDS
    assert protocol.decode_reply(protocol.encode_reply(reply)) == reply
    numbers = json.dumps(wire)
    assert f": {PER_SITE}," not in numbers and f": {PER_SITE}}}" not in numbers  # the dataset size N is not in it
    return wire


def test_every_reply_kind_of_the_real_site_code(data_root: Path, tmp_path: Path) -> None:
    weights, spec = global_model()
    site = site_config(data_root, tmp_path / "state")

    ok = run_site_round(site, "run", 1, weights, spec, 2)
    assert ok.reply.status == "ok" and ok.reply.reason is None and ok.update
    assert all(np.isfinite(a).all() for a in ok.update.values())
    _check(ok.reply)

    resent = run_site_round(site, "run", 1, weights, spec, 2)  # a replayed message: the same release again
    assert resent.reply.status == "ok" and resent.reply.reason == "resent-earlier-release"
    assert all(np.array_equal(resent.update[k], ok.update[k]) for k in ok.update)
    _check(resent.reply)

    (tmp_path / "state" / "released_update.npz").unlink()
    replayed = run_site_round(site, "run", 1, weights, spec, 2)
    assert replayed.reply.status == "replayed" and not replayed.update
    _check(replayed.reply)

    refused = run_site_round(site_config(data_root, tmp_path / "poor", eps_max=0.01), "run", 1, weights, spec, 2)
    assert refused.reply.status == "refused" and refused.reply.reason == "budget-exhausted" and not refused.update
    _check(refused.reply)

    diverging = site_config(data_root, tmp_path / "diverging", noise_multiplier=10.0)
    # lr near float32's maximum: any noisy gradient coordinate above ~1.1 overflows the weights
    diverging = diverging.model_copy(update={"optim": diverging.optim.model_copy(update={"lr": 3e38})})
    failed = run_site_round(diverging, "run", 1, weights, spec, 2)
    assert failed.reply.status == "failed" and failed.reply.reason == "training-diverged" and not failed.update
    assert failed.reply.privacy is not None and failed.reply.privacy.epsilon > 0  # spent, and says so
    _check(failed.reply)

    broken = {k: v for k, v in weights.items() if not k.startswith("head.")}  # a malformed instruction
    error = run_site_round(site_config(data_root, tmp_path / "error"), "run", 1, broken, spec, 2)
    assert error.reply.status == "error" and error.reply.error_class == "GlobalModelRejected" and not error.update
    wire = _check(error.reply)
    assert "head." not in json.dumps(wire)  # the exception's text stays in the site's log
    log = [json.loads(line) for line in (tmp_path / "error" / "rounds.jsonl").read_text().splitlines()]
    assert log[-1]["outcome"] == "error" and "head." in log[-1]["note"]  # ... where it is


def test_the_reply_does_not_depend_on_the_data(data_root: Path, tmp_path: Path) -> None:
    """A neighbouring dataset (three records fewer, one record's keypoints moved) changes the loss
    and N; apart from Δ, the reply must be identical."""
    import shutil

    from fedpose.data.annotations import ANNOTATIONS_FILE, read_annotations, write_annotations

    neighbour = tmp_path / "neighbour"
    shutil.copytree(data_root, neighbour)
    records = read_annotations(neighbour / "site-1")
    records[0].joints = records[0].joints + 7.0
    write_annotations(neighbour / "site-1" / ANNOTATIONS_FILE, records[3:] + records[:1])

    weights, spec = global_model()
    first = run_site_round(site_config(data_root, tmp_path / "a"), "run", 1, weights, spec, 2).reply
    second = run_site_round(site_config(neighbour, tmp_path / "b"), "run", 1, weights, spec, 2).reply
    assert first.status == "ok" and first.model_dump() == second.model_dump()
    local = [json.loads(line) for line in (tmp_path / "a" / "rounds.jsonl").read_text().splitlines()]
    assert "train_loss" in local[-1]  # the loss is kept for the site's own operators only
