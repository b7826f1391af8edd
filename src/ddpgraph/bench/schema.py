"""The benchmark's results as data, and their JSON form (a versioned schema).

    {
      "schema": "ddpgraph.bench", "schema_version": 3,
      "setup": {world_size, backend, device, torch, cuda, nccl, python, ddpgraph,
                command, date, settings: {...}},
      "strategies": [{name, summary, available, cpu_skip, missing}],
      "results": [{model, batch_size, strategy, status, reason, feeds: {device: {...},
                   dataloader: {...}}, kernel_ms_per_step, gpu_timeline, capture_s, captured,
                   peak_memory_mib, final_loss, note, wall_s}],
      "summary": [{model, batch_size, ...whole (capture_step) against the others}],
      "markdown": "the tables as Markdown"
    }

`status` is "ok", "failed" (with the error in `reason`) or "skipped" (with why). A
feed's `speedup` is over `eager` with the same feed; `gpu_busy` is the fraction of the
step during which any kernel, copy or memset runs (1.0 is 100%; in version 1 it was summed
kernel time over step time, which counts overlapping streams twice). `gpu_timeline`
(rank 0, from the profiled steps) says where a step's time goes: `active_ms_per_step` with
any kernel, copy or memset running, `idle_ms_per_step` with none, and the idle gaps
(`gaps_per_step`, `median_gap_us`, `p90_gap_us`, `max_gap_us`, `short_gaps_ms_per_step`:
the idle time in gaps of at most `short_gap_us`).
A result's `varlen` (the variable-length case, `--seq-lens`) holds its `role` (variable,
bucketed, fixed, pool_reference), `family`, `lengths`, `buckets`, and for capture_step rows
`graphs_held`, `captures`, `replays`, `eager_steps`, `eager_after_warmup`, `pool_mib`;
setup.settings.variable_lengths then describes the case (None otherwise).
A feed's `eager_calls` counts its timed calls that a strategy which captures (`whole`,
`compile`, `partial`) ran eagerly instead of replaying (None for the others).
A feed's `throughput` is `units_per_step` (world size × batch size × tokens per sequence,
or images) per second, in the result's `throughput_unit`.
Times are milliseconds, except `capture_s` and `wall_s` (seconds) and the gaps (µs).
Fields are only ever added within a schema version. A file of another version is refused
(`DdpGraphUsageError`), naming the version found and the one expected: the strategy names
are `make_step`'s (`strategies/names.py`) since version 3, and an earlier file's `compile`
meant plain torch.compile, so a row of another version is never read as a row of this one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import usage_error

SCHEMA = "ddpgraph.bench"
SCHEMA_VERSION = 3
STATUSES = ("ok", "failed", "skipped")
FEED_TITLES = {"device": "device feed", "dataloader": "DataLoader feed"}

SETUP_KEYS = (
    "world_size",
    "backend",
    "device",
    "torch",
    "cuda",
    "nccl",
    "python",
    "ddpgraph",
    "command",
    "date",
    "settings",
)


@dataclass
class FeedResult:
    ms_per_step: float
    spread_ms: float
    window_ms: list[float] = field(default_factory=list)
    speedup: float | None = None
    gpu_busy: float | None = None
    throughput: float | None = None  # `throughput_unit`s per second, all ranks together
    # Timed calls a strategy that captures ran eagerly (None: it does not capture).
    eager_calls: int | None = None


@dataclass
class StrategyResult:
    model: str
    batch_size: int
    strategy: str
    status: str = "ok"
    reason: str | None = None
    feeds: dict[str, FeedResult] = field(default_factory=dict)
    kernel_ms_per_step: float | None = None
    gpu_timeline: dict[str, Any] | None = None
    capture_s: float | None = None
    captured: bool | None = None
    peak_memory_mib: float | None = None
    final_loss: float | None = None
    note: str | None = None
    wall_s: float | None = None
    throughput_unit: str | None = None  # "tokens", "images", "samples"
    units_per_step: int | None = None  # all ranks together
    # A row of the variable-length case (`--seq-lens`): its role, lengths, buckets and
    # graph counts (`varlen_rows`); None in the fixed-shape bench.
    varlen: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StrategyResult:
        fields = dict(data)
        fields["feeds"] = {k: FeedResult(**v) for k, v in data.get("feeds", {}).items()}
        return cls(**fields)


@dataclass
class Report:
    setup: dict[str, Any]
    strategies: list[dict[str, Any]]
    results: list[StrategyResult]

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(r.model for r in self.results))

    @property
    def emulated(self) -> bool:
        """A run without CUDA: its captured rows were recorded and replayed on CPU by the
        recording backend, whose times are CPU times, not a GPU speed-up."""
        return self.setup.get("cuda") is None

    def case(self, model: str, batch_size: int) -> dict[str, StrategyResult]:
        return {
            r.strategy: r for r in self.results if r.model == model and r.batch_size == batch_size
        }

    def batch_sizes(self, model: str) -> list[int]:
        return sorted({r.batch_size for r in self.results if r.model == model})

    def to_dict(self, *, summary: list[dict[str, Any]], markdown: str) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "setup": self.setup,
            "strategies": self.strategies,
            "results": [asdict(r) for r in self.results],
            "summary": summary,
            "markdown": markdown,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The report a JSON document holds. A file of another schema version raises
        `DdpGraphUsageError` (a `ValueError`) naming both versions; anything else wrong
        with it, `ValueError`."""
        if (
            isinstance(data, dict)
            and data.get("schema") == SCHEMA
            and data.get("schema_version") != SCHEMA_VERSION
        ):
            raise usage_error(
                "`Report.from_dict`",
                f"a ddpgraph bench result of schema_version {data.get('schema_version')!r}, "
                f"expected {SCHEMA_VERSION} (the version whose strategy names are make_step's)",
                "run `ddpgraph bench` again to write the results in this version",
            )
        problems = validate(data)
        if problems:
            raise ValueError("not a ddpgraph bench result: " + "; ".join(problems))
        results = [StrategyResult.from_dict(r) for r in data["results"]]
        return cls(dict(data["setup"]), list(data["strategies"]), results)


_NUMBER = (int, float)
_FEED_FIELDS: dict[str, tuple[type, ...]] = {
    "ms_per_step": _NUMBER,
    "spread_ms": _NUMBER,
    "window_ms": (list,),
    "speedup": (*_NUMBER, type(None)),
    "gpu_busy": (*_NUMBER, type(None)),
    "throughput": (*_NUMBER, type(None)),
}
_RESULT_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "batch_size": (int,),
    "strategy": (str,),
    "status": (str,),
    "reason": (str, type(None)),
    "feeds": (dict,),
    "kernel_ms_per_step": (*_NUMBER, type(None)),
    "gpu_timeline": (dict, type(None)),
    "capture_s": (*_NUMBER, type(None)),
    "captured": (bool, type(None)),
    "peak_memory_mib": (*_NUMBER, type(None)),
    "final_loss": (*_NUMBER, type(None)),
    "note": (str, type(None)),
    "wall_s": (*_NUMBER, type(None)),
    "throughput_unit": (str, type(None)),
    "units_per_step": (int, type(None)),
    "varlen": (dict, type(None)),
}


def validate(data: Any) -> list[str]:
    """What is wrong with `data` as a ddpgraph bench result (empty when nothing)."""
    if not isinstance(data, dict):
        return [f"expected a JSON object, got {type(data).__name__}"]
    problems: list[str] = []
    if data.get("schema") != SCHEMA:
        problems.append(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    if data.get("schema_version") != SCHEMA_VERSION:
        problems.append(
            f"schema_version is {data.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    setup = data.get("setup")
    if not isinstance(setup, dict):
        problems.append("setup is missing")
    else:
        problems += [f"setup.{k} is missing" for k in SETUP_KEYS if k not in setup]
    for key, kind in (
        ("strategies", list),
        ("results", list),
        ("summary", list),
        ("markdown", str),
    ):
        if not isinstance(data.get(key), kind):
            problems.append(f"{key} is missing or not a {kind.__name__}")
    for i, result in enumerate(data.get("results") or []):
        problems += _check_result(i, result)
    return problems


def _check_result(i: int, result: Any) -> list[str]:
    where = f"results[{i}]"
    if not isinstance(result, dict):
        return [f"{where} is not an object"]
    problems = _check_fields(where, result, _RESULT_FIELDS)
    if result.get("status") not in STATUSES:
        problems.append(f"{where}.status is {result.get('status')!r}, expected one of {STATUSES}")
    if result.get("status") != "ok" and not result.get("reason"):
        problems.append(f"{where} is {result.get('status')} without a reason")
    for feed, values in (result.get("feeds") or {}).items():
        if not isinstance(values, dict):
            problems.append(f"{where}.feeds.{feed} is not an object")
            continue
        problems += _check_fields(f"{where}.feeds.{feed}", values, _FEED_FIELDS)
    return problems


# Fields added after the first files of this version's layout were written (the GPU
# timeline, the throughput, the variable-length case): the published results lack some.
_ADDED_FIELDS = frozenset(
    {"gpu_timeline", "throughput", "throughput_unit", "units_per_step", "varlen"}
)


def _check_fields(where: str, obj: dict[str, Any], spec: dict[str, tuple[type, ...]]) -> list[str]:
    problems = []
    for key, kinds in spec.items():
        if key not in obj and key in _ADDED_FIELDS:
            continue
        if key not in obj:
            problems.append(f"{where}.{key} is missing")
        elif isinstance(obj[key], bool) and bool not in kinds:
            problems.append(f"{where}.{key} is a bool")
        elif not isinstance(obj[key], kinds):
            problems.append(f"{where}.{key} has type {type(obj[key]).__name__}")
    return problems
