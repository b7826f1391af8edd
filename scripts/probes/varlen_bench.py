"""Variable sequence lengths: ms/step of eager DDP, torch.compile reduce-overhead, and
capture_step with one graph or with length buckets and a family of graphs.

    python scripts/probes/varlen_bench.py --model gpt      # the demo GPT
    python scripts/probes/varlen_bench.py --model gpt2     # transformers GPT-2 from a config

One GPU, world size 1 (a one-process NCCL group, so the DDP reducer runs as in a job).
Batch 8, bf16 autocast, AdamW(capturable=True), `--steps` steps (120) with lengths drawn
uniformly from 64..512 (seeded); ms/step is measured over the second half (eager rows
after one untimed pass over the same batches). Rows with a
fixed T=256 give the fixed-shape speedup the bucketed run is held against (a row with
8 buckets, multiples of 64, shows what finer buckets buy). Prints a
table and PASS/FAIL for: bucketed capture_step reaches >= 80% of the fixed-shape
speedup over eager, beats every other variable-length row, and its pool is at most 1.3x
the pool of a graph of the largest bucket alone.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpgraph
from ddpgraph.app.models import GPTConfig, TinyGPT

BATCH, VOCAB, MAX_T = 8, 8192, 512
BUCKETS = (64, 128, 256, 512)


def build(kind: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return TinyGPT(GPTConfig(vocab=VOCAB, block=MAX_T, layers=6, dim=384, heads=6)).to(device)
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=VOCAB, n_positions=MAX_T)
    return GPT2LMHeadModel(cfg).to(device)


def loss_of(kind: str, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", torch.bfloat16):
        if kind == "gpt":
            logits = model(ids)
            return F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        # Padding sits at the end and its labels are -100: a causal model needs no mask
        # (and transformers may read a padded mask on the host).
        return model(input_ids=ids, labels=labels).loss


def batches(
    steps: int, device: torch.device, fixed: int | None, buckets: tuple[int, ...] = ()
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    lengths = (
        [fixed] * steps
        if fixed
        else [int(t) for t in torch.randint(64, MAX_T + 1, (steps,), generator=gen)]
    )
    out = []
    for t in lengths:
        ids = torch.randint(0, VOCAB, (BATCH, t), generator=gen)
        b = {"input_ids": ids, "labels": ids.clone()}
        if buckets:
            b = ddpgraph.pad_to_bucket(b, buckets)
        out.append((b["input_ids"].to(device), b["labels"].to(device)))
    return out


def run(
    kind: str,
    mode: str,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    **kw: Any,
) -> dict[str, Any]:
    model = build(kind, device)
    ddp: nn.Module = (
        ddpgraph.prepare_ddp(model, device_ids=[device.index])
        if mode == "capture"
        else DDP(model, device_ids=[device.index])
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, capturable=True)
    forward = (
        torch.compile(ddp, mode="reduce-overhead", dynamic=kw.pop("dynamic", None))
        if mode == "reduce-overhead"
        else ddp
    )

    def train_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(kind, forward, ids, labels)
        loss.backward()
        opt.step()
        return loss.detach()

    step: Callable[..., torch.Tensor] = train_step
    if mode == "capture":
        step = ddpgraph.capture_step(train_step, model=ddp, optimizer=opt, **kw)
    elif mode == "eager":
        # One untimed pass first: the first step at each new length pays for kernel
        # selection and allocator growth once, which later epochs (and the other rows,
        # run after this one) do not pay again.
        for ids, labels in data:
            train_step(ids, labels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    half = len(data) // 2
    start = time.perf_counter()
    for i, (ids, labels) in enumerate(data):
        if i == half:
            torch.cuda.synchronize()
            start = time.perf_counter()
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        step(ids, labels)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000 / (len(data) - half)
    row: dict[str, Any] = {"ms": ms, "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    if isinstance(step, ddpgraph.CapturedStep):
        s = step.stats
        row.update(
            graphs=s.graphs,
            replays=s.replays,
            eager=s.eager_steps + s.warmup_steps,
            pool=s.pool_bytes,
        )
        step.close()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt", "gpt2"), default="gpt")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    device, n = info.device, args.steps
    varlen, padded, fixed = (
        batches(n, device, None),
        batches(n, device, None, BUCKETS),
        batches(n, device, 256),
    )
    fine = batches(n, device, None, tuple(range(64, MAX_T + 1, 64)))
    largest = batches(n, device, MAX_T)
    rows: dict[str, dict[str, Any]] = {}
    plan: list[tuple[str, str, Any, dict[str, Any]]] = [
        ("eager, T=256", "eager", fixed, {}),
        ("capture_step, T=256", "capture", fixed, {}),
        ("eager, varlen", "eager", varlen, {}),
        ("capture_step 1 graph, varlen", "capture", varlen, {}),
        ("capture_step buckets max_graphs=4", "capture", padded, {"max_graphs": 4}),
        ("capture_step 8 buckets (x64) max_graphs=8", "capture", fine, {"max_graphs": 8}),
        (
            "capture_step T=512 alone (pool ref)",
            "capture",
            largest[: min(n, 40)],
            {"max_graphs": 2},
        ),
    ]
    if not args.skip_compile:
        plan += [
            ("reduce-overhead, varlen", "reduce-overhead", varlen, {}),
            ("reduce-overhead dynamic=True, varlen", "reduce-overhead", varlen, {"dynamic": True}),
        ]
    for name, mode, data, kw in plan:
        t0 = time.perf_counter()
        rows[name] = run(args.model, mode, data, device, **kw)
        gc.collect()
        torch.cuda.empty_cache()  # each row starts from the same free memory
        print(f"  ran {name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    eager_var = rows["eager, varlen"]["ms"]
    print(
        f"\nmodel={args.model} batch={BATCH} bf16 steps={n} lengths 64..{MAX_T} buckets={BUCKETS}  "
        f"(torch {torch.__version__})"
    )
    print(
        f"{'row':40} {'ms/step':>8} {'speedup':>8} {'peak MiB':>9} {'graphs':>6} "
        f"{'eager':>5} {'pool MiB':>9}"
    )
    for name, r in rows.items():
        base = rows["eager, T=256"]["ms"] if "T=256" in name else eager_var
        pool = f"{r['pool'] / 2**20:.1f}" if r.get("pool") else "-"
        print(
            f"{name:40} {r['ms']:8.2f} {base / r['ms']:7.2f}x {r['peak_mib']:9.0f} "
            f"{r.get('graphs', '-')!s:>6} {r.get('eager', '-')!s:>5} {pool:>9}"
        )
    fixed_speedup = rows["eager, T=256"]["ms"] / rows["capture_step, T=256"]["ms"]
    bucketed = rows["capture_step buckets max_graphs=4"]
    share = (eager_var / bucketed["ms"]) / fixed_speedup
    others = [
        r["ms"] for k, r in rows.items() if "varlen" in k
    ]  # the alternatives, on the same lengths
    pool_ratio = (
        (bucketed["pool"] / rows["capture_step T=512 alone (pool ref)"]["pool"])
        if bucketed.get("pool") and rows["capture_step T=512 alone (pool ref)"].get("pool")
        else None
    )
    checks = [
        (
            "bucketed reaches >= 80% of the fixed-shape speedup "
            f"({share:.0%} of {fixed_speedup:.2f}x)",
            share >= 0.8,
        ),
        (
            f"bucketed beats every variable-length row ({bucketed['ms']:.2f} vs "
            f"best other {min(others):.2f} ms)",
            bucketed["ms"] < min(others),
        ),
        (
            f"pool within 1.3x of the largest graph's ({pool_ratio:.2f}x)"
            if pool_ratio
            else "pool memory measured",
            bool(pool_ratio and pool_ratio <= 1.3),
        ),
    ]
    for text, passed in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {text}")
    return 0 if all(p for _, p in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
