"""Summarise one stage of a GPU run (scripts/gpu_suite.sh) as Markdown, finished or not.

    python3 scripts/gpu_summary.py --stage tests-core --debug DEBUG_DIR --out OUT_DIR \
        --rc 0 --seconds 312 --limit 540 > OUT_DIR/tests-core.md

Reads DEBUG_DIR/env.txt, DEBUG_DIR/<stage>.xml (a test stage's junit report),
DEBUG_DIR/demo.json and OUT_DIR/bench.json. A stage stopped by its time limit (exit
status 124 or 137) is said to be so; whatever it left is summarised: the tests that
finished (pytest writes its report when interrupted), the strategies the benchmark
finished (it rewrites its JSON after each one). A missing file is said to be missing.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

TIMED_OUT = (124, 137)


def tests_section(path: Path) -> list[str]:
    if not path.exists():
        return ["GPU tests: no junit report (pytest was stopped before it could write one)."]
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        return [f"GPU tests: the junit report is unreadable ({err})."]
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        f"GPU tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped (of {counts['tests']}), {float(suite.get('time', 0)):.0f} s.",
        "",
        "| test | result |",
        "| --- | --- |",
    ]
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            result = "FAIL"
        elif case.find("skipped") is not None:
            result = "skipped"
        else:
            result = "pass"
        lines.append(f"| {name} | {result} |")
    for case in suite.iter("testcase"):
        for prop in case.iter("property"):
            lines += ["", f"{case.get('name')}, {prop.get('name')}:", "", prop.get("value", "")]
    return lines


def demo_section(path: Path) -> list[str]:
    if not path.exists():
        return ["Demo: no results (it writes them when it finishes)."]
    d = json.loads(path.read_text())
    base = d["runs"][0]["ms_per_step"]
    lines = [
        f"Demo (TinyGPT, {d['world_size']} × {d['device']}):",
        "",
        "| run | ms/step | speedup vs eager | final loss |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in d["runs"]:
        lines.append(
            f"| {r['name']} | {r['ms_per_step']:.2f} ± {r['spread_ms'] / 2:.2f} | "
            f"{base / r['ms_per_step']:.2f}× | {r['losses'][-1]:.4f} |"
        )
    lines += [
        "",
        f"capture_step vs eager with the same graph-safe AdamW: max |Δloss| = "
        f"{d['max_abs_loss_diff_captured_vs_graph_safe_eager']:.2e}, relative parameter "
        f"difference {d['param_rel_diff_captured_vs_graph_safe_eager']:.2e}.",
    ]
    if d.get("reason"):
        lines += ["", f"Not captured: {d['reason']}"]
    return lines


def bench_section(path: Path) -> list[str]:
    if not path.exists():
        return ["Benchmark: no results (it writes them after its first strategy)."]
    d = json.loads(path.read_text())
    table = d.get("markdown")
    return ["Benchmark:", "", table] if table else ["Benchmark: see bench.json."]


def status_line(stage: str, rc: int, seconds: int, limit: int) -> str:
    if rc in TIMED_OUT:
        return (
            f"**{stage}: stopped by its time limit** after {seconds} s (limit {limit} s); "
            "below is what had finished."
        )
    return f"{stage}: finished in {seconds} s (limit {limit} s), exit status {rc}."


def stage_sections(stage: str, debug: Path, out: Path) -> list[str]:
    if stage == "demo":
        return demo_section(debug / "demo.json")
    if stage == "bench":
        return bench_section(out / "bench.json")
    return tests_section(debug / f"{stage}.xml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", required=True)
    parser.add_argument("--debug", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rc", type=int, required=True)
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--limit", type=int, required=True)
    args = parser.parse_args()
    env_file = args.debug / "env.txt"
    env = env_file.read_text() if env_file.exists() else "(no env.txt)"
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"# GPU run, {args.stage}, {now}",
        "",
        "```",
        env.strip(),
        "```",
        "",
        status_line(args.stage, args.rc, args.seconds, args.limit),
        "",
        *stage_sections(args.stage, args.debug, args.out),
    ]
    print("\n".join(parts))


if __name__ == "__main__":
    main()
