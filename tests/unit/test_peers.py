"""Ranks' replay progress through a real TCPStore on localhost, as torchrun provides it."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ddpgraph.agreement.peers import NoBoard, PeerBoard
from launcher import free_port


class Wall:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def boards(ranks: int) -> tuple[list[PeerBoard], Wall]:
    store = dist.TCPStore(
        "127.0.0.1", free_port(), world_size=1, is_master=True, timeout=timedelta(seconds=10)
    )
    wall = Wall()
    return [PeerBoard(store, 7, r, list(range(ranks)), 1.0, wall) for r in range(ranks)], wall


def test_others_grouped_by_counts_fewest_launched_first() -> None:
    (b0, b1, b2, b3, _b4), wall = boards(5)
    b3.publish(3, 3)  # stopped calling the step
    wall.now += 4.0
    b1.publish(40, 3, timed_out=4)
    b2.publish(40, 3)
    wall.now += 2.0
    text = b0.describe_others()
    assert text == (
        "rank 3 launched 3 replays, 3 finished (6 s ago); "
        "rank 1 launched 40 replays, 3 finished (2 s ago) and timed out waiting for replay 4; "
        "rank 2 launched 40 replays, 3 finished (2 s ago); "
        "rank 4 reported nothing"
    )


def test_same_counts_make_one_clause_with_the_oldest_age() -> None:
    (b0, b1, b2, b3), wall = boards(4)
    b1.publish(9, 9)
    wall.now += 3.0
    b2.publish(9, 9)
    b3.publish(9, 9)
    assert b0.describe_others() == "ranks 1-3 launched 9 replays, 9 finished (3 s ago)"


def test_publishing_is_rate_limited_and_only_on_change() -> None:
    (b0, b1), _ = boards(2)
    b1.maybe_publish(1, 1, now=0.0)
    b1.maybe_publish(2, 2, now=0.5)  # within publish_s: not written
    assert "launched 1 replays" in b0.describe_others()
    b1.maybe_publish(2, 2, now=1.5)
    assert "launched 2 replays" in b0.describe_others()
    writes = []
    b1.store = type("Spy", (), {"set": lambda self, k, v: writes.append(k)})()
    b1.maybe_publish(2, 2, now=9.0)  # unchanged: not written
    assert writes == []


def test_a_failing_store_is_reported_as_silence_not_raised() -> None:
    class Broken:
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("connection reset")

        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("connection reset")

    board = PeerBoard(Broken(), 0, 0, [0, 1, 2], 1.0)
    board.publish(1, 1)
    assert board.describe_others() == "ranks 1-2 reported nothing"


def test_alone_or_without_a_store() -> None:
    (only,), _ = boards(1)
    assert only.describe_others() == "no other ranks in the process group"
    assert "unknown" in NoBoard().describe_others()
