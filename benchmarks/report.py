"""What the benchmarks report: each timed run, the rows made of them, the plain-text (markdown) tables printed and the
JSON file written."""
import json
from dataclasses import dataclass


@dataclass
class Served:
    """What one engine run measured."""

    seconds: float
    tokens: int
    ttft: list[float]
    itl: list[float]
    facts: dict


@dataclass
class Measured:
    """One timed run of a row: its seconds and tokens, the matmul probe taken just before it, its peak memory (None
    where it ran in another process), and what nanovllm reported (`served`) or the baseline's name and attention
    (`baseline`)."""

    seconds: float
    tokens: int
    probe: float
    peak_mem_gib: float | None
    served: Served | None = None
    baseline: tuple[str, str] | None = None


def median(measured: list[Measured]) -> Measured:
    """The run with the median throughput (the lower middle one of an even count)."""
    return sorted(measured, key=lambda m: m.tokens / m.seconds)[(len(measured) - 1) // 2]


@dataclass
class Row:
    engine: str
    attention: str
    model: str
    device: str
    dtype: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ratio: float | None
    mfu: float
    peak_mem_gib: float | None
    ttft_ms: dict[str, float] | None = None
    itl_ms: dict[str, float] | None = None


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 (nearest rank) of `values` in seconds, as milliseconds; None without values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return {f"p{p}": 1000 * ordered[-(-p * len(ordered) // 100) - 1] for p in (50, 90, 99)}


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def format_report(rows: list[Row]) -> str:
    throughput = markdown_table(
        ["engine", "attention", "model", "device", "dtype", "requests", "tokens", "seconds", "tokens/s",
         "vs baseline", "MFU", "peak mem GiB"],
        [[r.engine, r.attention, r.model, r.device, r.dtype, str(r.requests), str(r.tokens), f"{r.seconds:.1f}",
          f"{r.tokens_per_s:.1f}", "-" if r.ratio is None else f"{r.ratio:.2f}x", f"{100 * r.mfu:.1f}%",
          "-" if r.peak_mem_gib is None else f"{r.peak_mem_gib:.2f}"] for r in rows])
    timed = [r for r in rows if r.ttft_ms]
    ms = lambda p: ["-"] * 3 if p is None else [f"{v:.0f}" for v in p.values()]
    latency = markdown_table(
        ["engine", "attention", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms"],
        [[r.engine, r.attention, *ms(r.ttft_ms), *ms(r.itl_ms)] for r in timed])
    return throughput + "\n\n" + latency if timed else throughput


def save_json(result: dict, path: str | None) -> dict:
    """Write `result` to `path` as JSON (`--json`), if given; returns `result`."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result
