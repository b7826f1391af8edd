"""Capturing the training step of the frameworks people already use.

Each submodule imports its framework, which is an optional dependency, and is imported
only when asked for, by its path: `ddpgraph.integrations.lightning` (PyTorch Lightning,
`pip install ddpgraph[lightning]`) and `ddpgraph.integrations.transformers` (transformers'
Trainer, `pip install ddpgraph[transformers]`), as in
`from ddpgraph.integrations.lightning import CUDAGraphCallback`. Hugging Face Accelerate
needs no integration: `capture_step` takes what `accelerator.prepare(...)` returns (the
optimizer wrapper: `ddpgraph.optimizer.wrappers`), as it takes a DDP model built with
plain `DDP(...)` (`ddpgraph.ddp.adopt`).
"""
