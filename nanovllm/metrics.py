"""`LLM.get_metrics()`: the engine's counters as vLLM v1's metric objects (`vllm.v1.metrics.reader`), so code that
reads vLLM's speculative decoding metrics reads nanovllm's the same way. Each metric carries the labels
`model_name` and `engine` (the data-parallel replica, "0" without data parallelism)."""
from dataclasses import dataclass


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's one: `vllm:spec_decode_num_accepted_tokens_per_pos`)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations counted in buckets: `buckets` maps each bucket's upper limit (as text, "+Inf" the last) to the
    observations up to it (cumulative, as Prometheus counts them); `count` is the "+Inf" bucket's, `sum` their total."""

    count: int
    sum: float
    buckets: dict[str, int]


def one_two_five_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 series of bucket limits up to `max_value`: 1, 2, 5, 10, 20, 50, ..."""
    limits, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return limits
            limits.append(mantissa * scale)
        scale *= 10


def histogram(name: str, labels: dict[str, str], limits: list[int], counts: list[int], total: float) -> Histogram:
    """A `Histogram` of observations counted per bucket (`counts[i]`: those in (limits[i-1], limits[i]]; one more
    count for those above the last limit)."""
    buckets, running = {}, 0
    for limit, count in zip(limits, counts):
        running += count
        buckets[str(float(limit))] = running
    buckets["+Inf"] = sum(counts)
    return Histogram(name, labels, sum(counts), total, buckets)


def metrics_from_stats(stats: dict, model_name: str, max_model_len: int, engine: int = 0) -> list[Metric]:
    """One engine's `stats()` as vLLM's metrics: requests running and waiting (sequences: each of `n` samples
    counts, as vLLM's child requests), preemptions, prompt tokens (of each sequence, counted at its first token)
    and generated tokens, prefix cache hits (tokens), KV cache usage, the tokens each finished sequence generated
    (a histogram over `one_two_five_buckets(max_model_len)`), and with speculative decoding the drafts (verification
    rows), draft tokens, accepted tokens and accepted tokens per draft position."""
    labels = {"model_name": model_name, "engine": str(engine)}
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", labels, float(stats["num_requests_running"])),
        Gauge("vllm:num_requests_waiting", labels, float(stats["num_requests_waiting"])),
        Counter("vllm:num_preemptions", labels, stats["num_preemptions"]),
        Counter("vllm:prompt_tokens", labels, stats["num_prompt_tokens"]),
        Counter("vllm:generation_tokens", labels, stats["num_generation_tokens"]),
        Counter("vllm:prefix_cache_hits", labels, stats["num_cached_tokens"]),
        Gauge("vllm:kv_cache_usage_perc", labels, 1 - stats["num_free_blocks"] / stats["num_blocks"]),
        histogram("vllm:request_generation_tokens", labels, one_two_five_buckets(max_model_len),
                  stats["num_finished_per_generation_tokens_bucket"], stats["num_finished_generation_tokens"])]
    if "num_draft_tokens" in stats:
        metrics += [Counter("vllm:spec_decode_num_drafts", labels, stats["num_spec_rows"]),
                    Counter("vllm:spec_decode_num_draft_tokens", labels, stats["num_draft_tokens"]),
                    Counter("vllm:spec_decode_num_accepted_tokens", labels, stats["num_accepted_tokens"]),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,
                           stats["num_accepted_per_position"])]
    return metrics
