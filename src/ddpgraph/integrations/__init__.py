"""Capturing the training step of the frameworks people already use.

Each submodule imports its framework, which is an optional dependency, and is imported
only when asked for, by its path: `ddpgraph.integrations.lightning` (PyTorch Lightning,
`pip install ddpgraph[lightning]`), `ddpgraph.integrations.accelerate` (Hugging Face
Accelerate, `pip install ddpgraph[accelerate]`) and `ddpgraph.integrations.transformers`
(transformers' Trainer, `pip install ddpgraph[transformers]`), as in
`from ddpgraph.integrations.lightning import CUDAGraphCallback`. A DDP model built with plain `DDP(...)` needs no integration:
`capture_step` adopts it (`ddpgraph.adopt`).
"""
