"""`transformers.Trainer` three ways, side by side in one process: plain Trainer as
written, plain Trainer with its optimizer in ddpgraph's graph-safe mode (the eager
reference, `ddpgraph.integrations.transformers.GraphSafeReference`), and
`ddpgraph.integrations.transformers.CUDAGraphTrainer`; on the hf-gpt2 and hf-llama bench
presets.

    torchrun --standalone --nproc_per_node=1 scripts/probes/trainer_bench.py --json OUT.json
    # the CPU check of this script:
    torchrun --standalone --nproc_per_node=1 scripts/probes/trainer_bench.py \\
        --cpu --steps 16 --models tiny

Trainer's defaults (AdamW fused, a DataLoader with pinned memory, `logging_nan_inf_filter`)
plus: batch 8 per process, bf16, cosine schedule with 5 warm-up steps, clipping at 1.0,
logging every 10 steps, no checkpoints. ms/step is over the second half of the steps,
with the GPU synchronised at the window's two ends only. Parity is the largest relative
difference of a parameter after training: captured against the graph-safe reference
(what capturing changed), and the reference against plain Trainer (what the graph-safe
kernel changed). `--nan-filter both` also runs with `logging_nan_inf_filter=False`,
which removes the host read of every step's loss that Trainer makes by default.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import ddpgraph
from ddpgraph.bench.presets import hf_gpt2, hf_llama
from ddpgraph.ddp.distributed import shutdown
from ddpgraph.integrations.transformers import CUDAGraphTrainer, GraphSafeReference

BATCH = 8
TINY = {
    "tiny": lambda: hf_gpt2(
        seq_len=32, n_layer=2, n_embd=64, n_head=2, vocab_size=256, bos_token_id=0, eos_token_id=0
    )
}
PRESETS = {"hf-gpt2": hf_gpt2, "hf-llama": hf_llama}


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, workload: Any, n: int) -> None:
        x, _ = workload.make_batch(n, torch.Generator().manual_seed(7), torch.device("cpu"))
        self.ids = x

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(TrainerCallback):
    """The time at the end of the window's first and last steps, the device synchronised there."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.times = start, end, {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in (self.start, self.end):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times[state.global_step] = time.perf_counter()


def run(
    name: str, workload: Any, way: str, steps: int, cpu: bool, nan_filter: bool
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = workload.build().model  # the transformers model inside the bench's logits wrapper
    clock = Clock(steps // 2, steps)
    args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "ddpgraph_trainer_bench"),
        use_cpu=cpu,
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=3e-4,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        max_grad_norm=1.0,
        bf16=True,
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        logging_nan_inf_filter=nan_filter,
    )
    common: dict[str, Any] = {
        "model": model,
        "args": args,
        "train_dataset": Tokens(workload, BATCH * steps * int(os.environ.get("WORLD_SIZE", "1"))),
    }
    if way == "ddpgraph":
        trainer: Trainer = CUDAGraphTrainer(
            callbacks=[clock], backend=ddpgraph.RecordingBackend() if cpu else None, **common
        )
    else:
        trainer = Trainer(
            callbacks=[clock, *([GraphSafeReference()] if way == "graph-safe" else [])], **common
        )
    # On CPU transformers cannot learn that the recording backend records: it is given
    # the answer a CUDA capture gives it, in every run alike (tests/scenarios/families.py).
    with (
        mock.patch("transformers.masking_utils.is_tracing", return_value=True)
        if cpu
        else nullcontext()
    ):
        trainer.train()
    ms = 1000 * (clock.times[steps] - clock.times[steps // 2]) / (steps - steps // 2)
    out: dict[str, Any] = {
        "model": name,
        "way": way,
        "nan_filter": nan_filter,
        "ms_per_step": ms,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "params": [p.detach().float().cpu() for p in model.parameters()],
    }
    if way == "ddpgraph":
        g = trainer.graphs  # type: ignore[attr-defined]
        out.update(state=g.state, reason=g.reason.format() if g.reason else None, stats=g.stats)
    return out


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x - y).abs().max()) / (float(x.abs().max()) or 1.0)
        for x, y in zip(a, b, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="hf-gpt2,hf-llama")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nan-filter", choices=["on", "both"], default="both")
    parser.add_argument(
        "--cpu", action="store_true", help="a CPU check of this script: recording backend, no speed"
    )
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    info = ddpgraph.init_distributed()
    if not opts.cpu and info.device.type != "cuda":
        print("SKIP: this probe needs a CUDA GPU (or --cpu)")
        return
    rows: list[dict[str, Any]] = []
    for name in opts.models.split(","):
        workload = {**PRESETS, **TINY}[name]()
        for nan_filter in (True, False) if opts.nan_filter == "both" else (True,):
            ways = ("plain", "graph-safe", "ddpgraph") if nan_filter else ("plain", "ddpgraph")
            runs = {way: run(name, workload, way, opts.steps, opts.cpu, nan_filter) for way in ways}
            for r in runs.values():
                if r["way"] == "ddpgraph":
                    r["speedup"] = runs["plain"]["ms_per_step"] / r["ms_per_step"]
                    if "graph-safe" in runs:
                        r["vs_reference"] = rel_diff(runs["graph-safe"]["params"], r["params"])
                        r["same_logged_losses"] = r["losses"] == runs["graph-safe"]["losses"]
                    r["vs_plain"] = rel_diff(runs["plain"]["params"], r["params"])
                if r["way"] == "graph-safe":
                    r["vs_plain"] = rel_diff(runs["plain"]["params"], r["params"])
                rows.append({k: v for k, v in r.items() if k != "params"})
    if info.is_main:
        print(
            f"world size {info.world_size}, torch {torch.__version__}, batch {BATCH}, "
            f"bf16, {opts.steps} steps"
        )
        print(
            "| model | logging_nan_inf_filter | plain ms | ddpgraph ms | speedup | "
            "captured vs reference | reference vs plain | state |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in rows:
            if r["way"] != "ddpgraph":
                continue
            plain = next(
                p
                for p in rows
                if p["model"] == r["model"]
                and p["nan_filter"] == r["nan_filter"]
                and p["way"] == "plain"
            )
            ref = next(
                (
                    p
                    for p in rows
                    if p["model"] == r["model"]
                    and p["way"] == "graph-safe"
                    and p["nan_filter"] == r["nan_filter"]
                ),
                None,
            )
            vs_reference = f"{r['vs_reference']:.2e}" if "vs_reference" in r else "-"
            vs_plain = f"{ref['vs_plain']:.2e}" if ref else "-"
            print(
                f"| {r['model']} | {r['nan_filter']} | {plain['ms_per_step']:.2f} | "
                f"{r['ms_per_step']:.2f} | {r['speedup']:.2f}x | {vs_reference} | {vs_plain} "
                f"| {r['state']} {r['stats'].get('replays', 0)} replays |"
            )
            if r["reason"]:
                print(f"  {r['model']}: {r['reason']}")
        if opts.json:
            with open(opts.json, "w") as fh:
                json.dump(
                    {"world_size": info.world_size, "torch": torch.__version__, "rows": rows},
                    fh,
                    indent=1,
                )
    shutdown()


if __name__ == "__main__":
    main()
