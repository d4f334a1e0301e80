"""vLLM's periodic stats lines (its `LoggingStatLogger`), which an engine made with `disable_log_stats=False` logs
from its step loop on the "nanovllm" logger, at most once every `LOG_STATS_INTERVAL_S` seconds of work (10, or
vLLM's `VLLM_LOG_STATS_INTERVAL`):

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 12 reqs,
    Waiting: 3 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 37.5%

as vLLM words it: the prompt tokens of the sequences that got their first token and the tokens generated since the
last line, per second; the sequences running and waiting after the step (each of a request's `n` samples counts, as
vLLM's child requests do); "Preemptions: N" when some happened since the last line; the share of KV blocks in use;
prompt tokens the prefix cache served, of the last ~1000 sequences' prompts. With speculative decoding (or
jump-forward) a second line gives vLLM's "SpecDecoding metrics" of the interval. A line whose throughputs and the
previous line's are all zero goes to DEBUG, as vLLM's.

Everything comes from the engine's `stats()` counters, read only when a line is due: off, the step loop pays one
test per step; on, two clock reads. Time the engine spends without requests does not count towards the interval or
the throughputs (vLLM's window would span it). With data parallelism each replica's engine sends its lines to the
front, which logs them in the caller's process as "Engine 001: ...". Like nanovllm's other INFO messages, the lines
show where logging is set up (`logging.basicConfig(level=logging.INFO)`, say): nanovllm adds no handler of its own.
"""
import logging
import os
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger("nanovllm")


def interval_from_env() -> float:
    """vLLM's `VLLM_LOG_STATS_INTERVAL`: seconds, 10 unless set to a positive number. Read at import, so
    data-parallel replicas (spawned processes) take it from the environment they inherit."""
    try:
        interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    except ValueError:
        return 10.0
    return interval if interval > 0 else 10.0


LOG_STATS_INTERVAL_S = interval_from_env()
RECENT_SEQUENCES = 1000  # the prefix cache hit rate is over about this many latest sequences (vLLM's CachingMetrics)


class StatsLogger:
    """The periodic lines of one engine (`engine_index`, 0 without data parallelism). The engine calls
    `step_started` and `step_ended` around each step; `emit(level, message)` logs a line (the "nanovllm" logger by
    default; a data-parallel replica sends it to the front)."""

    def __init__(self, engine_index: int = 0, emit: Callable[[int, str], None] | None = None):
        self.engine_index = engine_index
        self.emit = emit or logger.log
        self.window_start: float | None = None  # time.monotonic() when the interval's work began
        self.idle_since: float | None = None  # the last step left the engine without requests, at this time
        self.last: dict = {}  # the counters when the last line was logged
        self.last_throughputs = (0.0, 0.0)
        self.recent: deque[tuple[int, int, int]] = deque()  # (sequences, prompt tokens, cached tokens) per line
        self.recent_sums = [0, 0, 0]

    def step_started(self) -> None:
        now = time.monotonic()
        if self.window_start is None:
            self.window_start = now
        elif self.idle_since is not None:
            self.window_start += now - self.idle_since  # the idle time does not count
        self.idle_since = None

    def step_ended(self, stats: Callable[[], dict], idle: bool) -> None:
        """After a step: log the lines if the interval has passed (`stats`: the engine's counters); `idle`: no
        request is left."""
        now = time.monotonic()
        if now - self.window_start >= LOG_STATS_INTERVAL_S:
            self.log(stats(), now - self.window_start)
            self.window_start = None
        elif idle:
            self.idle_since = now

    def log(self, stats: dict, elapsed: float) -> None:
        """The lines for the `elapsed` seconds of work since the last one, from the counters `stats`."""
        last, self.last = self.last, stats
        delta = {key: value - last.get(key, 0) for key, value in stats.items()
                 if key.startswith("num_") and isinstance(value, int)}
        prompt, generation = rate(delta["num_prompt_tokens"], elapsed), rate(delta["num_generation_tokens"], elapsed)
        level = logging.DEBUG if not any((prompt, generation, *self.last_throughputs)) else logging.INFO
        self.last_throughputs = prompt, generation
        parts = [f"Avg prompt throughput: {prompt:.1f} tokens/s",
                 f"Avg generation throughput: {generation:.1f} tokens/s",
                 f"Running: {stats['num_requests_running']} reqs", f"Waiting: {stats['num_requests_waiting']} reqs"]
        if delta["num_preemptions"] > 0:
            parts.append(f"Preemptions: {delta['num_preemptions']}")
        usage = 1 - stats["num_free_blocks"] / stats["num_blocks"]
        parts += [f"GPU KV cache usage: {usage * 100:.1f}%",
                  f"Prefix cache hit rate: {self._hit_rate(delta) * 100:.1f}%"]
        prefix = f"Engine {self.engine_index:03d}: "
        self.emit(level, prefix + ", ".join(parts))
        if "num_spec_rows" in stats and delta["num_spec_rows"] > 0:
            self.emit(level, prefix + spec_decoding_line(stats, last, delta, elapsed))

    def _hit_rate(self, delta: dict) -> float:
        """Cached prompt tokens over prompt tokens of the latest sequences: this interval's, and earlier intervals'
        while they hold fewer than `RECENT_SEQUENCES` sequences (whole intervals are dropped, the latest kept)."""
        interval = (delta["num_prompt_sequences"], delta["num_prompt_tokens"], delta["num_prompt_cached_tokens"])
        if interval[0]:
            self.recent.append(interval)
            self.recent_sums = [total + n for total, n in zip(self.recent_sums, interval)]
        while len(self.recent) > 1 and self.recent_sums[0] > RECENT_SEQUENCES:
            self.recent_sums = [total - n for total, n in zip(self.recent_sums, self.recent.popleft())]
        return self.recent_sums[2] / self.recent_sums[1] if self.recent_sums[1] else 0.0


def rate(count: int, elapsed: float) -> float:
    return count / elapsed if elapsed > 0 else 0.0


def spec_decoding_line(stats: dict, last: dict, delta: dict, elapsed: float) -> str:
    """vLLM's "SpecDecoding metrics" line for an interval with verification rows (`delta`: the counters' growth)."""
    rows, drafted, accepted = delta["num_spec_rows"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    before = last.get("num_accepted_per_position", [])
    per_position = [(n - (before[i] if i < len(before) else 0)) / rows
                    for i, n in enumerate(stats["num_accepted_per_position"])]
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / rows:.2f}, "
            f"Accepted throughput: {rate(accepted, elapsed):.2f} tokens/s, "
            f"Drafted throughput: {rate(drafted, elapsed):.2f} tokens/s, Accepted: {accepted} tokens, "
            f"Drafted: {drafted} tokens, Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_position)}, "
            f"Avg Draft acceptance rate: {accepted / drafted * 100 if drafted else float('nan'):.1f}%")
