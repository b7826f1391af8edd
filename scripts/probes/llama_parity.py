"""Parity of `capture_step` with eager training on real models, and what breaks it.

Run on one GPU (about 3 minutes for Llama alone on an H200):

    PYTHONPATH=src python scripts/probes/llama_parity.py
    PYTHONPATH=src python scripts/probes/llama_parity.py --models llama,gpt2,vit
    PYTHONPATH=src torchrun --nproc_per_node=1 scripts/probes/llama_parity.py

Each model (transformers Llama: hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 32000,
sdpa; transformers GPT-2 small; timm ViT-S/16), batch 8, random weights, AdamW + cosine
+ `clip_grad_norm_`, is trained for --steps steps in bf16 autocast and in fp32, from the
same state and data: twice eagerly with the graph-safe optimizer `capture_step` uses
(`GraphSafeOptimizers.installed()`, the definition of "eager with the same settings"),
and once with `capture_step`. Then again under each variant, applied to the eager and the
captured run alike; all but the baseline run without ddpgraph's fix (`ddpgraph.step.same_path`),
to test each as a cause or as another fix:

  baseline                         ddpgraph as it is: the recording takes the eager code
                                   path in transformers (`ddpgraph.step.same_path`)
  capture_check_kept               without that: transformers sees the capture and builds
                                   an explicit causal mask (ddpgraph before the fix)
  sdpa=flash|efficient|math|cudnn  `torch.nn.attention.sdpa_kernel(<backend>)`
  eager_on_capture_stream          the eager runs on ddpgraph's capture stream
  deterministic                    `use_deterministic_algorithms` + CUBLAS_WORKSPACE_CONFIG
                                   (in a child process: the variable must precede cuBLAS)

It prints one row per (model, dtype, variant): eager vs eager and captured vs eager
(relative L2 difference of all parameters, largest loss difference), PASS when captured
equals eager bit for bit. For the baseline it also prints the attention operators each
call dispatched (eager warm-up vs the recording) and the CUDA kernels that run only in
the eager step or only in the replay (profiler), which names the cause.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ddpgraph
from ddpgraph.ddp.streams import capture_stream, on_stream
from ddpgraph.optimizer.safe_optimizers import GraphSafeOptimizers

BATCH, SEQ = 8, 256
VARIANTS = [
    "baseline",
    "capture_check_kept",
    "sdpa=flash",
    "sdpa=efficient",
    "sdpa=math",
    "sdpa=cudnn",
    "eager_on_capture_stream",
    "deterministic",
]


def build(name: str) -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=32000,
            intermediate_size=1376,
            max_position_embeddings=SEQ,
        )
        cfg._attn_implementation = "sdpa"
        model: torch.nn.Module = LlamaForCausalLM(cfg)
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg2 = GPT2Config(n_positions=SEQ)
        cfg2._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(cfg2)
    else:
        import timm

        model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=1000)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 1000)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        if name == "vit":
            return torch.randn(BATCH, 3, 224, 224, generator=g), torch.randint(
                0, 1000, (BATCH,), generator=g
            )
        tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        return tokens, tokens

    return model.cuda(), batch


def step_fn(
    model: torch.nn.Module, opt: torch.optim.Optimizer, vision: bool, bf16: bool
) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y) if vision else model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return fn


class AttentionLog(TorchDispatchMode):
    """The attention operators dispatched (forward and backward), with whether a mask came."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if "attention" in name or "scaled_dot_product" in name:
            mask = kwargs.get("attn_mask") if kwargs else (args[3] if len(args) > 3 else None)
            self.ops.add(f"{name}{' +mask' if isinstance(mask, torch.Tensor) else ''}")
        return func(*args, **(kwargs or {}))


def variant_context(variant: str) -> contextlib.AbstractContextManager[Any]:
    """Every variant but the baseline runs without ddpgraph's fix, to test it as a cause or
    as another fix."""
    stack = contextlib.ExitStack()
    if variant == "baseline":
        return stack
    stack.enter_context(_capture_check_kept())
    if variant.startswith("sdpa="):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }[variant[5:]]
        stack.enter_context(sdpa_kernel([backend]))
    return stack


@contextlib.contextmanager
def _capture_check_kept() -> Iterator[None]:
    from ddpgraph.step import same_path

    kept = same_path.CAPTURE_CHECKS
    same_path.CAPTURE_CHECKS = ()
    try:
        yield
    finally:
        same_path.CAPTURE_CHECKS = kept


def train(
    name: str, bf16: bool, captured: bool, variant: str, steps: int, *, inspect: bool = False
) -> dict[str, Any]:
    model, batch = build(name)
    ddp = ddpgraph.prepare_ddp(model, device_ids=[torch.cuda.current_device()])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    fn = step_fn(ddp, opt, name == "vit", bf16)
    log_per_call: list[set[str]] = []
    traced = fn
    if inspect:

        def traced(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with AttentionLog() as mode:
                out = fn(x, y)
            log_per_call.append(mode.ops)
            return out

    if captured:
        step: Any = ddpgraph.capture_step(traced, model=ddp, optimizer=opt)
    else:
        safe = GraphSafeOptimizers([opt], torch.device("cuda", torch.cuda.current_device()))
        assert safe.prepare() is None
        stream = (
            capture_stream(torch.device("cuda", torch.cuda.current_device()))
            if variant == "eager_on_capture_stream"
            else None
        )

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with safe.installed(), on_stream(stream):
                return traced(x, y)

    losses = []
    torch.manual_seed(1)
    with variant_context(variant):
        for i in range(steps):
            x, y = batch(i)
            losses.append(float(step(x.cuda(), y.cuda())))
            sched.step()
        kernels = _kernels(step, batch(steps)) if inspect else []
    out: dict[str, Any] = {
        "losses": losses,
        "params": [p.detach().float().clone() for p in model.parameters()],
        "kernels": kernels,
        "log": log_per_call,
    }
    if captured:
        out["state"], out["reason"], out["warmup"] = (
            step.state.value,
            step.reason and step.reason.code.value,
            step.stats.warmup_steps,
        )
        step.close()
    return out


def _kernels(step: Callable[..., Any], xy: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(xy[0].cuda(), xy[1].cuda())
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def compare(ref: dict[str, Any], got: dict[str, Any]) -> tuple[float, float]:
    num = sum(
        float((a - b).double().pow(2).sum())
        for a, b in zip(ref["params"], got["params"], strict=True)
    )
    den = sum(float(a.double().pow(2).sum()) for a in ref["params"])
    loss = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"], strict=True))
    return (num / den) ** 0.5, loss


def rows_for(name: str, variant: str, steps: int) -> list[dict[str, Any]]:
    rows = []
    for bf16 in (True, False):
        if variant == "sdpa=flash" and not bf16:
            continue  # flash attention has no fp32 kernel
        inspect = variant in ("baseline", "capture_check_kept")
        try:
            ref = train(name, bf16, False, variant, steps, inspect=inspect)
            again = train(name, bf16, False, variant, steps) if variant == "baseline" else None
            got = train(name, bf16, True, variant, steps, inspect=inspect)
        except Exception as err:  # a backend this model or GPU cannot use
            rows.append(
                {
                    "model": name,
                    "dtype": "bf16" if bf16 else "fp32",
                    "variant": variant,
                    "error": f"{type(err).__name__}: {str(err)[:80]}",
                }
            )
            continue
        row: dict[str, Any] = {
            "model": name,
            "dtype": "bf16" if bf16 else "fp32",
            "variant": variant,
            "state": got["state"],
            "reason": got["reason"],
        }
        row["eager_vs_eager"] = compare(ref, again)[0] if again else None
        row["param_rel"], row["loss_diff"] = compare(ref, got)
        if inspect:
            recording = got["log"][got["warmup"]] if len(got["log"]) > got["warmup"] else set()
            row["attention_eager"] = sorted(ref["log"][-1]) if ref["log"] else []
            row["attention_recording"] = sorted(recording)
            row["kernels_only_eager"] = sorted(set(ref["kernels"]) - set(got["kernels"]))[:12]
            row["kernels_only_replay"] = sorted(set(got["kernels"]) - set(ref["kernels"]))[:12]
        rows.append(row)
    return rows


def child_rows(name: str, variant: str, steps: int) -> list[dict[str, Any]]:
    # A process group of its own: none of this process's launcher variables.
    launcher = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in launcher and not k.startswith("TORCHELASTIC")
    }
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    cmd = [sys.executable, __file__, "--models", name, "--steps", str(steps), "--child", variant]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return [
            {
                "model": name,
                "variant": variant,
                "dtype": "-",
                "error": (out.stderr or "no output")[-120:],
            }
        ]
    return [json.loads(ln) for ln in lines]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    info = ddpgraph.init_distributed()
    if args.child:
        torch.use_deterministic_algorithms(True, warn_only=True)
        for row in rows_for(args.models, args.child, args.steps):
            print(json.dumps(row))
        return
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            found = (
                child_rows(name, variant, args.steps)
                if variant == "deterministic"
                else rows_for(name, variant, args.steps)
            )
            for row in found:
                rows.append(row)
                if info.is_main:
                    _print(row)
    if info.is_main:
        _summary(rows)
    torch.distributed.destroy_process_group()


def _print(row: dict[str, Any]) -> None:
    if "error" in row:
        print(
            f"{row['model']:6} {row['dtype']:5} {row['variant']:34} ERROR {row['error']}",
            flush=True,
        )
        return
    ee = "-" if row["eager_vs_eager"] is None else f"{row['eager_vs_eager']:.2e}"
    verdict = "PASS" if row["param_rel"] == 0 and row["loss_diff"] == 0 else "FAIL"
    print(
        f"{row['model']:6} {row['dtype']:5} {row['variant']:34} {row['state']:9} eager/eager "
        f"{ee:9} captured/eager {row['param_rel']:.2e} loss {row['loss_diff']:.2e} {verdict}",
        flush=True,
    )
    for key in (
        "attention_eager",
        "attention_recording",
        "kernels_only_eager",
        "kernels_only_replay",
    ):
        if key in row:
            print(f"    {key}: {row[key]}", flush=True)


def _summary(rows: list[dict[str, Any]]) -> None:
    print("\nvariants with captured == eager bit for bit:")
    for row in rows:
        if "error" not in row and row["param_rel"] == 0 and row["loss_diff"] == 0:
            print(f"  {row['model']} {row['dtype']} {row['variant']}")


if __name__ == "__main__":
    main()
