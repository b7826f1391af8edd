"""A step's arguments: their signature, the static buffers a graph reads, and the replay."""
