"""Laps (rlfleet/wire/timing.py) and the trainer's StepSplit (split.py), on a clock the test advances:
exclusive nesting, per-thread stacks, unknown names refused, take() starting afresh, steps that tile."""

from __future__ import annotations

import threading

import pytest

from rlfleet.services.trainer.split import COMPUTE_PARTS, PUBLISH_PARTS, SPLIT_PARTS, WAIT_PARTS, StepSplit
from rlfleet.wire.timing import Laps, lap_counter, timed


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_a_part_counts_its_block_and_a_nested_part_its_own_seconds_only():
    clock = Clock()
    laps = Laps(("outer", "inner", "other"), clock=clock)
    with laps.part("outer"):
        clock.tick(1.0)
        with laps.part("inner"):
            clock.tick(2.0)
            with laps.part("outer"):  # the same name nested counts once per second too
                clock.tick(0.5)
        clock.tick(0.25)
    clock.tick(10.0)  # outside every part: counted nowhere
    with laps.part("inner"):
        clock.tick(3.0)
    assert laps.take() == {"outer": 1.75, "inner": 5.0, "other": 0.0}
    assert laps.take() == {"outer": 0.0, "inner": 0.0, "other": 0.0}, "take() starts afresh"


def test_a_part_that_raises_still_counts_and_closes():
    clock = Clock()
    laps = Laps(("a", "b"), clock=clock)
    with pytest.raises(RuntimeError), laps.part("a"):
        clock.tick(1.0)
        with laps.part("b"):
            clock.tick(2.0)
            raise RuntimeError("boom")
    with laps.part("a"):  # the stack is empty again: nothing nests under the parts that raised
        clock.tick(4.0)
    assert laps.take() == {"a": 5.0, "b": 2.0}


def test_an_unknown_part_is_refused_with_the_known_names():
    laps = Laps(("wait", "send"))
    with pytest.raises(KeyError, match="unknown part 'wiat'.*wait, send"):
        with laps.part("wiat"):
            pass


def test_the_part_is_a_decorator_too():
    clock = Clock()
    laps = Laps(("work",), clock=clock)

    @laps.part("work")
    def work(seconds: float) -> str:
        clock.tick(seconds)
        return "done"

    assert work(1.0) == "done" and work(2.0) == "done"
    assert laps.take() == {"work": 3.0}


def test_parts_in_another_thread_never_pause_this_threads_part():
    laps = Laps(("main", "worker"))
    inside, release = threading.Event(), threading.Event()

    def worker() -> None:
        with laps.part("worker"):
            inside.set()
            release.wait(5)

    with laps.part("main"):
        thread = threading.Thread(target=worker)
        thread.start()
        inside.wait(5)
        release.set()
        thread.join(5)
        # had the worker's part nested under this thread's, its seconds would have been taken from "main"
        assert laps._stack()[-1].nested == 0.0
    parts = laps.take()
    assert parts["main"] >= parts["worker"] > 0.0


def test_on_lap_gets_every_closed_part_and_timed_without_laps_counts_nothing():
    from prometheus_client import CollectorRegistry, Counter

    clock = Clock()
    registry = CollectorRegistry()
    counter = Counter("t_seconds_total", "test", ["part"], registry=registry)
    laps = Laps(("x", "y"), on_lap=lap_counter(counter), clock=clock)
    with laps.part("x"):
        clock.tick(1.5)
        with laps.part("y"):
            clock.tick(0.5)
    assert registry.get_sample_value("t_seconds_total", {"part": "x"}) == 1.5
    assert registry.get_sample_value("t_seconds_total", {"part": "y"}) == 0.5
    with timed(None, "anything"):  # a caller without laps
        clock.tick(1.0)
    with timed(laps, "x"):
        clock.tick(1.0)
    assert laps.take() == {"x": 2.5, "y": 0.5}


def test_steps_tile_the_run_and_the_coarse_fields_are_sums_of_parts():
    clock = Clock()
    split = StepSplit(clock=clock)
    with split.laps.part("publish_save"):  # before the first step (resuming): no step's
        clock.tick(7.0)
    with split.background.part("publish_store"):  # nor is the background publish of the version resumed at
        clock.tick(3.0)
    split.begin()
    with split.laps.part("wait"):
        clock.tick(1.0)
    with split.laps.part("forward_backward"):
        clock.tick(2.0)
    split.background.add("publish_hash", 1.5)  # the publishing thread's, overlapping the step: outside its split
    with split.laps.part("publish_wait"):
        clock.tick(0.5)
    with split.laps.part("eval"):
        clock.tick(0.25)
    clock.tick(0.125)  # in no part: the gap between step_seconds and the sum
    first = split.end()
    assert first["step_seconds"] == 3.875
    assert set(first["split"]) == set(SPLIT_PARTS)
    assert sum(first["split"].values()) == 3.75
    assert (first["wait_seconds"], first["compute_seconds"], first["publish_seconds"]) == (1.0, 2.0, 0.5)
    assert first["background_split"]["publish_hash"] == 1.5 and sum(first["background_split"].values()) == 1.5
    with split.laps.part("record_write"):  # after the first step ended: the second one's
        clock.tick(0.5)
    split.begin()  # a later begin() does not move the start: the steps tile
    with split.laps.part("wait"):
        clock.tick(1.0)
    second = split.end()
    assert second["step_seconds"] == 1.5 and second["split"]["record_write"] == 0.5
    assert second["split"]["publish_wait"] == 0.0 and not any(second["background_split"].values())


def test_every_part_is_in_exactly_one_coarse_field_or_named_outside_them():
    grouped = [*WAIT_PARTS, *COMPUTE_PARTS, *PUBLISH_PARTS]
    assert len(grouped) == len(set(grouped)) and set(grouped) <= set(SPLIT_PARTS)
    assert set(SPLIT_PARTS) - set(grouped) == {"record_write", "eval"}
