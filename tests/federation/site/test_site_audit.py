"""The site's audit log (issue 28.3): written by the real site round at the moment it replies,
public values only, hash-chained, and `fedpose site report --verify` catching an edited, deleted
or reordered entry and a budget that disagrees with it."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedpose.cli import main
from fedpose.federation.local_training import ROUND_LOG, run_site_round
from fedpose.federation.site_audit import AUDIT_FILE, GENESIS, arrays_sha256, read_log, verify
from fedpose.federation.site_budget import JOURNAL_FILE, STATE_FILE
from site_round_helpers import global_model, make_site_data, site_config

#: recognisable private statistics planted in rounds.jsonl: none may appear in a report
PLANTED = {"train_loss": 0.8642097531, "seconds": 97531.86420, "nonfinite_samples": 8642097, "note": "PRIVATE-NOTE-7f3a"}


@pytest.fixture(scope="module")
def site_rounds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, Path]:
    """A real site's state after: round 1 ok, round 2 ok, round 2 asked again (re-sent, not re-noised),
    round 3 with a global model missing an array (error). Also the state after round 1, kept aside."""
    root = tmp_path_factory.mktemp("site-audit")
    site = site_config(make_site_data(root / "data"), root / "state")
    weights, spec = global_model()
    results = [run_site_round(site, "run", 1, weights, spec, 2)]
    after_round_1 = root / "after-round-1"
    shutil.copytree(root / "state", after_round_1)
    results.append(run_site_round(site, "run", 2, weights, spec, 2))
    results.append(run_site_round(site, "run", 2, weights, spec, 2))
    broken = {k: v for k, v in weights.items() if k != sorted(weights)[0]}
    results.append(run_site_round(site, "run", 3, broken, spec, 2))
    return root / "state", results, after_round_1


def _copy(state: Path, tmp_path: Path) -> Path:
    shutil.copytree(state, tmp_path / "state")
    return tmp_path / "state"


def test_every_reply_is_logged_with_its_public_values_and_the_chain_verifies(site_rounds) -> None:
    state, results, _ = site_rounds
    entries = read_log(state)
    assert [(e.round, e.status, e.reason) for e in entries] == [(1, "ok", None), (2, "ok", None),
                                                                (2, "ok", "resent-earlier-release"), (3, "error", "site-error")]
    assert [e.seq for e in entries] == [1, 2, 3, 4] and entries[0].prev == GENESIS
    assert all(b.prev == a.hash for a, b in zip(entries, entries[1:]))
    weights, _ = global_model()
    for entry, result in zip(entries, results):
        reply = result.reply
        assert entry.epsilon == (reply.privacy.epsilon if reply.privacy else None)
        assert (entry.guarantee, entry.protection_unit, entry.delta, entry.accountant, entry.adjacency) == (
            "DP", "patient", 1e-5, reply.privacy.accountant, "add_remove")  # the relation as reported, not inferred
        if reply.carries_update:  # what was released, by size and digest
            assert entry.update_sha256 == arrays_sha256(result.update)
            assert entry.update_bytes == sum(a.nbytes for a in result.update.values()) > 0
            assert entry.spend is not None and (entry.spend.noise_multiplier, entry.spend.steps) == (1.0, 2)
        else:
            assert entry.update_sha256 is None and entry.update_bytes == 0
    assert entries[1].update_sha256 == entries[2].update_sha256  # the re-sent release is the same bytes
    assert entries[0].asked.global_sha256 == arrays_sha256(weights) and entries[0].asked.local_steps == 2
    assert entries[3].asked.global_sha256 != entries[0].asked.global_sha256
    assert entries[3].error_class is not None and entries[3].spend is None
    assert entries[1].epsilon > entries[0].epsilon
    result = verify(state)
    assert (result.entries, result.spends_checked, result.unlogged_spends) == (4, 3, ())


def test_the_report_shows_public_values_only(site_rounds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """rounds.jsonl holds private statistics: plant recognisable ones and look for them in every format."""
    state = _copy(site_rounds[0], tmp_path)
    modes = ([], ["--json"], ["--csv"], ["--verify"])

    def reports() -> dict[tuple[str, ...], str]:
        outputs = {}
        for mode in modes:
            assert main(["site", "report", "--state-dir", str(state), *mode]) == 0
            outputs[tuple(mode)] = capsys.readouterr().out
        return outputs

    before = reports()
    with open(state / ROUND_LOG, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"run_id": "run", "round": 1, "outcome": "ok", **PLANTED}) + "\n")
    outputs = reports()
    # The planted statistics change nothing in any format: no rounded or reformatted trace of them
    # either. (Searching the text for digit runs such as "8642" is not a test: the report's public
    # digests and times contain any short digit run now and then.)
    assert outputs == before
    for text in outputs.values():
        for value in PLANTED.values():
            assert str(value) not in text
    table = outputs[()]
    assert "ε = " in table and "(DP, δ = 1e-05, PLD) per patient" in table and "resent-earlier-release" in table
    doc = json.loads(outputs[("--json",)])
    assert [e["seq"] for e in doc["entries"]] == [1, 2, 3, 4]
    assert doc["entries"][0]["epsilon_text"].endswith("(DP, δ = 1e-05, PLD) per patient, add/remove-one-patient adjacency")
    assert doc["entries"][0]["update_sha256"] == read_log(state)[0].update_sha256
    rows = list(csv.DictReader(io.StringIO(outputs[("--csv",)])))
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "error"] and rows[0]["noise_multiplier"] == "1.0"
    assert rows[0]["adjacency"] == "add_remove"
    assert "4 entries, hash chain intact; its 3 spends agree" in outputs[("--verify",)]


def test_an_entry_written_before_the_adjacency_field_still_verifies_and_reads_with_its_guarantees_relation(
        site_rounds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedpose.federation.site_audit import _entry_hash

    state = _copy(site_rounds[0], tmp_path)
    lines = _lines(state)
    old = json.loads(lines[0])
    del old["adjacency"]  # as a site wrote it before the field existed: hashed without it
    old["hash"] = _entry_hash(old)
    follower = json.loads(lines[1])
    follower["prev"] = old["hash"]
    follower["hash"] = _entry_hash(follower)
    rest = [json.loads(line) for line in lines[2:]]
    for before, entry in zip([follower, *rest], rest):
        entry["prev"] = before["hash"]
        entry["hash"] = _entry_hash(entry)
    (state / AUDIT_FILE).write_text("".join(json.dumps(e) + "\n" for e in [old, follower, *rest]))
    assert read_log(state)[0].adjacency is None and read_log(state)[1].adjacency == "add_remove"
    assert main(["site", "report", "--state-dir", str(state), "--verify"]) == 0
    capsys.readouterr()
    assert main(["site", "report", "--state-dir", str(state), "--json"]) == 0
    texts = [e["epsilon_text"] for e in json.loads(capsys.readouterr().out)["entries"]]
    assert texts[0].endswith("add/remove-one-patient adjacency") and texts[0].split(" (")[1] == texts[1].split(" (")[1]


def _lines(state: Path) -> list[str]:
    return (state / AUDIT_FILE).read_text().splitlines(keepends=True)


def _verify_fails(state: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["site", "report", "--state-dir", str(state), "--verify"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpose: error: ") and "Traceback" not in captured.err
    return lines[0]


def test_verify_names_an_edited_entry(site_rounds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _copy(site_rounds[0], tmp_path)
    lines = _lines(state)
    entry = json.loads(lines[1])
    entry["epsilon"] = entry["epsilon"] / 2  # a lower ε after round 2
    lines[1] = json.dumps(entry) + "\n"
    (state / AUDIT_FILE).write_text("".join(lines))
    line = _verify_fails(state, capsys)
    assert "entry 2 (run 'run' round 2): its content does not match its hash" in line

    # the forger recomputes the entry's hash: the next entry's link breaks instead
    from fedpose.federation.site_audit import _entry_hash

    entry["hash"] = _entry_hash(entry)
    lines[1] = json.dumps(entry) + "\n"
    (state / AUDIT_FILE).write_text("".join(lines))
    assert "entry 3 (run 'run' round 2, seq 3): does not follow the entry before it" in _verify_fails(state, capsys)


def test_verify_names_a_deleted_entry(site_rounds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _copy(site_rounds[0], tmp_path)
    lines = _lines(state)
    (state / AUDIT_FILE).write_text("".join(lines[:1] + lines[2:]))
    assert "entry 2 (run 'run' round 2, seq 3): does not follow the entry before it (expected seq 2" in _verify_fails(state, capsys)


def test_verify_names_a_reordered_entry(site_rounds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _copy(site_rounds[0], tmp_path)
    lines = _lines(state)
    (state / AUDIT_FILE).write_text("".join([lines[0], lines[2], lines[1], lines[3]]))
    assert "entry 2 (run 'run' round 2, seq 3): does not follow" in _verify_fails(state, capsys)


def test_verify_names_a_budget_that_disagrees_with_the_log(site_rounds, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Budget and journal rolled back together to their copies after round 1 (consistent with each
    other, so the site's own check passes): the log still says round 2 was spent and released."""
    state, _, after_round_1 = site_rounds
    state = _copy(state, tmp_path)
    for name in (STATE_FILE, JOURNAL_FILE):
        shutil.copy2(after_round_1 / name, state / name)
    line = _verify_fails(state, capsys)
    assert "entry 2 (run 'run' round 2): the site replied with this spend" in line and "budget.json does not hold it" in line


def test_a_torn_last_line_is_not_an_entry_and_the_next_reply_continues_the_chain(site_rounds, tmp_path: Path) -> None:
    from fedpose.federation.site_audit import record_reply

    state = _copy(site_rounds[0], tmp_path)
    with open(state / AUDIT_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"format": "fedpose.site-au')  # the site stopped mid-append
    assert verify(state).entries == 4
    reply = site_rounds[1][0].reply.model_copy(update={"round": 9, "spends": []})
    record_reply(state, reply, site_rounds[1][0].update, None)
    entries = read_log(state)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5] and entries[4].prev == entries[3].hash
    assert verify(state).entries == 5


def test_report_without_a_log_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["site", "report", "--state-dir", str(tmp_path)]) == 2
    assert "no audit log (audit.jsonl)" in capsys.readouterr().err


def test_an_update_that_cannot_be_logged_is_not_sent(site_rounds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log is written before the reply leaves: when it cannot be, the round becomes an error
    reply carrying no update (its spend stays counted: conservative). A log that cannot take an entry
    at all is found before the spend (nothing spent); one whose write fails only after the spend (the
    disk filled meanwhile: the write is made to fail) costs that round's spend and releases nothing."""
    import errno

    import fedpose.federation.site_audit as site_audit
    from fedpose.federation.site_budget import SiteBudget

    state = _copy(site_rounds[0], tmp_path)
    (state / AUDIT_FILE).unlink()
    (state / AUDIT_FILE).mkdir()  # unwritable as a file, even for root
    site = site_config(site_rounds[0].parent / "data", state)
    weights, spec = global_model()
    result = run_site_round(site, "run", 4, weights, spec, 2)
    assert (result.reply.status, result.reply.error_class) == ("error", "IsADirectoryError")
    assert not result.update and not result.reply.carries_update
    assert SiteBudget(state, "site-1", 50.0, 1e-5, "DP", unit="patient").entry("run", 4) is None  # found before the spend

    (state / AUDIT_FILE).rmdir()
    shutil.copy2(site_rounds[0] / AUDIT_FILE, state / AUDIT_FILE)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(site_audit, "append_lines", disk_full)
    result = run_site_round(site, "run", 4, weights, spec, 2)
    assert (result.reply.status, result.reply.error_class) == ("error", "OSError")
    assert not result.update and not result.reply.carries_update
    assert SiteBudget(state, "site-1", 50.0, 1e-5, "DP", unit="patient").entry("run", 4).status == "spent"


@pytest.mark.usefixtures("flower_task_identity")
def test_a_reply_the_egress_guard_blocks_is_recorded_as_blocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real ClientApp: a bug adds a record the protocol does not allow to a trained
    round's reply. The round's "ok" line (with the update's digest) was written before the guard
    looked; a second line says the guard blocked it and that no update left — what the coordinator
    got (an egress error) — and the chain and its spend still verify."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

    import sites.client_app as client_app
    from fedpose.federation import protocol
    from fedpose.federation.site_audit import BLOCKED_ERROR_CLASS
    from fedpose.train.central import to_toml
    from sites.egress import EGRESS_ERROR_CODE

    site = site_config(make_site_data(tmp_path / "data"), tmp_path / "state")
    config = tmp_path / "site.toml"
    config.write_text(to_toml(json.loads(site.model_dump_json())))
    context = Context(run_id=1, node_id=1, node_config={"site-config": str(config)}, state=RecordDict(), run_config={})
    weights, spec = global_model()
    instruction = protocol.TrainInstruction(run_id="run", round=1, local_steps=2, model_spec=spec)
    msg = Message(RecordDict({protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(instruction)),
                               protocol.GLOBAL_RECORD: ArrayRecord({k: Array(v) for k, v in weights.items()})}),
                  dst_node_id=1, message_type=protocol.MESSAGE_TYPE_TRAIN)
    msg.metadata.__dict__["_message_id"] = "t1"
    real_handle_train = client_app.handle_train

    def leaky_handle_train(msg: Message, context: Context, site) -> Message:
        reply = real_handle_train(msg, context, site)
        reply.content["images"] = ArrayRecord({"x": Array(np.zeros((2, 3, 8, 8), np.float32))})  # the bug
        return reply

    monkeypatch.setattr(client_app, "handle_train", leaky_handle_train)
    reply = client_app.build_client_app()(msg, context)
    assert reply.has_error() and reply.error.code == EGRESS_ERROR_CODE

    state = tmp_path / "state"
    trained, blocked = read_log(state)
    assert (trained.status, trained.blocked_seq) == ("ok", None) and trained.update_bytes > 0
    assert (blocked.status, blocked.error_class, blocked.blocked_seq) == ("error", BLOCKED_ERROR_CLASS, trained.seq)
    assert (blocked.update_bytes, blocked.update_sha256) == (0, None)
    assert (blocked.run_id, blocked.round, blocked.spend, blocked.epsilon) == ("run", 1, trained.spend, trained.epsilon)
    assert verify(state).entries == 2
    assert "egress guard blocked the reply (record 'images' is not part of the protocol); audit.jsonl entry 2" in (
        state / "site.log").read_text()
    assert "blocked_seq" not in json.loads(_lines(state)[0])  # lines of replies that left are written as before


def test_a_lost_audit_log_is_never_silently_begun_again(site_rounds, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The site's log was deleted: the next reply used to start a new chain at seq 1 and `--verify`
    passed without a note, every earlier reply gone from the record. The state marker now says since
    when the state keeps a log: `--verify` on the missing log says it was lost; the next reply begins a
    new log whose first entry says so, and `--verify` lists every spend the new log does not hold."""
    state = _copy(site_rounds[0], tmp_path)
    (state / AUDIT_FILE).unlink()
    assert "it was lost or removed — restore it from its outside copy" in _verify_fails(state, capsys)
    site = site_config(site_rounds[0].parent / "data", state)
    weights, spec = global_model()
    assert run_site_round(site, "run", 4, weights, spec, 2).reply.status == "ok"
    (entry,) = read_log(state)
    assert (entry.seq, entry.prev, entry.restarted_after_loss) == (1, GENESIS, True)
    result = verify(state)
    assert result.restarted_after_loss and result.unlogged_spends == (("run", 1), ("run", 2))
    assert main(["site", "report", "--state-dir", str(state), "--verify"]) == 0
    assert "begun again after the site's earlier log was lost" in capsys.readouterr().out


def test_spends_without_a_logged_reply_are_found_whatever_the_clock_said(site_rounds, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A site killed between its spend and its reply leaves a spend with no logged reply; `--verify`
    selected those by time, so one recorded while the clock was set back a day was not listed. They
    are selected by what the budget held when the log began (the state marker's record)."""
    import fedpose.federation.site_budget as site_budget_module
    from fedpose.federation.site_budget import SiteBudget

    state = _copy(site_rounds[0], tmp_path)
    real_time = site_budget_module.time.time
    monkeypatch.setattr(site_budget_module.time, "time", lambda: real_time() - 86_400)
    SiteBudget(state, "site-1", 50.0, 1e-5, "DP", unit="patient").authorize_round("run", 5, 1.0, 0.25, 2)  # then killed
    monkeypatch.setattr(site_budget_module.time, "time", real_time)
    assert verify(state).unlogged_spends == (("run", 5),)


def test_a_warning_naming_a_private_count_stays_in_the_site_log(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A coordinator that asks a colour-only site to train grey copies made the site warn "none of the
    N training images is grey" — N, and a bit one grey record flips — through Python's warnings, to the
    SuperNode's console (a red-team finding). While the ClientApp handles a message, warnings go to the
    site's own log, like its records."""
    import warnings

    from sites.client_app import site_log

    site = site_config(tmp_path / "data", tmp_path / "state")
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with site_log(site):
            warnings.warn("the model trains only grey copies but none of the 16 training images is grey", RuntimeWarning)
    console = capfd.readouterr()
    assert "training images is grey" not in console.out + console.err
    assert "none of the 16 training images is grey" in (tmp_path / "state" / "site.log").read_text()
