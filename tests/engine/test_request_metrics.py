"""RequestOutput.metrics (vLLM V1's RequestStateStats) and vLLM's periodic stats line (`disable_log_stats=False`):
timestamps taken where each event happens, exact counts under preemption, prefix caching, n > 1, streaming, aborts and
data parallelism, and the line's figures."""
import logging
import re
import time

import pytest

import nanovllm.engine.stats_logger as stats_logger
from nanovllm import LLM, SamplingParams
from nanovllm.outputs import RequestMetrics

SETTINGS = dict(device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256)
SHARED = list(range(100, 140))  # two whole blocks and a bit
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LINE = re.compile(r"Engine (\d{3}): Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) "
                  r"tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, (?:Preemptions: (\d+), )?GPU KV cache usage: "
                  r"([\d.]+)%, Prefix cache hit rate: ([\d.]+)%$")


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, disable_log_stats=False, max_num_batched_tokens=64, **SETTINGS) as engine:
        yield engine


def stat_lines(caplog) -> list[re.Match]:
    return [LINE.match(r.getMessage()) for r in caplog.records
            if r.name == "nanovllm" and r.getMessage().startswith("Engine ") and "SpecDecoding" not in r.getMessage()]


def assert_consistent(out, finished: bool = True) -> RequestMetrics:
    """The invariants every output's metrics keep."""
    m = out.metrics
    assert isinstance(m, RequestMetrics) and not m.is_corrupted
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_cached_tokens == out.num_cached_tokens
    assert 0 < m.arrival_time <= m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
    assert m.first_token_latency == pytest.approx(m.first_token_ts - m.arrival_time)
    assert m.first_token_time == m.first_token_ts and m.last_token_time == m.last_token_ts  # the earlier names
    if finished:
        assert m.last_token_ts <= m.finished_time
    else:
        assert m.finished_time is None
    return m


def run_steps(llm: LLM) -> list[tuple[float, float, list, set[str]]]:
    """Step until every request finished: per step, the wall clock before and after it, its outputs, and the
    requests that had a sequence preempted (waiting again) after it."""
    engine, steps = llm.engine, []
    while not llm.is_finished():
        before = time.time()
        outputs = llm.step()
        after = time.time()
        preempted = {engine._completions[seq.seq_id][0].request_id for seq in engine.scheduler.waiting
                     if seq.status.name == "PREEMPTED"}
        steps.append((before, after, outputs, preempted))
    return steps


def test_vllms_test_log_stats(tied_model):
    """vLLM's tests/entrypoints/llm/test_generate.py::test_log_stats: with disable_log_stats=False every output
    has metrics."""
    with LLM(tied_model, disable_log_stats=False, **SETTINGS) as llm:
        outputs = llm.generate([[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 45))], sampling_params=None,
                               use_tqdm=False)
    assert all(output.metrics is not None for output in outputs)


def test_metrics_are_taken_when_each_event_happens(llm):
    """Step by step: a request's first and latest tokens are stamped in the steps that gave them; a request
    admitted later (max_num_seqs) is scheduled after the first ones finished, not when it arrived."""
    ids = [llm.add_request(p, GREEDY) for p in ([1, 2, 3, 4, 5], [7, 8, 9])]
    engine = llm.engine
    engine.scheduler.max_num_seqs, kept = 1, engine.scheduler.max_num_seqs
    try:
        steps = run_steps(llm)
    finally:
        engine.scheduler.max_num_seqs = kept
    final, first_seen = {}, {}
    for before, after, outputs, _ in steps:
        for out in outputs:
            m = assert_consistent(out, finished=out.finished)
            assert before <= m.last_token_ts <= after  # this step gave it a token
            first_seen.setdefault(out.request_id, (before, after))
            final[out.request_id] = out
    for request_id in ids:
        m = assert_consistent(final[request_id])
        before, after = first_seen[request_id]
        assert before <= m.first_token_ts <= after and m.num_generation_tokens == GREEDY.max_tokens
    first, second = final[ids[0]].metrics, final[ids[1]].metrics
    assert second.arrival_time < first.finished_time < second.scheduled_ts  # it waited for the first one
    assert second.first_token_latency > first.first_token_latency


def test_a_chunked_prompt_is_scheduled_steps_before_its_first_token(llm):
    request_id = llm.add_request(list(range(10, 160)), GREEDY)  # 150 tokens, 64 a step: three chunks
    steps = run_steps(llm)
    assert [len(outputs) for _, _, outputs, _ in steps[:3]] == [0, 0, 1]
    m = assert_consistent(steps[-1][2][0])
    assert steps[-1][2][0].request_id == request_id and m.num_generation_tokens == GREEDY.max_tokens
    assert steps[0][0] <= m.scheduled_ts <= steps[0][1] < steps[2][0] <= m.first_token_ts <= steps[2][1]


def test_speculative_steps_count_every_accepted_token(tied_model, caplog, monkeypatch):
    """Several tokens a step: the counts are the tokens kept, and the interval's SpecDecoding line is vLLM's."""
    from test_speculative import GREEDY as SPEC_GREEDY
    from test_speculative import grounded_prompts, spec_llm

    monkeypatch.setattr(stats_logger, "LOG_STATS_INTERVAL_S", 0.0)
    prompts = grounded_prompts([7, 12])
    with spec_llm(tied_model, disable_log_stats=False) as llm, caplog.at_level(logging.INFO, logger="nanovllm"):
        ids = [llm.add_request(p, SPEC_GREEDY) for p in prompts]
        steps = run_steps(llm)
        stats = llm.stats()
    assert stats["num_accepted_tokens"] > 0
    counts = {request_id: [] for request_id in ids}
    for _, _, outputs, _ in steps:
        for out in outputs:
            m = assert_consistent(out, finished=out.finished)
            assert m.num_generation_tokens == len(out.outputs[0].token_ids)
            counts[out.request_id].append(m.num_generation_tokens)
    assert all(c[-1] == SPEC_GREEDY.max_tokens for c in counts.values())
    assert any(b - a > 1 for c in counts.values() for a, b in zip(c, c[1:])), "a step kept several tokens"
    assert stats["num_generation_tokens"] == 2 * SPEC_GREEDY.max_tokens
    spec = [r.getMessage() for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]
    assert spec and all(re.match(r"Engine 000: SpecDecoding metrics: Mean acceptance length: [\d.]+, Accepted "
                                 r"throughput: [\d.]+ tokens/s, Drafted throughput: [\d.]+ tokens/s, Accepted: \d+ "
                                 r"tokens, Drafted: \d+ tokens, Per-position acceptance rate: [\d., ]+, Avg Draft "
                                 r"acceptance rate: [\d.]+%$", line) for line in spec)
    accepted = sum(int(re.search(r"Accepted: (\d+) tokens", line).group(1)) for line in spec)
    assert accepted == stats["num_accepted_tokens"]


def test_preempted_requests_keep_their_first_schedule_and_exact_counts(tied_model):
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([30, 50, 20, 45, 60, 10])]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(tied_model, num_kvcache_blocks=16, **SETTINGS) as llm:
        ids = [llm.add_request(p, params) for p in prompts]
        steps = run_steps(llm)
        assert llm.stats()["num_preemptions"] > 0
    final, first_token, preempted_at = {}, {}, {}
    for _, after, outputs, preempted in steps:
        for out in outputs:
            final[out.request_id] = out
            first_token.setdefault(out.request_id, out.metrics.first_token_ts)
        for request_id in preempted:
            preempted_at.setdefault(request_id, after)
    assert preempted_at, "some request was preempted"
    for request_id in ids:
        m = assert_consistent(final[request_id])
        assert m.num_generation_tokens == len(final[request_id].outputs[0].token_ids) == 48
        assert m.first_token_ts == first_token[request_id]  # a recomputation does not move it
        if request_id in preempted_at:
            assert m.scheduled_ts <= preempted_at[request_id]  # the first schedule, not the one after preemption


def test_cached_prefix_n_samples_streaming_and_counters(llm):
    stats = llm.stats()
    llm.generate([SHARED + [1]], GREEDY, use_tqdm=False)
    cached, pair = llm.generate([SHARED + [2], [5, 6, 7]], [GREEDY, SamplingParams(n=2, seed=1, max_tokens=6)],
                                use_tqdm=False)
    m = assert_consistent(cached)
    assert m.num_cached_tokens == cached.num_cached_tokens == 32 and m.num_prompt_tokens == 41
    m = assert_consistent(pair)
    assert m.num_generation_tokens == sum(len(c.token_ids) for c in pair.outputs) == 12  # both samples
    deltas = list(llm.stream([[9, 10, 11]], GREEDY))
    counts = [d.metrics.num_generation_tokens for d in deltas]
    assert counts == [sum(len(d.outputs[0].token_ids) for d in deltas[:i + 1]) for i in range(len(deltas))]
    assert counts[-1] == GREEDY.max_tokens and deltas[0].metrics.num_generation_tokens == 1  # each keeps its own
    assert [d.metrics.last_token_ts for d in deltas] == sorted(d.metrics.last_token_ts for d in deltas)
    assert len({d.metrics.first_token_ts for d in deltas}) == 1
    for d in deltas:
        assert_consistent(d, finished=d.finished)
    after = llm.stats()
    grown = {key: after[key] - stats[key] for key in ("num_prompt_sequences", "num_prompt_tokens",
                                                      "num_prompt_cached_tokens", "num_generation_tokens")}
    # sequences: the shared prompt, the cached one, 2 samples of [5, 6, 7], the stream
    assert grown == {"num_prompt_sequences": 5, "num_prompt_tokens": 41 + 41 + 2 * 3 + 3,
                     "num_prompt_cached_tokens": 32, "num_generation_tokens": 8 + 8 + 12 + 8}
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:generation_tokens"].value == after["num_generation_tokens"]
    assert metrics["vllm:prompt_tokens"].value == after["num_prompt_tokens"]
    assert metrics["vllm:num_requests_running"].value == metrics["vllm:num_requests_waiting"].value == 0.0


def test_aborted_requests_finish_with_their_metrics(llm):
    engine = llm.engine
    engine.scheduler.max_num_seqs, kept = 1, engine.scheduler.max_num_seqs
    try:
        last = {}
        stream = llm.stream([[1, 2, 3], [4, 5, 6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        for delta in stream:
            last[delta.request_id] = delta
            if len(last) == 1 and delta.metrics.num_generation_tokens == 3:
                llm.abort_request([delta.request_id, str(int(delta.request_id) + 1)])
    finally:
        engine.scheduler.max_num_seqs = kept
    running, waiting = sorted(last.values(), key=lambda d: int(d.request_id))
    assert running.outputs[0].finish_reason == waiting.outputs[0].finish_reason == "abort"
    m = assert_consistent(running)
    assert m.num_generation_tokens == 3
    m = waiting.metrics  # never scheduled: no schedule nor token time, and it is not left behind
    assert m.scheduled_ts == m.first_token_ts == m.last_token_ts == 0.0 and m.num_generation_tokens == 0
    assert m.arrival_time <= m.queued_ts <= m.finished_time and m.first_token_time is None
    assert not engine._unscheduled and llm.is_finished()


def test_metrics_without_log_stats_and_the_setting_is_checked(tied_model, caplog, monkeypatch):
    """Off by default, as vLLM's LLM: no line, however short the interval; the metrics are filled all the same
    (nanovllm's outputs always had them; vLLM's are None then)."""
    monkeypatch.setattr(stats_logger, "LOG_STATS_INTERVAL_S", 0.0)
    with LLM(tied_model, **SETTINGS) as llm, caplog.at_level(logging.DEBUG, logger="nanovllm"):
        assert llm.engine.stat_logger is None
        out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert_consistent(out)
    assert stat_lines(caplog) == []
    with pytest.raises(ValueError, match="disable_log_stats must be a bool"):
        LLM(tied_model, disable_log_stats="no", **SETTINGS)


def test_the_periodic_line_counts_running_and_waiting(llm, caplog, monkeypatch):
    monkeypatch.setattr(stats_logger, "LOG_STATS_INTERVAL_S", 0.0)  # a line after every step
    engine = llm.engine
    engine.scheduler.max_num_seqs, kept = 2, engine.scheduler.max_num_seqs
    steps = llm.stats()["num_steps"]
    try:
        with caplog.at_level(logging.INFO, logger="nanovllm"):
            llm.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]], GREEDY, use_tqdm=False)
    finally:
        engine.scheduler.max_num_seqs = kept
    lines = stat_lines(caplog)
    assert all(lines) and len(lines) == llm.stats()["num_steps"] - steps
    first, last = lines[0].groups(), lines[-1].groups()
    assert first[0] == "000" and first[3:5] == ("2", "2") and float(first[1]) > 0  # two ran, two waited
    assert last[3:5] == ("0", "0") and float(last[6]) == 0.0  # every block free again
    assert all(float(line.group(3)) > 0 for line in lines)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_line_every_interval_of_work_with_vllms_figures(llm, caplog, monkeypatch):
    """At most one line per interval, throughputs over the work since the last line, the time the engine had no
    request left out; a second line with speculative decoding's figures when drafts were verified."""
    clock = FakeClock()
    monkeypatch.setattr(stats_logger, "time", clock)
    monkeypatch.setattr(stats_logger, "LOG_STATS_INTERVAL_S", 10.0)
    engine = llm.engine
    start = llm.stats()
    engine.stat_logger.window_start, engine.stat_logger.last = None, start  # a fresh window
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        llm.add_request([1, 2, 3, 4], GREEDY)
        llm.step()  # the prompt: window opens at 1000
        clock.now += 4
        llm.step()
        assert stat_lines(caplog) == []
        clock.now += 7
        llm.step()  # 11 s of work
        [line] = stat_lines(caplog)
        assert float(line.group(2)) == pytest.approx(round(4 / 11, 1))  # one prompt of 4 tokens
        assert float(line.group(3)) == pytest.approx(round(3 / 11, 1))  # three tokens
        assert line.group(4) == "1" and line.group(5) == "0"
        while not llm.is_finished():
            llm.step()
        clock.now += 1000  # idle: not counted
        caplog.clear()
        llm.add_request(SHARED, GREEDY)
        llm.step()
        clock.now += 10
        llm.step()
        [line] = stat_lines(caplog)
        generated = llm.stats()["num_generation_tokens"] - start["num_generation_tokens"] - 3
        assert float(line.group(3)) == pytest.approx(round(generated / 10, 1))  # 10 s of work, not 1010
        while not llm.is_finished():
            llm.step()


def test_data_parallel_metrics_and_lines_reach_the_caller(tied_model, caplog, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.000001")  # the replicas read it when they start
    prompts = [SHARED + [i] for i in range(3)] + [[7, 8, 9], list(range(20, 45))]
    with LLM(tied_model, data_parallel_size=2, disable_log_stats=False, **SETTINGS) as llm, \
            caplog.at_level(logging.INFO, logger="nanovllm"):
        submitted = time.time()
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        deltas = list(llm.stream([[4, 5, 6]], GREEDY))
        stats = llm.stats()
        for delta in llm.stream([[4, 5]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
            if not delta.finished:
                llm.abort_request(delta.request_id)
        aborted = delta
    for out in [*outputs, deltas[-1]]:
        m = assert_consistent(out)
        assert m.num_generation_tokens == GREEDY.max_tokens
    assert [d.metrics.num_generation_tokens for d in deltas] == list(range(1, GREEDY.max_tokens + 1))
    assert aborted.outputs[0].finish_reason == "abort" and assert_consistent(aborted).num_generation_tokens >= 1
    assert submitted <= outputs[0].metrics.arrival_time  # the front's arrival, before the replica queued it
    assert sorted(o.metrics.num_cached_tokens for o in outputs[:3]) == [0, 32, 32]
    assert stats["num_generation_tokens"] == 6 * GREEDY.max_tokens
    engines = {line.group(1) for line in stat_lines(caplog)}
    assert engines == {"000", "001"}, "both replicas' lines, logged by the front"
