"""The data pipelines training scripts have, feeding captured steps on the GPU.

Each scenario is one case of the feed matrix and is launched in a fresh process by
tests/gpu/test_feeds_gpu.py (the pin-memory thread's first CUDA calls happen in a fresh
process, and a crashed case must not take the next with it). In each, several fresh
captures train from the same initial weights on the same batches as the eager loop with
the same graph-safe optimizer (`harness.with_same_settings`), and must equal it:

* `loader_*`: `DataLoader(pin_memory=..., num_workers=0/2/4, persistent_workers,
  prefetch_factor)` passing its CPU batches to the step as they come: `capture_step`
  twice, with `capture_eval` over a validation loader of the same kind after each epoch,
  `strategy="partial"`, and with 4 pinned workers `compile=True` twice;
* `non_blocking`: the loop copies each pinned batch with `.to(device, non_blocking=True)`;
* `prefetcher`: timm's pattern: the next batch copied and normalised on a CUDA stream of
  its own, handed over with `wait_stream` and `record_stream`;
* `poller`: a thread of the user's polls `torch.cuda.memory_allocated()` and records and
  queries CUDA events on its own stream all through training;
* `own_sync_in_capture`: the step reads the loss on the host only while it is recorded:
  still refused in "thread_local" mode, and named;
* `buckets`: a small GPT on variable lengths padded by `ddpgraph.bucket_collate` in the
  loader's workers, `capture_step(max_graphs=4)`, a graph per bucket;
* `stress_20` / `stress_5`: 20 (5) fresh `capture_step`s in one process on the pinned
  4-worker loader, each of which must capture and replay;
* `model_sweep`: three torchvision ResNet-18s trained one after another in one process
  (eager, then captured twice), each epoch from the DataLoader's default workers (forked
  anew per epoch, pinned), which collect their garbage as they start: the runs before
  leave their models unreachable in reference cycles, and a worker that freed one of
  their CUDA tensors would abort.

Without CUDA the whole-step cases run with the CPU recording backend (compile and
partial skip), which checks the script's own logic.
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import harness
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import ddpgraph
from ddpgraph.app.models import MLP, GPTConfig, TinyGPT
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.backends.graph import GraphBackend
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.strategies import make_step

BATCH, TRAIN_BATCHES, VAL_BATCHES, EPOCHS, DIM = 64, 16, 4, 2, 64
WARMUP = 11
Batch = Any
Feed = Callable[[int], Iterator[Batch]]  # epoch -> its batches, as the step takes them


@dataclass(frozen=True)
class Loading:
    pin_memory: bool = True
    workers: int = 4
    persistent: bool = True
    prefetch: int | None = 2


PINNED_4 = Loading()


def _data(samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, DIM, generator=gen)
    return TensorDataset(x, x[:, :10].argmax(1))


def _loader(
    info: DistInfo, data: Dataset[Any], how: Loading, **kw: Any
) -> tuple[DataLoader[Any], DistributedSampler[Any]]:
    sampler = DistributedSampler(
        data, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=1
    )
    extra = (
        {"persistent_workers": how.persistent, "prefetch_factor": how.prefetch}
        if how.workers
        else {}
    )
    loader = DataLoader(
        data,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=how.workers,
        pin_memory=how.pin_memory and info.device.type == "cuda",
        drop_last=True,
        **extra,
        **kw,
    )
    return loader, sampler


def loader_feed(info: DistInfo, how: Loading, seed: int = 7, batches: int = TRAIN_BATCHES) -> Feed:
    """The loader's own batches, CPU tensors (pinned or not), one epoch per call."""
    loader, sampler = _loader(info, _data(BATCH * batches * info.world_size, seed), how)

    def epoch(e: int) -> Iterator[Batch]:
        sampler.set_epoch(e)
        return iter(loader)

    return epoch


def non_blocking_feed(info: DistInfo) -> Feed:
    inner = loader_feed(info, PINNED_4)

    def epoch(e: int) -> Iterator[Batch]:
        for x, y in inner(e):
            yield x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)

    return epoch


def prefetcher_feed(info: DistInfo) -> Feed:
    """timm's prefetching loader, in short: batch n+1 is copied and normalised on a side
    stream while step n runs; the training stream waits for it, and the tensors are
    marked as used there so that their memory is not reused too early."""
    inner = loader_feed(info, PINNED_4)
    mean, std = torch.tensor(0.1, device=info.device), torch.tensor(1.5, device=info.device)
    on_cuda = info.device.type == "cuda"

    def epoch(e: int) -> Iterator[Batch]:
        stream = torch.cuda.Stream() if on_cuda else None
        pending = None
        for x, y in inner(e):
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                nx = (x.to(info.device, non_blocking=True).float() - mean) / std
                ny = y.to(info.device, non_blocking=True)
            if pending is not None:
                yield pending
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
                nx.record_stream(torch.cuda.current_stream())
                ny.record_stream(torch.cuda.current_stream())
            pending = (nx, ny)
        if pending is not None:
            yield pending

    return epoch


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Poller:
    """A user's monitoring thread: memory statistics and CUDA events on its own stream,
    every millisecond, for as long as it runs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.polls = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-poller", daemon=True)

    def _run(self) -> None:
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        while not self._stop.is_set():
            try:
                if cuda:
                    torch.cuda.memory_allocated(self.device)
                    event = torch.cuda.Event()
                    event.record(stream)
                    event.query()
                self.polls += 1
            except Exception as exc:  # reported: a poll that fails is a failed case
                self.errors.append(repr(exc)[:300])
            time.sleep(0.001)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# ------------------------------------------------------------------ runs
def _backend() -> GraphBackend | None:
    return None if torch.cuda.is_available() else ddpgraph.RecordingBackend()


def _mlp(info: DistInfo) -> nn.Module:
    torch.manual_seed(0)
    return MLP(dim=DIM, hidden=128, depth=2).to(info.device)


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    # The CPU recording backend needs the fused kernel, as a CUDA graph needs a capturable one.
    fused = {} if torch.cuda.is_available() else {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **fused)


def _step_fn(
    ddp: nn.Module, opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """zero_grad, forward in fp32, cross-entropy, backward, optimizer step."""
    return make_train_step(ddp, opt, F.cross_entropy, StepOptions(amp_dtype=None, clip_norm=None))


def _summary(step: Any) -> dict[str, Any]:
    reason = step.reason
    eager = getattr(step, "eager_reason", None)
    return {
        "state": step.state.value,
        "code": reason.code.value if reason is not None else None,
        "reason": reason.format() if reason is not None else None,
        "eager_reason": eager.format() if eager is not None else None,
        "stats": dict(vars(step.stats)),
    }


def _run(
    info: DistInfo,
    feed: Feed,
    strategy: str | None,
    val: Feed | None = None,
    graph_safe: bool = True,
) -> dict[str, Any]:
    """Train EPOCHS epochs from `feed`: `strategy` None is the eager reference (DDP as
    written, the optimizer graph-safe as `capture_step` runs it unless `graph_safe` is
    False); with `val`, the validation batches' predictions after each epoch."""
    model = _mlp(info)
    ddp = (
        DDP(model, **_ids(info)) if strategy is None else ddpgraph.prepare_ddp(model, **_ids(info))
    )
    opt = _opt(ddp)
    fn = _step_fn(ddp, opt)
    evaluate: Any = None
    if strategy is None:
        step: Any = (
            harness.with_same_settings(opt, fn, info.device)
            if graph_safe
            else harness.on_device(fn, info.device)
        )

        def evaluate(x: torch.Tensor) -> torch.Tensor:
            ddp.eval()
            with torch.no_grad():
                out = ddp(x.to(info.device)).softmax(-1)
            ddp.train()
            return out
    else:
        step = make_step(fn, model=ddp, optimizer=opt, strategy=strategy, backend=_backend())  # type: ignore[arg-type]
        if val is not None:
            evaluate = ddpgraph.capture_eval(
                lambda x: ddp(x).softmax(-1), model=ddp, training_step=step, backend=_backend()
            )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    losses: list[float] = []
    preds: list[torch.Tensor] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for e in range(EPOCHS):
            for x, y in feed(e):
                losses.append(float(step(x, y)))
                sched.step()
            if val is not None and evaluate is not None:
                preds += [evaluate(x).clone() for x, _ in val(e)]
    out: dict[str, Any] = {"losses": losses, "params": harness.params_of(ddp), "preds": preds}
    if strategy is not None:
        out["summary"] = _summary(step)
        out["warnings"] = [
            str(w.message)[:300] for w in caught if issubclass(w.category, ddpgraph.DdpGraphWarning)
        ]
        if evaluate is not None:
            out["eval"] = _summary(evaluate)
            evaluate.close()
        step.close()
    return out


def _ids(info: DistInfo) -> dict[str, Any]:
    return {"device_ids": [info.device.index]} if info.device.type == "cuda" else {}


def _against(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    return {
        **got["summary"],
        "eval": got.get("eval"),
        "warnings": got["warnings"],
        "calls": len(got["losses"]),
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
        "pred_rel_diff": harness.rel_diff(ref["preds"], got["preds"]) if got["preds"] else None,
        "bitwise": ref["losses"] == got["losses"]
        and harness.rel_diff(ref["params"], got["params"]) == 0.0,
    }


def _matrix(
    info: DistInfo,
    feed: Feed,
    *,
    val: Feed | None = None,
    compile_runs: int = 0,
    partial: bool = True,
) -> dict[str, Any]:
    """Every strategy that applies, each from fresh weights, against the eager loop."""
    ref = _run(info, feed, None, val)
    runs: dict[str, Any] = {}
    for i in range(2):
        runs[f"whole_{i}"] = _against(ref, _run(info, feed, "whole", val))
    on_cuda = info.device.type == "cuda"
    if partial and on_cuda:
        runs["partial"] = _against(
            _run(info, feed, None, graph_safe=False), _run(info, feed, "partial")
        )
    for i in range(compile_runs if on_cuda else 0):
        runs[f"compile_{i}"] = _against(ref, _run(info, feed, "compile"))
        torch._dynamo.reset()
    return {"runs": runs}


def _loader_case(how: Loading, compile_runs: int = 0) -> Callable[[DistInfo], dict[str, Any]]:
    def case(info: DistInfo) -> dict[str, Any]:
        return _matrix(
            info,
            loader_feed(info, how),
            val=loader_feed(info, how, seed=8, batches=VAL_BATCHES),
            compile_runs=compile_runs,
        )

    return case


def non_blocking(info: DistInfo) -> dict[str, Any]:
    return _matrix(info, non_blocking_feed(info))


def prefetcher(info: DistInfo) -> dict[str, Any]:
    return _matrix(info, prefetcher_feed(info))


def poller(info: DistInfo) -> dict[str, Any]:
    with Poller(info.device) as thread:
        result = _matrix(
            info,
            loader_feed(info, PINNED_4),
            val=loader_feed(info, PINNED_4, seed=8, batches=VAL_BATCHES),
        )
    return {**result, "polls": thread.polls, "poll_errors": thread.errors}


def own_sync_in_capture(info: DistInfo) -> dict[str, Any]:
    """The capturing thread's own host read, made only while the step is recorded (as a
    library that tests for a capture does), with the pinned 4-worker loader feeding: the
    thread_local mode still refuses it, and it is named with its line; every call then
    runs eagerly, equal to the eager loop."""
    backend = _backend()

    def recording() -> bool:
        return (
            backend.capturing if backend is not None else torch.cuda.is_current_stream_capturing()
        )

    model = _mlp(info)
    ddp = ddpgraph.prepare_ddp(model, **_ids(info))
    opt = _opt(ddp)
    plain = _step_fn(ddp, opt)
    seen: list[float] = []

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = plain(x, y)
        if recording():
            seen.append(float(loss))  # the host read
        return loss

    line = inspect.getsourcelines(train_step)[1] + 3
    feed = loader_feed(info, PINNED_4)
    ref = _run(info, feed, None)
    step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt, backend=backend)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))  # as `_run`'s
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in range(EPOCHS):
            for x, y in feed(e):
                losses.append(float(step(x, y)))
                sched.step()
    summary = _summary(step)
    reason = step.reason
    step.close()
    return {
        **summary,
        "line": reason.location.lineno
        if reason is not None and reason.location is not None
        else None,
        "file": reason.location.filename
        if reason is not None and reason.location is not None
        else None,
        "expected_line": line,
        "expected_file": __file__,
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], losses),
        "param_rel_diff": harness.rel_diff(ref["params"], harness.params_of(ddp)),
    }


# ------------------------------------------------------------------ variable lengths
GPT = GPTConfig(vocab=512, block=128, layers=2, dim=64, heads=4)
BUCKETS = (32, 64, 96, 128)


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences whose lengths come in groups of one batch per rank (as a sampler
    that groups by length gives them), so that the batches' longest lengths fall in every
    bucket."""

    def __init__(self, count: int, group: int) -> None:
        gen = torch.Generator().manual_seed(5)
        typical = (20, 50, 80, 110, 30, 60, 90, 120)
        self.lengths = [
            typical[(i // group) % len(typical)] - int(torch.randint(0, 12, (), generator=gen))
            for i in range(count)
        ]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + i)
        return {"input_ids": torch.randint(1, GPT.vocab, (self.lengths[i],), generator=gen)}


def _pad_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding to the longest sequence of the batch, as a tokenizer's collator does."""
    ids = nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    return {"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100)}


def buckets(info: DistInfo) -> dict[str, Any]:
    """Variable lengths padded to 4 buckets by the loader's workers: a graph per bucket."""
    data = Sequences(8 * 24 * info.world_size, group=8 * info.world_size)
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, shuffle=False)
    loader = DataLoader(
        data,
        batch_size=8,
        sampler=sampler,
        num_workers=4,
        persistent_workers=True,
        drop_last=True,
        pin_memory=info.device.type == "cuda",
        collate_fn=ddpgraph.bucket_collate(_pad_collate, BUCKETS),
    )

    def run(captured: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = TinyGPT(GPT).to(info.device)
        ddp = ddpgraph.prepare_ddp(model, **_ids(info)) if captured else DDP(model, **_ids(info))
        opt = _opt(ddp)

        def train_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            logits = ddp(ids)
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
            loss.backward()
            opt.step()
            return loss.detach()

        step: Any = (
            ddpgraph.capture_step(
                train_step, model=ddp, optimizer=opt, max_graphs=4, backend=_backend()
            )
            if captured
            else harness.with_same_settings(opt, train_step, info.device)
        )
        losses, lengths = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for e in range(EPOCHS):
                sampler.set_epoch(e)
                for batch in loader:
                    lengths.append(int(batch["input_ids"].shape[1]))
                    losses.append(float(step(batch["input_ids"], batch["labels"])))
        out: dict[str, Any] = {
            "losses": losses,
            "params": harness.params_of(ddp),
            "lengths": sorted(set(lengths)),
        }
        if captured:
            out["summary"] = _summary(step)
            step.close()
        return out

    ref = run(False)
    got = run(True)
    return {
        **got["summary"],
        "lengths": got["lengths"],
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
    }


# ------------------------------------------------------------------ stress
def _stress(count: int) -> Callable[[DistInfo], dict[str, Any]]:
    def stress(info: DistInfo) -> dict[str, Any]:
        """`count` fresh capture_steps in a row on one model, all fed by one pinned
        4-worker loader: each warms up, captures and replays."""
        ddp = ddpgraph.prepare_ddp(_mlp(info), **_ids(info))
        opt = _opt(ddp)
        fn = _step_fn(ddp, opt)
        feed = loader_feed(info, PINNED_4, batches=8)
        outcomes = []
        batches = (b for e in range(10_000) for b in feed(e))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(count):
                step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=_backend())
                calls = 0
                while step.stats.replays < 3 and calls < WARMUP + 8:
                    step(*next(batches))
                    calls += 1
                outcomes.append({**_summary(step), "calls": calls})
                step.close()
        return {"outcomes": outcomes}

    return stress


# ------------------------------------------------------------------ sweep
def _collect_inherited(_: int) -> None:
    import gc

    gc.collect()


def model_sweep(info: DistInfo) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    samples = 32 * 6 * info.world_size
    data = TensorDataset(
        torch.randn(samples, 3, 32, 32, generator=gen),
        torch.randint(0, 10, (samples,), generator=gen),
    )
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, seed=1)
    loader = DataLoader(
        data,
        batch_size=32,
        sampler=sampler,
        num_workers=4,
        pin_memory=True,
        drop_last=True,
        worker_init_fn=_collect_inherited,
    )
    runs: dict[str, Any] = {}
    # cuDNN's fastest convolution gradients add in no fixed order: eager against eager
    # would differ too. Its deterministic ones make the comparison exact.
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        _sweep_runs(info, loader, sampler, runs)
    finally:
        torch.backends.cudnn.deterministic = deterministic
    ref = runs.pop("eager")
    return {
        "runs": {
            label: {
                **got["summary"],
                "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
                "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
                "bitwise": ref["losses"] == got["losses"]
                and harness.rel_diff(ref["params"], got["params"]) == 0.0,
                "calls": len(got["losses"]),
            }
            for label, got in runs.items()
        }
    }


def _sweep_runs(
    info: DistInfo, loader: DataLoader[Any], sampler: DistributedSampler[Any], runs: dict[str, Any]
) -> None:
    import torchvision

    for label in ("eager", "captured_0", "captured_1"):
        torch.manual_seed(0)
        ddp = ddpgraph.prepare_ddp(
            torchvision.models.resnet18(num_classes=10).to(info.device), **_ids(info)
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        fn = _step_fn(ddp, opt)
        step: Any = (
            harness.with_same_settings(opt, fn, info.device)
            if label == "eager"
            else ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=_backend())
        )
        losses = []
        for e in range(3):
            sampler.set_epoch(e)
            losses += [float(step(x, y)) for x, y in loader]
        runs[label] = {"losses": losses, "params": harness.params_of(ddp)}
        if label != "eager":
            runs[label]["summary"] = _summary(step)
            step.close()
        # The model, its DDP wrapper and the step stay behind as garbage in cycles, for
        # the next run's workers to inherit.


REGISTRY: dict[str, Callable[[DistInfo], dict[str, Any]]] = {
    "loader_pin0_w0": _loader_case(
        Loading(pin_memory=False, workers=0, persistent=False, prefetch=None)
    ),
    "loader_pin0_w2": _loader_case(
        Loading(pin_memory=False, workers=2, persistent=False, prefetch=2)
    ),
    "loader_pin0_w4": _loader_case(
        Loading(pin_memory=False, workers=4, persistent=True, prefetch=4)
    ),
    "loader_pin1_w0": _loader_case(
        Loading(pin_memory=True, workers=0, persistent=False, prefetch=None)
    ),
    "loader_pin1_w2": _loader_case(
        Loading(pin_memory=True, workers=2, persistent=True, prefetch=2)
    ),
    "loader_pin1_w4": _loader_case(
        Loading(pin_memory=True, workers=4, persistent=False, prefetch=4), compile_runs=2
    ),
    "non_blocking": non_blocking,
    "prefetcher": prefetcher,
    "poller": poller,
    "buckets": buckets,
    "own_sync_in_capture": own_sync_in_capture,
    "model_sweep": model_sweep,
    "stress_20": _stress(20),
    "stress_5": _stress(5),
}

if __name__ == "__main__":
    harness.run(REGISTRY)
