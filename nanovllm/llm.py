from nanovllm.engine.data_parallel import DataParallelLLM
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.setup import resolve_config


class LLM:
    """The public entry point, as vLLM's: `LLM(model, **engine_settings).generate(prompts, sampling_params)`.

    The settings are resolved once (`nanovllm.engine.setup.resolve_config`) and run by `engine`: one `LLMEngine` in
    this process, or with `data_parallel_size=N` (N > 1) a `DataParallelLLM` of N engine replicas in worker
    processes. Both serve the same methods (`generate`, `chat`, `stream`, `add_request`, `step`, `abort_request`,
    `is_finished`, `stats`, `get_tokenizer`, `exit`, ...), which `LLM` hands to `engine` as they are.
    """

    def __init__(self, model: str | None = None, data_parallel_size: int = 1, **settings):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        config = resolve_config(model, settings)
        self.engine = LLMEngine(config) if data_parallel_size == 1 else DataParallelLLM(config, data_parallel_size)

    def __getattr__(self, name: str):
        if name == "engine":  # not set: __init__ raised
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.engine.exit()
