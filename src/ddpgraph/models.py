"""Deprecated path: `ddpgraph.models` moved to `ddpgraph.app.models`; removed in the next release."""

from ._moved import moved
from .app.models import (
    BUILTIN_WORKLOADS,
    CPU_GPT_CONFIG,
    MLP,
    GPTConfig,
    SmallResNet,
    TinyGPT,
    Workload,
    cnn_workload,
    cosine_with_warmup,
    gpt_workload,
    mlp_workload,
    resnet18,
)

moved("ddpgraph.models", "ddpgraph.app.models")

__all__ = ["BUILTIN_WORKLOADS", "CPU_GPT_CONFIG", "MLP", "GPTConfig", "SmallResNet", "TinyGPT", "Workload", "cnn_workload", "cosine_with_warmup", "gpt_workload", "mlp_workload", "resnet18"]
