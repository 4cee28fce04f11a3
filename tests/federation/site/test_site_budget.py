"""Site budget guard: refuses past ε_max, survives restarts and failed writes, never resets silently."""

from __future__ import annotations

import json

import pytest

import fedpose.io
from fedpose.federation import site_budget as sb
from fedpose.federation.site_budget import BudgetExhausted, BudgetStateError, RoundConflict, SiteBudget
from fedpose.privacy.accountant import epsilon_for

SIGMA, Q, STEPS, DELTA = 1.0, 0.01, 200, 1e-5


def _eps_after(rounds: int) -> float:
    # a new budget enforces the relation's default accountant: PLD (fedpose.privacy.accountants)
    return epsilon_for(SIGMA, Q, rounds * STEPS, DELTA, accountant="pld")[0]


def _budget(tmp_path, eps_max: float) -> SiteBudget:
    return SiteBudget(tmp_path / "site-a", "site-a", eps_max=eps_max, delta=DELTA, guarantee="DP")


def test_refuses_exactly_the_round_that_would_pass_eps_max(tmp_path):
    # ε_max between the ε after 3 and after 4 rounds: rounds 1-3 run, round 4 is refused.
    eps3, eps4 = _eps_after(3), _eps_after(4)
    budget = _budget(tmp_path, eps_max=(eps3 + eps4) / 2)
    for r in (1, 2, 3):
        auth = budget.authorize_round("run", r, SIGMA, Q, STEPS)
        assert not auth.replayed
        assert auth.entry.epsilon_after == pytest.approx(_eps_after(r), rel=1e-9)
    with pytest.raises(BudgetExhausted) as info:
        budget.authorize_round("run", 4, SIGMA, Q, STEPS)
    assert info.value.planned == pytest.approx(eps4, rel=1e-9)
    assert "refuses round 4" in info.value.reason and "ε_max" in info.value.reason and "DP" in info.value.reason
    # Nothing was spent by the refusal, and it is recorded for audit.
    assert budget.epsilon == pytest.approx(eps3, rel=1e-9)
    assert budget.steps == 3 * STEPS
    assert [e.status for e in budget.entries] == ["spent", "spent", "spent", "refused"]
    # A smaller round still fits.
    budget.authorize_round("run", 5, SIGMA, Q, 1)
    assert budget.steps == 3 * STEPS + 1


def test_restart_does_not_reset_the_budget(tmp_path):
    eps_max = (_eps_after(2) + _eps_after(3)) / 2
    first = _budget(tmp_path, eps_max)
    first.authorize_round("run", 1, SIGMA, Q, STEPS)
    first.authorize_round("run", 2, SIGMA, Q, STEPS)
    del first
    restarted = _budget(tmp_path, eps_max)  # a new process: state comes from disk only
    assert restarted.epsilon == pytest.approx(_eps_after(2), rel=1e-9)
    with pytest.raises(BudgetExhausted):
        restarted.authorize_round("run", 3, SIGMA, Q, STEPS)
    # A new run id on the same site shares the same budget (it is about the site's records).
    with pytest.raises(BudgetExhausted):
        _budget(tmp_path, eps_max).authorize_round("another-run", 1, SIGMA, Q, STEPS)


def test_replayed_round_is_not_double_counted(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    first = budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    again = _budget(tmp_path, eps_max=10.0).authorize_round("run", 1, SIGMA, Q, STEPS)
    assert again.replayed and again.entry == first.entry
    assert _budget(tmp_path, 10.0).steps == STEPS
    with pytest.raises(RoundConflict):
        budget.authorize_round("run", 1, SIGMA, Q, STEPS + 1)
    # Same round number in another run is a different round.
    budget.authorize_round("run2", 1, SIGMA, Q, STEPS)
    assert budget.steps == 2 * STEPS


def test_two_objects_on_one_state_dir_see_each_others_spend(tmp_path):
    # Flower starts a new ClientApp process per message: each authorization re-reads the disk.
    a, b = _budget(tmp_path, 10.0), _budget(tmp_path, 10.0)
    a.authorize_round("run", 1, SIGMA, Q, STEPS)
    b.authorize_round("run", 2, SIGMA, Q, STEPS)
    assert b.steps == 2 * STEPS


def test_failed_write_keeps_the_old_state(tmp_path, monkeypatch):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    before = budget.path.read_bytes()

    real_atomic_write = fedpose.io.atomic_write

    def crashing_write_text(path, text):
        def write_half_then_die(fh):
            fh.write(text.encode()[: len(text) // 2])
            raise OSError("disk died mid-write")

        real_atomic_write(path, write_half_then_die)

    monkeypatch.setattr(sb, "atomic_write_text", crashing_write_text)
    with pytest.raises(OSError, match="mid-write"):
        budget.authorize_round("run", 2, SIGMA, Q, STEPS)
    assert budget.path.read_bytes() == before
    assert budget.steps == STEPS  # memory did not run ahead of disk
    assert not [p for p in budget.state_dir.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    reloaded = _budget(tmp_path, eps_max=10.0)
    assert reloaded.steps == STEPS
    reloaded.authorize_round("run", 2, SIGMA, Q, STEPS)
    assert reloaded.steps == 2 * STEPS


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: "",  # emptied
        lambda text: text.replace('"steps": 200', '"steps": 2', 1),  # edited without the checksum
    ],
)
def test_corrupt_state_is_a_clear_error_not_a_reset(tmp_path, damage):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    budget.path.write_text(damage(budget.path.read_text()))
    with pytest.raises(BudgetStateError, match="corrupt|malformed"):
        _budget(tmp_path, eps_max=10.0)


def test_state_of_another_site_or_guarantee_is_refused(tmp_path):
    _budget(tmp_path, 10.0).authorize_round("run", 1, SIGMA, Q, STEPS)
    with pytest.raises(BudgetStateError, match="belongs to site"):
        SiteBudget(tmp_path / "site-a", "site-b", eps_max=10.0, delta=DELTA)
    with pytest.raises(BudgetStateError, match="FDP") as refused:
        SiteBudget(tmp_path / "site-a", "site-a", eps_max=10.0, delta=DELTA, guarantee="FDP")
    # what it has spent is stated with every qualifier, never a bare ε
    assert "(DP, δ = 1e-05, PLD) per record, add/remove-one-record adjacency" in str(refused.value)
    other = "rdp" if SiteBudget(tmp_path / "site-a", "site-a", eps_max=10.0, delta=DELTA).accountant_name == "pld" else "pld"
    with pytest.raises(BudgetStateError, match="the config asks for") as switched:
        SiteBudget(tmp_path / "site-a", "site-a", eps_max=10.0, delta=DELTA, accountant=other)
    assert str(switched.value).count("per record, add/remove-one-record adjacency") == 2


def test_zero_noise_is_refused(tmp_path):
    budget = _budget(tmp_path, eps_max=100.0)
    with pytest.raises(BudgetExhausted):
        budget.authorize_round("run", 1, 0.0, Q, 1)
    assert budget.epsilon == 0.0


def test_report_is_cumulative_and_json_ready(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    budget.authorize_round("run", 2, SIGMA, Q, STEPS)
    report = json.loads(json.dumps(budget.report()))
    assert report["epsilon"] == pytest.approx(_eps_after(2), rel=1e-9)
    assert report["rounds_spent"] == 2 and report["steps"] == 2 * STEPS
    assert len(report["rdp"]) == len(report["orders"])


def _snapshot(directory) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name != sb.LOCK_FILE}


def test_a_deleted_budget_file_is_an_error_not_a_fresh_start(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    budget.path.unlink()
    before = _snapshot(budget.state_dir)
    with pytest.raises(BudgetStateError, match=r"budget\.json is missing.*refusing to restart"):
        _budget(tmp_path, eps_max=10.0)
    assert _snapshot(budget.state_dir) == before  # nothing recreated


def test_a_deleted_marker_is_an_error_naming_it(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    (budget.state_dir / sb.GENESIS_FILE).unlink()
    before = _snapshot(budget.state_dir)
    with pytest.raises(BudgetStateError, match=r"site_state\.json is missing.*Restore site_state\.json from a backup"):
        _budget(tmp_path, eps_max=10.0)
    assert _snapshot(budget.state_dir) == before  # no marker recreated


def test_a_budget_from_before_markers_is_adopted_and_then_guarded(tmp_path):
    """Sites that ran before genesis markers existed keep their spend; from then on the marker is required."""
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    legacy = json.loads(budget.path.read_text())["payload"]
    del legacy["genesis_created_at"]
    sb._write_signed(budget.path, legacy)
    (budget.state_dir / sb.GENESIS_FILE).unlink()
    adopted = _budget(tmp_path, eps_max=10.0)
    assert adopted.epsilon == pytest.approx(_eps_after(1))  # nothing lost
    marker = json.loads((budget.state_dir / sb.GENESIS_FILE).read_text())["payload"]
    assert marker["adopted_from"] == sb.STATE_FILE and "pins" not in marker  # its earlier rounds pinned nothing
    adopted.authorize_round("run", 2, SIGMA, Q, STEPS)  # the next write stamps the budget with its marker
    (budget.state_dir / sb.GENESIS_FILE).unlink()
    with pytest.raises(BudgetStateError, match=r"site_state\.json is missing"):
        _budget(tmp_path, eps_max=10.0)


def test_a_creation_stopped_before_its_marker_is_completed(tmp_path):
    """Genesis writes the empty budget, then the marker: a crash in between has spent nothing, so it is
    completed rather than refused (the site could otherwise never start)."""
    budget = _budget(tmp_path, eps_max=10.0)
    (budget.state_dir / sb.GENESIS_FILE).unlink()
    assert _budget(tmp_path, eps_max=10.0).epsilon == 0.0
    marker = json.loads((budget.state_dir / sb.GENESIS_FILE).read_text())["payload"]
    # it pins its settings from its first round, as a state created in one go does: a pins file lost
    # later is refused, not re-pinned to what a coordinator asks (site_pins._kept_pins)
    assert marker["pins"] == sb.PINS_VERSION


def test_state_without_marker_or_budget_is_refused(tmp_path):
    """Losing both files while other state survives (a basis cache, a released update) is loss, not a new site."""
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    (budget.state_dir / "released_update.npz").write_bytes(b"update")
    budget.path.unlink()
    (budget.state_dir / sb.GENESIS_FILE).unlink()
    with pytest.raises(BudgetStateError, match="released_update.npz.*restore both"):
        _budget(tmp_path, eps_max=10.0)
    assert not budget.path.exists()


@pytest.mark.parametrize("before, after", [("DP", "FDP"), ("FDP", "DP"), ("none", "DP"), ("DP", "none")])
def test_a_change_of_guarantee_is_refused_with_the_spend_and_never_a_new_state_dir(tmp_path, before, after):
    state = tmp_path / "site-a"
    if before == "none":
        sb.ensure_site_state(state, "site-a", "none", None)
    else:
        SiteBudget(state, "site-a", 100.0, DELTA, before).authorize_round("run", 1, SIGMA, Q, STEPS)
    snapshot = _snapshot(state)
    with pytest.raises(BudgetStateError) as refusal:
        if after == "none":
            sb.ensure_site_state(state, "site-a", "none", None)
        else:
            SiteBudget(state, "site-a", 10.0, DELTA, after)
    message = str(refusal.value)
    assert f"set up for the {before} guarantee" in message and "state_dir" not in message
    if before != "none":
        assert "spent ε = " in message
    assert _snapshot(state) == snapshot


def test_mechanisms_sharing_a_guarantee_share_one_budget(tmp_path):
    """dpsgd and pdp are both record-level DP: switching between them continues the same spend."""
    from fedpose.privacy.mechanisms import get_mechanism

    state = tmp_path / "site-a"
    SiteBudget(state, "site-a", 10.0, DELTA, get_mechanism("dpsgd").guarantee.name).authorize_round("run", 1, SIGMA, Q, STEPS)
    continued = SiteBudget(state, "site-a", 10.0, DELTA, get_mechanism("pdp").guarantee.name)
    assert continued.epsilon == pytest.approx(_eps_after(1))


def test_a_site_created_concurrently_keeps_the_spend_recorded_first(tmp_path, monkeypatch):
    """Two processes (the metrics exporter and a ClientApp) may create one site's state at once: the one
    that comes second must find the other's spend, never write a fresh empty budget over it."""
    from contextlib import contextmanager

    state = tmp_path / "site-a"
    real_lock = sb._state_lock

    @contextmanager
    def lock_taken_after_another_process_created_and_spent(state_dir):
        monkeypatch.setattr(sb, "_state_lock", real_lock)
        SiteBudget(state, "site-a", 10.0, DELTA, "DP").authorize_round("run", 1, SIGMA, Q, STEPS)
        with real_lock(state_dir):
            yield

    monkeypatch.setattr(sb, "_state_lock", lock_taken_after_another_process_created_and_spent)
    second = SiteBudget(state, "site-a", 10.0, DELTA, "DP")
    assert second.epsilon == pytest.approx(_eps_after(1))
    assert SiteBudget(state, "site-a", 10.0, DELTA, "DP").steps == STEPS


def test_the_protection_unit_is_part_of_the_guarantee(tmp_path):
    """ε per patient and ε per record are different statements: a site cannot switch between them."""
    state = tmp_path / "site-p"
    per_patient = SiteBudget(state, "site-p", eps_max=10.0, delta=DELTA, guarantee="DP", unit="patient")
    per_patient.authorize_round("run", 1, SIGMA, Q, STEPS)
    assert per_patient.report()["unit"] == "patient" and sb.stored_unit(state) == "patient"
    with pytest.raises(BudgetStateError, match=r"accounted per patient, and it now asks to train per record"):
        SiteBudget(state, "site-p", eps_max=10.0, delta=DELTA, guarantee="DP", unit="record")
    # the budget file itself carries the unit too: a marker edited to another unit does not pass
    marker = json.loads((state / sb.GENESIS_FILE).read_text())["payload"]
    sb._write_signed(state / sb.GENESIS_FILE, {**marker, "unit": "image"})
    with pytest.raises(BudgetStateError, match=r"budget\.json\) is accounted per patient"):
        SiteBudget(state, "site-p", eps_max=10.0, delta=DELTA, guarantee="DP", unit="image")
    sb._write_signed(state / sb.GENESIS_FILE, marker)
    assert SiteBudget(state, "site-p", eps_max=10.0, delta=DELTA, guarantee="DP", unit="patient").epsilon == pytest.approx(_eps_after(1))


def test_a_state_from_before_units_is_record_level(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    for path in (budget.path, budget.state_dir / sb.GENESIS_FILE):  # as written before protection units existed
        payload = json.loads(path.read_text())["payload"]
        payload.pop("unit", None)
        sb._write_signed(path, payload)
    assert sb.stored_unit(budget.state_dir) == "record"
    assert _budget(tmp_path, eps_max=10.0).epsilon == pytest.approx(_eps_after(1))  # unit defaults to record
    with pytest.raises(BudgetStateError, match="accounted per record, and it now asks to train per patient"):
        SiteBudget(tmp_path / "site-a", "site-a", eps_max=10.0, delta=DELTA, guarantee="DP", unit="patient")
    assert sb.stored_unit(tmp_path / "nowhere") is None


def test_a_reader_without_a_unit_sees_the_states_own_unit(tmp_path):
    SiteBudget(tmp_path / "s", "s", eps_max=10.0, delta=DELTA, guarantee="DP", unit="image").authorize_round("r", 1, SIGMA, Q, STEPS)
    reader = SiteBudget(tmp_path / "s", "s", eps_max=10.0, delta=DELTA, guarantee="DP")
    assert reader.unit == "image" and reader.epsilon == pytest.approx(_eps_after(1))
    assert SiteBudget(tmp_path / "new", "n", eps_max=10.0, delta=DELTA, guarantee="DP").unit == "record"


def test_the_demo_config_spends_what_the_readme_says(tmp_path):
    """configs/demo.toml through the real guard: sites 1–2 spend both rounds and stay within ε 1
    per patient; site-3's own guard (ε_max 0.8) refuses round 2 (the README's main job shows that refusal)."""
    from pathlib import Path

    from fedpose.cli.simulate import resolve_federation
    from fedpose.federation.local_training import declared_noise, open_budget

    demo = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"
    paths = [f'sites.{i}.state_dir="{tmp_path / str(i)}"' for i in range(3)]
    federation, _, _ = resolve_federation(demo, [f'coordinator.checkpoint_dir="{tmp_path / "c"}"', *paths])
    outcomes: dict[str, list[str]] = {}
    for site in federation.sites:
        budget = open_budget(site)
        sigma, q = declared_noise(site)
        outcomes[site.site_id] = []
        for round_id in range(1, federation.coordinator.rounds + 1):
            try:
                budget.authorize_round("demo", round_id, sigma, q, site.local_steps)
                outcomes[site.site_id].append("spent")
            except BudgetExhausted:
                outcomes[site.site_id].append("refused")
                break
        assert site.privacy.mechanism == "dpsgd" and budget.unit == "patient" and budget.guarantee == "DP"
        assert budget.epsilon <= min(site.eps_max, 1.0)
    assert outcomes["site-1"] == outcomes["site-2"] == ["spent"] * 2
    assert outcomes["site-3"] == ["spent", "refused"]


# -- the journal of spends and what marks a state dir as a site's ----------------------------------------
def _forge_without_last_round(budget: SiteBudget) -> None:
    """What an operator with a text editor can do: drop the last spent round, recompute the
    accountant's history from the remaining rounds and the checksum."""
    from fedpose.privacy.accountant import PrivacyLedger

    payload = json.loads(budget.path.read_text())["payload"]
    payload["entries"] = payload["entries"][:-1]
    kept = PrivacyLedger.from_dict(payload["accountant"])
    forged = PrivacyLedger(orders=kept.orders, relation=kept.relation, accountant=kept.accountant)
    for e in payload["entries"]:
        forged.step(e["noise_multiplier"], e["sample_rate"], e["steps"])
    payload["accountant"] = forged.to_dict()
    sb._write_signed(budget.path, payload)


def test_an_edited_budget_with_a_recomputed_checksum_is_below_its_journal(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    for r in (1, 2, 3):
        budget.authorize_round("run", r, SIGMA, Q, STEPS)
    _forge_without_last_round(budget)
    forged = json.loads(budget.path.read_text())["payload"]
    assert len(forged["entries"]) == 2  # the checksum holds: only the journal tells
    with pytest.raises(BudgetStateError, match=r"below its spend journal .*spends\.jsonl.*run 'run' round 3.*privacy adopt"):
        _budget(tmp_path, eps_max=10.0)
    # the deliberate way back: the journaled spend is adopted (recorded), ε is the true one again
    result = sb.adopt_spends(tmp_path / "site-a", [], "")
    assert [s["round"] for s in result["adopted"]] == [3] and result["applied"]
    assert result["epsilon_before"] == pytest.approx(_eps_after(2), rel=1e-9)
    restored = _budget(tmp_path, eps_max=10.0)
    assert restored.epsilon == pytest.approx(_eps_after(3), rel=1e-9)
    assert restored.entry("run", 3).status == "spent" and "adopted from journal" in restored.entry("run", 3).reason
    assert sb.adopt_spends(tmp_path / "site-a", [], "")["adopted"] == []  # idempotent


def test_two_records_of_one_round_that_disagree_are_not_adopted(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    _forge_without_last_round(budget)  # the budget forgets round 1; the journal does not
    assert json.loads(budget.path.read_text())["payload"]["entries"] == []
    with pytest.raises(BudgetStateError, match="round 1"):
        _budget(tmp_path, eps_max=10.0)
    other = sb.JournaledSpend("run", 1, 4 * SIGMA, Q, STEPS)
    with pytest.raises(BudgetStateError, match="investigate before adopting"):
        sb.adopt_spends(tmp_path / "site-a", [other], "coordinator's record")


def test_a_budget_whose_journal_is_gone_is_refused(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    (tmp_path / "site-a" / sb.JOURNAL_FILE).unlink()
    with pytest.raises(BudgetStateError, match=r"journal .*spends\.jsonl, which is missing"):
        _budget(tmp_path, eps_max=10.0)


def test_a_budget_from_before_the_journal_loads_and_its_next_spend_starts_one(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    (tmp_path / "site-a" / sb.JOURNAL_FILE).unlink()
    payload = json.loads(budget.path.read_text())["payload"]
    del payload["journal"]  # as written before the journal existed
    sb._write_signed(budget.path, payload)
    old = _budget(tmp_path, eps_max=10.0)
    assert old.epsilon == pytest.approx(_eps_after(1), rel=1e-9)
    old.authorize_round("run", 2, SIGMA, Q, STEPS)
    assert [s.round for s in sb.read_journal(tmp_path / "site-a")] == [2]
    assert _budget(tmp_path, eps_max=10.0).epsilon == pytest.approx(_eps_after(2), rel=1e-9)


def test_a_torn_last_journal_line_is_ignored_a_torn_middle_line_is_not(tmp_path):
    budget = _budget(tmp_path, eps_max=10.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    journal = tmp_path / "site-a" / sb.JOURNAL_FILE
    whole = journal.read_text()
    journal.write_text(whole + '{"run_id": "run", "round": 2, "noise_mul')  # killed mid-append, before the budget
    assert _budget(tmp_path, eps_max=10.0).epsilon == pytest.approx(_eps_after(1), rel=1e-9)
    journal.write_text('{"run_id": "run", "rou\n' + whole)
    with pytest.raises(BudgetStateError, match="line 1: malformed"):
        _budget(tmp_path, eps_max=10.0)


@pytest.mark.parametrize("leftover", ["image_check.json", "spends.jsonl", "federation_record.json", "a-file-fedpose-never-wrote"])
def test_any_file_marks_a_state_dir_as_a_sites(tmp_path, leftover):
    """Deleting the budget, the marker, the released update and rounds.jsonl is not a fresh start
    while anything else is left — not just the files on some list."""
    state = tmp_path / "site-a"
    _budget(tmp_path, eps_max=10.0).authorize_round("run", 1, SIGMA, Q, STEPS)
    for path in state.iterdir():
        if path.name != leftover and path.name != sb.LOCK_FILE:
            path.unlink()
    (state / leftover).write_text("{}")
    with pytest.raises(BudgetStateError, match=f"holds site state \\({leftover}\\).*restore both files"):
        _budget(tmp_path, eps_max=10.0)
    assert sorted(p.name for p in state.iterdir()) == sorted({leftover, sb.LOCK_FILE})  # left as found


def test_a_state_dir_holding_only_the_lock_and_the_site_log_is_new(tmp_path):
    state = tmp_path / "site-a"
    state.mkdir()
    (state / sb.LOCK_FILE).touch()
    (state / sb.SITE_LOG_FILE).write_text("2026-01-01 INFO fedpose.site: protection unit record\n")
    assert _budget(tmp_path, eps_max=10.0).epsilon == 0.0


def test_a_torn_journal_line_is_cut_before_the_next_spend_is_appended(tmp_path):
    """A spend whose journal append was cut short (a full disk; nothing spent: the budget was never
    written) left a fragment without its newline; the next spend was appended right after it, fusing
    both into one malformed line, and from then on neither the budget nor `privacy adopt` could be
    loaded. The fragment is cut off first now; every spend stays on record."""
    budget = _budget(tmp_path, eps_max=50.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    with open(budget.state_dir / sb.JOURNAL_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"run_id": "run", "round": 2, "noise_mul')  # the append that the full disk cut short
    assert [s.round for s in sb.read_journal(budget.state_dir)] == [1]
    budget.authorize_round("run", 2, SIGMA, Q, STEPS)  # the round retried once there is space again
    restarted = _budget(tmp_path, eps_max=50.0)  # loads (and checks the journal against the budget)
    restarted.authorize_round("run", 3, SIGMA, Q, STEPS)
    assert [s.round for s in sb.read_journal(budget.state_dir)] == [1, 2, 3]
    assert restarted.epsilon == pytest.approx(_eps_after(3), rel=1e-9)
    assert sb.adopt_spends(budget.state_dir, [], "nothing", dry_run=True) is not None


def test_an_unterminated_but_whole_journal_line_is_kept(tmp_path):
    """The other kind of torn append: the whole line reached the disk, its newline did not. Readers
    count it (it parses), so the next append keeps it and only adds the newline."""
    budget = _budget(tmp_path, eps_max=50.0)
    budget.authorize_round("run", 1, SIGMA, Q, STEPS)
    path = budget.state_dir / sb.JOURNAL_FILE
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    budget.authorize_round("run", 2, SIGMA, Q, STEPS)
    assert [s.round for s in sb.read_journal(budget.state_dir)] == [1, 2]
    assert path.read_bytes().count(b"\n") == 2
