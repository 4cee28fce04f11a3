"""A site runs its own installed ClientApp, never the code of a run's app package (sites/pinned.py):
the real deployment path is exercised by the deploy tests (tests/federation/test_federation_deploy.py
checks that no package was installed); here, what the two entry points change in Flower's process."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path


def test_the_clientapp_process_loads_the_installed_app_and_installs_nothing(tmp_path: Path) -> None:
    """Flower's ClientApp process with the site's loader: a package holding other code is neither
    unpacked nor imported, and the ClientApp it runs is sites.client_app:app."""
    package = tmp_path / "evil.fab"
    with zipfile.ZipFile(package, "w") as fab:
        fab.writestr("sites/client_app.py", "raise SystemExit('the run package was imported')\n")
    script = f"""
import sys
sys.argv = ["fedpose-site-clientapp", "--token", "x"]
import flwr.supernode.runtime.run_clientapp as run_clientapp
import flwr.supernode.cli as cli
import sites.pinned as pinned
cli.flwr_clientapp = lambda: None  # only the process's set-up, not its Runtime API loop
pinned.clientapp_main()
assert run_clientapp.install_from_fab(open({str(package)!r}, "rb").read(), skip_prompt=True) is None
app = run_clientapp.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)("evil", "1", "0" * 64)
import sites.client_app
assert app is sites.client_app.app
print("installed app")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={"FLWR_HOME": str(tmp_path / "flwr-home"), "FLWR_TELEMETRY_ENABLED": "0", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and "installed app" in result.stdout, result.stderr
    assert "not installed: the site runs its own installed fedpose ClientApp" in result.stderr
    assert not (tmp_path / "flwr-home").exists() or not any((tmp_path / "flwr-home").rglob("client_app.py"))


def test_the_site_superexec_starts_the_pinned_clientapp_and_refuses_dependency_installation() -> None:
    script = """
import sys
import flwr.supercore.cli as cli
cli.flower_superexec = lambda: None
import sites.pinned as pinned
from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType
sys.argv = ["fedpose-site-superexec"]
pinned.superexec_main()
print(TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP])
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "fedpose-site-clientapp", result.stderr
    refused = subprocess.run([sys.executable, "-c", script.replace('["fedpose-site-superexec"]',
                              '["fedpose-site-superexec", "--allow-runtime-dependency-installation"]')],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "refused" in refused.stderr
