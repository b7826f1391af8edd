"""Graph families (one graph per input signature, one memory pool) and length buckets."""
