"""vLLM's `vllm.v1.metrics.reader`: the metric objects of `LLM.get_metrics()` (`nanovllm.metrics`)."""
from nanovllm.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
