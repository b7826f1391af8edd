"""Whether a DataLoader's forked workers survive the garbage a training process leaves.

    python3 scripts/probes/fork_garbage.py            (one GPU, two to three minutes)

A worker forked from a CUDA process inherits the parent's unreachable objects; when the
worker's collector frees one that holds a CUDA tensor (a dropped DDP model's, in a
reference cycle), the caching allocator calls CUDA in the child and the worker dies
("DataLoader worker ... killed by signal: Aborted"). Each sweep trains a model eagerly,
then twice with `capture_step`, one after another in a fresh process, every epoch from
fresh pinned workers; once as the library runs, once with its fork hook left out
(`ddp/streams.py`). Prints one JSON line per sweep and setting: "ok" or the error.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

# "plain": torch's DDP and eager steps only, three times: ddpgraph never touches CUDA there.
SWEEPS = ("resnet18", "mlp", "resnet18_plain")


def _collect(_: int) -> None:
    gc.collect()  # what a long epoch's worker does sooner or later


def _sweep(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ddpgraph
    from ddpgraph.app.reference_step import StepOptions, make_train_step

    info = ddpgraph.init_distributed()
    image, plain = name.startswith("resnet18"), name.endswith("plain")
    data = TensorDataset(
        torch.randn(192, 3, 32, 32) if image else torch.randn(192, 64), torch.randint(0, 10, (192,))
    )
    loader = DataLoader(
        data, batch_size=32, num_workers=4, pin_memory=True, worker_init_fn=_collect
    )
    for run in ("eager", "captured", "captured"):
        torch.manual_seed(0)
        if image:
            import torchvision

            net: nn.Module = torchvision.models.resnet18(num_classes=10)
        else:
            net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        wrap = torch.nn.parallel.DistributedDataParallel if plain else ddpgraph.prepare_ddp
        ddp = wrap(net.to(info.device), device_ids=[info.device.index])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

        train_step = make_train_step(
            ddp, opt, F.cross_entropy, StepOptions(amp_dtype=None, clip_norm=None)
        )
        step: Any = train_step
        if run == "captured" and not plain:
            step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt)
        for _ in range(3):
            for x, y in loader:  # fresh workers each epoch
                step(x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True))
        torch.cuda.synchronize()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--sweep":
        if sys.argv[3] == "unhooked":
            from ddpgraph.ddp import streams

            streams._FORK_HOOK.append(True)  # as if registered: never registered
        _sweep(sys.argv[2])
        return
    for name in SWEEPS:
        for setting in ("hooked",) if name.endswith("plain") else ("hooked", "unhooked"):
            done = subprocess.run(
                [sys.executable, __file__, "--sweep", name, setting],
                capture_output=True,
                text=True,
                timeout=300,
            )
            errors = [ln for ln in done.stderr.splitlines() if "Error" in ln or "killed" in ln]
            result = (
                "ok" if done.returncode == 0 else (errors[-1] if errors else done.stderr[-300:])
            )
            print(json.dumps({"sweep": name, "setting": setting, "result": result}), flush=True)


if __name__ == "__main__":
    main()
