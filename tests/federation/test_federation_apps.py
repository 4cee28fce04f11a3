"""Fast tests of the Flower wiring: certificates, the egress guard, the round protocol, reports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedpose.federation import protocol
from sites.egress import egress_guard, violations
from site_round_helpers import SMALL_SPEC, small_model_arrays


TRAINED, OTHER_TRAINED = small_model_arrays()[1][:2]
FROZEN = next(k for k in small_model_arrays()[0] if k.endswith(".weight") and k not in small_model_arrays()[1])
STATISTIC = next(k for k in small_model_arrays()[0] if k.endswith("running_var"))


def _train_message() -> Message:
    arrays = small_model_arrays()[0]
    content = RecordDict({
        protocol.GLOBAL_RECORD: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(protocol.TrainInstruction(run_id="run", round=1, local_steps=2, model_spec=SMALL_SPEC))),
    })
    msg = Message(content, dst_node_id=1, message_type=protocol.MESSAGE_TYPE_TRAIN)
    msg.metadata.__dict__["_message_id"] = "m1"  # a pushed message has an id; replies refer to it
    return msg


def _global(name: str) -> np.ndarray:
    return small_model_arrays()[0][name]


def _reply(msg: Message, records: dict) -> Message:
    return Message(RecordDict(records), reply_to=msg)


def _site_reply(**changes) -> protocol.SiteReply:
    privacy = protocol.PrivacyReport(guarantee="DP", unit="one record", adjacency="add_remove", accountant="rdp",
                                     epsilon=0.5, delta=1e-5, eps_max=8.0, steps=4, rounds_spent=1, orders=[2.0, 4.0],
                                     rdp=[0.1, 0.2], next_round_affordable=True)
    fields = dict(site_id="site-1", run_id="run", round=1, status="ok", privacy=privacy, basis_version=-1, local_steps=2)
    return protocol.SiteReply(**{**fields, **changes})


def _ok_records() -> dict:
    return {
        protocol.UPDATE_RECORD: ArrayRecord({TRAINED: Array(np.ones_like(_global(TRAINED)))}),
        protocol.REPLY_RECORD: ConfigRecord(protocol.encode_reply(_site_reply())),
    }


def _tamper_reply(records: dict, **extra) -> None:
    raw = json.loads(records[protocol.REPLY_RECORD][protocol.REPLY_KEY])
    raw.update(extra)
    records[protocol.REPLY_RECORD][protocol.REPLY_KEY] = json.dumps(raw)


def test_egress_guard_lets_the_protocol_through(flower_task_identity) -> None:
    msg = _train_message()
    assert violations(msg, _reply(msg, _ok_records())) == []
    refused = {protocol.REPLY_RECORD: ConfigRecord(protocol.encode_reply(_site_reply(status="refused", reason="budget-exhausted")))}
    assert violations(msg, _reply(msg, refused)) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r.update(images=ArrayRecord({"x": Array(np.zeros((2, 3, 8, 8), np.float32))})), "record 'images'"),
        (lambda r: r[protocol.UPDATE_RECORD].__setitem__("per_sample_grad", Array(np.zeros((16, 4, 3), np.float32))), "per_sample_grad"),
        (lambda r: r[protocol.UPDATE_RECORD].__setitem__(TRAINED, Array(np.zeros((16, 4, 3), np.float32))), "shape"),
        (lambda r: r[protocol.UPDATE_RECORD].__setitem__(OTHER_TRAINED, Array(_global(OTHER_TRAINED).astype(np.float64))), OTHER_TRAINED),
        # in the global model, but not trained: a frozen weight's or a BatchNorm statistic's "Δ" was never noised
        (lambda r: r[protocol.UPDATE_RECORD].__setitem__(FROZEN, Array(np.zeros_like(_global(FROZEN)))), "not a trainable parameter"),
        (lambda r: r[protocol.UPDATE_RECORD].__setitem__(STATISTIC, Array(np.ones_like(_global(STATISTIC)))), "not a trainable parameter"),
        (lambda r: r.update(metrics=MetricRecord({"train-loss": 2.5})), "record 'metrics'"),
        (lambda r: _tamper_reply(r, train_loss=2.5), "train_loss"),
        (lambda r: _tamper_reply(r, num_examples=160), "num_examples"),
        (lambda r: _tamper_reply(r, reason="loss 2.5 at /data/patient-17.png"), "reason"),
        (lambda r: _tamper_reply(r, status="refused"), "status"),
        (lambda r: r[protocol.REPLY_RECORD].__setitem__("patient", "John Doe"), "'patient'"),
        (lambda r: r.pop(protocol.REPLY_RECORD), "record 'reply'"),
    ],
)
def test_egress_guard_blocks_anything_else(flower_task_identity, mutate, expected: str) -> None:
    msg = _train_message()
    records = _ok_records()
    mutate(records)
    problems = violations(msg, _reply(msg, records))
    assert problems and any(expected in p for p in problems), problems

    # as a mod: the reply is replaced by an error, nothing of the content leaves
    out = egress_guard(msg, Context(1, 1, {}, RecordDict(), {}), lambda m, c: _reply(m, records))
    assert out.has_error() and not out.has_content()
    assert expected.strip("'") in out.error.reason
    assert "2.5" not in out.error.reason and "John Doe" not in out.error.reason and "patient-17" not in out.error.reason


def test_a_crashing_client_app_sends_only_the_error_class(flower_task_identity) -> None:
    """An exception's message can hold paths or values of private data: only its class leaves."""
    msg = _train_message()

    def crash(m, c):
        raise FileNotFoundError("/hospital/data/patient-0042/scan.png: loss was 0.731")

    out = egress_guard(msg, Context(1, 1, {}, RecordDict(), {}), crash)
    assert out.has_error() and not out.has_content()
    assert out.error.reason.startswith("FileNotFoundError:")
    assert "patient" not in out.error.reason and "0.731" not in out.error.reason and "/hospital" not in out.error.reason


def test_reply_schema_is_consistent() -> None:
    """Each status carries exactly what its kind allows (the guard relies on the schema for this)."""
    with pytest.raises(ValueError):
        _site_reply(status="error")  # needs error_class + site-error
    with pytest.raises(ValueError):
        _site_reply(status="refused")  # needs its reason code
    with pytest.raises(ValueError):
        _site_reply(error_class="ValueError")  # only with "error"
    with pytest.raises(ValueError):
        _site_reply(status="error", reason="site-error", error_class="x: /path")  # a class name, not text
    error = _site_reply(status="error", reason="site-error", error_class="ImageLoadError", privacy=None)
    assert protocol.decode_reply(protocol.encode_reply(error)) == error
    with pytest.raises(protocol.ProtocolError, match="malformed"):
        protocol.decode_reply({protocol.REPLY_KEY: "{}"})


def test_dev_certificates_chain_san_and_supernode_keys(tmp_path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from fedpose.cli.certs import write_dev_certificates

    write_dev_certificates(tmp_path, ["site-1", "site-2"], extra_hosts=["coordinator.example"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert {"localhost", "coordinator.example"} <= set(san.get_values_for_type(x509.DNSName))
    assert (tmp_path / "server.key").stat().st_mode & 0o077 == 0  # private keys are owner-only
    for site in ("site-1", "site-2"):
        private = load_ssh_private_key((tmp_path / "sites" / site).read_bytes(), password=None)
        public = load_ssh_public_key((tmp_path / "sites" / f"{site}.pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey) and isinstance(public, ec.EllipticCurvePublicKey)
        assert private.public_key().public_numbers() == public.public_numbers()


def test_report_writes_json_and_png(tmp_path) -> None:
    from fedpose.federation.report import RoundRecord, round_line, write_report

    rounds = [RoundRecord.model_validate(
        {"round": r, "pckh": {"Mean": 10.0 * r, "Mean@0.1": 2.0 * r}, "wall_seconds": 3.0,
         "sites": {"site-1": {"status": "ok", "epsilon": 0.5 * r, "delta": 1e-5, "guarantee": "FDP", "accountant": "rdp"},
                   "site-2": {"status": "missing", "epsilon": None}}})
        for r in (1, 2)
    ]
    line = round_line(rounds[1])
    assert "PCKh@0.5 = 20.00" in line and "site-1: ok, ε = 1 (FDP, δ = 1e-05, RDP)" in line and "site-2: missing (no report)" in line
    path = write_report(tmp_path, {"run_id": "r"}, rounds, {"sites": []})
    report = json.loads(path.read_text())
    assert report["rounds_completed"] == 2 and report["final_pckh"]["Mean"] == 20.0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not math.isnan(report["rounds"][0]["sites"]["site-1"]["epsilon"])
    # every failed (round, site) is listed for the end-of-run summary and the exit code
    assert [(f["round"], f["site"], f["status"]) for f in report["site_failures"]] == [(1, "site-2", "missing"), (2, "site-2", "missing")]


def test_round_line_names_failures_and_unidentified_nodes() -> None:
    from fedpose.federation.report import RoundRecord, failure_summary, round_line, site_failures

    entry = RoundRecord.model_validate({"round": 3, "pckh": None, "unidentified_missing_nodes": [77],
             "sites": {"site-1": {"status": "error", "reason": "ImageLoadError: the site's ClientApp failed; details are in the site's local log",
                                  "epsilon": 1.5, "delta": 1e-5, "guarantee": "DP", "accountant": "rdp"}}})
    line = round_line(entry)
    assert "site-1: error (ImageLoadError: the site's ClientApp failed" in line and "ε = 1.5 (DP" in line
    assert "node 77: missing" in line
    lines = failure_summary(site_failures([entry]))
    assert lines[0].startswith("2 site failure(s) in this run (node 77, site-1)")
    assert any("round   3 site-1: error — ImageLoadError" in x for x in lines)


def test_the_coordinator_console_shows_warnings_not_what_the_round_lines_say(capfd: pytest.CaptureFixture[str]) -> None:
    """A budget refusal is logged at INFO (the round line shows it); faults are warnings."""
    import logging

    from coordinator.server_app import _console_log

    log = logging.getLogger("fedpose.coordinator")
    with _console_log():
        log.info("round 6: site site-3 refused: the site's planned steps would pass its ε_max")
        log.warning("round 6: site site-2 missing: no reply")
    err = capfd.readouterr().err
    assert "site-3 refused" not in err
    assert "WARNING fedpose.coordinator: round 6: site site-2 missing: no reply" in err


@pytest.mark.parametrize("ray_class, expected", [
    ("ActorDiedError", "the site's simulation worker died before replying — killed or crashed"),
    ("ActorUnavailableError", "the site's simulation worker died before replying — killed or crashed"),
    ("OutOfMemoryError", "the site's simulation worker died before replying — killed or crashed"),
    ("RaySystemError", "the simulation runtime (Ray) could not run the site's ClientApp"),
])
def test_a_ray_failure_is_told_in_fedposes_words_and_a_site_failure_keeps_its_own(flower_task_identity, ray_class: str, expected: str) -> None:
    """Flower's simulation runtime reports Ray's own exceptions as error code UNKNOWN with Ray's
    text (actor ids, ports, tips): the round record says what happened to the site instead."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    from coordinator.grid import node_reply

    reason = (f"<class 'ray.exceptions.{ray_class}'>:<'The actor 6c1b32666883 is unavailable: RpcError: Socket closed "
              "rpc_code: 14. Worker ID: 3b2dcf93 Worker PID: 6879'>")
    failure = node_reply(Message(Error(code=ErrorCode.UNKNOWN, reason=reason), reply_to=_train_message()), 7, 3.0)
    assert failure.reply is None and failure.node == 7  # the node the message went to, not the reply's source
    assert failure.failure.startswith(expected) and failure.failure.endswith("Ray's report is in the simulation log")
    assert "6879" not in failure.failure and "Socket" not in failure.failure
    # the site's own ClientApp failing keeps its (sanitized) class and message
    crashed = node_reply(Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                       reason="<class 'flwr.clientapp.client_app.ClientAppException'>:<'OSError'>"),
                                 reply_to=_train_message()), 7, 3.0)
    assert crashed.failure.startswith("the site's ClientApp failed: ") and "OSError" in crashed.failure


def test_what_rays_driver_threads_print_goes_to_the_simulation_log(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    """Ray's error listener prints a dead worker's notice ("(raylet) A worker died …", coloured) on
    the driver's stdout: under `fedpose simulate` it lands in the simulation log; the
    coordinator's own lines still reach the console."""
    import threading

    from fedpose.cli.simulate import flower_log_to

    log = tmp_path / "simulation.log"
    with flower_log_to(log):
        print("round   2 | PCKh@0.5 = 1.42 | site-1: ok", flush=True)
        notice = threading.Thread(target=lambda: print("\x1b[33m(raylet)\x1b[0m A worker died or was killed. Worker PID: 6879"),
                                  name="ray_listen_error_messages")
        notice.start()
        notice.join()
    print("after", flush=True)
    console = capfd.readouterr()
    assert "round   2 | PCKh@0.5" in console.out and "after" in console.out
    assert "raylet" not in console.out + console.err
    assert "(raylet) A worker died or was killed. Worker PID: 6879\n" in log.read_text()  # without colour codes


@pytest.mark.parametrize("scenario", ["full", "biases_norms", "grey_early_biases_norms", "lora"])
def test_the_guard_lets_out_what_a_fresh_model_of_the_spec_trains(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The names the guard allows are the trainable parameters of the model the spec builds (the set the
    DP engine clips and noises), remembered from the round's own build instead of a second one."""
    import fedpose.model as model_module

    spec = SMALL_SPEC.model_copy(update={"scenario": scenario, "lora_rank": 2 if scenario == "lora" else None,
                                   "lora_alpha": 4.0 if scenario == "lora" else None})
    model = model_module.build_model_from_spec(spec)
    trained = frozenset(model.trainable_parameters())
    monkeypatch.setattr(model_module, "build_model_from_spec", lambda *_: pytest.fail("built again"))
    assert model_module.trainable_parameter_names(spec) == trained
    assert trained < frozenset(name for name, _ in model.named_parameters()) or scenario == "full"
