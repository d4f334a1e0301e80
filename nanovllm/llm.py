from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **engine_settings).generate(prompts, sampling_params)`.

    With `data_parallel_size=N` (N > 1) it is a `nanovllm.data_parallel.DataParallelLLM` instead: N replicas of the
    engine in worker processes behind the same API.
    """

    def __new__(cls, model: str | None = None, data_parallel_size: int = 1, **settings):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        if data_parallel_size > 1:
            from nanovllm.data_parallel import DataParallelLLM

            return DataParallelLLM(model, data_parallel_size, **settings)
        return super().__new__(cls)

    def __init__(self, model: str | None = None, data_parallel_size: int = 1, **settings):
        super().__init__(model, **settings)
