"""`bench.py --structured --jump-forward-compare`: what exact jump-forward saves on the JSON-schema workload.

The same engine runs the constrained requests (greedy, submitted at once) with jump-forward off and on, interleaved
(off, on, off, on, ...), each run compiling its grammars afresh: forward passes (engine steps) per completion token
of the whole batch; a request's decode passes per token of its own (each of its steps yields its accepted drafts and
one token more: 1 - accepted / tokens); tok/s; the forced drafts' acceptance; and whether the outputs are
token-identical (they must be).
"""
import statistics
import time

from nanovllm import LLM, SamplingParams


def compare_jump_forward(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], repeat: int) -> dict:
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeat):
        for mode in runs:
            llm.engine.grammar_drafts.jump_forward = mode == "on"
            llm.engine.structured.clear_cache()
            before = llm.stats()
            start = time.perf_counter()
            done = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.stats()
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            outputs[mode] = [o.outputs[0].token_ids for o in done]
            counts = {k: after[k] - before[k] for k in ("num_steps", "num_draft_tokens", "num_accepted_tokens")}
            runs[mode].append({"tokens_per_s": tokens / seconds, "steps_per_token": counts["num_steps"] / tokens,
                               "request_passes_per_token": 1 - counts["num_accepted_tokens"] / tokens, **counts})
    llm.engine.grammar_drafts.jump_forward = llm.config.jump_forward
    figures = {mode: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "steps_per_token": statistics.median(r["steps_per_token"] for r in rs),
                      "request_passes_per_token": statistics.median(r["request_passes_per_token"] for r in rs),
                      "num_draft_tokens": rs[-1]["num_draft_tokens"],
                      "num_accepted_tokens": rs[-1]["num_accepted_tokens"]}
               for mode, rs in runs.items()}
    return {**figures, "identical": outputs["off"] == outputs["on"]}


def jump_forward_row(name: str, figures: dict) -> list[str]:
    off, on = figures["off"], figures["on"]
    drafts = on["num_draft_tokens"]
    accepted = f"{on['num_accepted_tokens']} of {drafts}" if drafts else "none proposed"
    return [name, f"{off['steps_per_token']:.3f}", f"{on['steps_per_token']:.3f}",
            f"{on['request_passes_per_token']:.3f}", f"{off['tokens_per_s']:.1f}",
            f"{on['tokens_per_s']:.1f}", f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x", accepted,
            "yes" if figures["identical"] else "NO"]


JUMP_FORWARD_HEADER = ["engine", "steps/token off", "steps/token on", "request passes/token on", "tok/s off",
                       "tok/s on", "on/off",
                       "forced drafts accepted", "identical"]
