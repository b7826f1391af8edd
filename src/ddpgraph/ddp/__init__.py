"""DDP and the process: building or adopting the model, its streams, the reducer's warm-up."""
