from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **engine_settings).generate(prompts, sampling_params)`."""
