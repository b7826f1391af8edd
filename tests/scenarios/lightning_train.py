"""A Lightning `Trainer(strategy="ddp")`, with and without
`ddpgraph.integrations.lightning.CUDAGraphCallback`, from the same state and data: on gloo CPU
processes with the stand-in backend (tests/dist/test_lightning_gloo.py), or one process
per GPU with CUDA graphs (tests/gpu/test_lightning_gpu.py).

The run without the callback makes its optimizer graph-safe too, so both runs do the same
arithmetic and must agree bit for bit.
Lightning joins the process group the harness opened (torchrun's variables).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import harness
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpgraph
from ddpgraph.ddp.distributed import DistInfo
from ddpgraph.integrations.lightning import CUDAGraphCallback

BATCH, PER_RANK_BATCHES = 8, 16


class Net(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
        return {"loss": loss, "scaled": loss.detach() * 2}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GraphSafe(L.Callback):
    """The reference run's optimizer stepped as the callback's eager steps step it: with
    its graph-safe mode installed around each `step` (the closure, which Lightning runs
    inside `step`, included)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

        opt = trainer.optimizers[0]
        safe = GraphSafeOptimizers([opt], module.device)
        assert safe.prepare() is None
        plain_step = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            with safe.installed():
                return plain_step(*args, **kwargs)

        opt.step = step  # type: ignore[method-assign]


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.scaled: list[float] = []
        self.lrs: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.scaled.append(float(outputs["scaled"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_validation_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if "val_loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


def _data(info: DistInfo) -> tuple[DataLoader, DataLoader]:
    gen = torch.Generator().manual_seed(5)
    n = BATCH * PER_RANK_BATCHES * info.world_size
    x = torch.randn(n, 16, generator=gen)
    y = x[:, :4].argmax(1)
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, drop_last=True)
    val = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=BATCH)
    return train, val


def _fit(
    info: DistInfo,
    *,
    callback: bool,
    epochs: int = 2,
    root: str | None = None,
    ckpt: str | None = None,
    save: bool = False,
    **trainer_kw: Any,
) -> dict[str, Any]:
    manual = trainer_kw.pop("manual", False)
    refused = trainer_kw.pop("refused", False)  # the callback leaves the optimizer as it is
    record = Record()
    on_gpu = info.device.type == "cuda"
    graph = CUDAGraphCallback(backend=None if on_gpu else ddpgraph.PassThroughBackend())
    callbacks: list[L.Callback] = [record, graph if callback else GraphSafe()]
    if refused and not callback:
        callbacks.pop()
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, save_last=True, every_n_epochs=1))
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=info.world_size,
        strategy="ddp",
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        default_root_dir=root or os.getcwd(),
        **trainer_kw,
    )
    module = Net(manual=manual)
    train, val = _data(info)
    start = time.perf_counter()
    trainer.fit(module, train, val, ckpt_path=ckpt)
    seconds = time.perf_counter() - start
    return {
        "losses": record.losses,
        "logged": record.logged,
        "scaled": record.scaled,
        "lrs": record.lrs,
        "val": record.val,
        "epoch_loss": float(trainer.callback_metrics["epoch_loss"]),
        "params": harness.params_of(module),
        "state": graph.state,
        "code": graph.reason.code.value if graph.reason else None,
        "reason": graph.reason.format() if graph.reason else None,
        "stats": vars(graph.stats),
        "restored": "optimizer_step" not in vars(module),
        "fit_seconds": seconds,
    }


def _compare(info: DistInfo, **kw: Any) -> dict[str, Any]:
    plain = _fit(info, callback=False, **kw)
    graphed = _fit(info, callback=True, **kw)
    return {
        **{k: graphed[k] for k in ("state", "code", "reason", "stats", "restored", "lrs", "val")},
        "fit_seconds": {"plain": plain["fit_seconds"], "graphed": graphed["fit_seconds"]},
        "steps": len(graphed["losses"]),
        "same": {
            k: plain[k] == graphed[k]
            for k in ("losses", "logged", "scaled", "lrs", "val", "epoch_loss")
        },
        "param_rel_diff": harness.rel_diff(plain["params"], graphed["params"]),
        "loss_rel_diff": harness.loss_rel_diff(plain["losses"], graphed["losses"]),
    }


def equivalence(info: DistInfo) -> dict[str, Any]:
    return _compare(info)


def manual_optimization(info: DistInfo) -> dict[str, Any]:
    return _compare(info, manual=True, refused=True)


def accumulate(info: DistInfo) -> dict[str, Any]:
    return _compare(info, accumulate_grad_batches=2, refused=True)


def clipping(info: DistInfo) -> dict[str, Any]:
    return _compare(info, gradient_clip_val=0.5)


def bf16(info: DistInfo) -> dict[str, Any]:
    return _compare(info, precision="bf16-mixed")


def checkpoint_resume(info: DistInfo) -> dict[str, Any]:
    """One epoch, saved; a new Trainer resumes for a second epoch: with the callback and
    without, the resumed runs agree, and each captured again."""
    out: dict[str, Any] = {}
    for callback in (False, True):
        # Under the launch's folder (the same on every rank), which the test's tmp_path owns.
        root = str(Path(harness.out_dir()) / f"ckpt_{int(callback)}")
        _fit(info, callback=callback, epochs=1, root=root, save=True)
        resumed = _fit(
            info, callback=callback, epochs=2, root=root, ckpt=os.path.join(root, "last.ckpt")
        )
        out[f"cb{int(callback)}"] = resumed
    plain, graphed = out["cb0"], out["cb1"]
    return {
        "state": graphed["state"],
        "stats": graphed["stats"],
        "code": graphed["code"],
        "steps": len(graphed["losses"]),
        "param_rel_diff": harness.rel_diff(plain["params"], graphed["params"]),
        "same_losses": plain["losses"] == graphed["losses"],
    }


REGISTRY: dict[str, harness.Scenario] = {
    "equivalence": equivalence,
    "manual_optimization": manual_optimization,
    "accumulate": accumulate,
    "clipping": clipping,
    "bf16": bf16,
    "checkpoint_resume": checkpoint_resume,
}

if __name__ == "__main__":
    harness.run(REGISTRY)
