"""What a CUDA-graph capture must not serve or swallow, on real GPUs, against eager training.

Run by tests/gpu/test_capture_call_gpu.py under torchrun, one process per GPU (1 or 2):

* `no_sync_outside`, `no_sync_argument`: forward and `(loss / 4).backward()`, called under
  `ddp.no_sync()` for 3 of every 4 calls, the optimizer stepping on the 4th, after the
  call or inside it: refused (UNSUPPORTED_SETUP) at the probe step, eager throughout;
* `no_sync_after_capture`: 24 calls that each synchronise and step (captured at call 12),
  then accumulation over 4 calls: eager from the first `no_sync` call on;
* `raises_in_capture`, `interrupted_in_capture`: the step raises a `ValueError`, or a
  `KeyboardInterrupt`, once while CUDA records it (after backward): it reaches the loop as
  itself, the training state is as before the call, and the loop's retry captures.

On a machine without CUDA the same scenarios run with the stand-in backend:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/scenarios/gpu_capture_call.py --out /tmp/out
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import harness
import torch
import torch.nn.functional as F
from cpu_accumulation import accumulation_loop
from gpu_rank_safety import _batches, _model
from torch import nn

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo

M = 4
CALLS = 40


def _backend(info: DistInfo) -> Any:
    return None if info.device.type == "cuda" else ddpgraph.PassThroughBackend()


def _ddp(info: DistInfo) -> nn.Module:
    return ddpgraph.prepare_ddp(_model(info))


def _capturing(backend: Any) -> bool:
    if backend is not None:
        return bool(backend.capturing)
    return torch.cuda.is_current_stream_capturing()


def _accumulate(
    info: DistInfo, where: str, cycle: Callable[[int], int], captured: bool
) -> dict[str, Any]:
    ddp = _ddp(info)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return accumulation_loop(
        info, ddp, opt, _batches(info, CALLS), where, cycle, _backend(info), captured=captured
    )


def _compare_accumulation(
    info: DistInfo, where: str, cycle: Callable[[int], int]
) -> dict[str, Any]:
    got = _accumulate(info, where, cycle, captured=True)
    ref = _accumulate(info, where, cycle, captured=False)
    return {
        **{k: v for k, v in got.items() if k != "params"},
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
    }


def no_sync_outside(info: DistInfo) -> dict[str, Any]:
    return _compare_accumulation(info, "outside", lambda i: M)


def no_sync_argument(info: DistInfo) -> dict[str, Any]:
    return _compare_accumulation(info, "argument", lambda i: M)


def no_sync_after_capture(info: DistInfo) -> dict[str, Any]:
    return _compare_accumulation(info, "argument", lambda i: 1 if i < 24 else M)


def _raise_run(info: DistInfo, error: BaseException, captured: bool) -> dict[str, Any]:
    """Train CALLS calls, captured with the step raising `error` once while it is recorded
    (the loop catches it and calls again), or eagerly, for reference."""
    ddp = _ddp(info)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    backend = _backend(info)
    raised = {"done": not captured}

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        if not raised["done"] and _capturing(backend):
            raised["done"] = True
            raise error
        opt.step()
        return loss.detach()

    step: Any = (
        ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=backend)
        if captured
        else harness.with_same_settings(opt, fn, info.device)
    )
    losses: list[float] = []
    seen: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(_batches(info, CALLS)):
            before = harness.params_of(ddp) if not raised["done"] else None
            try:
                losses.append(float(step(x, y)))
            except BaseException as err:  # what the test raises, nothing else
                if err is not error or before is None:
                    raise
                untouched = harness.rel_diff(before, harness.params_of(ddp)) == 0.0
                seen = {
                    "at": i,
                    "type": type(err).__name__,
                    "state": step.state.value,
                    "untouched": untouched,
                }
                losses.append(float(step(x, y)))  # the loop retries the call
    out: dict[str, Any] = {"losses": losses, "params": harness.params_of(ddp), "raised": seen}
    if captured:
        out.update(state=step.state.value, stats=vars(step.stats))
        step.close()
    return out


def _raise_once(info: DistInfo, error: BaseException) -> dict[str, Any]:
    got, ref = _raise_run(info, error, True), _raise_run(info, error, False)
    return {
        **{k: v for k, v in got.items() if k != "params"},
        "loss_rel_diff": harness.loss_rel_diff(ref["losses"], got["losses"]),
        "param_rel_diff": harness.rel_diff(ref["params"], got["params"]),
    }


def raises_in_capture(info: DistInfo) -> dict[str, Any]:
    return _raise_once(info, ValueError("bad batch"))


def interrupted_in_capture(info: DistInfo) -> dict[str, Any]:
    return _raise_once(info, KeyboardInterrupt())


REGISTRY = {
    "no_sync_outside": no_sync_outside,
    "no_sync_argument": no_sync_argument,
    "no_sync_after_capture": no_sync_after_capture,
    "raises_in_capture": raises_in_capture,
    "interrupted_in_capture": interrupted_in_capture,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
