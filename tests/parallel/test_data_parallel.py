"""data_parallel_size=2 on CPU: the same tokens as one engine, prefix-aware routing, and a replica that dies."""
import multiprocessing
import os
import signal
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.data_parallel import DataParallelLLM, ReplicaFailure

SETTINGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64)
SHARED = list(range(100, 132))  # two whole blocks
PROMPTS = [SHARED + [i, i + 1] for i in range(1, 5)] + [[7, 8, 9], list(range(20, 45)), [11, 12, 13, 14], [5] * 40]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True)
          for i in range(len(PROMPTS))]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(tied_model):
    with LLM(tied_model, **SETTINGS) as one:
        return token_ids(one.generate(PROMPTS, GREEDY, use_tqdm=False)), \
            token_ids(one.generate(PROMPTS, SEEDED, use_tqdm=False))


@pytest.fixture(scope="module")
def dp(tied_model):
    with LLM(tied_model, data_parallel_size=2, **SETTINGS) as llm:
        yield llm
    assert multiprocessing.active_children() == []


def test_two_replicas_give_one_engines_tokens_and_keep_prefixes_together(dp, expected):
    assert isinstance(dp.engine, DataParallelLLM)
    greedy, seeded = expected
    assert token_ids(dp.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy
    replicas = dp.stats()["replicas"]
    assert all(r["num_requests"] > 0 and r["load"] == 0 for r in replicas), "both replicas served, nothing is left"
    # the four prompts sharing two whole blocks all went to one replica: three of them hit both blocks
    assert sorted(r["num_cached_tokens"] for r in replicas) == [0, 3 * len(SHARED)]
    assert token_ids(dp.generate(PROMPTS, SEEDED, use_tqdm=False)) == seeded
    streamed = {}
    for delta in dp.stream(PROMPTS, GREEDY):
        streamed.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert [streamed[k] for k in sorted(streamed, key=int)] == greedy
    stats = dp.stats()
    assert stats["num_cached_tokens"] == sum(r["num_cached_tokens"] for r in stats["replicas"])
    assert stats["num_free_blocks"] == stats["num_blocks"] == 2 * SETTINGS["num_kvcache_blocks"]


def test_generate_shows_its_progress_as_one_engine_does(dp, expected, capsys):
    assert token_ids(dp.generate(PROMPTS, GREEDY)) == expected[0]
    progress = capsys.readouterr().err
    assert "Processed prompts" in progress and f"{len(PROMPTS)}/{len(PROMPTS)}" in progress


def test_a_killed_replica_s_requests_are_retried_on_the_other(tied_model, expected, monkeypatch):
    llm = LLM(tied_model, data_parallel_size=2, **SETTINGS)
    processes = [r.child.process for r in llm.engine.replicas]
    try:
        victim = processes[0]
        receive = DataParallelLLM._receive

        def kill_on_first_output(self, replica, message, updated):
            if replica.index == 0 and message[0] == "outputs" and victim.exitcode is None:
                os.kill(victim.pid, signal.SIGKILL)  # mid-generate: it has started on its requests
            return receive(self, replica, message, updated)

        monkeypatch.setattr(DataParallelLLM, "_receive", kill_on_first_output)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        start = time.monotonic()
        outputs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
        assert time.monotonic() - start < 60
        assert victim.exitcode == -signal.SIGKILL
        with LLM(tied_model, **SETTINGS) as one:
            assert token_ids(outputs) == token_ids(one.generate(PROMPTS * 2, params, use_tqdm=False))
        stats = llm.stats()
        assert [r["alive"] for r in stats["replicas"]] == [False, True]
        assert stats["num_free_blocks"] == stats["num_blocks"] == SETTINGS["num_kvcache_blocks"], "the live one's"
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected[0], "still usable"
    finally:
        llm.exit()
    assert not any(p.is_alive() for p in processes)


def test_a_stream_that_read_from_a_dying_replica_says_so(tied_model):
    llm = LLM(tied_model, data_parallel_size=2, **SETTINGS)
    processes = [r.child.process for r in llm.engine.replicas]
    try:
        stream = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        first = next(stream)
        replica = llm.engine.replicas[llm.engine._requests[first.request_id].replica]
        os.kill(replica.child.pid, signal.SIGKILL)
        with pytest.raises(ReplicaFailure, match=rf"data-parallel replica {replica.index} \(pid \d+\) was killed "
                                                 r"by SIGKILL; a stream had read part of its output"):
            for _ in stream:
                pass
    finally:
        llm.exit()
    assert not any(p.is_alive() for p in processes)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_sizes_are_refused(tied_model, size):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM(tied_model, data_parallel_size=size, **SETTINGS)
