"""The scenarios of several scripts in one torchrun launch (tests/shared_launches.py `batched`):
a launch costs every process a PyTorch import, and the test files that share a launch
pay it once.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/scenarios/together.py --out DIR cpu_core.name1 recording:cpu_feeds.name2 ...

A name is SCRIPT.NAME (SCRIPT without `.py`), with the `recording:` prefix as in
harness.py; the scripts are imported as modules, so their scenarios run one after the
other in the same processes, in the order named.
"""

from __future__ import annotations

import importlib

import harness


def registry(names: list[str]) -> dict[str, harness.Scenario]:
    """SCRIPT.NAME for every scenario of every script that `names` come from."""
    scripts = dict.fromkeys(harness.split_name(n)[1].split(".", 1)[0] for n in names)
    return {
        f"{script}.{name}": scenario
        for script in scripts
        for name, scenario in importlib.import_module(script).REGISTRY.items()
    }


if __name__ == "__main__":
    harness.run(registry)
