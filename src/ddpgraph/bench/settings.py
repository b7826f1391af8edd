"""How long `ddpgraph bench` runs each strategy (`Settings`), and the warm-up its captured
strategies need: plain values, without PyTorch, which the command's checks read before
any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from .stats import windows

# PyTorch's recipe: DDP's reducer samples host-synchronising statistics on iterations
# 1-10, so 11 eager iterations must run before the capture.
RECIPE_WARMUP_ITERATIONS = 11
# Captured strategies run 11 eager DDP iterations and capture on the 12th call; timing
# must start after that.
MIN_WARMUP = RECIPE_WARMUP_ITERATIONS + 1


@dataclass(frozen=True)
class Settings:
    steps: int = 60  # timed steps per feed
    warmup: int = 20  # untimed steps before timing the device feed
    window: int = 5  # steps per timing window
    profile_steps: int = 5  # steps under the profiler (0: no GPU-busy figure)
    dataloader: bool = True
    loader_warmup: int = 8  # untimed DataLoader steps (room for a second capture)
    # As training scripts set their loaders up: worker processes, pinned batches.
    loader_workers: int = 4

    @property
    def timed_steps(self) -> int:
        return sum(windows(self.steps, self.window))
