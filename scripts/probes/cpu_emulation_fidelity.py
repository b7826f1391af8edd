"""Does the CPU recording backend behave as a CUDA graph does? One GPU, one process.

    python scripts/probes/cpu_emulation_fidelity.py

Each case records a small step twice: as a CUDA graph on the GPU (`CudaGraphBackend`)
and with `RecordingBackend` on CPU, and reports what happened on each: the capture
failed, or it succeeded and the case's check held. A row PASSes when both sides agree.
Exit status 0 when every row passes. Needs CUDA; takes well under a minute.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ddpgraph.backends.graph import CaptureError, CudaGraphBackend
from ddpgraph.backends.recording import RecordingBackend

Case = Callable[[torch.device], tuple[Callable[[], Any], Callable[[Any], str]]]


def _host_read(read: Callable[[torch.Tensor], Any]) -> Case:
    def build(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
        t = torch.randn(16, device=device)
        return (lambda: read(t * 2)), (lambda graph: "captured")

    return build


def _float_lr(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4, device=device), torch.randn(8, 2, device=device)

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    def check(graph: Any) -> str:
        opt.param_groups[0]["lr"] = 0.0
        before = model.weight.detach().clone()
        graph.replay()
        moved = bool((model.weight.detach() - before).abs().max() > 0)
        return "update after lr=0" if moved else "no update after lr=0"

    return step, check


def _dropout_fresh(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    x = torch.ones(256, device=device)

    def check(graph: Any) -> str:
        graph.replay()
        first = graph.outputs.clone()
        graph.replay()
        return "fresh mask per replay" if not torch.equal(first, graph.outputs) else "same mask"

    return (lambda: F.dropout(x, 0.5, training=True)), check


def _nothing_until_replay(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    total = torch.zeros(4, device=device)
    ones = torch.ones(4, device=device)

    def check(graph: Any) -> str:
        # 3 after the eager calls: a capture that ran the step would leave 4
        after_capture = float(total[0])
        graph.replay()
        graph.replay()
        return f"{after_capture} after capture, +{float(total[0]) - after_capture} after 2 replays"

    return (lambda: total.add_(ones)), check


def _same_output_tensor(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    x = torch.randn(4, 4, device=device)

    def check(graph: Any) -> str:
        out = graph.outputs
        pointer = out.data_ptr()
        x.mul_(2)
        graph.replay()
        ok = graph.outputs is out and out.data_ptr() == pointer and torch.allclose(out, x @ x)
        return "output overwritten in place" if ok else "output elsewhere"

    return (lambda: x @ x), check


def _mask_fill(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    x = torch.randn(16, device=device)
    return (lambda: x.masked_fill(x > 0, 0.0)), (lambda graph: "captured")


def _mask_assign(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    x = torch.randn(16, device=device)

    def step() -> torch.Tensor:
        y = x.clone()
        y[y > 0] = 0.0
        return y

    return step, (lambda graph: "captured")


CASES: dict[str, Case] = {
    "loss.item()": _host_read(lambda t: t.sum().item()),
    "float(t)": _host_read(lambda t: float(t.sum())),
    "if t.sum() > 0:": _host_read(lambda t: 1 if t.sum() > 0 else 0),
    "t.tolist()": _host_read(lambda t: t.tolist()),
    "print(t)": _host_read(lambda t: repr(t)),
    "t.cpu()": _host_read(lambda t: t.cpu()),
    "torch.nonzero": _host_read(torch.nonzero),
    "t[mask]": _host_read(lambda t: t[t > 0]),
    "torch.unique": _host_read(torch.unique),
    "repeat_interleave(tensor)": _host_read(
        lambda t: torch.repeat_interleave(t, (t > 0).long() + 1)
    ),
    "bincount": _host_read(lambda t: torch.bincount((t > 0).long())),
    "masked_fill (no read)": _mask_fill,
    "t[mask] = 0": _mask_assign,
    "index_put_(mask, accumulate=True)": _host_read(
        lambda t: t.clone().index_put_((t > 0,), torch.tensor(1.0), accumulate=True)
    ),
    "float lr changed after capture": _float_lr,
    "dropout across replays": _dropout_fresh,
    "in-place update, before and after replays": _nothing_until_replay,
    "output tensor across replays": _same_output_tensor,
}


def _outcome(case: Case, device: torch.device) -> str:
    fn, check = case(device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    backend = CudaGraphBackend() if device.type == "cuda" else RecordingBackend()
    # Three eager calls first (on the side stream, as a CUDA capture needs): lazy state
    # such as gradients and autograd's accumulators exists before recording.
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for _ in range(3):
            fn()
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
    try:
        graph = backend.capture(fn, stream=stream, pool=None)
    except CaptureError:
        return "capture fails"
    return check(graph)


def _guarded(case: Case, device: torch.device) -> str:
    # A case that breaks the process's state (a generator left in capture mode by an
    # earlier failed capture) shows as its own failing row, not as the end of the table.
    try:
        return _outcome(case, device)
    except Exception as exc:
        return f"error: {type(exc).__name__}: {str(exc)[:60]}"


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL: needs CUDA (it compares CUDA graphs with the CPU emulation)")
        return 1
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    rows = []
    for name, case in CASES.items():
        torch.manual_seed(0)
        on_gpu = _guarded(case, gpu)
        torch.cuda.synchronize()
        torch.manual_seed(0)
        on_cpu = _guarded(case, cpu)
        rows.append((name, on_gpu, on_cpu, "PASS" if on_gpu == on_cpu else "FAIL"))
    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'CUDA graph':<40}  {'CPU recording backend':<40}  result")
    for name, on_gpu, on_cpu, verdict in rows:
        print(f"{name:<{width}}  {on_gpu:<40}  {on_cpu:<40}  {verdict}")
    failed = [r[0] for r in rows if r[3] == "FAIL"]
    print(
        f"{len(rows) - len(failed)}/{len(rows)} agree"
        + (f"; differ: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
