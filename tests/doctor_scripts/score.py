"""Precision and recall of `ddpgraph doctor` over every script here.

    python tests/doctor_scripts/score.py                 # every script, 2 ranks
    python tests/doctor_scripts/score.py --nproc 1 --jobs 4 --out score.json
    python tests/doctor_scripts/score.py cpu_fail.py portable_graph.py

Runs the doctor on each script and compares its findings with what the script's comments
expect (`expect.expectations`: on this machine, with a GPU or without). A finding is
right when its code, line and ranks match an expectation, wrong otherwise; an
expectation no right finding covers on every rank it names is a missed cause. Prints
one row per script and the totals; exits 0 when no finding was wrong and none missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from doctor_scripts.expect import (
    Expected,
    all_scripts,
    doctor_timeout,
    expectations,
    ranks_needed,
    run_doctor,
)


@dataclass
class Score:
    script: str
    expected: list[str]
    found: list[str]
    right: int = 0
    wrong: int = 0
    missed: int = 0
    exit_code: int | None = None
    notes: list[str] = field(default_factory=list)


def _matches(e: Expected, code: str, rank: int, line: int | None) -> bool:
    return e.code == code and e.rank in (None, rank) and e.line in (None, line)


def _line_in(name: str, location: dict[str, Any] | None) -> int | None:
    """The finding's line if it is in script `name` itself (a mark's line is there)."""
    if location is None or not str(location.get("file", name)).endswith(name):
        return None
    return int(location["line"])


def score_report(name: str, report: dict[str, Any], expected: list[Expected], world: int) -> Score:
    findings = [
        (f["code"], list(f["ranks"]), _line_in(name, f["location"])) for f in report["findings"]
    ]
    result = Score(
        name,
        [
            f"{e.code}@{e.line or '*'}" + (f" rank {e.rank}" if e.rank is not None else "")
            for e in expected
        ],
        [f"{c}@{line} ranks {ranks}" for c, ranks, line in findings],
        exit_code=report["exit_code"],
    )
    covered: dict[int, set[int]] = {i: set() for i in range(len(expected))}
    for code, ranks, line in findings:
        matched = [
            [i for i, e in enumerate(expected) if _matches(e, code, r, line)] for r in ranks or [0]
        ]
        if all(matched):
            result.right += 1
            for r, hits in zip(ranks or [0], matched, strict=True):
                for i in hits:
                    covered[i].add(r)
        else:
            result.wrong += 1
    for i, e in enumerate(expected):
        needed = {e.rank} if e.rank is not None else set(range(world))
        if not needed <= covered[i]:
            result.missed += 1
    return result


def score_script(name: str, nproc: int, gpu: bool) -> Score:
    expected = expectations(name, gpu=gpu)
    _, report, output = run_doctor(name, nproc=nproc, timeout=doctor_timeout(name))
    score = score_report(name, report, expected, nproc)
    if score.wrong or score.missed:
        score.notes = [f["happened"][:300] for f in report["findings"]] or [output[-600:]]
    print(f"{name}: right {score.right} wrong {score.wrong} missed {score.missed}", file=sys.stderr)
    return score


def run(names: list[str], nproc: int, jobs: int = 1) -> list[Score]:
    """Score `names` with `nproc` ranks each, `jobs` scripts at a time (each is its own
    torchrun job with its own ports)."""
    gpu = torch.cuda.is_available()
    runnable = []
    for name in names:
        if ranks_needed(name) > nproc:
            print(f"{name}: skipped (needs {ranks_needed(name)} ranks)", file=sys.stderr)
        else:
            runnable.append(name)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda name: score_script(name, nproc, gpu), runnable))


def totals(scores: list[Score]) -> dict[str, float]:
    right = sum(s.right for s in scores)
    wrong = sum(s.wrong for s in scores)
    missed = sum(s.missed for s in scores)
    return {
        "scripts": len(scores),
        "right": right,
        "wrong": wrong,
        "missed": missed,
        "precision": right / (right + wrong) if right + wrong else 1.0,
        "recall": right / (right + missed) if right + missed else 1.0,
    }


def table(scores: list[Score], machine: str) -> str:
    lines = [
        f"Doctor scripts on {machine}:",
        "",
        "| script | expected | found | right | wrong | missed |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for s in scores:
        lines.append(
            f"| {s.script} | {', '.join(s.expected) or 'nothing'} | "
            f"{', '.join(s.found) or 'nothing'} | {s.right} | {s.wrong} | {s.missed} |"
        )
    t = totals(scores)
    lines += [
        "",
        f"{t['scripts']} scripts: {t['right']} right, {t['wrong']} wrong, {t['missed']} missed; "
        f"precision {t['precision']:.3f}, recall {t['recall']:.3f}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scripts", nargs="*", help="script names here (default: all)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the scores as JSON here")
    parser.add_argument("--jobs", type=int, default=1, help="scripts run at a time (default 1)")
    args = parser.parse_args(argv)
    scores = run(args.scripts or all_scripts(), args.nproc, args.jobs)
    gpu = torch.cuda.is_available()
    machine = f"{args.nproc} rank(s), " + (
        torch.cuda.get_device_name(0) if gpu else "no GPU (CPU only)"
    )
    print(table(scores, machine))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "totals": totals(scores),
                    "scripts": [asdict(s) for s in scores],
                },
                indent=1,
            )
        )
    t = totals(scores)
    return 0 if t["wrong"] == 0 and t["missed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
