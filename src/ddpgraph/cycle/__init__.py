"""The warm-up / capture / replay cycle of a captured step, and its decision points."""
