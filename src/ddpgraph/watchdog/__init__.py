"""A replay never waits forever: its GPU work is watched, and the group stopped if stuck."""
