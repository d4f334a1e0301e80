"""The `--lora N` mode: the workload's requests spread over N LoRA adapters, against the same requests on the base
model in the same engine, and vLLM's rates with the same adapters under `--baseline vllm`.

The adapters are PEFT's own (`get_peft_model` with `init_lora_weights=False`: random, non-zero), rank `--lora-rank`,
on every linear layer of the model's architecture (PEFT's "all-linear"), written to a temporary directory; request i
runs under adapter i mod N. nanovllm runs `LLM(model, enable_lora=True, max_loras=N, max_lora_rank=R)` and times, in
turn (`--repeat` rounds, medians), the requests without an adapter and with theirs, greedy with `ignore_eos` (the
`vllm-cpu` workload's lengths unless flags say otherwise), so both runs produce the same number of tokens. With
`--baseline vllm` a GGUF model is dequantized into a float32 directory that both engines load, and vLLM
(`vllm_lora_runner.py`, its own python) times the same two runs after each of nanovllm's rounds.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.baselines import find_vllm_python, run_vllm_runner
from benchmarks.machine import bench_device
from benchmarks.model import config_dir, structured_weights
from benchmarks.options import resolve_workload
from benchmarks.report import markdown_table
from benchmarks.workload import make_requests
from nanovllm import LLM, SamplingParams, default_model
from nanovllm.lora.request import LoRARequest


def write_adapters(model: str, count: int, rank: int, root: str, seed: int) -> list[str]:
    """`count` random PEFT adapters of rank `rank` on every linear layer of `model`'s architecture, one directory
    each under `root`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir(model))
    paths = []
    for index in range(count):
        torch.manual_seed(seed + index)
        base = AutoModelForCausalLM.from_config(config)
        adapter = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                  init_lora_weights=False))
        paths.append(os.path.join(root, f"adapter-{index}"))
        adapter.save_pretrained(paths[-1])
    return paths


def run(args: argparse.Namespace) -> dict:
    """--lora N: the table of both engines' rates with and without adapters, printed; the figures returned."""
    device = bench_device(args.device)
    if args.workload == "nano-vllm":
        args.workload = "vllm-cpu"  # greedy, so that vLLM's runs produce the same tokens
    args.scheduling = ["chunked"]  # the engine's default (vLLM V1's): one row, not one per scheduling mode
    resolve_workload(args, device)
    count, rank = args.lora, args.lora_rank
    vllm_python = find_vllm_python(args.vllm_python, device) if args.baseline == "vllm" else None
    with structured_weights(args.model or default_model(), args.baseline) as (model, weights, _), \
            tempfile.TemporaryDirectory(prefix="nanovllm-lora-") as root:
        print(f"writing {count} rank-{rank} adapters with PEFT ...", file=sys.stderr)
        paths = write_adapters(model, count, rank, root, args.seed)
        with LLM(model, device=device, dtype=args.dtype, enable_lora=True, max_loras=count, max_lora_rank=rank,
                 max_num_batched_tokens=args.max_num_batched_tokens) as llm:
            dtype = str(llm.config.torch_dtype).removeprefix("torch.")
            requests = make_requests(args, llm.config.hf_config.vocab_size, model)
            prompts = [{"prompt_token_ids": ids} for ids in requests.prompts]
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in requests.max_tokens]
            loras = [LoRARequest(f"adapter-{i % count}", i % count + 1, paths[i % count]) for i in range(len(prompts))]
            llm.generate(prompts[:count], params[:count], lora_request=loras[:count], use_tqdm=False)  # loads them
            rounds: dict[str, list[float]] = {}
            for _ in range(args.repeat):
                for name, lora in (("nanovllm, base", None), (f"nanovllm, {count} adapters", loras)):
                    start = time.perf_counter()
                    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
                    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                    rounds.setdefault(name, []).append(tokens / (time.perf_counter() - start))
                if vllm_python:
                    print("vLLM ...", file=sys.stderr)
                    figures = run_vllm_runner(vllm_python, "vllm_lora_runner.py", model,
                                              {"prompts": requests.prompts, "max_tokens": requests.max_tokens,
                                               "adapters": paths, "rank": rank},
                                              "--dtype", dtype, "--max-model-len",
                                              str(args.max_input_len + args.max_output_len))
                    for name in ("base", "adapters"):
                        rounds.setdefault(f"{figures['engine']}, {name if name == 'base' else f'{count} adapters'}",
                                          []).append(figures[name])
    rates = {name: statistics.median(values) for name, values in rounds.items()}
    rows, result = [], {"model": weights, "dtype": dtype, "adapters": count, "rank": rank,
                        "requests": len(prompts), "tokens_per_s": rates, "rounds": rounds}
    names = list(rates)
    for base, lora in zip(names[::2], names[1::2]):
        rows.append([base, f"{rates[base]:.1f}", ""])
        rows.append([lora, f"{rates[lora]:.1f}", f"{rates[lora] / rates[base]:.2f}x"])
    if vllm_python:
        result["lora_vs_vllm"] = rates[names[1]] / rates[names[3]]
        print(f"nanovllm / vLLM with {count} adapters: {result['lora_vs_vllm']:.2f}x")
    print(f"\n{len(prompts)} requests, {count} rank-{rank} adapters on every linear layer, {weights}, {dtype}, "
          f"{args.repeat} round(s), engines in turn (median)")
    print(markdown_table(["engine", "tok/s", "with adapters / base"], rows))
    return result
