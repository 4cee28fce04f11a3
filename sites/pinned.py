"""Run a site's ClientApp tasks with the fedpose installed at the site, never the code of the run.

A Flower SuperNode runs, for every message, the ClientApp inside the app package (FAB) of the run:
whoever submits the run (anyone who reaches the SuperLink's Control API) chooses that code, and code
of their choosing could read the site's images and send them back — past the egress guard and the
budget guard, which are part of the code replaced. A site that runs these two processes instead of
Flower's own keeps its code its own::

    flower-supernode ... --isolation process --host 127.0.0.1 --port 9094
    fedpose-site-superexec --runtime-api-address 127.0.0.1:9094 --insecure

``fedpose-site-superexec`` is Flower's SuperExec (it polls the SuperNode for tasks and starts one
process per task) launching ``fedpose-site-clientapp`` instead of ``flwr-clientapp``; that process
is Flower's ClientApp process, except that it neither installs nor imports the run's package: it runs
``sites.client_app:app`` as installed here, whatever the package holds (its SHA-256 goes to the
executor's output). Runtime dependency installation is refused (it would run the package's installer).
The runtime API stays on the loopback: it carries the site's messages in the clear.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

#: the command the SuperExec starts for a ClientApp task (a console script of this package)
PINNED_CLIENTAPP_COMMAND = "fedpose-site-clientapp"


def superexec_main() -> None:
    """Flower's ``flower-superexec``, starting ``fedpose-site-clientapp`` for every ClientApp task."""
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType

    if "--allow-runtime-dependency-installation" in sys.argv:
        sys.exit("fedpose-site-superexec: runtime dependency installation would run the run's package installer: refused")
    TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] = PINNED_CLIENTAPP_COMMAND  # the one dict every executor reads
    flower_superexec()


def clientapp_main() -> None:
    """Flower's ``flwr-clientapp`` process, running this site's installed ClientApp for the task."""
    import flwr.supernode.runtime.run_clientapp as run_clientapp
    from flwr.supernode.cli import flwr_clientapp

    if "--allow-runtime-dependency-installation" in sys.argv:
        sys.exit("fedpose-site-clientapp: runtime dependency installation would run the run's package installer: refused")
    run_clientapp.install_from_fab = _skip_install
    run_clientapp.get_load_client_app_fn = _installed_client_app
    flwr_clientapp()


#: what the ClientApp process prints (to the SuperExec's output) for each task's package
NOT_INSTALLED = "not installed: the site runs its own installed fedpose ClientApp"


def _skip_install(fab_content: bytes, *args: Any, **kwargs: Any) -> Path | None:
    """The run's package is never installed (nor unpacked): its code must not run here."""
    import hashlib

    from flwr.common.logger import log as flower_log

    flower_log(logging.INFO, "run package sha256 %s received; %s", hashlib.sha256(fab_content).hexdigest(), NOT_INSTALLED)
    return None


def _installed_client_app(**kwargs: Any) -> Any:
    """In place of Flower's loader of the package's ClientApp: the one installed at this site."""

    def load(*args: Any) -> Any:
        from sites.client_app import app

        return app

    return load
