"""The benchmark's workload: the requests and the model they run on."""
import argparse
import random
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from benchmarks.chat import chat_prompts
from benchmarks.grounded import grounded_prompts


@dataclass
class Requests:
    """The prompts, their max_tokens and arrival times; with `ignore_eos` every request produces its max_tokens."""

    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]
    ignore_eos: bool = True

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

CHAT_WORKLOADS = {"grounded": grounded_prompts, "chat": chat_prompts}


def make_requests(args: argparse.Namespace, vocab_size: int, model_dir: str | None = None) -> Requests:
    """nano-vLLM's workload: token ids uniform in [0, 10000], lengths uniform in the given ranges; or with
    `--workload grounded` or `chat` the chat prompts of `benchmarks.grounded` or `.chat` (tokenized by
    `model_dir`'s tokenizer), ending at EOS."""
    rng = random.Random(args.seed)
    top = min(10000, vocab_size - 1)
    if args.workload in CHAT_WORKLOADS:
        prompts = CHAT_WORKLOADS[args.workload](AutoTokenizer.from_pretrained(model_dir), args.num_seqs)
    else:
        prompts = [[rng.randint(0, top) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
                   for _ in range(args.num_seqs)]
    max_tokens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]
    arrivals, t = [], 0.0
    for _ in range(args.num_seqs):
        arrivals.append(t)
        t += rng.expovariate(args.request_rate) if args.request_rate != float("inf") else 0.0
    return Requests(prompts, max_tokens, arrivals, ignore_eos=args.workload not in CHAT_WORKLOADS)


def count_parameters(model_dir: str) -> int:
    """Parameters of the model (tied embeddings counted once), without allocating them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def write_random_checkpoint(config_path: str, out_dir: str, seed: int) -> None:
    """transformers' own random init of the config, saved as a float32 safetensors checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path), dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
