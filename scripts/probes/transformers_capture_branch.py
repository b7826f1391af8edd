"""Where a captured transformers Llama (the `hf-llama` preset) differs from eager.

    python scripts/probes/transformers_capture_branch.py      # one GPU, about 30 s

One forward and backward at batch 2 under bf16 autocast, each from the same weights and
batch, compared with plain eager on the default stream: eager again, eager on a side
stream, captured in a CUDA graph and replayed, eager with transformers told that a graph
is being recorded (`transformers.masking_utils.is_tracing` patched to true: the branch it
takes while a stream captures, where it cannot read the position ids and builds an
explicit causal mask), and each SDPA backend forced, eager and captured. Prints the
relative difference of the output and of the gradients per variant (a variant a backend
cannot run reports its error).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ddpgraph.bench.presets import hf_llama

Context = Callable[[], contextlib.AbstractContextManager[Any]]


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    work = hf_llama()
    model = work.build().to(dev)
    x, y = work.make_batch(2, torch.Generator().manual_seed(11), dev)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)

    def step() -> torch.Tensor:
        for p in params:
            assert p.grad is not None
            p.grad.zero_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            loss = work.loss(out, y)
        loss.backward()
        return out.detach().float()

    def snapshot(out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return out.clone(), [p.grad.detach().float().clone() for p in params if p.grad is not None]

    def eager(ctx: Context = contextlib.nullcontext) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with ctx():
            out = step()
        torch.cuda.synchronize()
        return snapshot(out)

    def side_stream(
        ctx: Context = contextlib.nullcontext,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with _on_side_stream(), ctx():
            out = step()
        torch.cuda.synchronize()
        return snapshot(out)

    def captured(ctx: Context = contextlib.nullcontext) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with _on_side_stream(), ctx():
            for _ in range(3):
                step()
        graph = torch.cuda.CUDAGraph()
        with ctx(), torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
        return snapshot(out)

    def tracing() -> contextlib.AbstractContextManager[Any]:
        return mock.patch("transformers.masking_utils.is_tracing", return_value=True)

    def backend(b: SDPBackend) -> Context:
        return lambda: sdpa_kernel([b])

    ref_out, ref_grads = eager()
    variants: dict[str, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]] = {
        "eager again": eager,
        "side stream": side_stream,
        "captured": captured,
        "eager, capture branch": lambda: eager(tracing),
    }
    for b in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    ):
        forced = backend(b)
        variants[f"eager {b.name.lower()}"] = functools.partial(eager, forced)
        variants[f"captured {b.name.lower()}"] = functools.partial(captured, forced)
    rows: dict[str, dict[str, Any]] = {}
    for name, run in variants.items():
        try:
            out, grads = run()
            rows[name] = {"out": _rel([ref_out], [out]), "grads": _rel(ref_grads, grads)}
        except RuntimeError as err:
            rows[name] = {"error": str(err)[:200]}
        print(f"{name:28s} {rows[name]}", flush=True)
    print(json.dumps(rows))


@contextlib.contextmanager
def _on_side_stream() -> Iterator[None]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((u - v).pow(2).sum()) for u, v in zip(a, b, strict=True))
    den = sum(float(u.pow(2).sum()) for u in a) or 1.0
    return float((num / den) ** 0.5)


if __name__ == "__main__":
    main()
