"""Each bench row's DataLoader feed against its device feed, from `ddpgraph bench --json`.

    python3 scripts/feed_ratio.py bench.json [more.json ...] [--target 1.05]

Prints one Markdown row per model and strategy: ms/step with batches already on the GPU,
ms/step fed by the bench's pinned, 4-worker DataLoader, their ratio, the timed calls a
captured strategy ran eagerly on each feed, and whether the ratio is within the target.
Exits 1 when a row that ran both feeds is over the target, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from ddpgraph.bench.schema import FeedResult, Report


def _eager(feed: FeedResult | None) -> str:
    return "-" if feed is None or feed.eager_calls is None else str(feed.eager_calls)


def rows(report: Report, target: float) -> tuple[list[str], int]:
    """The table's rows, and how many rows are over `target`."""
    lines, over = [], 0
    for r in report.results:
        device, loader = r.feeds.get("device"), r.feeds.get("dataloader")
        if r.status != "ok" or device is None or loader is None:
            lines.append(
                f"| {r.model} | {r.strategy} | {r.status} | | | | {(r.reason or '')[:80]} |"
            )
            continue
        ratio = loader.ms_per_step / device.ms_per_step
        ok = ratio <= target
        over += not ok
        lines.append(
            f"| {r.model} | {r.strategy} | {device.ms_per_step:.2f} | {loader.ms_per_step:.2f} | "
            f"{ratio:.3f} | {_eager(device)} / {_eager(loader)} | {'yes' if ok else '**no**'} |"
        )
    return lines, over


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--target", type=float, default=1.05, help="largest DataLoader/device ratio that passes"
    )
    args = parser.parse_args(argv)
    print(
        "| model | strategy | device ms/step | DataLoader ms/step | ratio | eager calls "
        f"(device / DataLoader) | within {args.target:g}x |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    over = 0
    for path in args.files:
        lines, n = rows(Report.from_dict(json.loads(path.read_text())), args.target)
        print("\n".join(lines))
        over += n
    print(f"\n{over} row(s) over {args.target:g}x.")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
