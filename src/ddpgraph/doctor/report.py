"""The doctor's report: every rank's findings grouped by finding, plus what only the
comparison of ranks shows; printed with rich, or as versioned JSON (`--json`).

JSON schema `ddpgraph.doctor.report/1` (docs/doctor.md describes each field)::

    {"schema": "ddpgraph.doctor.report/1", "status": "clean" | "findings",
     "exit_code": 0 | 1, "script": str, "args": [str], "nproc": int,
     "torchrun_exit_code": int | null, "timed_out": bool, "timeout_s": float,
     "elapsed_s": float,
     "findings": [{"code", "title", "subject", "happened", "fix",
                   "location": {"file", "line", "source"} | null, "ranks": [int]}],
     "ranks": [{"rank", "status", "exit_code", "captures", "failed_captures",
                "replays", "ddp_captures", "ddp_replays", "collective_steps",
                "doctor_errors": [str]}]}

`status` is "unchecked" (exit status 3) when the only findings are NO_CUDA: without a
GPU the doctor could check nothing the script does with CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..findings import Code, Finding, Location, format_ranks, merge_by_code
from .records import RankRecord, RankStatus, finding_to_json
from .run import RunResult

if TYPE_CHECKING:  # env imports torch, which the launching process never does
    from .env import EnvReport

SCHEMA = "ddpgraph.doctor.report/1"
EXIT_CLEAN, EXIT_FINDINGS, EXIT_UNCHECKED = 0, 1, 3
_DONE = (RankStatus.FINISHED, RankStatus.FAILED)


def exit_status(findings: list[Finding]) -> int:
    """The doctor's exit status for `findings`, a script's or `--env`'s: NO_CUDA alone
    means nothing could be checked (3), not a finding (1)."""
    if findings and all(f.code is Code.NO_CUDA for f in findings):
        return EXIT_UNCHECKED
    return EXIT_FINDINGS if findings else EXIT_CLEAN


@dataclass
class DoctorReport:
    script: str
    args: list[str]
    nproc: int
    timeout_s: float
    run: RunResult
    findings: list[Finding]

    @property
    def unchecked(self) -> bool:
        """Nothing could be checked: the only findings say there is no GPU."""
        return bool(self.findings) and all(f.code is Code.NO_CUDA for f in self.findings)

    @property
    def exit_code(self) -> int:
        return exit_status(self.findings)

    @property
    def status(self) -> str:
        return "unchecked" if self.unchecked else "findings" if self.findings else "clean"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "status": self.status,
            "exit_code": self.exit_code,
            "script": self.script,
            "args": self.args,
            "nproc": self.nproc,
            "torchrun_exit_code": self.run.exit_code,
            "timed_out": self.run.timed_out,
            "timeout_s": self.timeout_s,
            "elapsed_s": round(self.run.elapsed_s, 3),
            "findings": [finding_to_json(f) for f in self.findings],
            "ranks": [_rank_json(r) for r in self.run.records],
        }


def build_report(
    script: str, args: list[str], nproc: int, timeout_s: float, run: RunResult
) -> DoctorReport:
    findings = merge_by_code((r.rank, f) for r in run.records for f in r.findings)
    findings += cross_rank_findings(run, timeout_s, own_findings=bool(findings))
    return DoctorReport(script, args, nproc, timeout_s, run, findings)


def cross_rank_findings(run: RunResult, timeout_s: float, *, own_findings: bool) -> list[Finding]:
    """What only the parent sees: time running out, ranks that vanished, ranks that
    took different paths."""
    records = run.records
    if run.timed_out:
        return merge_by_code(
            (r.rank, _timed_out(timeout_s, run.stuck_at.get(r.rank)))
            for r in records
            if r.status not in _DONE
        ) or [Finding(Code.SCRIPT_TIMED_OUT, f"torchrun was still running after {timeout_s:g} s")]
    if all(r.status is RankStatus.FINISHED for r in records):
        disagree = ranks_disagree(records)
        if disagree is not None:
            return [disagree]
        if run.exit_code not in (0, None):
            return [
                Finding(
                    Code.SCRIPT_FAILED,
                    "every rank finished the script, but torchrun exited with "
                    f"status {run.exit_code}",
                    ranks=tuple(r.rank for r in records),
                )
            ]
        return []
    if own_findings:
        return []  # ranks stopped because another failed: that failure is the finding
    stopped = [r.rank for r in records if r.status not in _DONE]
    status = f" (torchrun exited with status {run.exit_code})" if run.exit_code is not None else ""
    return (
        [
            Finding(
                Code.SCRIPT_FAILED,
                f"the process ended before the script finished{status}; it may have been killed "
                "(out of memory, a signal) or crashed outside Python",
                ranks=tuple(stopped),
            )
        ]
        if stopped
        else []
    )


def _timed_out(timeout_s: float, where: Location | None) -> Finding:
    return Finding(
        Code.SCRIPT_TIMED_OUT,
        f"still running after {timeout_s:g} s"
        + ("; it was waiting here" if where else "; its Python stack could not be read"),
        location=where,
    )


def ranks_disagree(records: list[RankRecord]) -> Finding | None:
    """CAPTURE_RANKS_DISAGREE when ranks captured DDP graphs different numbers of times, or
    ran different numbers of DDP gradient synchronisations: their collectives no longer
    pair up. Ranks that replayed different numbers of times but synchronised alike are
    not told apart: a step ran eagerly on one rank where another replayed (what
    `capture_step` does for a batch its graph cannot serve), and the eager all-reduce
    paired with the replayed one."""
    captures = {r.rank: r.ddp_graphs.captured for r in records}
    steps = {r.rank: r.collective_steps for r in records}
    if len(set(captures.values())) <= 1 and len(set(steps.values())) <= 1:
        return None
    counts = {r.rank: (captures[r.rank], r.ddp_graphs.replays, steps[r.rank]) for r in records}
    most_captures = max(captures.values())
    behind = [rank for rank, c in captures.items() if c < most_captures]
    if not behind:
        most_steps = max(steps.values())
        behind = [rank for rank, n in steps.items() if n < most_steps]
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank, triple in counts.items():
        groups.setdefault(triple, []).append(rank)
    told = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}: "
        f"{c} capture{'' if c == 1 else 's'}, {n} replay{'' if n == 1 else 's'}, "
        f"{k} gradient synchronisation{'' if k == 1 else 's'}"
        for (c, n, k), ranks in groups.items()
    )
    where = next(
        (r.ddp_graphs.capture_location for r in records if r.ddp_graphs.captured == most_captures),
        None,
    )
    return Finding(
        Code.CAPTURE_RANKS_DISAGREE,
        "the ranks captured DDP graphs or synchronised gradients a different number of times "
        f"({told}); a replay's all-reduce then pairs with another rank's eager one, "
        "or waits forever",
        subject="capture and replay",
        location=where,
        ranks=tuple(sorted(behind)),
    )


def _rank_json(r: RankRecord) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "status": r.status.value,
        "exit_code": r.exit_code,
        "captures": r.graphs.captured,
        "failed_captures": r.graphs.failed,
        "replays": r.graphs.replays,
        "ddp_captures": r.ddp_graphs.captured,
        "ddp_replays": r.ddp_graphs.replays,
        "collective_steps": r.collective_steps,
        "doctor_errors": r.doctor_errors,
    }


# ---------------------------------------------------------------------- terminal
def show_path(path: str) -> str:
    """A path relative to the current folder when it is under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _finding_panel(finding: Finding) -> Panel:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    if finding.ranks:
        grid.add_row("ranks", format_ranks(finding.ranks))
    if finding.location is not None:
        where = Text(
            f"{show_path(finding.location.filename)}:{finding.location.lineno}", style="cyan"
        )
        if finding.location.source:
            where.append(f"\n{finding.location.source}", style="dim")
        grid.add_row("where", where)
    what = f"{finding.subject}: {finding.happened}" if finding.subject else finding.happened
    grid.add_row("what", what)
    grid.add_row("fix", Text(finding.hint, style="green"))
    title = Text.assemble((finding.code.value, "bold red"), "  ", finding.title)
    return Panel(grid, title=title, title_align="left", border_style="red")


def _ranks_table(records: list[RankRecord]) -> Table:
    table = Table(title="ranks", title_justify="left", show_edge=False)
    for name in ("rank", "status", "exit", "captures", "failed", "replays"):
        table.add_column(name, justify="right" if name not in ("status",) else "left")
    for r in records:
        table.add_row(
            str(r.rank),
            r.status.value,
            "" if r.exit_code is None else str(r.exit_code),
            str(r.graphs.captured),
            str(r.graphs.failed),
            str(r.graphs.replays),
        )
    return table


def render(report: DoctorReport, console: Console) -> None:
    name = show_path(report.script)
    run = report.run
    head = (
        f"ddpgraph doctor: {name} on {report.nproc} rank{'s' if report.nproc != 1 else ''}, "
        f"{run.elapsed_s:.1f} s"
    )
    console.print(Text(head, style="bold"))
    if report.unchecked:
        console.print(Group(*(_finding_panel(f) for f in report.findings)))
        console.print(_ranks_table(run.records))
        console.print(Text("Nothing was checked because there is no GPU.", style="bold yellow"))
    elif report.findings:
        count = len(report.findings)
        console.print(Group(*(_finding_panel(f) for f in report.findings)))
        console.print(_ranks_table(run.records))
        console.print(Text(f"{count} finding{'s' if count > 1 else ''}.", style="bold red"))
    else:
        console.print(_ranks_table(run.records))
        captured = max((r.graphs.captured for r in run.records), default=0)
        note = "" if captured else " (the script captured no CUDA graph)"
        console.print(Text(f"No problems found{note}.", style="bold green"))
    errors = [e for r in run.records for e in r.doctor_errors]
    if errors:
        console.print(
            Text(
                f"The doctor's own bookkeeping failed {len(errors)} time(s); first:\n{errors[0]}",
                style="yellow",
            )
        )


def render_env(env: EnvReport, console: Console) -> None:
    versions = Table(title="versions", title_justify="left", show_edge=False, show_header=False)
    versions.add_column(style="bold")
    versions.add_column()
    for key, value in env.versions.items():
        versions.add_row(key, value or "-")
    console.print(versions)
    if env.gpus:
        gpus = Table(title="GPUs", title_justify="left", show_edge=False)
        for name in ("index", "name", "capability", "memory_gib"):
            gpus.add_column(name)
        for gpu in env.gpus:
            gpus.add_row(*(str(gpu[k]) for k in ("index", "name", "capability", "memory_gib")))
        console.print(gpus)
    if env.topology:
        console.print(Panel(Text(env.topology), title="nvidia-smi topo -m", title_align="left"))
    variables = Table(
        title="environment variables", title_justify="left", show_edge=False, show_header=False
    )
    variables.add_column(style="bold")
    variables.add_column()
    for key, value in env.variables.items():
        variables.add_row(key, value)
    if not env.variables:
        variables.add_row("(none set)", "")
    console.print(variables)
    features = Table(title="capture features", title_justify="left", show_edge=False)
    for name in ("feature", "here", "detail"):
        features.add_column(name)
    for feature in env.features:
        mark = Text("yes", style="green") if feature.available else Text("no", style="red")
        features.add_row(feature.name, mark, feature.detail)
    console.print(features)
    for finding in env.findings:
        console.print(_finding_panel(finding))
