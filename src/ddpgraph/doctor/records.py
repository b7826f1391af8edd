"""What each rank of a doctored script hands to the doctor: one JSON file per rank.

A worker writes its file when it starts, after every capture and when the script
ends (or is stopped), each time whole and by rename, so the doctor always reads a
complete file even from a rank that was killed.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..findings import CATALOG, Code, Finding, Location

DIR_VARIABLE = "DDPGRAPH_DOCTOR_DIR"


class RankStatus(str, enum.Enum):
    RUNNING = "running"  # the last file written while the script ran: it never finished
    FINISHED = "finished"
    FAILED = "failed"
    TERMINATED = "terminated"  # stopped by a signal (torchrun stopping the job)
    MISSING = "missing"  # no file: the process never started the script


@dataclass
class GraphCounts:
    """Captures and replays of the graphs that contain a DDP forward (they run collectives)."""

    captured: int = 0
    failed: int = 0
    replays: int = 0
    capture_location: Location | None = None


@dataclass
class RankRecord:
    rank: int
    world_size: int
    pid: int = 0
    status: RankStatus = RankStatus.RUNNING
    exit_code: int | None = None
    findings: list[Finding] = field(default_factory=list)
    # All graphs, and the DDP graphs that must agree between ranks.
    graphs: GraphCounts = field(default_factory=GraphCounts)
    ddp_graphs: GraphCounts = field(default_factory=GraphCounts)
    # DDP gradient synchronisations run, eagerly or replayed (see `Recorder`).
    collective_steps: int = 0
    # Failures of the doctor's own bookkeeping (never of the script).
    doctor_errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "status": self.status.value,
            "exit_code": self.exit_code,
            "findings": [finding_to_json(f) for f in self.findings],
            "graphs": _counts_to_json(self.graphs),
            "ddp_graphs": _counts_to_json(self.ddp_graphs),
            "collective_steps": self.collective_steps,
            "doctor_errors": list(self.doctor_errors),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankRecord:
        return cls(
            rank=int(data["rank"]),
            world_size=int(data["world_size"]),
            pid=int(data.get("pid", 0)),
            status=RankStatus(data["status"]),
            exit_code=data.get("exit_code"),
            findings=[finding_from_json(f) for f in data.get("findings", [])],
            graphs=_counts_from_json(data.get("graphs", {})),
            ddp_graphs=_counts_from_json(data.get("ddp_graphs", {})),
            collective_steps=int(data.get("collective_steps", 0)),
            doctor_errors=[str(e) for e in data.get("doctor_errors", [])],
        )


def location_to_json(location: Location | None) -> dict[str, Any] | None:
    if location is None:
        return None
    return {"file": location.filename, "line": location.lineno, "source": location.source}


def location_from_json(data: dict[str, Any] | None) -> Location | None:
    if data is None:
        return None
    return Location(str(data["file"]), int(data["line"]), str(data.get("source", "")))


def finding_to_json(finding: Finding) -> dict[str, Any]:
    return {
        "code": finding.code.value,
        "title": CATALOG[finding.code].title,
        "subject": finding.subject,
        "happened": finding.happened,
        "fix": finding.hint,
        "location": location_to_json(finding.location),
        "ranks": list(finding.ranks),
    }


def finding_from_json(data: dict[str, Any]) -> Finding:
    code = Code(data["code"])
    fix = str(data.get("fix", ""))
    return Finding(
        code,
        str(data["happened"]),
        "" if fix == CATALOG[code].fix else fix,
        str(data.get("subject", "")),
        location_from_json(data.get("location")),
        tuple(int(r) for r in data.get("ranks", [])),
    )


def _counts_to_json(counts: GraphCounts) -> dict[str, Any]:
    return {
        "captured": counts.captured,
        "failed": counts.failed,
        "replays": counts.replays,
        "capture_location": location_to_json(counts.capture_location),
    }


def _counts_from_json(data: dict[str, Any]) -> GraphCounts:
    return GraphCounts(
        int(data.get("captured", 0)),
        int(data.get("failed", 0)),
        int(data.get("replays", 0)),
        location_from_json(data.get("capture_location")),
    )


def record_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


def stack_dump_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.stacks"


def write_record(directory: str | Path, record: RankRecord) -> None:
    path = record_path(directory, record.rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=1))
    os.replace(tmp, path)


def read_records(directory: str | Path, world_size: int) -> list[RankRecord]:
    """One record per rank; a rank with no file gets a MISSING record."""
    records = []
    for rank in range(world_size):
        path = record_path(directory, rank)
        try:
            records.append(RankRecord.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError):
            records.append(RankRecord(rank, world_size, status=RankStatus.MISSING))
    return records
