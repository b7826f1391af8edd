"""Where transformers' Mixtral waits for the GPU in one training step, per routing.

    python scripts/probes/moe_syncs.py      # one GPU, about 20 s

For the `hf-moe` preset (fp32 weights under bf16 autocast, `grouped_mm` routing), the
same with `experts_implementation="eager"`, and `hf-moe-bf16`: one eager step (forward,
backward, clipping, AdamW) under ddpgraph's host-sync probe. Prints, for each
synchronisation, whether it happened in the forward or the backward, the innermost
frames outside torch, and the setting the probe names; then the finding the probe would
report for the step.
"""

from __future__ import annotations

import os
import traceback

import torch

from ddpgraph.app.reference_step import StepOptions, make_train_step
from ddpgraph.bench import family_presets as fp
from ddpgraph.probe.syncs import host_sync_probe


def _frames(stack: list[traceback.FrameSummary]) -> list[str]:
    torch_dir = os.path.dirname(torch.__file__)
    return [
        f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
        for f in stack[-14:]
        if not f.filename.startswith(torch_dir)
    ][-6:]


def main() -> None:
    dev = torch.device("cuda", 0)
    for name, work in (
        ("hf-moe", fp.hf_moe()),
        ("hf-moe eager experts", fp.hf_moe(experts_implementation="eager")),
        ("hf-moe-bf16", fp.hf_moe(dtype=torch.bfloat16)),
    ):
        torch.manual_seed(0)
        model = work.build().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
        fn = make_train_step(
            model, opt, work.loss, StepOptions(amp_dtype=torch.bfloat16, clip_norm=1.0)
        )
        x, y = work.make_batch(2, torch.Generator().manual_seed(1), dev)
        fn(x, y)
        torch.cuda.synchronize()
        with host_sync_probe() as probe:
            fn(x, y)
        torch.cuda.synchronize()
        print(f"== {name}: {len(probe.events)} synchronisations")
        for event in probe.events:
            backward = any(f.name in ("backward", "_engine_run_backward") for f in event.stack[-8:])
            print(f"  {'backward' if backward else 'forward'}; setting: {event.setting}")
            for line in _frames(event.stack):
                print(f"    {line}")
        for finding in probe.findings(defer_library=True):
            print(f"  kept: {finding.format()}")
        for finding in probe.deferred():
            print(f"  deferred: {finding.format()}")


if __name__ == "__main__":
    main()
