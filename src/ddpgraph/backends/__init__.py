"""Graph backends: CUDA graphs, the CPU recording and the pass-through stand-in."""
