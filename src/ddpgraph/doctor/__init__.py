"""`ddpgraph doctor`: run a user's DDP + CUDA graph training script unmodified and name,
per rank, the real cause of a failed or silently wrong capture.

Layout: `command` (the CLI), `run` (torchrun, time limit), `worker` (one rank:
instrument, run the script, write its record), `instrument` (the PyTorch wrappers),
`recorder` (one rank's events), `observed` (what it keeps of models and graphs),
`failure_rules` and `replay_rules` (the findings), `records` (the per-rank files), `report`
(grouping, terminal and JSON output), `env` (`--env`).
"""
