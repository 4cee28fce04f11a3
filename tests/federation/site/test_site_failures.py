"""A site that cannot train says so — attributed to its site id, before it spends anything — and
every image is checked once when the site's data is first loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedpose.data.image_check import check_images
from fedpose.data.loaders import ImageLoadError, load_records
from fedpose.federation.local_training import IMAGE_CHECK_CACHE, run_site_round, train_site_round
from site_round_helpers import PLACEHOLDER_SPEC, global_model, make_site_data, site_config


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("site-data"))


@pytest.fixture
def data_root(pristine: Path, tmp_path: Path) -> Path:
    """A private copy per test: tests corrupt files."""
    return Path(shutil.copytree(pristine, tmp_path / "data"))


@pytest.fixture(scope="module")
def weights() -> tuple:
    return global_model()


def _corrupt(data_root: Path, index: int = 3) -> str:
    records, root = load_records(data_root / "site-1")
    name = sorted({r.image for r in records})[index]
    path = root / name
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])  # truncated: the header still parses
    return name


def test_check_images_names_every_bad_file_and_caches_the_good_ones(data_root: Path, tmp_path: Path) -> None:
    records, root = load_records(data_root / "site-1")
    cache = tmp_path / "cache.json"
    assert check_images(records, root, cache) == len({r.image for r in records})
    assert check_images(records, root, cache) == 0  # nothing changed: nothing re-decoded
    bad = _corrupt(data_root)
    with pytest.raises(ImageLoadError) as failure:
        check_images(records, root, cache)
    assert f"1 of {len({r.image for r in records})} images under {root}" in str(failure.value) and bad in str(failure.value)
    assert bad not in json.loads(cache.read_text())["files"]


def test_one_corrupt_image_fails_the_round_before_any_spend(data_root: Path, tmp_path: Path, weights: tuple) -> None:
    """One truncated file among 16 that a 2-step round would probably never draw: the site names
    it in its own log and replies a typed error with its id, its privacy report and no spend."""
    state, (global_state, spec) = tmp_path / "state", weights
    site = site_config(data_root, state)
    bad = _corrupt(data_root)
    result = run_site_round(site, "run", 1, global_state, spec, 2)
    reply = result.reply
    assert (reply.site_id, reply.status, reply.error_class) == ("site-1", "error", "ImageLoadError")
    assert reply.privacy is not None and reply.privacy.rounds_spent == 0 and reply.privacy.epsilon in (None, 0.0)
    budget = json.loads((state / "budget.json").read_text())["payload"]
    assert not [e for e in budget["entries"] if e["status"] == "spent"]
    note = json.loads((state / "rounds.jsonl").read_text().splitlines()[-1])["note"]
    assert note.startswith("ImageLoadError") and bad in note  # the details stay at the site
    assert bad not in reply.model_dump_json()  # ... and never leave it

    shutil.copytree(make_site_data(tmp_path / "fresh") / "site-1", data_root / "site-1", dirs_exist_ok=True)
    result = run_site_round(site, "run", 1, global_state, spec, 2)  # repaired: the same round now trains
    assert result.reply.status == "ok" and result.reply.privacy.rounds_spent == 1
    assert (state / IMAGE_CHECK_CACHE).exists()


def test_a_refused_round_never_reads_the_data(data_root: Path, tmp_path: Path, weights: tuple) -> None:
    global_state, spec = weights
    site = site_config(data_root, tmp_path / "state", eps_max=0.01)
    _corrupt(data_root)
    reply = run_site_round(site, "run", 1, global_state, spec, 2).reply
    assert reply.status == "refused"  # not "error": the budget said no before any image was opened
    assert not (tmp_path / "state" / IMAGE_CHECK_CACHE).exists()


@pytest.mark.parametrize("site_id, attributed", [("site-7", True), ("../etc/passwd", False)])
def test_a_broken_site_config_is_reported_under_its_site_id(tmp_path: Path, flower_task_identity: None,
                                                             site_id: str, attributed: bool) -> None:
    """A SuperNode whose site TOML does not validate still answers: a typed error naming the site
    (its configured, public id) and the error class — nothing of the file's content."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from fedpose.config import ConfigError
    from fedpose.federation import protocol
    from sites.client_app import config_failure_reply, site_from_context
    from sites.egress import violations

    config = tmp_path / "site.toml"
    config.write_text(f'site_id = "{site_id}"\neps_max = "secret-value"\n')
    context = Context(run_id=1, node_id=3, node_config={"site-config": str(config)}, state=RecordDict(), run_config={})
    incoming = Message(RecordDict({protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(protocol.TrainInstruction(run_id="run", round=4, local_steps=2, model_spec=PLACEHOLDER_SPEC)))}),
                       dst_node_id=3, message_type=protocol.MESSAGE_TYPE_TRAIN, group_id="4", ttl=30)
    with pytest.raises(ConfigError) as failure:
        site_from_context(context)
    if not attributed:  # not a valid site id: the egress guard sends the class name only
        with pytest.raises(ConfigError):
            config_failure_reply(incoming, context, failure.value, None)
        return
    reply = config_failure_reply(incoming, context, failure.value, None)
    assert violations(incoming, reply) == []
    site_reply = protocol.decode_reply(dict(reply.content[protocol.REPLY_RECORD]))
    assert (site_reply.site_id, site_reply.run_id, site_reply.round) == ("site-7", "run", 4)
    assert (site_reply.status, site_reply.error_class, site_reply.privacy) == ("error", "ConfigError", None)
    assert "secret-value" not in site_reply.model_dump_json()


@pytest.mark.parametrize("damage", ["garbage", "empty", "deleted"])
def test_damaged_budget_state_is_reported_under_the_site_id_and_nothing_trains(
        data_root: Path, tmp_path: Path, weights: tuple, damage: str) -> None:
    """After a spent round the budget file is damaged: the next round is an attributed error (no
    privacy report: the site cannot read its own state), the file is left as it was, nothing trains."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state)
    assert run_site_round(site, "run", 1, global_state, spec, 2).reply.status == "ok"
    budget = state / "budget.json"
    {"garbage": lambda: budget.write_text("{not json"), "empty": lambda: budget.write_bytes(b""), "deleted": budget.unlink}[damage]()
    before = budget.read_bytes() if budget.exists() else None
    reply = run_site_round(site, "run", 2, global_state, spec, 2).reply
    assert (reply.site_id, reply.status, reply.error_class, reply.privacy) == ("site-1", "error", "BudgetStateError", None)
    assert (budget.read_bytes() if budget.exists() else None) == before  # never recreated or reset


def test_a_site_that_does_not_project_ignores_the_federations_basis(data_root: Path, tmp_path: Path, weights: tuple) -> None:
    """The coordinator serves one basis to every site; a dpsgd site trains without it (it used to
    fail every round with "mechanism 'dpsgd' does not project")."""
    site = site_config(data_root, tmp_path / "state")
    state, spec = weights
    result = train_site_round(site, "run", 1, state, spec, local_steps=2, basis_version=3, basis_message=None)
    assert result.reply.status == "ok" and result.update


def test_a_projecting_site_without_a_shipped_basis_computes_its_own(data_root: Path, tmp_path: Path, weights: tuple) -> None:
    """basis.source = "sites": no basis arrives, so a pdp site builds V from its own S_pub copy at its
    current weights, every privacy.basis.refresh_every local steps (here 4 steps → 2 bases)."""
    site = site_config(data_root, tmp_path / "state", mechanism="pdp", basis={"k": 2, "public_samples": 4, "refresh_every": 2},
                       local_steps=4).model_copy(update={"public_data": data_root / "public"})
    state, spec = weights
    engines: list = []
    result = train_site_round(site, "run", 1, state, spec, local_steps=4, engine_hook=engines.append)
    assert result.reply.status == "ok" and result.update
    (engine,) = engines
    assert len(engine.basis_seconds) == 2 and engine.basis is not None and engine.basis.vectors.shape[1] == 2


def test_a_site_basis_sees_the_public_images_turned_by_privacy_basis_public_rotation(
    data_root: Path, tmp_path: Path, weights: tuple
) -> None:
    """privacy.basis.public_rotation reaches the site's own basis: its public set shows every image at
    its fixed angle within ±public_rotation (upright without it), and training runs on it."""
    basis = {"k": 2, "public_samples": 4, "refresh_every": 2}
    state, spec = weights
    angles = {}
    for rotation in (0.0, 60.0):
        site = site_config(data_root, tmp_path / f"state-{rotation:g}", mechanism="pdp", basis={**basis, "public_rotation": rotation},
                           local_steps=2).model_copy(update={"public_data": data_root / "public"})
        engines: list = []
        result = train_site_round(site, "run", 1, state, spec, local_steps=2, engine_hook=engines.append)
        assert result.reply.status == "ok" and result.update
        public = engines[0].public_dataset
        angles[rotation] = [public[i]["rotation"] for i in range(len(public))]
    assert all(a == 0.0 for a in angles[0.0])
    assert all(abs(a) <= 60.0 for a in angles[60.0]) and max(abs(a) for a in angles[60.0]) > 10.0


@pytest.mark.parametrize("first_failure", ["data not mounted", "no such device"])
def test_a_first_round_that_fails_before_the_state_exists_leaves_nothing_that_looks_like_a_lost_budget(
        pristine: Path, tmp_path: Path, weights: tuple, first_failure: str) -> None:
    """A new site's first round fails before its state is created (its data not mounted yet with the
    default unit "auto", which reads the annotations first; or a device this machine lacks): it wrote
    its diagnostics into the state dir, and every later round refused the site as one whose budget was
    lost. Nothing is written there now; once the cause is fixed, the site trains."""
    state = tmp_path / "state"
    site = site_config(pristine, state)
    if first_failure == "data not mounted":
        broken = site.model_copy(update={"data": site.data.model_copy(update={"train": str(tmp_path / "not-mounted")}),
                                         "privacy": site.privacy.model_copy(update={"unit": "auto"})})
    else:
        broken = site.model_copy(update={"train": site.train.model_copy(update={"device": "cuda:7"})})
    failed = run_site_round(broken, "run", 1, *weights, 2)
    assert failed.reply.status == "error" and failed.reply.error_class != "BudgetStateError"
    assert not (state / "rounds.jsonl").exists() or (state / "site_state.json").exists()
    assert run_site_round(site, "run", 1, *weights, 2).reply.status == "ok"


@pytest.mark.parametrize("fault", ["garbled audit log", "full disk"])
def test_a_state_that_cannot_take_the_rounds_writes_fails_before_the_spend(
        data_root: Path, tmp_path: Path, weights: tuple, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a round writes after its spend (its audit entry, the update it keeps) is checked before the
    spend: a garbled audit log or a disk too full used to make every round spend ε, train and release
    nothing, until ε_max. Now each such round fails unspent (the coordinator may ask again: it costs
    nothing) until the operator repairs the state."""
    import fedpose.federation.local_training as local_training
    from fedpose.federation.site_budget import SiteBudget

    state = tmp_path / "state"
    site = site_config(data_root, state)
    assert run_site_round(site, "run", 1, *weights, 2).reply.status == "ok"
    spent = SiteBudget(state, "site-1", 50.0, 1e-5, "DP", unit="patient").epsilon
    if fault == "garbled audit log":
        log = state / "audit.jsonl"
        log.write_text(log.read_text().replace('"status": "ok"', '"status": "o', 1) + log.read_text())
        expected = "AuditLogError"
    else:
        free = local_training.STATE_WRITE_MARGIN_BYTES // 2
        monkeypatch.setattr(local_training.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - free, free))
        expected = "StateNotWritable"
    for round_id in (2, 3):
        failed = run_site_round(site, "run", round_id, *weights, 2)
        assert (failed.reply.status, failed.reply.error_class) == ("error", expected) and not failed.update
    budget = SiteBudget(state, "site-1", 50.0, 1e-5, "DP", unit="patient")
    assert budget.epsilon == spent and [e.round for e in budget.entries] == [1]
