"""`ddpgraph.accelerate`: what `capture_step` checks on Hugging Face Accelerate's prepared
objects (`pip install ddpgraph[accelerate]`)."""

from .integrations.accelerate import accelerate_refusal, is_accelerated_optimizer, unwrap_optimizers

__all__ = ["accelerate_refusal", "is_accelerated_optimizer", "unwrap_optimizers"]
