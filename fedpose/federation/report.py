"""The federation's round history, final report JSON and curves PNG (Flower-free).

``history.json`` (one entry per finished round) is rewritten atomically after every round; the
final ``report.json`` adds the per-site privacy summary from the ledger, and ``curves.png``
plots server-side PCKh@0.5 and each site's cumulative ε over rounds. ε values always travel with
their guarantee, δ and accountant (FDP's ε is not comparable with DP's), so the ε panel labels
every site's curve with its guarantee.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from fedpose.io import atomic_write, atomic_write_json
from fedpose.federation.protocol import REASON_TEXT

HISTORY_FILE = "history.json"
REPORT_FILE = "report.json"
CURVES_FILE = "curves.png"


def _finite(value: Any) -> Any:
    """JSON has no ∞/NaN: write None instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


#: a site's outcome in one round: its reply's status, or what the coordinator made of it
SiteRoundStatus = Literal["ok", "refused", "replayed", "failed", "error", "missing", "rejected"]


class SiteRoundRecord(BaseModel):
    """One site's line of one round in the history. The ε fields are the site's own cumulative
    report (None when it sent none this round); the rest is what the coordinator saw."""

    # files written before a field existed still load (ignore what is no longer recorded)
    model_config = ConfigDict(extra="ignore")

    status: SiteRoundStatus
    epsilon: float | None = None
    delta: float | None = None
    guarantee: str | None = None
    accountant: str | None = None
    unit: str | None = None  #: protection unit; None in records written before units (record-level)
    #: the accountant's neighbouring relation (None in records written before it was kept: the guarantee's own)
    adjacency: str | None = None
    eps_max: float | None = None  #: the site's own budget, as it reported it (None: no report this round)
    reason: str = ""
    reject_reason: str | None = None  #: the validation's code when status is "rejected"
    local_steps: int = 0
    update_norm: float | None = None  #: ‖Δ‖₂ of an update that reached validation
    bytes_down: int = 0
    bytes_up: int = 0


class SecureAggregationRecord(BaseModel):
    """How a round's secure sum went (None in rounds without secure aggregation)."""

    model_config = ConfigDict(extra="ignore")

    participants: int  #: n: sites asked to join
    threshold: int  #: t = ⌊n/2⌋ + 1
    survivors: int = 0  #: sites whose masked vectors are in the unmasked sum
    abandoned: str = ""  #: why nothing was aggregated ('' when the sum was unmasked and used)
    #: per-coordinate bound on |aggregated Δ − FedAvg of the clipped Δ|: survivors · 2R/(2^bits − 1) / Σw
    error_bound: float | None = None
    stage_bytes: int = 0  #: setup, share-keys and unmask messages, both ways
    mean_update_norm: float | None = None  #: ‖Σ w_i Δ_i / Σ w_i‖₂ of the unmasked sum (the only norm the coordinator sees)


class RoundRecord(BaseModel):
    """One finished round, as history.json and report.json list it."""

    model_config = ConfigDict(extra="ignore")

    round: int
    pckh: dict[str, float | None] | None = None  #: PCKh of the global model after the round (None: no held-out split)
    #: coordinator.ema on: ``pckh`` is of the moving average of the global models since this round (else of the iterate)
    averaged_from_round: int | None = None
    #: ... up to this round: the last that changed the model (None in records from before: ``round``)
    averaged_to_round: int | None = None
    aggregated: bool = False  #: whether the global model changed
    accepted: int = 0
    rejected: int = 0
    selected: int = 0
    basis_version: int = -1
    wall_seconds: float = 0.0
    exchange_seconds: float = 0.0
    sites: dict[str, SiteRoundRecord] = {}
    exhausted: int = 0  #: sites the ledger counts as exhausted after the round
    not_asked_exhausted: list[str] = []  #: sites not asked this round: their own reports said the budget is spent
    basis_bytes: int = 0
    basis_transport: str = "full"
    #: selected nodes whose reply counted for no site: they failed before naming it, or their reply was
    #: not used (unsigned, another round's, claimed a site another node also claimed, malformed update)
    unidentified_missing_nodes: list[int] = []
    node_wait_seconds: float = 0.0
    secure_aggregation: SecureAggregationRecord | None = None

    @property
    def pckh_is_averaged(self) -> bool:
        """Whether ``pckh`` is of an average of several rounds' models (round 1's average is its model)."""
        return self.averaged_from_round is not None and self.averaged_from_round < (self.averaged_to_round or self.round)


def _rounds(raw: Any, path: Path) -> list[RoundRecord]:
    """The round records of a history or report file; a clear error naming the file when they do not parse."""
    try:
        return [RoundRecord.model_validate(entry) for entry in raw]
    except (ValidationError, TypeError) as exc:
        raise ValueError(f"{path}: unreadable round history ({exc})") from None


def load_history(directory: str | Path) -> list[RoundRecord]:
    path = Path(directory) / HISTORY_FILE
    if not path.exists():
        return []
    return _rounds(json.loads(path.read_text())["rounds"], path)


def save_history(directory: str | Path, rounds: list[RoundRecord]) -> None:
    atomic_write_json(Path(directory) / HISTORY_FILE, {"rounds": _finite([r.model_dump(mode="json") for r in rounds])})


def epsilon_text(epsilon: float | None, delta: float | None, guarantee: str | None, accountant: str | None = "rdp",
                 unit: str | None = None, relation: str | None = None) -> str:
    """The site's ε with guarantee, δ, accountant, protection unit (``unit`` None: a record written
    before units, which were all record-level) and neighbouring relation (None: the guarantee's)."""
    from fedpose.privacy.report import format_epsilon

    if guarantee in (None, "", "none"):
        return format_epsilon(math.inf, 0.0, "none")
    return format_epsilon(math.inf if epsilon is None else float(epsilon), float(delta or 0.0), guarantee, accountant or "rdp",
                          unit or "record", relation)


def _adjacency_of(site: Any) -> str:
    """A round record's neighbouring relation in words (its own, or its guarantee's)."""
    from fedpose.privacy.report import adjacency_words, relation_of

    if site.adjacency is None and site.guarantee is None:  # a record that names neither
        return "adjacency not reported"
    return adjacency_words(site.adjacency or relation_of(site.guarantee), site.unit or "record")


#: per-site round statuses that mean the site failed the round (ok / refused / replayed are not failures)
FAILURE_STATUSES = ("error", "failed", "missing", "rejected")
#: how the coordinator's fatal error line starts in the ServerApp's output (the CLI shows that line)
COORDINATOR_ERROR_PREFIX = "fedpose: coordinator error: "
#: exit code of ``fedpose simulate`` / ``deploy local`` when a site failed (without --allow-site-failures)
SITE_FAILURE_EXIT = 3


class SiteFailure(BaseModel):
    """One (round, site) that failed, as report.json lists it."""

    round: int
    site: str  #: the site id, or "node <id>" for a node whose reply counted for no site
    status: SiteRoundStatus  #: one of FAILURE_STATUSES, or "refused" by a site behind the ledger's record
    reason: str = ""  #: starts with the site's error class when it sent one (e.g. "ImageLoadError: …")


class RunReport(BaseModel):
    """What the CLIs read back from the coordinator's report.json at the end of a run."""

    model_config = ConfigDict(extra="ignore")

    run_id: str
    stopped_reason: str = ""
    rounds_completed: int
    site_failures: list[SiteFailure] = []
    rounds: list[RoundRecord] = []


def load_report(directory: str | Path) -> RunReport:
    path = Path(directory) / REPORT_FILE
    try:
        return RunReport.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise ValueError(f"{path}: unreadable run report ({exc})") from None


def finished_run_note(run_id: str, rounds_done: int, rounds_configured: int, how: str) -> str:
    """What resuming a run that already did all its configured rounds says (``how``: how to raise
    coordinator.rounds where the operator is, formatted with ``rounds`` = one more round)."""
    return (f"run '{run_id}' already finished after {rounds_done} rounds (coordinator.rounds = {rounds_configured}); "
            f"to continue, raise coordinator.rounds: {how.format(rounds=rounds_done + 1)}")


def site_failures(rounds: list[RoundRecord]) -> list[SiteFailure]:
    """Every (round, site) that failed, in order: a site's error, diverged training, no reply,
    a rejected update, a site refusing because its state is behind the ledger's record, and nodes
    that failed before they could say which site they are."""
    failures = []
    for entry in rounds:
        for site_id, site in sorted(entry.sites.items()):
            # a site behind the ledger's record refused (nothing spent) but needs its operator: a failure
            behind = site.status == "refused" and site.reason == REASON_TEXT["behind-federation-record"]
            if site.status in FAILURE_STATUSES or behind:
                failures.append(SiteFailure(round=entry.round, site=site_id, status=site.status, reason=site.reason))
        for node in entry.unidentified_missing_nodes:
            failures.append(SiteFailure(round=entry.round, site=f"node {node}", status="missing",
                                        reason="no reply that counts for a site: it failed before naming its site, or its reply "
                                               "was not used (the coordinator log says why)"))
    return failures


def failure_summary(failures: list[SiteFailure]) -> list[str]:
    """Human-readable lines for the end of a run (empty when no site failed)."""
    if not failures:
        return []
    sites = sorted({f.site for f in failures})
    lines = [f"{len(failures)} site failure(s) in this run ({', '.join(sites)}):"]
    lines += [f"  round {f.round:>3} {f.site}: {f.status} — {f.reason}" for f in failures]
    return lines


def initial_line(initial_pckh: float) -> str:
    """Round 0's line: the initial global model's PCKh, before any site data."""
    return f"round   0 | PCKh@0.5 = {initial_pckh:.2f} | initial global model (no site data used)"


def round_line(entry: RoundRecord) -> str:
    """One human-readable line per round: PCKh (saying so when it is of the moving average) and every
    site's ε with guarantee, δ, accountant."""
    pckh = (entry.pckh or {}).get("Mean")
    last = entry.averaged_to_round or entry.round
    averaged = f" (moving average of rounds {entry.averaged_from_round}–{last})" if entry.pckh_is_averaged else ""
    parts = [f"round {entry.round:>3}", f"PCKh@0.5 = {pckh:.2f}{averaged}" if pckh is not None else "PCKh@0.5 = n/a"]
    for site_id, site in sorted(entry.sites.items()):
        reason = f" ({site.reason})" if site.reason else ""
        if site.guarantee is None:  # no privacy report this round (its spend shows in its next one)
            parts.append(f"{site_id}: {site.status}{reason or ' (no report)'}")
        else:
            eps = epsilon_text(site.epsilon, site.delta, site.guarantee, site.accountant, site.unit, site.adjacency)
            parts.append(f"{site_id}: {site.status}{reason}, {eps}")
    for site_id in entry.not_asked_exhausted:
        parts.append(f"{site_id}: not asked (its budget is exhausted)")
    for node in entry.unidentified_missing_nodes:
        parts.append(f"node {node}: missing (no reply that counts for a site; the coordinator log says why)")
    secure = entry.secure_aggregation
    if secure is not None:
        parts.append(f"secure aggregation: abandoned ({secure.abandoned})" if secure.abandoned else
                     f"secure aggregation: sum of {secure.survivors} of {secure.participants} sites (t = {secure.threshold}, "
                     f"quantization error ≤ {secure.error_bound:.2g} per coordinate)")
    parts.append(f"{entry.wall_seconds:.1f} s")
    return " | ".join(parts)


def write_report(directory: str | Path, run_info: dict[str, Any], rounds: list[RoundRecord], ledger_summary: dict[str, Any]) -> Path:
    """Write report.json and curves.png into ``directory``; return the report path."""
    directory = Path(directory)
    report = {
        **run_info,
        "rounds_completed": len(rounds),
        "site_failures": [failure.model_dump() for failure in site_failures(rounds)],
        "final_pckh": rounds[-1].pckh if rounds else None,
        "sites": ledger_summary.get("sites", []),
        "privacy_note": (
            "Each site's ε is its cumulative spend reported by the site itself (the authority on its budget), "
            "composed over every local step of every round it joined by the accountant named with it (PLD unless "
            "the site chose another), at the δ shown, per the site's protection unit (record, image or patient). "
            "'DP' protects the whole unit; 'FDP' only what the public view ψ discards of it (ψ(x) — by default "
            "f×f block averages at b bits — and keypoints are public; see each site's privacy report); 'MaskDP' "
            "the masked head regions. ε of different guarantees or units are not comparable. Site selection is "
            "not secret: no amplification claimed."
        ),
        "rounds": [r.model_dump(mode="json") for r in rounds],
    }
    path = directory / REPORT_FILE
    atomic_write_json(path, _finite(report))
    save_federation_curves(directory / CURVES_FILE, rounds, run_info.get("initial_pckh"))
    return path


def save_federation_curves(path: str | Path, rounds: list[RoundRecord], initial_pckh: float | None = None) -> None:
    """PCKh@0.5 (server-side, held-out split) and per-site cumulative ε over rounds, with each
    site's ε_max."""
    import io

    import matplotlib.pyplot as plt

    fig = federation_figure(rounds, initial_pckh)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, lambda fh: fh.write(buf.getvalue()))


def federation_figure(rounds: list[RoundRecord], initial_pckh: float | None = None) -> Any:
    """The matplotlib figure of :func:`save_federation_curves` (axes: PCKh, ε)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_pckh, ax_eps) = plt.subplots(1, 2, figsize=(11, 4))
    evaluated = [(r.round, r.pckh) for r in rounds if r.pckh]
    xs = [x for x, _ in evaluated]
    means = [p["Mean"] for _, p in evaluated]
    if initial_pckh is not None:  # round 0, as the console prints it: a short run is a curve, not a point
        ax_pckh.axhline(initial_pckh, color="gray", ls=":", label="initial model (no site data)")
        xs, means = [0, *xs], [initial_pckh, *means]
    ax_pckh.plot(xs, means, marker="o", label="Mean")
    ax_pckh.plot([x for x, _ in evaluated], [p.get("Mean@0.1", float("nan")) for _, p in evaluated], marker=".", label="Mean@0.1")
    averaged = [r.round for r in rounds if r.pckh and r.pckh_is_averaged]
    model = f"global model (its moving average from round {averaged[0]})" if averaged else "global model"
    ax_pckh.set(title=f"{model}, held-out split", xlabel="round", ylabel="PCKh (%)")
    ax_pckh.legend()
    sites = sorted({s for r in rounds for s in r.sites})
    for site_id in sites:
        points = [(r.round, r.sites[site_id]) for r in rounds if site_id in r.sites]
        points = [(x, s) for x, s in points if s.epsilon is not None]
        if not points:
            continue
        # one line per accountant the site reported with (a switch to PLD restates the same spends
        # lower): a line never joins one accountant's ε to another's
        color = None
        for accountant in dict.fromkeys(s.accountant for _, s in points):
            same = [(x, s) for x, s in points if s.accountant == accountant]
            last = same[-1][1]
            label = (f"{site_id} ({last.guarantee} per {last.unit or 'record'}, δ={last.delta or 0.0:.0e}, "
                     f"{str(accountant).upper()}, {_adjacency_of(last)})")
            line, = ax_eps.plot([x for x, _ in same], [s.epsilon for _, s in same], marker="o", label=label, color=color,
                                ls="-" if accountant == points[-1][1].accountant else ":")
            color = line.get_color()
        budgets = [s.eps_max for _, s in points if s.eps_max is not None]
        if budgets:  # the site's own ε_max, in its colour: where its guard refuses
            ax_eps.axhline(budgets[-1], color=line.get_color(), ls="--", lw=1, label=f"{site_id} ε_max = {budgets[-1]:g}")
    ax_eps.set(title="cumulative ε per site (as reported)", xlabel="round", ylabel="ε")
    ax_eps.set_ylim(bottom=0)  # ε from 0: a zoomed axis makes a spend of 0.3 look like a budget's worth
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_pckh, ax_eps):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax_eps.get_legend_handles_labels()[0]:  # non-private runs report no ε
        ax_eps.legend(fontsize=8)
    fig.tight_layout()
    return fig
