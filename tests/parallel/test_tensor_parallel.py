"""tensor_parallel_size=2 on CPU (gloo): token-exact output, lifecycle, and failures that surface on rank 0."""
import _thread
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from checkpoints import hf_greedy

from benchmarks.compete import competing_process
from nanovllm import LLM, SamplingParams
from nanovllm.distributed import process_group
from nanovllm.execution import tensor_parallel
from nanovllm.execution.tensor_parallel import WorkerFailure

# Tiny blocks and a 16-block cache: four 28-token sequences need 28 blocks, so decoding preempts.
SMALL_CACHE = dict(device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=16, max_model_len=64,
                   max_num_batched_tokens=64)
SHARED = list(range(1, 9))
PROMPTS = [SHARED + [10, 11, 12, 13], SHARED + [20, 21, 22], list(range(30, 42)), SHARED + [10, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BOUND_S = 30.0


@pytest.fixture
def busy_machine():
    """Another program busy for the whole test, in its own session as an unrelated job would be: on a 2-core machine
    each worker's `import torch` then takes seconds, which must not count against `distributed_timeout_s`."""
    with competing_process():
        yield


def _token_ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def _assert_nothing_left() -> None:
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def _assert_workers_gone_and_engine_refuses(llm: LLM) -> None:
    """After a worker failure: no worker process is left, and the engine refuses further work."""
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _disturb_mid_generate(llm: LLM, action) -> tuple[BaseException, float]:
    """Start a long generate, run `action` from another thread once it is under way; return what
    generate raised and how long after the action it raised."""
    acted_at: list[float] = []

    def disturb():
        time.sleep(1.0)
        acted_at.append(time.monotonic())
        action()

    prompts = [[i % 300 + 1, 7, 8, 9] for i in range(40)]
    thread = threading.Thread(target=disturb)
    thread.start()
    try:
        with pytest.raises(BaseException) as info:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    finally:
        thread.join()
    assert acted_at, "generate finished before it could be disturbed; make the workload longer"
    return info.value, time.monotonic() - acted_at[0]


@pytest.mark.parametrize("size, message", [(0, "positive integer"), (-1, "positive integer"),
                                           (3, r"must divide .*valid sizes for this model: \[1, 2\]"),
                                           (4, r"num_key_value_heads \(2\).*valid sizes for this model: \[1, 2\]")])
def test_invalid_sizes_rejected_before_workers_start(tied_model, size, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size.*{message}"):
        LLM(tied_model, device="cpu", dtype="float32", tensor_parallel_size=size)
    _assert_nothing_left()


def test_tp2_matches_tp1_and_transformers_then_ctrl_c_cleans_up(tied_model):
    expected = hf_greedy(tied_model, PROMPTS, GREEDY.max_tokens)
    with LLM(tied_model, **SMALL_CACHE) as llm:
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    with LLM(tied_model, tensor_parallel_size=2, **SMALL_CACHE) as llm:
        assert len(multiprocessing.active_children()) == 1
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_cached_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_blocks"]

        error, _ = _disturb_mid_generate(llm, _thread.interrupt_main)
        assert isinstance(error, KeyboardInterrupt)
    _assert_nothing_left()


@pytest.mark.parametrize("model", ["llama_untied_model", "qwen2_model"])
def test_tp2_sharded_biases_match_transformers(request, model):
    """q/k/v, o_proj and MLP biases split across ranks (row-parallel biases added once)."""
    path = request.getfixturevalue(model)
    expected = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    with LLM(path, tensor_parallel_size=2, **SMALL_CACHE) as llm:
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    _assert_nothing_left()


def test_second_engine_dummy_weights_match_tp1_and_worker_error_surfaces(tied_model):
    """The tests in this file start their tensor-parallel engines one after another in one process, so each
    relies on the previous one having released its port, process group and workers."""
    with LLM(tied_model, load_format="dummy", **SMALL_CACHE) as llm:
        expected = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(tied_model, tensor_parallel_size=2, load_format="dummy", **SMALL_CACHE) as llm:
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected

        llm.engine.model_runner.workers.dispatch("no_such_method")
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"(?s)worker rank 1 .*exited with code 1.*no_such_method"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < BOUND_S
        _assert_workers_gone_and_engine_refuses(llm)
    _assert_nothing_left()


def test_killed_worker_raises_on_rank0_in_bounded_time(tied_model):
    llm = LLM(tied_model, tensor_parallel_size=2, **SMALL_CACHE)
    try:
        (worker,) = llm.engine.model_runner.workers.workers
        error, elapsed = _disturb_mid_generate(llm, lambda: os.kill(worker.pid, signal.SIGKILL))
        assert isinstance(error, WorkerFailure)
        assert f"worker rank 1 (pid {worker.pid}) was killed by SIGKILL" in str(error)
        assert elapsed < BOUND_S
    finally:
        llm.exit()
    _assert_nothing_left()


def test_a_step_the_watchdog_gave_up_fails_even_where_it_returns(tied_model, monkeypatch):
    """A worker that dies mid-step: the watchdog kills the others and aborts the group (on NCCL the step's collectives
    then return, with nothing in their buffers), so the step must fail however it ends: here its body returns as an
    aborted NCCL step would, and the guard still raises the dead worker's failure."""
    aborts = []
    monkeypatch.setattr(tensor_parallel, "abort_tp_group", lambda: aborts.append(process_group.abort_tp_group()))
    llm = LLM(tied_model, tensor_parallel_size=2, **SMALL_CACHE)
    group = llm.engine.model_runner.workers
    (worker,) = group.workers
    try:
        with pytest.raises(WorkerFailure) as info:
            with group.guard():
                os.kill(worker.pid, signal.SIGKILL)
                deadline = time.monotonic() + BOUND_S
                while not group.gave_up and time.monotonic() < deadline:
                    time.sleep(0.05)
        assert group.gave_up and aborts == [False]  # gloo: nothing to abort
        assert f"worker rank 1 (pid {worker.pid}) was killed by SIGKILL" in str(info.value)
        _assert_workers_gone_and_engine_refuses(llm)
    finally:
        llm.exit()
    _assert_nothing_left()


@pytest.mark.parametrize("backend, aborts", [("nccl", True), ("gloo", False)])
def test_only_an_nccl_group_is_aborted(monkeypatch, backend, aborts):
    """Gloo fails a dead peer's collective by itself; NCCL's would wait for the timeout, so its group is aborted."""
    calls = []
    monkeypatch.setattr(process_group, "_size", 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append(group))
    assert process_group.abort_tp_group() is aborts
    assert calls == ([None] if aborts else [])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for tensor_parallel_size=2")
@pytest.mark.parametrize("sig, state", [(signal.SIGSTOP, "was stopped by a signal (SIGSTOP/SIGTSTP) for"),
                                        (signal.SIGKILL, "was killed by SIGKILL")])
def test_a_frozen_or_dead_nccl_worker_is_named_within_seconds_and_the_process_survives(tied_model, sig, state):
    """On NCCL a stopped or dead peer's collective waits on the device, then torch's watchdog ends the whole process:
    the engine's watchdog aborts the group first, and generate() raises, naming the rank."""
    llm = LLM(tied_model, tensor_parallel_size=2, dtype="float32", kvcache_block_size=16, enforce_eager=True)
    try:
        (worker,) = llm.engine.model_runner.workers.workers
        error, elapsed = _disturb_mid_generate(llm, lambda: os.kill(worker.pid, sig))
        assert isinstance(error, WorkerFailure), error
        assert f"worker rank 1 (pid {worker.pid}) {state}" in str(error)
        assert elapsed < tensor_parallel.STOPPED_GRACE_S + 10
        assert multiprocessing.active_children() == [] and llm.is_finished()
    finally:
        llm.exit()
    _assert_nothing_left()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for tensor_parallel_size=2")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_tp2_nccl_matches_transformers(tied_model, enforce_eager):
    """The same engine over NCCL, eager and with CUDA-graph decode (all-reduces captured in the graph)."""
    expected = hf_greedy(tied_model, PROMPTS, GREEDY.max_tokens)
    with LLM(tied_model, tensor_parallel_size=2, dtype="float32", kvcache_block_size=16,
             enforce_eager=enforce_eager) as llm:
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    _assert_nothing_left()


def test_stopped_worker_is_reported_after_the_timeout_and_nothing_is_left(tied_model, busy_machine, monkeypatch):
    """A worker that stops answering (here SIGSTOP, with the watchdog for stopped workers held off) makes the step's
    collective time out after `distributed_timeout_s`: rank 0 names the worker and its state, and the stopped process
    is killed. The short timeout bounds collectives only: workers start and meet under `worker_start_timeout_s`, even
    with the machine busy."""
    monkeypatch.setattr(tensor_parallel, "STOPPED_GRACE_S", 600.0)
    llm = LLM(tied_model, tensor_parallel_size=2, distributed_timeout_s=2, **SMALL_CACHE)
    try:
        (worker,) = llm.engine.model_runner.workers.workers
        error, elapsed = _disturb_mid_generate(llm, lambda: os.kill(worker.pid, signal.SIGSTOP))
        assert isinstance(error, WorkerFailure), error
        assert "did not answer within distributed_timeout_s=2" in str(error)
        assert f"worker rank 1 (pid {worker.pid}) is stopped by a signal" in str(error)
        assert elapsed < BOUND_S
        _assert_workers_gone_and_engine_refuses(llm)
    finally:
        llm.exit()
    _assert_nothing_left()


def test_a_frozen_worker_is_named_within_seconds_not_after_the_collective_timeout(tied_model):
    """SIGSTOP on a worker mid-generate (a debugger, Ctrl-Z on it, an overloaded host), with the default 300 s
    distributed_timeout_s: within a few seconds generate() raises a WorkerFailure naming the stopped rank, its
    requests are aborted, and no process is left."""
    llm = LLM(tied_model, tensor_parallel_size=2, **SMALL_CACHE)
    try:
        (worker,) = llm.engine.model_runner.workers.workers
        error, elapsed = _disturb_mid_generate(llm, lambda: os.kill(worker.pid, signal.SIGSTOP))
        assert isinstance(error, WorkerFailure), error
        assert f"worker rank 1 (pid {worker.pid}) was stopped by a signal (SIGSTOP/SIGTSTP) for" in str(error)
        assert tensor_parallel.STOPPED_GRACE_S <= elapsed < tensor_parallel.STOPPED_GRACE_S + 10
        assert llm.is_finished()
        _assert_workers_gone_and_engine_refuses(llm)
    finally:
        llm.exit()
    _assert_nothing_left()
