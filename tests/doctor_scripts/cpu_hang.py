"""Each rank waits in a collective the other never joins: without a time limit this hangs
forever, and neither rank runs a SIGTERM handler. The doctor stops every process of the
job and reports SCRIPT_TIMED_OUT with each rank's line.

    ddpgraph doctor --nproc 2 --timeout 20 tests/doctor_scripts/cpu_hang.py
"""

# doctor-timeout: 25
# doctor-ranks: 2
import datetime

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3600))
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)  # doctor: SCRIPT_TIMED_OUT rank 0
    else:
        dist.all_reduce(torch.ones(1))  # doctor: SCRIPT_TIMED_OUT rank 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
