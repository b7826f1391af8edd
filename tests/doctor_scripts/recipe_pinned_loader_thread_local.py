"""recipe_pinned_loader.py with the doctor's fix: the capture begins with
`capture_error_mode="thread_local"`, so CUDA refuses only the capturing thread's own
unsafe calls, and the DataLoader's pin-memory thread pins the next batches while the
step is recorded without breaking it. Nothing to report.

    torchrun --nproc_per_node=2 tests/doctor_scripts/recipe_pinned_loader_thread_local.py
    ddpgraph doctor --nproc 2 tests/doctor_scripts/recipe_pinned_loader_thread_local.py
"""

from recipe_pinned_loader import main

if __name__ == "__main__":
    main(capture_error_mode="thread_local")
