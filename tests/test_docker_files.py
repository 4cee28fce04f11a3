"""docker/: every file, command, flag and config the Dockerfiles and compose.yaml name exists.

No Docker engine here: the files are parsed and every reference is checked against the repo, the
installed Flower executables (their real ``--help``), ``fedpose certs`` output and the config
models.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedpose.config import load_config
from fedpose.federation.config import SiteConfig
from fedpose.federation.deployment import load_coordinator_run
from fedpose.privacy.input_privacy import site_ldp_copy_dir

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent
APP_ROOT = "/app"  # WORKDIR of both images: /app/<path> is <repo>/<path>


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def help_text() -> dict[str, str]:
    texts = {}
    for exe in ("flower-superlink", "flower-supernode", "fedpose-site-superexec"):
        result = subprocess.run([str(BIN / exe), "--help"], capture_output=True, text=True, timeout=120,
                                env={"FLWR_TELEMETRY_ENABLED": "0", "PATH": str(BIN)})
        texts[exe] = result.stdout + result.stderr
    return texts


@pytest.mark.parametrize("name", ["Dockerfile.coordinator", "Dockerfile.site"])
def test_dockerfile_copies_existing_paths_and_installs_the_project(name: str) -> None:
    instructions = dockerfile_instructions(DOCKER / name)
    assert instructions[0][0] == "FROM"
    copies = [rest.split() for op, rest in instructions if op == "COPY"]
    assert copies, "nothing copied into the image"
    for parts in copies:
        for source in parts[:-1]:
            assert (REPO / source).exists(), f"{name}: COPY source {source} does not exist in the repo"
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    assert "pip install" in runs and " ." in runs, f"{name}: the project is not pip-installed"
    # the Flower app packages must be inside the image: the SuperLink/SuperNode load them from the FAB,
    # but the installed project provides fedpose itself
    copied = {parts[0] for parts in copies}
    assert {"pyproject.toml", "fedpose", "coordinator", "sites", "configs"} <= copied | {p for parts in copies for p in parts[:-1]}


def _service_argv(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _built(compose: dict) -> dict[str, dict]:
    """The services built from this repo (the monitoring ones run published images: test_dashboard.py)."""
    return {name: service for name, service in compose["services"].items() if "image" not in service}


def test_compose_builds_from_existing_dockerfiles(compose: dict) -> None:
    for name, service in _built(compose).items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO, f"{name}: build context must be the repo root"
        assert (context / build["dockerfile"]).exists(), f"{name}: {build['dockerfile']} missing"


def test_compose_commands_and_flags_exist(compose: dict, help_text: dict[str, str]) -> None:
    for name, service in _built(compose).items():
        argv = _service_argv(service)
        exe = argv[0]
        if exe in help_text:
            assert (BIN / exe).exists()
            for flag in _flags(argv[1:]):
                assert re.search(rf"(^|\s|\[){re.escape(flag)}(\s|=|\]|,|$)", help_text[exe], re.M), \
                    f"{name}: {exe} has no flag {flag}"
        elif exe == "python":
            assert argv[1:3] == ["-m", "sites.metrics"], f"{name}: unexpected python command {argv}"
            usage = subprocess.run([sys.executable, "-m", "sites.metrics", "--help"], capture_output=True, text=True,
                                   cwd=REPO, timeout=120).stdout
            for flag in _flags(argv[3:]):
                assert flag in usage, f"{name}: sites.metrics has no flag {flag}"
        else:
            assert exe == "submit-run.sh", f"{name}: unexpected command {exe}"
            assert (DOCKER / exe).exists() and (DOCKER / exe).stat().st_mode & 0o111, "submit-run.sh missing / not executable"


def test_transport_is_grpc_with_tls_and_supernode_auth(compose: dict) -> None:
    link = _service_argv(compose["services"]["superlink"])
    assert "--fleet-api-type=grpc-rere" in link and "--enable-supernode-auth" in link
    assert "--disable-runtime-dependency-installation" in link and "--insecure" not in link
    sites = [s for s in compose["services"] if s.startswith("site-")]
    assert len(sites) == 3
    for name in sites:
        argv = _service_argv(compose["services"][name])
        assert "--grpc-rere" in argv and "--insecure" not in argv
        assert any(a.startswith("--root-certificates=") for a in argv)
        assert any(a.startswith("--auth-supernode-private-key=") for a in argv)


def test_certificates_named_are_what_fedpose_certs_writes(compose: dict, tmp_path: Path) -> None:
    from fedpose.cli.certs import write_dev_certificates

    sites = sorted(s for s in compose["services"] if s.startswith("site-"))
    write_dev_certificates(tmp_path, sites, extra_hosts=["superlink"])
    named = []
    for service in _built(compose).values():
        for arg in _service_argv(service):
            named += re.findall(r"/certs/([\w./-]+)", arg)
        named += re.findall(r"/certs/([\w./-]+)", " ".join(str(v) for v in service.get("environment", {}).values()))
    assert named
    for rel in named:
        assert (tmp_path / rel).exists(), f"compose names /certs/{rel}, fedpose certs does not write it"


def test_site_and_coordinator_configs_are_valid_and_match_the_mounts(compose: dict) -> None:
    for name, service in _built(compose).items():
        for arg in _service_argv(service):
            match = re.match(r'--node-config=site-config="(.+)"', arg)
            if not match:
                continue
            path = REPO / Path(match.group(1)).relative_to(APP_ROOT)
            site = load_config(path, model=SiteConfig)
            assert site.site_id == name, f"{name} runs the config of {site.site_id}"
            mounts = [v.split(":")[1] for v in service["volumes"]]
            assert str(site.data.train) in mounts, f"{name}: data.train {site.data.train} is not mounted"
            # budget, LDP copy and its release record must survive a recreated container: a named
            # volume (declared at the top level), not a bind of the writable layer
            named = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"] if not v.startswith((".", "/"))}
            durable = [m for m in named if str(site.state_dir).startswith(m)]
            assert durable and named[durable[0]] in compose["volumes"], f"{name}: state_dir not on a named volume"
            assert str(site_ldp_copy_dir(site.state_dir)).startswith(durable[0]), f"{name}: LDP copy outside the state volume"
    env = compose["services"]["coordinator"]["environment"]
    run = load_coordinator_run(REPO / Path(env["COORDINATOR_CONFIG"]).relative_to(APP_ROOT))
    link_mounts = [v.split(":")[1] for v in compose["services"]["superlink"]["volumes"]]
    assert any(str(run.coordinator.checkpoint_dir).startswith(m) for m in link_mounts)
    assert any(str(run.coordinator.data.val).startswith(m) for m in link_mounts)


def test_submit_script_uses_existing_flwr_commands() -> None:
    script = (DOCKER / "submit-run.sh").read_text()
    for sub in (["supernode", "register"], ["supernode", "list"], ["run"]):
        assert "flwr " + " ".join(sub) in script
        result = subprocess.run([str(BIN / "flwr"), *sub, "--help"], capture_output=True, text=True, timeout=120,
                                env={"FLWR_TELEMETRY_ENABLED": "0", "PATH": str(BIN)})
        assert result.returncode == 0, f"flwr {' '.join(sub)} does not exist"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'serverapp = "coordinator.server_app:app"' in pyproject and 'clientapp = "sites.client_app:app"' in pyproject


def test_every_site_has_a_metrics_exporter_on_its_state_volume(compose: dict) -> None:
    """Site metrics come from a long-lived exporter reading the budget the ClientApps persist."""
    sites = sorted(s for s in compose["services"] if s.startswith("site-"))
    for name in sites:
        exporter = compose["services"][f"metrics-{name}"]
        argv = _service_argv(exporter)
        config = next(a.split("=", 1)[1] for a in argv if a.startswith("--site-config="))
        site = load_config(REPO / Path(config).relative_to(APP_ROOT), model=SiteConfig)
        assert site.site_id == name
        state_volume = next(v for v in compose["services"][name]["volumes"] if v.endswith(":/state"))
        assert state_volume in exporter["volumes"], f"metrics-{name} does not read {name}'s state volume"
        assert str(site.state_dir).startswith("/state"), f"{name}: state_dir is not on the shared volume"


def test_the_site_image_keeps_its_state_out_of_the_writable_layer(compose: dict) -> None:
    """The image declares the state volume too: even a container started without compose's named volume
    never keeps the budget or the LDP copy in its writable layer (lost when it is recreated)."""
    import json

    volumes = [json.loads(rest) if rest.startswith("[") else rest.split()
               for op, rest in dockerfile_instructions(DOCKER / "Dockerfile.site") if op == "VOLUME"]
    declared = {v for group in volumes for v in group}
    for name in sorted(s for s in compose["services"] if s.startswith("site-")):
        service = compose["services"][name]
        config = next(re.match(r'--node-config=site-config="(.+)"', a).group(1)
                      for a in _service_argv(service) if a.startswith("--node-config="))
        site = load_config(REPO / Path(config).relative_to(APP_ROOT), model=SiteConfig)
        assert any(str(site.state_dir).startswith(v.rstrip("/") + "/") for v in declared), \
            f"Dockerfile.site declares no VOLUME holding {name}'s state_dir {site.state_dir}"
        state_mount = next(v for v in service["volumes"] if v.endswith(":/state"))
        assert state_mount.split(":")[0] in compose["volumes"], f"{name}: /state is not a named (top-level) volume"


def test_only_the_fleet_api_is_published_beyond_this_host(compose: dict) -> None:
    """Whoever reaches the SuperLink's Control API submits the code every site runs and registers
    SuperNode keys; the metrics exporters carry no authentication. Found by a red-team: compose
    published them on every interface. Only the Fleet API (9092, TLS + SuperNode auth) may be."""
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port == "9092:9092" or port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"


def test_each_container_mounts_only_its_own_keys_and_data(compose: dict) -> None:
    """A site's container held the CA key, the coordinator's key and every site's SuperNode key (it
    could connect as another site or mint certificates), and the SuperLink's held every site's
    training data. Each now mounts its own key and data only; no container gets the CA key."""
    sources = {name: [v.split(":")[0] for v in service.get("volumes", [])] for name, service in compose["services"].items()}
    for name, mounted in sources.items():
        assert "./certs" not in mounted and not any(m.endswith("ca.key") for m in mounted), f"{name} mounts the CA key"
        keys = [m for m in mounted if m.startswith("./certs/sites/") and not m.endswith(".pub")]
        data = [m for m in mounted if m.startswith("./data/site-")]
        if name.startswith("site-"):
            assert keys == [f"./certs/sites/{name}"] and data == [f"./data/{name}"], f"{name}: {keys} {data}"
        elif name.startswith("exec-site-"):  # the site's ClientApp process: its data, no key
            assert not keys and data == [f"./data/{name.removeprefix('exec-')}"], f"{name}: {keys} {data}"
        else:
            assert not keys and not data, f"{name} mounts a site's key or training data: {keys} {data}"
    assert "./data" not in sources["superlink"] and "./certs/server.key" in sources["superlink"]


def test_every_site_runs_its_own_clientapp_never_the_runs_package(compose: dict) -> None:
    """A SuperNode runs the ClientApp inside the run's package, which whoever submits the run chooses
    (a red-team read a site's images that way): each site's SuperNode runs in process isolation and
    its exec service starts the site's installed ClientApp (sites/pinned.py) on the SuperNode's loopback."""
    for name in sorted(s for s in compose["services"] if s.startswith("site-")):
        assert "--isolation=process" in _service_argv(compose["services"][name]), name
        executor = compose["services"][f"exec-{name}"]
        assert executor["network_mode"] == f"service:{name}"
        argv = _service_argv(executor)
        assert argv[0] == "fedpose-site-superexec" and "--runtime-api-address=127.0.0.1:9094" in argv
        assert not any(v.split(":")[0].startswith("./certs") for v in executor["volumes"]), "the executor needs no key"
