"""The captured training step: its policy and the guards it checks before each replay."""
