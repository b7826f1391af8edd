"""The graph-safe optimizer: a captured optimizer step that follows the user's schedule."""
