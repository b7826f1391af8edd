"""`ddpgraph.accelerate`: what `capture_step` checks on Hugging Face Accelerate's prepared
objects (`pip install ddpgraph[accelerate]`)."""

from .optimizer.wrappers import accelerate_refusal, is_accelerated_optimizer, unwrap_optimizers

__all__ = ["accelerate_refusal", "is_accelerated_optimizer", "unwrap_optimizers"]
