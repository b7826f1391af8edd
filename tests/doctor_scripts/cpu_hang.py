"""Rank 1 waits in a collective that rank 0 never joins: without a time limit this
hangs forever. The doctor stops it and reports SCRIPT_TIMED_OUT with rank 1's line.

    ddpgraph doctor --nproc 2 --timeout 20 tests/doctor_scripts/cpu_hang.py
"""

# doctor-timeout: 25
# doctor-ranks: 2
import datetime
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3600))
    if dist.get_rank() == 0:
        time.sleep(3600)  # doctor: SCRIPT_TIMED_OUT rank 0
    else:
        dist.all_reduce(torch.ones(1))  # doctor: SCRIPT_TIMED_OUT rank 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
