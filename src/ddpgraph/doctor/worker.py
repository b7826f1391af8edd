"""One rank of a doctored script: instrument PyTorch, run the script, hand in the record.

    torchrun --nproc_per_node=N -m ddpgraph.doctor.worker script.py [script arguments]

with `DDPGRAPH_DOCTOR_DIR` set to the folder for the per-rank records; `ddpgraph
doctor` starts it so. The script runs unmodified as `__main__`, with its own
`sys.argv` and its folder first on `sys.path`, as `python script.py` would run it.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import time
import traceback
from types import FrameType, TracebackType
from typing import IO, NoReturn

from .env import installed_version_findings
from .instrument import Instrumentation
from .recorder import Recorder
from .records import DIR_VARIABLE, RankStatus, read_records, stack_dump_path, write_record

# After the script failed, how long a rank waits for the others to hand in their own
# records before it exits (torchrun stops every rank once one has exited).
PEER_WAIT_VARIABLE = "DDPGRAPH_DOCTOR_PEER_WAIT"
DEFAULT_PEER_WAIT_S = 20.0
_SIGTERM_EXIT = 128 + signal.SIGTERM


class Worker:
    def __init__(self, directory: str, rank: int, world_size: int) -> None:
        self.directory = directory
        self.recorder = Recorder(rank, world_size, on_change=self.write)
        self.instrumentation = Instrumentation(self.recorder)
        self._stacks: IO[str] | None = None
        # The status this rank ended with, once it has one. torchrun stops the other
        # ranks as soon as one exits, and its SIGTERM can reach a rank that has already
        # failed or finished on its own: that rank's record must keep what it ended with.
        self._ended: tuple[RankStatus, int] | None = None

    def write(self, status: RankStatus = RankStatus.RUNNING, exit_code: int | None = None) -> None:
        record = self.recorder.record(status, exit_code)
        record.pid = os.getpid()
        record.doctor_errors = list(self.instrumentation.internal_errors)
        write_record(self.directory, record)

    def start(self) -> None:
        self.instrumentation.install()
        # The doctor asks for every thread's stack when the script runs out of time: a
        # rank stuck in a collective never returns to Python, but faulthandler answers.
        self._stacks = open(stack_dump_path(self.directory, self.recorder.rank), "w")  # noqa: SIM115
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        signal.signal(signal.SIGTERM, self._terminated)
        self.write()

    def _terminated(self, signum: int, frame: FrameType | None) -> None:
        if self._ended is None:
            self._finish(RankStatus.TERMINATED, _SIGTERM_EXIT)
            os._exit(_SIGTERM_EXIT)
        status, code = self._ended
        # Written again in case the signal cut the first write short; the record is the
        # same either way.
        self.write(status, code)
        os._exit(code)

    def _finish(self, status: RankStatus, exit_code: int) -> None:
        self.recorder.script_ended()
        for finding in installed_version_findings():
            self.recorder.add(finding)
        self._ended = (status, exit_code)
        self.write(status, exit_code)

    def run(self, script: str, args: list[str]) -> int:
        path = os.path.abspath(script)
        sys.argv = [script, *args]
        # `python script.py` puts the script's folder first on sys.path; `-m` put the
        # current folder there instead.
        if sys.path and sys.path[0] in ("", os.getcwd()):
            sys.path[0] = os.path.dirname(path)
        else:
            sys.path.insert(0, os.path.dirname(path))
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = _exit_status(exc)
            if code == 0:
                self._finish(RankStatus.FINISHED, 0)
                return 0
            return self._failed(exc, code, path)
        except BaseException as exc:
            return self._failed(exc, 1, path)
        self._finish(RankStatus.FINISHED, 0)
        return 0

    def _failed(self, exc: BaseException, code: int, path: str) -> NoReturn:
        self.instrumentation.finish_open_capture(exc)
        self.recorder.script_error(exc)
        self._finish(RankStatus.FAILED, code)
        if not isinstance(exc, SystemExit):
            _print_user_traceback(exc, path)
        elif not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
        self._wait_for_peers()
        # A script that failed in the middle of a capture can leave NCCL work that never
        # completes, and tearing the communicator down at exit can then wait forever.
        # The record is written: end the process now, as the failure would have.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _wait_for_peers(self) -> None:
        deadline = time.monotonic() + float(os.environ.get(PEER_WAIT_VARIABLE, DEFAULT_PEER_WAIT_S))
        me, world = self.recorder.rank, self.recorder.world_size
        while time.monotonic() < deadline:
            records = read_records(self.directory, world)
            if all(
                r.status not in (RankStatus.RUNNING, RankStatus.MISSING)
                for r in records
                if r.rank != me
            ):
                return
            time.sleep(0.05)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _print_user_traceback(exc: BaseException, path: str) -> None:
    """The traceback Python would print for `python script.py`: from the script's frame on."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m ddpgraph.doctor.worker script.py [arguments]", file=sys.stderr)
        return 2
    directory = os.environ.get(DIR_VARIABLE)
    if not directory:
        print(f"{DIR_VARIABLE} is not set; run the script with `ddpgraph doctor`", file=sys.stderr)
        return 2
    worker = Worker(
        directory, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    )
    worker.start()
    return worker.run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
