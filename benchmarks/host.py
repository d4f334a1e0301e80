"""The `--host-overhead` mode: what a decode step costs outside the model, with a model so small that the model costs
little.

A 1-layer, hidden-32 Qwen3 with random weights and a byte-level tokenizer decodes `batch` requests on the CPU. The
engine's profiling hook (`llm.engine.model_runner.phase_seconds`, the one this package documents) times each step's
phases; a step's host work is its wall time minus its device phases, "model" (embedding, layers, final norm),
"lm_head" and "sampler" (and "draft", unused here): scheduling, preparing the batch's tensors (the "prepare" phase,
also reported on its own), the runner's glue, appending tokens, detokenizing, building outputs. On a GPU all of it is
overhead on every step.

Measured two ways:
- through `step()` (which builds each updated request's output every step): per decode step, the median over steps;
- through `generate()`, whose steps run inside one call: the difference between a call decoding `steps` tokens per
  request and one stopping after the first token (the prompt's step), over the decode steps between them, so the
  prompt step and each call's own setup cancel out; the median of three such pairs (a mean per step within each).
"""
import argparse
import json
import os
import statistics
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from benchmarks.report import markdown_table
from nanovllm import LLM, SamplingParams

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "eos_token_id": 0}
DEVICE_PHASES = ("draft", "model", "lm_head", "sampler")  # the rest of a step's wall time is host work
PAIRS = 3  # generate() pairs (a long and a one-token call)


def run(args: argparse.Namespace) -> dict:
    """--host-overhead: host milliseconds per decode step at batch `--host-batch`; prints the table."""
    result = host_overhead(args.host_batch)
    print(markdown_table(["decode batch", "host ms per step, generate()", "host ms per step, step()",
                          "of which prepare ms", "model ms per step"],
                         [[str(result["batch"]), f"{result['generate_ms']:.2f}", f"{result['step_ms']:.2f}",
                           f"{result['prepare_ms']:.2f}", f"{result['model_ms']:.2f}"]]))
    return result


def write_tiny_model(path: str) -> None:
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


def device_seconds(phases: dict[str, float]) -> float:
    return sum(phases.get(phase, 0.0) for phase in DEVICE_PHASES)


def host_overhead(batch: int = 256, steps: int = 64) -> dict[str, float]:
    """Host milliseconds per decode step through `generate()` and `step()`; of the `step()` ones, the "prepare"
    phase's; the device phases' ("model_ms")."""
    with tempfile.TemporaryDirectory(prefix="nanovllm-host-") as path:
        write_tiny_model(path)
        with LLM(path, device="cpu", load_format="dummy", max_num_seqs=batch, max_model_len=steps + 16,
                 max_num_batched_tokens=max(batch * 16, 2048), kvcache_block_size=16) as llm:
            phases: dict[str, float] = {}
            llm.engine.model_runner.phase_seconds = phases  # the documented profiling hook
            run_number = iter(range(1_000_000))

            def prompts() -> list[list[int]]:
                """8 tokens each, never seen before (no prefix cache hit)."""
                n = next(run_number)
                return [[(i * 7 + j + 13 * n) % 500 + 1 for j in range(8)] for i in range(batch)]

            def timed_generate(max_tokens: int) -> tuple[float, int]:
                """Host seconds of one generate() call, and its steps."""
                phases.clear()
                before = llm.stats()["num_steps"]
                start = time.perf_counter()
                llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             use_tqdm=False)
                wall = time.perf_counter() - start
                return wall - device_seconds(phases), llm.stats()["num_steps"] - before

            timed_generate(steps)  # warm-up
            generate_host = []
            for _ in range(PAIRS):
                (long_s, long_steps), (short_s, short_steps) = timed_generate(steps), timed_generate(1)
                generate_host.append((long_s - short_s) / (long_steps - short_steps))
            params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            for prompt in prompts():
                llm.add_request(prompt, params)
            step_host, prepare, model = [], [], []
            while not llm.is_finished():
                phases.clear()
                start = time.perf_counter()
                llm.step()
                wall = time.perf_counter() - start
                step_host.append(wall - device_seconds(phases))
                prepare.append(phases.get("prepare", 0.0))
                model.append(device_seconds(phases))
            llm.engine.model_runner.phase_seconds = None
    decode = slice(2, None)  # past the prompt's step and the first decode step
    ms = lambda seconds: 1000 * statistics.median(seconds)
    return {"generate_ms": ms(generate_host), "step_ms": ms(step_host[decode]), "prepare_ms": ms(prepare[decode]),
            "model_ms": ms(model[decode]), "batch": batch}
