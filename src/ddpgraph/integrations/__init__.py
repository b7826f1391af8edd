"""Capturing the training step of the frameworks people already use.

Each submodule imports its framework, which is an optional dependency, and is imported
only when asked for: `ddpgraph.lightning` (PyTorch Lightning, `pip install
ddpgraph[lightning]`), `ddpgraph.accelerate` (Hugging Face Accelerate, `pip install
ddpgraph[accelerate]`) and `ddpgraph.transformers` (transformers' Trainer, `pip install
ddpgraph[transformers]`). A DDP model built with plain `DDP(...)` needs no integration:
`capture_step` adopts it (`ddpgraph.ddp.adopt`).
"""
