"""`ddpgraph.transformers`: `transformers.Trainer` with its updates captured
(`pip install ddpgraph[transformers]`)."""

from .integrations.transformers import CUDAGraphTrainer, TrainerGraphs, trainer_refusal
from .integrations.transformers_reference import GraphSafeReference

__all__ = ["CUDAGraphTrainer", "GraphSafeReference", "TrainerGraphs", "trainer_refusal"]
