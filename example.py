"""Generate completions for a few prompts with a local Qwen3 checkpoint.

    python example.py --model /path/to/Qwen3-0.6B
"""
import argparse
import sys

from nanovllm import LLM, SamplingParams

PROMPTS = ["introduce yourself", "list all prime numbers within 100"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="local Hugging Face model directory: config.json, *.safetensors and tokenizer files")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()

    try:
        llm = LLM(args.model, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with llm:
        if llm.tokenizer is None:
            print(f"error: {args.model!r} has no tokenizer files; this example needs one to encode its prompts",
                  file=sys.stderr)
            return 2
        prompts = PROMPTS
        if llm.tokenizer.chat_template:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                         add_generation_prompt=True) for p in PROMPTS]
        for prompt, output in zip(prompts, llm.generate(prompts, params)):
            print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
