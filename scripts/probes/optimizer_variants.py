"""Fewer kernels per replayed step: the AdamW kernel and DDP's bucketing, each measured alone.

    python scripts/probes/optimizer_variants.py [--models gpt,hf-gpt2] [--json FILE]
    python scripts/probes/optimizer_variants.py --smoke     # CPU, stand-in graphs: does it run

On one GPU (world size 1, a one-process NCCL group), batch 8, bf16 autocast, the step of
`ddpgraph bench` (zero_grad, forward, loss, backward, AdamW) captured by `capture_step`.
For TinyGPT (`ddpgraph.app.models.gpt_workload`) and transformers GPT-2 124M (T=256, the
`hf-gpt2` preset), each row changes one setting of `ddpgraph.step.step_settings` from the
first row, PyTorch's defaults:

* the AdamW kernel: `foreach` (today's, made capturable), `fused=True`, single-tensor;
* DDP `gradient_as_bucket_view=True` (gradients live in the all-reduce buckets);
* DDP `bucket_cap_mb` 100 and 250 (fewer, larger all-reduces than the default 25);
* and all the changes that can be combined, together.

It reports the replayed ms/step (median of timing windows), against the first row, and
peak memory. Then the numerics: parameters after 30 captured steps from the same
weights on the same batches, fused and single-tensor against foreach, relative
(max |a - b| / max |a| over tensors), in bf16 and fp32; a repeat of foreach is the
control (0.0 means the runs are deterministic, so any other difference is the kernel's).

PASS: the step captured and replayed; FAIL: it did not (the reason is printed). About
two minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpgraph
from ddpgraph.app.models import GPTConfig, Workload, gpt_workload
from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.bench.measure import _release_memory as free  # the bench's cleanup between strategies
from ddpgraph.step.step_settings import StepSettings, fused_adam_takes_tensor_lr

BATCH = 8
LR = 1e-3
NUMERICS_STEPS = 30
BASELINE = StepSettings(adam_kernel="foreach")
VARIANTS: list[tuple[str, StepSettings]] = [
    ("AdamW foreach, capturable (today)", BASELINE),
    ("AdamW fused=True", StepSettings(adam_kernel="fused")),
    ("AdamW single-tensor, capturable", StepSettings(adam_kernel="single")),
    ("gradient_as_bucket_view=True", StepSettings("foreach", gradient_as_bucket_view=True)),
    ("bucket_cap_mb=100", StepSettings("foreach", bucket_cap_mb=100)),
    ("bucket_cap_mb=250", StepSettings("foreach", bucket_cap_mb=250)),
    ("fused + bucket view + 100 MiB", StepSettings("fused", True, 100)),
]


@dataclass
class Row:
    model: str
    variant: str
    captured: bool
    replays: int
    ms_per_step: float | None
    vs_first: float | None
    peak_mib: float | None
    reason: str | None


@dataclass(frozen=True)
class Setup:
    device: torch.device
    backend: Any  # a stand-in graph backend for --smoke, else None (CUDA graphs)
    warm: int  # replays before timing
    windows: int
    window: int


def workloads(names: list[str], smoke: bool) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    for name in names:
        if name == "gpt":
            out[name] = gpt_workload(
                GPTConfig(vocab=64, block=16, layers=2, dim=32, heads=2) if smoke else None
            )
        elif name == "hf-gpt2":
            try:
                from ddpgraph.bench.presets import hf_gpt2
            except ImportError as err:  # pragma: no cover - the module itself always imports
                print(f"hf-gpt2 skipped: {err}")
                continue
            try:
                tiny = {
                    "n_layer": 2,
                    "n_embd": 32,
                    "n_head": 2,
                    "vocab_size": 64,
                    "bos_token_id": 0,
                    "eos_token_id": 0,
                }
                out[name] = hf_gpt2(seq_len=16, **tiny) if smoke else hf_gpt2()
            except ImportError as err:
                print(f"hf-gpt2 skipped: transformers does not import ({err})")
        else:
            raise SystemExit(f"unknown model {name!r}: choose from gpt, hf-gpt2")
    return out


def batches(
    workload: Workload, device: torch.device, n: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [workload.make_batch(BATCH, gen, device) for _ in range(n)]


def build(
    workload: Workload, settings: StepSettings, setup: Setup, amp: torch.dtype | None
) -> tuple[nn.Module, Any]:
    if setup.backend is not None and settings.adam_kernel == "foreach":
        # On CPU graph-safe mode only moves lr into a tensor, which foreach AdamW refuses
        # without `capturable` (CUDA only); --smoke checks the probe runs, not the kernel.
        settings = replace(settings, adam_kernel="default")
    torch.manual_seed(0)  # the same weights for every variant
    model = workload.build().to(setup.device)
    ids = {"device_ids": [setup.device.index]} if setup.device.type == "cuda" else {}
    ddp = ddpgraph.prepare_ddp(model, **ids, **settings.ddp_kwargs())
    opt = settings.adamw(ddp.parameters(), lr=LR)
    fn = make_train_step(ddp, opt, workload.loss, StepOptions(amp_dtype=amp, clip_norm=None))
    step = ddpgraph.capture_step(fn, model=ddp, optimizer=opt, backend=setup.backend)
    return ddp, step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(
    model: str, label: str, workload: Workload, settings: StepSettings, setup: Setup
) -> Row:
    free(setup.device)
    data = batches(workload, setup.device)
    ddp, step = build(
        workload, settings, setup, torch.bfloat16 if setup.device.type == "cuda" else None
    )
    calls = 0
    try:
        while step.state is ddpgraph.StepState.WARMUP or calls < 12 + setup.warm:
            step(*data[calls % len(data)])
            calls += 1
            if step.state is ddpgraph.StepState.EAGER:
                break
        captured = step.state is ddpgraph.StepState.CAPTURED
        window_ms = []
        sync(setup.device)
        for _ in range(setup.windows):
            start = time.perf_counter()
            for _ in range(setup.window):
                step(*data[calls % len(data)])
                calls += 1
            sync(setup.device)
            window_ms.append((time.perf_counter() - start) * 1000 / setup.window)
        peak = (
            torch.cuda.max_memory_allocated(setup.device) / 2**20
            if setup.device.type == "cuda"
            else None
        )
        reason = step.reason.format() if step.reason is not None else None
        return Row(
            model,
            label,
            captured,
            step.stats.replays,
            statistics.median(window_ms),
            None,
            peak,
            reason,
        )
    finally:
        step.close()
        del ddp, step


def params_after(
    workload: Workload, settings: StepSettings, setup: Setup, amp: torch.dtype | None
) -> tuple[list[torch.Tensor], bool]:
    free(setup.device)
    data = batches(workload, setup.device)
    ddp, step = build(workload, settings, setup, amp)
    try:
        for i in range(NUMERICS_STEPS):
            step(*data[i % len(data)])
        sync(setup.device)
        captured = step.state is ddpgraph.StepState.CAPTURED
        return [p.detach().double().cpu() for p in ddp.parameters()], captured
    finally:
        step.close()
        del ddp, step


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        worst = max(worst, float((x - y).abs().max()) / (float(x.abs().max()) or 1.0))
    return worst


def numerics(model: str, workload: Workload, setup: Setup) -> list[dict[str, Any]]:
    out = []
    amps = {"bf16": torch.bfloat16, "fp32": None} if setup.device.type == "cuda" else {"fp32": None}
    for amp_name, amp in amps.items():
        reference, ref_captured = params_after(workload, BASELINE, setup, amp)
        for label, kernel in (
            ("foreach again (control)", "foreach"),
            ("fused", "fused"),
            ("single-tensor", "single"),
        ):
            params, captured = params_after(workload, StepSettings(adam_kernel=kernel), setup, amp)  # type: ignore[arg-type]
            out.append(
                {
                    "model": model,
                    "amp": amp_name,
                    "against foreach": label,
                    "captured": captured and ref_captured,
                    "param_rel_diff": rel_diff(reference, params),
                }
            )
    return out


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt,hf-gpt2")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, stand-in graph backend, tiny models"
    )
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("FAIL: needs a CUDA GPU (or --smoke for a CPU check that the probe runs)")
        return 1
    info = ddpgraph.init_distributed(force_cpu=args.smoke)
    setup = (
        Setup(info.device, ddpgraph.PassThroughBackend(), warm=2, windows=2, window=2)
        if args.smoke
        else Setup(info.device, None, warm=10, windows=6, window=10)
    )
    tensor_lr = fused_adam_takes_tensor_lr()
    print(
        f"torch {torch.__version__}; fused AdamW reads a tensor lr (graph-safe): "
        f"{'yes' if tensor_lr else 'no'}"
    )
    variants = [(n, s) for n, s in VARIANTS if tensor_lr or s.adam_kernel != "fused"]
    rows: list[Row] = []
    checks: list[dict[str, Any]] = []
    for name, workload in workloads(args.models.split(","), args.smoke).items():
        first: float | None = None
        for label, settings in variants:
            row = time_variant(name, label, workload, settings, setup)
            first = row.ms_per_step if first is None else first
            row.vs_first = first / row.ms_per_step if first and row.ms_per_step else None
            rows.append(row)
            print(
                f"  {name}: {label}: {row.ms_per_step:.3f} ms/step, captured {row.captured}",
                flush=True,
            )
        checks += numerics(name, workload, setup) if tensor_lr else []
    print()
    print_table(
        ["model", "variant", "ms/step", "× first", "peak MiB", "replays", "result"],
        [
            [
                r.model,
                r.variant,
                f"{r.ms_per_step:.3f}" if r.ms_per_step is not None else "–",
                f"{r.vs_first:.3f}×" if r.vs_first is not None else "–",
                f"{r.peak_mib:.0f}" if r.peak_mib is not None else "–",
                str(r.replays),
                "PASS" if r.captured and r.replays > 0 else f"FAIL: {r.reason}",
            ]
            for r in rows
        ],
    )
    print()
    print(f"Parameters after {NUMERICS_STEPS} captured steps, relative to AdamW foreach:")
    print_table(
        ["model", "amp", "against foreach", "param rel diff", "result"],
        [
            [
                c["model"],
                c["amp"],
                c["against foreach"],
                f"{c['param_rel_diff']:.2e}",
                "PASS" if c["captured"] else "FAIL: not captured",
            ]
            for c in checks
        ],
    )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(
                {
                    "torch": torch.__version__,
                    "fused_tensor_lr": tensor_lr,
                    "timing": [asdict(r) for r in rows],
                    "numerics": checks,
                },
                fh,
                indent=1,
            )
    failed = [r for r in rows if not (r.captured and r.replays > 0)] + [
        c for c in checks if not c["captured"]
    ]
    print(
        f"\n{'FAIL' if failed else 'PASS'}: {len(failed)} of {len(rows) + len(checks)} "
        "rows did not capture"
    )
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
