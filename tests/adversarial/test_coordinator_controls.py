"""A malicious coordinator against the real site code: whatever it sends that would change what the
site's guarantee means, or cost budget without training, is refused before any data work or spend.

Each attack runs through :func:`~fedpose.federation.local_training.run_site_round` (the ClientApp's
whole round, minus Flower) and checks what a site must keep: the refusal names the setting or the
problem in the site's own log (the exception), the wire carries only the class name, and nothing is
spent (budget file unchanged, no released update, no basis cached).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from fedpose.config import ConfigError, ModelSpec, validate
from fedpose.federation import basis_transport as bt
from fedpose.federation.config import SiteConfig
from fedpose.federation.local_training import (
    CANONICAL_WINDOWS_DIR,
    cached_basis_version,
    open_budget,
    run_site_round,
    train_site_round,
)
from fedpose.federation.protocol import SecAggSetup, TrainInstruction
from fedpose.federation.site_pins import (
    INSTRUCTION_FIELDS,
    MODEL_SPEC_FIELDS,
    PINS_FILE,
    SECAGG_SETUP_FIELDS,
    SITE_CONFIG_PINS,
    BasisRejected,
    GlobalModelRejected,
    PinnedSettingMismatch,
    check_basis,
    orthonormality_tolerance,
)
from site_round_helpers import global_model, make_site_data, site_config

#: ε_max below one round's cost: the site refuses every round (budget-exhausted) without training,
#: which is enough to pin its settings (they are checked before the budget decision)
TOO_SMALL_BUDGET = 0.01


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("site-data"))


@pytest.fixture(scope="module")
def weights() -> tuple[dict, ModelSpec]:
    return global_model()


def _global_at(spec: ModelSpec, input_size: tuple[int, int]) -> tuple[dict, ModelSpec]:
    """A well-formed global model at another input size (what a coordinator changing the size sends)."""
    import torch

    from fedpose.model import build_model_from_spec

    torch.manual_seed(0)
    other = spec.model_copy(update={"input_size": input_size})
    model = build_model_from_spec(other)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}, other


class _Unspent:
    """The site's spend-relevant state before an attack, to assert the attack changed none of it
    (a new site's state is created first, with its empty budget, as its first message does)."""

    def __init__(self, site: SiteConfig):
        open_budget(site)
        self.state = state = Path(site.state_dir)
        self.budget = (state / "budget.json").read_bytes() if (state / "budget.json").exists() else None
        self.released = (state / "released_update.npz").exists()

    def check(self) -> None:
        now = (self.state / "budget.json").read_bytes() if (self.state / "budget.json").exists() else None
        assert now == self.budget, "the budget changed"
        assert (self.state / "released_update.npz").exists() == self.released, "an update was released"


def _refused_on_the_wire(result, error_class: str) -> None:
    reply = result.reply
    assert (reply.status, reply.reason, reply.error_class, result.update) == ("error", "site-error", error_class, {})
    assert reply.privacy is not None  # the ledger still learns what the site has spent


# -- 1. the site decides what its guarantee means ----------------------------------------------------
def test_every_instruction_and_model_spec_field_is_classified() -> None:
    """A field added to the instruction or the model spec fails here until site_pins.py says whether
    it changes what a guarantee means (pinned) or cannot, and why."""
    assert set(INSTRUCTION_FIELDS) == set(TrainInstruction.model_fields)
    assert set(MODEL_SPEC_FIELDS) == set(ModelSpec.model_fields)
    assert set(SECAGG_SETUP_FIELDS) == set(SecAggSetup.model_fields)  # the secure sum's settings, sent in its setup
    guarantees = {"DP", "FDP", "MaskDP"}
    for name, rule in {**INSTRUCTION_FIELDS, **MODEL_SPEC_FIELDS, **SITE_CONFIG_PINS, **SECAGG_SETUP_FIELDS}.items():
        assert len(rule.why) > 20, name
        assert (rule.kind == "site-pinned") == bool(rule.pinned_for), name
        assert rule.pinned_for <= guarantees, name
    assert INSTRUCTION_FIELDS["model_spec"].kind == "field by field"
    assert MODEL_SPEC_FIELDS["input_size"].pinned_for == {"DP", "FDP", "MaskDP"}


@pytest.mark.parametrize("smuggled", [{"privacy": {"public_view": {"factor": 64}}}, {"public_view": {"factor": 64}},
                                      {"mask": {"margin": 0.0}}, {"model_spec": {"public_view": {"factor": 64}}}])
def test_the_public_view_and_the_mask_cannot_come_from_the_coordinator(smuggled) -> None:
    """ψ's and the mask's settings exist only in the site's config: an instruction carrying them
    anywhere is malformed (the wire models forbid unknown fields), not obeyed."""
    from fedpose.federation.protocol import ProtocolError, decode_instruction
    from site_round_helpers import PLACEHOLDER_SPEC

    honest = TrainInstruction(run_id="run", round=1, local_steps=2, model_spec=PLACEHOLDER_SPEC).model_dump(mode="json")
    for key, value in smuggled.items():
        honest[key] = {**honest[key], **value} if isinstance(honest.get(key), dict) else value
    with pytest.raises(ProtocolError, match="malformed train instruction"):
        decode_instruction({"instruction": json.dumps(honest)})


def test_an_fdp_site_refuses_a_new_input_size_after_its_first_release(data_root, weights, tmp_path) -> None:
    """The audit's attack: the same FDP site at 64 and then 32 pixels would release a ψ of each record
    on a 4× coarser block grid relative to the person (another view of the same records) under an
    unchanged ε. The size of the first round is pinned; the second is refused before its data is
    even read (the data directory is gone) and before any spend."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state, mechanism="fdp")
    first = run_site_round(site, "run", 1, global_state, spec, 2)
    assert first.reply.status == "ok" and first.update
    unspent = _Unspent(site)

    small_state, small_spec = _global_at(spec, (32, 32))
    no_data = site.model_copy(update={"data": site.data.model_copy(update={"train": tmp_path / "gone"})})
    with pytest.raises(PinnedSettingMismatch, match=r"model_spec.input_size is pinned to \[64, 64\].*asks for \[32, 32\]"):
        train_site_round(no_data, "run", 2, small_state, small_spec, 2)
    result = run_site_round(no_data, "run", 2, small_state, small_spec, 2)
    _refused_on_the_wire(result, "PinnedSettingMismatch")
    assert "input_size" not in result.reply.model_dump_json()  # no free text on the wire
    unspent.check()
    # the pinned size still trains
    assert run_site_round(site, "run", 2, global_state, spec, 2).reply.status == "ok"


def test_a_dp_site_refuses_a_new_input_size_which_would_time_a_rebuild_of_its_windows(data_root, weights, tmp_path) -> None:
    """DP protects the whole crop at any resolution, but a site's rows come from windows built for one
    input size (fedpose.data.canonical): a round at a new size would rebuild them, and its time would
    be a sum over all of the site's image files. The size of the first round is pinned; the windows
    are built once."""
    global_state, spec = weights
    site = site_config(data_root, tmp_path / "state")
    assert run_site_round(site, "run", 1, global_state, spec, 1).reply.status == "ok"
    assert (tmp_path / "state" / PINS_FILE).exists()
    windows = sorted((tmp_path / "state" / CANONICAL_WINDOWS_DIR).glob("*.npy"))
    assert len(windows) == 1
    unspent = _Unspent(site)
    _refused_on_the_wire(run_site_round(site, "run", 2, *_global_at(spec, (32, 32)), 1), "PinnedSettingMismatch")
    unspent.check()
    assert sorted((tmp_path / "state" / CANONICAL_WINDOWS_DIR).glob("*.npy")) == windows
    assert run_site_round(site, "run", 2, global_state, spec, 1).reply.status == "ok"


@pytest.mark.parametrize("mechanism, setting, change", [
    ("fdp", "privacy.public_view", {"public_view": {"factor": 8}}),
    ("fdp", "privacy.public_view", {"public_view": {"bits": 4}}),
    ("maskdp", "privacy.mask", {"mask": {"margin": 0.0}}),
    ("maskdp", "model_spec.input_size", {}),
])
def test_the_public_part_of_a_guarantee_cannot_change_between_rounds(data_root, weights, tmp_path, mechanism, setting, change) -> None:
    """ψ's parameters and the mask never come from the coordinator; the site's own config cannot
    silently change them between releases of the same records either."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state, mechanism=mechanism, eps_max=TOO_SMALL_BUDGET)
    assert run_site_round(site, "run", 1, global_state, spec, 2).reply.status == "refused"
    unspent = _Unspent(site)
    changed = site_config(data_root, state, mechanism=mechanism, eps_max=TOO_SMALL_BUDGET, **change)
    asked = _global_at(spec, (32, 32)) if setting == "model_spec.input_size" else (global_state, spec)
    with pytest.raises(PinnedSettingMismatch, match=rf"{setting} is pinned to"):
        train_site_round(changed, "run", 2, *asked, 2)
    _refused_on_the_wire(run_site_round(changed, "run", 2, *asked, 2), "PinnedSettingMismatch")
    unspent.check()


def test_a_state_from_before_pins_adopts_them_and_keeps_everything(data_root, weights, tmp_path, caplog) -> None:
    """A site whose state predates the pins keeps working: the values of its next round are adopted
    (with a log line), nothing saved changes, and from then on a change is refused."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state, mechanism="fdp", eps_max=TOO_SMALL_BUDGET)
    assert run_site_round(site, "run", 1, global_state, spec, 2).reply.status == "refused"
    _as_before_pins(state)
    budget_entries = json.loads((state / "budget.json").read_text())["payload"]["entries"]
    with caplog.at_level(logging.WARNING, logger="fedpose"):
        assert run_site_round(site, "run", 2, global_state, spec, 2).reply.status == "refused"
    assert any("adopting" in r.getMessage() and "model_spec.input_size = [64, 64]" in r.getMessage() for r in caplog.records)
    entries = json.loads((state / "budget.json").read_text())["payload"]["entries"]
    assert entries[: len(budget_entries)] == budget_entries and len(entries) == 2
    assert run_site_round(site, "run", 3, *_global_at(spec, (32, 32)), 2).reply.error_class == "PinnedSettingMismatch"


def _as_before_pins(state: Path) -> None:
    """The state as a site wrote it before pins existed: no pins file, a genesis marker without "pins"."""
    from fedpose.federation.site_budget import GENESIS_FILE, _read_signed, _write_signed

    (state / PINS_FILE).unlink()
    genesis = _read_signed(state / GENESIS_FILE, "site state marker")
    del genesis["pins"]
    _write_signed(state / GENESIS_FILE, genesis)


def test_a_dp_state_from_before_the_input_size_pin_adopts_it(data_root, weights, tmp_path, caplog) -> None:
    """Until 2026-12-06 a DP site pinned nothing, so its state (pins version 1, ``true``) has no pins
    file although it has spent: that is not a lost file. Its next round adopts the input size (with a
    log line) and keeps everything saved; a new size is refused from then on. An FDP state of that
    version with no pins file did lose it, and is still refused."""
    from fedpose.federation.site_budget import GENESIS_FILE, BudgetStateError, _read_signed, _write_signed

    global_state, spec = weights
    for mechanism in ("dpsgd", "fdp"):
        state = tmp_path / mechanism
        site = site_config(data_root, state, mechanism=mechanism, eps_max=TOO_SMALL_BUDGET)
        assert run_site_round(site, "run", 1, global_state, spec, 2).reply.status == "refused"
        (state / PINS_FILE).unlink()
        genesis = _read_signed(state / GENESIS_FILE, "site state marker")
        assert genesis["pins"] == 2
        _write_signed(state / GENESIS_FILE, {**genesis, "pins": True})
        entries = json.loads((state / "budget.json").read_text())["payload"]["entries"]
        if mechanism == "fdp":
            with pytest.raises(BudgetStateError, match=rf"{PINS_FILE} are missing"):
                train_site_round(site, "run", 2, global_state, spec, 2)
            continue
        with caplog.at_level(logging.WARNING, logger="fedpose"):
            assert run_site_round(site, "run", 2, global_state, spec, 2).reply.status == "refused"
        assert any("adopting" in r.getMessage() and "model_spec.input_size = [64, 64]" in r.getMessage() for r in caplog.records)
        assert json.loads((state / "budget.json").read_text())["payload"]["entries"][: len(entries)] == entries
        assert run_site_round(site, "run", 3, *_global_at(spec, (32, 32)), 2).reply.error_class == "PinnedSettingMismatch"


def test_a_lost_pins_file_is_refused_not_adopted(data_root, weights, tmp_path) -> None:
    """A state created with pins whose pins file is gone after it spent (a partial restore, a
    deleted file) would let the coordinator choose the pinned values anew: refused, naming the
    file, before any data work or spend; restoring the file is the way on."""
    from fedpose.federation.site_budget import BudgetStateError

    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state, mechanism="fdp", eps_max=TOO_SMALL_BUDGET)
    assert run_site_round(site, "run", 1, global_state, spec, 2).reply.status == "refused"
    saved = (state / PINS_FILE).read_bytes()
    (state / PINS_FILE).unlink()
    unspent = _Unspent(site)
    asked = _global_at(spec, (32, 32))
    with pytest.raises(BudgetStateError, match=rf"{PINS_FILE} are missing.*Restore {PINS_FILE}"):
        train_site_round(site, "run", 2, *asked, 2)
    _refused_on_the_wire(run_site_round(site, "run", 2, *asked, 2), "BudgetStateError")
    unspent.check()
    assert not (state / PINS_FILE).exists()
    (state / PINS_FILE).write_bytes(saved)
    assert run_site_round(site, "run", 2, *asked, 2).reply.error_class == "PinnedSettingMismatch"


def test_asking_for_fewer_steps_never_buys_a_lower_sigma(data_root, weights, tmp_path) -> None:
    """With privacy.target_epsilon, σ was calibrated for the steps the coordinator asked: one step
    got the σ that spends a whole round's ε on it. σ now comes from the site's own local_steps."""
    from fedpose.federation.site_budget import SiteBudget
    from fedpose.privacy.engine import resolve_noise_multiplier

    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state, noise_multiplier=None, target_epsilon=3.0, accountant="rdp", local_steps=4)
    result = run_site_round(site, "run", 1, global_state, spec, 1)
    assert result.reply.status == "ok" and result.reply.local_steps == 1
    (entry,) = SiteBudget(state, "site-1", 50.0, 1e-5, "DP").entries
    assert entry.steps == 1
    assert entry.noise_multiplier == resolve_noise_multiplier(site.privacy, site.privacy.sample_rate, 4)
    assert result.reply.privacy.epsilon < 3.0  # one step of a 4-step round costs less than the round


# -- the global arrays ----------------------------------------------------------------------------------
@pytest.mark.parametrize("attack", ["nan-weight", "missing-tensor", "wrong-shape", "float64-overflow", "float64-honest",
                                    "int-weight", "negative-variance"])
def test_a_broken_global_model_is_refused_before_the_spend(data_root, weights, tmp_path, attack) -> None:
    """A NaN weight used to make the round diverge after its spend (a coordinator burning the
    site's budget); a missing or misshapen tensor failed it there. Found by a red-team: a float64
    1e300 is finite as sent and inf once the model holds it in float32 (spent, then diverged), and any
    other dtype than the model's, even the honest values in float64, trained and spent, then the
    site's own egress guard blocked its float32 Δ. Every array must have the model's dtype. A negative
    BatchNorm variance made every row NaN, each zeroed: the round spent to release noise only."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state)
    hostile = dict(global_state)
    name = next(k for k in global_state if k.startswith("head.") and global_state[k].dtype.kind == "f")
    if attack == "negative-variance":
        name = next(k for k in global_state if k.endswith("running_var"))
        hostile[name] = -global_state[name]
    elif attack == "nan-weight":
        hostile[name] = np.full_like(global_state[name], np.nan)
    elif attack == "missing-tensor":
        del hostile[name]
    elif attack == "wrong-shape":
        hostile[name] = np.zeros(global_state[name].shape + (1,), dtype=np.float32)
    elif attack == "float64-overflow":
        hostile[name] = np.full(global_state[name].shape, 1e300, dtype=np.float64)
    elif attack == "float64-honest":
        hostile[name] = global_state[name].astype(np.float64)
    else:
        hostile[name] = np.zeros(global_state[name].shape, dtype=np.int32)
    unspent = _Unspent(site)
    with pytest.raises(GlobalModelRejected, match=name.replace(".", r"\.")):
        train_site_round(site, "run", 1, hostile, spec, 2)
    _refused_on_the_wire(run_site_round(site, "run", 1, hostile, spec, 2), "GlobalModelRejected")
    unspent.check()


def test_a_trainable_set_too_large_for_the_accounting_is_refused_before_the_spend(data_root, weights, tmp_path,
                                                                                monkeypatch) -> None:
    """A model spec whose trainable set exceeds what the noise's accounting covers (a coordinator
    sending a huge head) used to fail at the first noise draw, after the spend: a budget burned by
    an input the site could have refused. The cap is lowered here to below the test model's size,
    as a head of ~34 M parameters would exceed the real one; the spec's fields keep a config's bounds."""
    from pydantic import ValidationError

    from fedpose.privacy import noise

    global_state, spec = weights
    site = site_config(data_root, tmp_path / "state")
    monkeypatch.setattr(noise, "MAX_NOISE_COORDINATES", 1000)
    unspent = _Unspent(site)
    with pytest.raises(GlobalModelRejected, match="trainable parameters: a Gaussian release of .* at most 1,000"):
        train_site_round(site, "run", 1, global_state, spec, 2)
    _refused_on_the_wire(run_site_round(site, "run", 1, global_state, spec, 2), "GlobalModelRejected")
    unspent.check()
    for field, value in [("split_factor", 4096), ("head_hidden", -1), ("label_sigma", 0.0)]:
        with pytest.raises(ValidationError, match=field):
            ModelSpec(**{**spec.model_dump(), field: value})


def test_scalars_may_arrive_in_the_shape_flower_gives_them(data_root, weights, tmp_path) -> None:
    """Flower's ArrayRecord turns a 0-d tensor (BatchNorm's num_batches_tracked) into shape (1,):
    that is the same value, not a misshapen array."""
    global_state, spec = weights
    scalars = [k for k, v in global_state.items() if v.ndim == 0]
    assert scalars
    wire = {k: (v.reshape(1) if v.ndim == 0 else v) for k, v in global_state.items()}
    assert run_site_round(site_config(data_root, tmp_path / "state"), "run", 1, wire, spec, 1).reply.status == "ok"


# -- 2. the projection basis ---------------------------------------------------------------------------
K = 2


@pytest.fixture(scope="module")
def basis_messages(data_root, weights) -> dict[str, bt.BasisMessage]:
    """The real coordinator's basis messages (full and compact, k = 2) at the global weights."""
    import torch

    from fedpose.federation.public_basis import compute_basis
    from fedpose.model import build_model_from_spec

    global_state, spec = weights
    model = build_model_from_spec(spec)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in global_state.items()})
    return {transport: compute_basis(model, data_root / "public", K, 4, 1, transport, "float32")
            for transport in ("full", "compact")}


def _pdp_site(data_root: Path, state: Path, **settings) -> SiteConfig:
    site = site_config(data_root, state, mechanism="pdp", basis={"k": K, "public_samples": 4})
    return site.model_copy(update={"public_data": data_root / "public", **settings})


def _tampered(messages: dict[str, bt.BasisMessage], attack: str) -> tuple[dict, dict]:
    full = messages["full"]
    v = bt.decode(full.arrays, full.config)
    assert isinstance(v, np.ndarray)
    weights_version = str(full.config["basis.weights"])
    rng = np.random.default_rng(0)
    if attack == "compact-nan-mixing":
        compact = messages["compact"]
        return {**compact.arrays, bt.MIX_KEY: np.full_like(compact.arrays[bt.MIX_KEY], np.nan)}, dict(compact.config)
    bad = {
        "scaled-x1000": lambda: v * 1000,
        "nan": lambda: np.where(np.arange(v.shape[0])[:, None] == 7, np.nan, v),
        "wrong-shape": lambda: np.vstack([v, np.zeros((1, K), np.float32)]),
        "k-above-the-site-limit": lambda: np.linalg.qr(rng.standard_normal((v.shape[0], K + 1)))[0],
        "not-orthonormal": lambda: v * 1.01,
        "dependent-columns": lambda: np.hstack([v[:, :1], v[:, :1]]),
    }[attack]()
    message = bt.encode_full(bad.astype(np.float32), 1, weights_version, "float32")
    return message.arrays, message.config


@pytest.mark.parametrize("attack", ["scaled-x1000", "nan", "wrong-shape", "k-above-the-site-limit", "not-orthonormal",
                                    "dependent-columns", "compact-nan-mixing"])
def test_a_bad_basis_is_refused_before_any_spend(data_root, weights, basis_messages, tmp_path, attack) -> None:
    """The audit's attacks on V (× 1000 was accepted and turned an update norm of 0.037 into 39 346;
    NaN failed the round after its spend): each is refused naming the problem, with nothing spent,
    nothing trained, and nothing cached (the site asks for the basis again)."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = _pdp_site(data_root, state, max_basis_k=K)
    message = _tampered(basis_messages, attack)
    unspent = _Unspent(site)
    problem = {"scaled-x1000": "not orthonormal", "nan": "non-finite", "wrong-shape": "shape", "k-above-the-site-limit": "max_basis_k",
               "not-orthonormal": "not orthonormal", "dependent-columns": "not orthonormal", "compact-nan-mixing": "non-finite"}[attack]
    with pytest.raises(BasisRejected, match=problem):
        train_site_round(site, "run", 1, global_state, spec, 2, basis_version=1, basis_message=message)
    result = run_site_round(site, "run", 1, global_state, spec, 2, basis_version=1, basis_message=message)
    _refused_on_the_wire(result, "BasisRejected")
    assert result.reply.basis_version == -1 and cached_basis_version(site) == -1
    unspent.check()


def test_a_projecting_site_sent_no_basis_refuses_before_the_spend(data_root, weights, tmp_path) -> None:
    """A pdp site without its own public copy needs the coordinator's V. Sent none, it used to spend
    the round's ε and only then fail at its first step: a coordinator could burn the site's budget
    round after round, releasing nothing."""
    global_state, spec = weights
    site = site_config(data_root, tmp_path / "state", mechanism="pdp", basis={"k": K, "public_samples": 4})
    assert site.public_data is None
    unspent = _Unspent(site)
    with pytest.raises(ValueError, match="sent none and the site has no public_data"):
        train_site_round(site, "run", 1, global_state, spec, 2, basis_version=-1)
    for round_id in (1, 2):
        _refused_on_the_wire(run_site_round(site, "run", round_id, global_state, spec, 2, basis_version=-1), "ValueError")
    unspent.check()


def test_grey_copies_sent_to_a_projecting_site_are_refused_before_the_spend(data_root, tmp_path) -> None:
    """The engine refuses to project grey copies (their public gradients are zero); the coordinator's
    scenario used to reach that refusal only after the site had spent the round."""
    import torch

    from fedpose.config import ModelConfig
    from fedpose.model import build_model
    from fedpose.model.checkpoint import model_spec
    from site_round_helpers import INPUT_SIZE

    torch.manual_seed(0)
    grey = build_model(ModelConfig(backbone="tiny_vit_test", scenario="grey_biases_norms"), INPUT_SIZE)
    state, spec = {k: v.detach().numpy().copy() for k, v in grey.state_dict().items()}, model_spec(grey)
    site = _pdp_site(data_root, tmp_path / "state")
    unspent = _Unspent(site)
    with pytest.raises(ValueError, match="grey copies"):
        train_site_round(site, "run", 1, state, spec, 2)
    _refused_on_the_wire(run_site_round(site, "run", 1, state, spec, 2), "ValueError")
    unspent.check()


@pytest.mark.parametrize("transport", ["full", "compact"])
def test_the_coordinators_own_basis_is_accepted(data_root, weights, basis_messages, tmp_path, transport) -> None:
    global_state, spec = weights
    site = _pdp_site(data_root, tmp_path / "state", max_basis_k=K)
    message = basis_messages[transport]
    result = run_site_round(site, "run", 1, global_state, spec, 2, basis_version=1, basis_message=(message.arrays, message.config))
    assert result.reply.status == "ok" and result.reply.basis_version == 1 and result.update


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_the_orthonormality_tolerance_admits_wire_rounding_and_nothing_much_more(wire: str) -> None:
    """An orthonormal V rounded to each wire dtype passes; the same V scaled by (1 + 2·tolerance)
    does not. Derived from the dtypes' eps, not from one CPU's rounding."""
    p, k = 20_000, 8
    v = np.linalg.qr(np.random.default_rng(1).standard_normal((p, k)))[0].astype(np.float32)
    message = bt.encode_full(v, 1, "w", wire)  # type: ignore[arg-type]
    received = bt.decode(message.arrays, message.config)
    check_basis(received, p, k, wire)
    tolerance = orthonormality_tolerance(wire, p)
    with pytest.raises(BasisRejected, match="not orthonormal"):
        check_basis(received * np.float32(1 + 2 * tolerance), p, k, wire)


def test_a_basis_just_inside_the_tolerance_cannot_stretch_the_projection() -> None:
    """Each entry of VᵀV = I + c(J − I) is inside bfloat16's tolerance, yet together they made
    λ_max(VᵀV) = 2.96 at k = 128: the projection stretched a gradient ×2.96. The site now projects
    onto V's span with orthonormal columns (nothing is spent on a projection: this is integrity,
    not ε)."""
    p, k = 30_912, 128
    c = 0.98 * orthonormality_tolerance("bfloat16", p)
    stretched = np.linalg.qr(np.random.default_rng(0).standard_normal((p, k)))[0] @ np.linalg.cholesky(
        np.eye(k) * (1 - c) + c).T
    sent = stretched.astype(np.float32)
    assert np.linalg.eigvalsh(sent.T.astype(np.float64) @ sent)[-1] > 2.9
    used = check_basis(sent, p, k, "bfloat16")
    gram = used.T.astype(np.float64) @ used
    assert np.abs(np.linalg.eigvalsh(gram) - 1).max() < 1e-4
    # the same column space: V's columns lie in the span of the basis the site uses
    inside = used.astype(np.float64) @ (used.T.astype(np.float64) @ sent)
    assert np.abs(inside - sent).max() < 1e-5
    assert np.array_equal(sent, stretched.astype(np.float32))  # the array as sent is left alone


# -- 7. seeded input privacy ---------------------------------------------------------------------------
def test_a_site_without_gradient_noise_still_refuses_seeded_input_privacy() -> None:
    """LDP-Slicing at the input is the guarantee of a site whose gradient mechanism is "none"; with
    a seed anyone who knows it undoes the flips. The validator used to return before this check."""
    raw = {"site_id": "site-1", "data": {"train": "data/site-1"}, "state_dir": "state", "eps_max": 8.0,
           "privacy": {"mechanism": "none"},
           "input_privacy": {"mechanism": "ldp-slicing", "epsilon": 4.0, "insecure_seed": 3}}
    with pytest.raises(ConfigError, match="insecure_seed is for tests only"):
        validate(SiteConfig, raw, "site.toml")
    del raw["input_privacy"]["insecure_seed"]
    validate(SiteConfig, raw, "site.toml")
