"""--host-overhead: what a decode step costs outside the model, with a model so small that the model costs little.

A 1-layer, hidden-32 Qwen3 with random weights and a byte-level tokenizer decodes `batch` requests; every step's
wall time minus the model runner's `run` (the forward pass and sampling) is the engine's host work: scheduling,
preparing the batch, appending tokens, detokenizing, building outputs. Measured through `generate()` and through
`step()` (which builds each updated request's output every step). On a GPU all of it is overhead on every step.
"""
import json
import os
import statistics
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nanovllm import LLM, SamplingParams

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "eos_token_id": 0}


def _write_tiny_model(path: str) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY, f)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["The quick brown fox jumps over the lazy dog; paged attention stores keys."] * 50,
                                  trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(path)


def host_overhead(batch: int = 256, steps: int = 64) -> dict[str, float]:
    """Median host milliseconds per decode step, through `generate()` and through `step()`."""
    with tempfile.TemporaryDirectory(prefix="nanovllm-host-") as path:
        _write_tiny_model(path)
        with LLM(path, device="cpu", load_format="dummy", max_num_seqs=batch, max_model_len=steps + 16,
                 max_num_batched_tokens=max(batch * 16, 2048), kvcache_block_size=16) as llm:
            engine = llm.engine
            runner, model_seconds = engine.model_runner, []
            run = runner.run

            def timed_run(*args):
                start = time.perf_counter()
                try:
                    return run(*args)
                finally:
                    model_seconds.append(time.perf_counter() - start)

            runner.run = timed_run
            prompts = [[(i * 7 + j) % 500 + 1 for j in range(8)] for i in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            step = engine._step  # generate's own loop, timed step by step
            step_seconds = []

            def timed_step():
                start = time.perf_counter()
                try:
                    return step()
                finally:
                    step_seconds.append(time.perf_counter() - start)

            engine._step = timed_step
            llm.generate(prompts, params, use_tqdm=False)
            del engine._step
            generate_host = [s - m for s, m in zip(step_seconds, model_seconds)][2:]
            model_seconds.clear()
            for prompt in prompts:
                llm.add_request(prompt, params)
            public_step = []
            while not llm.is_finished():
                start = time.perf_counter()
                llm.step()
                public_step.append(time.perf_counter() - start)
            step_host = [s - m for s, m in zip(public_step, model_seconds)][2:]
    return {"generate_ms": 1000 * statistics.median(generate_host), "step_ms": 1000 * statistics.median(step_host),
            "model_ms": 1000 * statistics.median(model_seconds[2:]), "batch": batch}
