"""The thread governor: one thread while other programs keep the CPU busy, all of them again once it is quiet."""
import types

import pytest
import torch

from nanovllm.execution import cpu_threads
from nanovllm.execution.cpu_threads import ThreadGovernor


class Clock:
    """Wall and CPU time moved by hand: a model run of `wall` seconds during which the threads got `utilization`."""

    def __init__(self):
        self.wall = self.cpu = self.mono = 0.0

    def advance(self, wall: float, utilization: float) -> None:
        self.wall += wall
        self.mono += wall
        self.cpu += wall * torch.get_num_threads() * utilization


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    fake = types.SimpleNamespace(perf_counter=lambda: clock.wall, process_time=lambda: clock.cpu,
                                 monotonic=lambda: clock.mono)
    monkeypatch.setattr(cpu_threads, "time", fake)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield clock
    torch.set_num_threads(threads)


def run(governor: ThreadGovernor, clock: Clock, seconds: float, utilization: float) -> None:
    for _ in range(int(seconds / 0.1)):
        with governor.run():
            clock.advance(0.1, utilization)


def test_a_busy_machine_takes_it_to_one_thread_and_a_quiet_one_back(clock):
    governor = ThreadGovernor(2, window_s=0.5, retry_s=10.0)
    run(governor, clock, 5.0, 0.98)
    assert torch.get_num_threads() == 2, "a quiet machine keeps every thread"
    run(governor, clock, 1.2, 0.5)
    assert torch.get_num_threads() == 1
    run(governor, clock, 9.0, 1.0)
    assert torch.get_num_threads() == 1, "no retry before retry_s"
    run(governor, clock, 1.5, 1.0)
    assert torch.get_num_threads() == 2, "retried"
    run(governor, clock, 1.2, 0.55)
    assert torch.get_num_threads() == 1, "still busy: back to one"
    run(governor, clock, 10.5, 1.0)
    run(governor, clock, 2.0, 0.97)
    assert torch.get_num_threads() == 2, "quiet again: kept"
    torch.set_num_threads(1)
    governor.restore()
    assert torch.get_num_threads() == 2


def test_the_engine_governs_its_threads_on_cpu_and_gives_them_back(tied_model):
    from nanovllm import LLM

    threads = torch.get_num_threads()
    llm = LLM(tied_model, device="cpu", dtype="float32", max_model_len=64)
    runner = llm.engine.model_runner
    assert (runner.governor is not None) == (threads > 1)
    if runner.governor is not None:
        torch.set_num_threads(1)
    llm.exit()
    assert torch.get_num_threads() == threads


def test_one_long_run_is_cut_short_at_a_layer(clock):
    governor = ThreadGovernor(2, window_s=0.5)
    with governor.run():
        for _ in range(3):  # layers of one large prefill step
            clock.advance(0.3, 0.5)
            governor.tick()
        assert torch.get_num_threads() == 1, "before the step ends"
