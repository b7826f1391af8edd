"""`ddpgraph.transformers`: `transformers.Trainer` with its updates captured
(`pip install ddpgraph[transformers]`)."""

from .integrations.transformers import CUDAGraphTrainer, TrainerGraphs, trainer_refusal

__all__ = ["CUDAGraphTrainer", "TrainerGraphs", "trainer_refusal"]
