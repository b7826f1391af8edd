"""Summarise a GPU run directory (env.txt, junit.xml, demo.json, bench.json) as Markdown.

    python3 scripts/gpu_summary.py OUT_DIR > summary.md
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path


def tests_section(path: Path) -> list[str]:
    if not path.exists():
        return ["GPU tests: not run."]
    root = ET.parse(path).getroot()
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
    return lines


def demo_section(path: Path) -> list[str]:
    if not path.exists():
        return ["Demo: not run."]
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
        return ["Benchmark: not run."]
    d = json.loads(path.read_text())
    table = d.get("markdown")
    return ["Benchmark:", "", table] if table else ["Benchmark: see bench.json."]


def main() -> None:
    out = Path(sys.argv[1])
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else ""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"# GPU run, {now}",
        "",
        "```",
        env.strip(),
        "```",
        "",
        *tests_section(out / "junit.xml"),
        "",
        *demo_section(out / "demo.json"),
        "",
        *bench_section(out / "bench.json"),
    ]
    print("\n".join(parts))


if __name__ == "__main__":
    main()
