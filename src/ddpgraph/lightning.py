"""`ddpgraph.lightning`: the PyTorch Lightning callback (`pip install ddpgraph[lightning]`)."""

from .integrations.lightning import CUDAGraphCallback, lightning_refusal

__all__ = ["CUDAGraphCallback", "lightning_refusal"]
