"""Batch inference across machines on Ray Data (`pip install "nanovllm[ray]"`), shaped like Ray Data's own LLM
processor for vLLM: rows with a `prompt` (text or token ids) or `messages` (a conversation) column, and optionally a
`sampling_params` column (a dict of `SamplingParams` fields per row), come back with the generated text and tokens.

    import ray
    from nanovllm.ray import build_processor

    processor = build_processor("/models/Qwen3-0.6B", concurrency=4, num_gpus=1, batch_size=64,
                                sampling_params={"temperature": 0, "max_tokens": 128})
    results = processor(ray.data.read_parquet("s3://bucket/prompts/")).take_all()

`build_processor` maps the dataset with `LLMProcessor`, a callable class that builds one engine per Ray actor; the
actors are restarted and their batches retried when a worker (or its machine) is lost.
"""
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "finish_reason", "num_input_tokens", "num_generated_tokens")


class LLMProcessor:
    """For `Dataset.map_batches`: one `LLM` per actor, built from `model` and `engine_kwargs`; each batch's rows are
    generated together (continuous batching), each with `sampling_params` overridden by its row's own."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any] | None = None,
                 sampling_params: dict[str, Any] | None = None):
        from nanovllm import LLM

        self.llm = LLM(model, **(engine_kwargs or {}))
        self.sampling_params = dict(sampling_params or {})

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        if not rows:
            return {**{name: list(values) for name, values in batch.items()}, **{c: [] for c in OUTPUT_COLUMNS}}
        params = [SamplingParams(**{**self.sampling_params, **_row_params(row.get("sampling_params"))})
                  for row in rows]
        if "messages" in batch:
            outputs = self.llm.chat([[dict(m) for m in row["messages"]] for row in rows], params, use_tqdm=False)
        elif "prompt" in batch:
            outputs = self.llm.generate([_prompt(row["prompt"]) for row in rows], params, use_tqdm=False)
        else:
            raise ValueError(f"rows need a 'prompt' or a 'messages' column; these have {sorted(batch)}")
        return {**{name: list(values) for name, values in batch.items()}, **_columns(outputs)}


_INTEGER_FIELDS = {f.name for f in fields(SamplingParams) if f.type in (int, int | None)}


def _row_params(value: dict | None) -> dict[str, Any]:
    """A row's sampling fields as Python values. Ray stores the column as one struct for all rows: a field a row did
    not set is None there, numbers arrive as numpy scalars (an integer field as a float when another row left it out)
    and lists as arrays."""
    params = {}
    for name, v in (value or {}).items():
        v = v.tolist() if hasattr(v, "tolist") else v
        if v is not None:
            params[name] = int(v) if name in _INTEGER_FIELDS and isinstance(v, float) and v.is_integer() else v
    return params


def _prompt(value: Any) -> str | list[int]:
    """A prompt column's value: text, or token ids (Ray hands those over as an array)."""
    return value if isinstance(value, str) else [int(t) for t in value]


def _columns(outputs: list[RequestOutput]) -> dict[str, list]:
    first = [out.outputs[0] for out in outputs]
    return {"generated_text": [c.text for c in first], "generated_tokens": [list(c.token_ids) for c in first],
            "finish_reason": [c.finish_reason for c in first],
            "num_input_tokens": [len(out.prompt_token_ids) for out in outputs],
            "num_generated_tokens": [len(c.token_ids) for c in first]}


def build_processor(model: str, *, concurrency: int = 1, batch_size: int = 32, num_gpus: float = 0,
                    num_cpus: float | None = None, engine_kwargs: dict[str, Any] | None = None,
                    sampling_params: dict[str, Any] | None = None,
                    processor: type[LLMProcessor] = LLMProcessor) -> Callable:
    """A function from a Ray Dataset to the dataset with `OUTPUT_COLUMNS` added: `concurrency` actors, each one engine
    on `num_gpus` GPUs (or `num_cpus` CPUs), fed `batch_size` rows at a time; a lost actor is restarted and its
    batch retried (Ray's `max_restarts` / `max_task_retries`)."""
    def process(dataset):
        resources = {"num_gpus": num_gpus} | ({"num_cpus": num_cpus} if num_cpus is not None else {})
        return dataset.map_batches(processor, batch_size=batch_size, concurrency=concurrency,
                                   fn_constructor_kwargs={"model": model, "engine_kwargs": engine_kwargs,
                                                          "sampling_params": sampling_params},
                                   max_restarts=-1, max_task_retries=-1, **resources)

    return process
