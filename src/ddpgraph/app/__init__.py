"""The application built on the library: the `ddpgraph` command (`cli`) and its `demo`
(the command, without PyTorch; `demo_worker` is what its torchrun workers run),
the built-in models (`models`), the torchrun launcher (`launch`), console output
(`console`), the commands' argument checks (`arguments`) and the reference training step
the demo and the benchmark share (`reference_step`)."""
