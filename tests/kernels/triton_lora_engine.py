"""The engine with its LoRA deltas added by the Triton kernels, as on CUDA (`LoRAManager.use_triton`, a graph's row
buffer of 8 rows), on the CPU under the interpreter; run by test_triton_lora.py under TRITON_INTERPRET=1.

Prints one JSON line: the engine's greedy tokens and PEFT's, for three adapters and the base mixed in one call with
max_loras=2 (so the adapters in the slots change from step to step), and how many steps used the row buffer.
"""
import json
import tempfile

from checkpoints import make_checkpoint
from lora.test_lora_engine import ADAPTERS, GREEDY, PROMPTS, make_adapter, peft_greedy, tokens

from nanovllm import LLM
from nanovllm.layers.lora import lora_step
from nanovllm.lora.request import LoRARequest

SHORT = PROMPTS[1:]  # the interpreter is slow: the two short prompts


def main(root: str) -> dict:
    base = make_checkpoint(f"{root}/base", family="qwen3", seed=11)
    paths = {name: make_adapter(base, f"{root}/{name}", i, **settings) for i, (name, settings) in
             enumerate(ADAPTERS.items())}
    names = [None, *paths]
    expected = [t for name in names for t in peft_greedy(base, paths.get(name), SHORT)]
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    with LLM(base, enable_lora=True, device="cpu", dtype="float32", kvcache_block_size=16, max_loras=2,
             max_lora_rank=8, max_num_seqs=4, enforce_eager=True) as llm:
        manager = llm.engine.model_runner.loras
        manager.use_triton(8)
        buffered, start_step = [], manager.start_step

        def recorded_start_step(rows: list[tuple[int, int]]) -> None:
            start_step(rows)
            buffered.append(lora_step().token_index is manager.graph_rows)

        manager.start_step = recorded_start_step
        outputs = llm.generate([p for _ in names for p in SHORT], GREEDY,
                               lora_request=[requests.get(name) for name in names for _ in SHORT], use_tqdm=False)
    return {"tokens": tokens(outputs), "expected": expected, "buffered_steps": sum(buffered)}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        print(json.dumps(main(root)))
