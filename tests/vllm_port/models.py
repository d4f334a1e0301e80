"""The Hugging Face models vLLM's tests name, as tiny random checkpoints built here once per session (no model is
downloaded): `local_model(name)` is the directory standing in for hub model `name`. Two checkpoints serve them all,
chosen for what the tests read of the model beyond its weights:

- "llama": a Llama with a 32000-token vocabulary (the tests pass token ids up to 31999, as
  hmellor/tiny-random-LlamaForCausalLM has), a BOS token the tokenizer prepends, and Llama 3's chat template (which
  writes the BOS itself, so a chat prompt encoded with special tokens would start with two);
- "qwen3": a Qwen3 with a 2048-token vocabulary, no BOS, `<think>` / `</think>` tokens and a Qwen3-style chat
  template that honours `enable_thinking` (False writes an empty think block into the prompt).

Both float32, 2 layers, hidden size 64, 1024 positions. Their byte-level BPE tokenizers learn the tests' prompts (so
that a prompt takes about as many tokens as with a real tokenizer: `test_max_model_len` fits 20 tokens) and enough
made-up words that every id of the vocabulary is a token they produce."""
import atexit
import os
import shutil
import tempfile
from functools import cache

from checkpoints import CORPUS, make_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

LLAMA_SEED = 17
"""The llama checkpoint's seed: its greedy words after test_stop's prompt are six distinct ones before any repeats
(in float32 and bfloat16), which test_stop assumes of hmellor/tiny-random-LlamaForCausalLM; with some seeds a random
model repeats its first word, and the stop string then ends the text earlier."""
PROMPTS = [
    "Hello, my name is", "The president of the United States is", "The capital of France is", "The future of AI is",
    "Hello my name is Robert and I", "You are a helpful assistant", "Explain the concept of entropy.",
    "Explain what among us is.", "What is 1+1?", "Hello!", "Hello world", "This is a very long text to test the error",
    "In this example,", "The following numbers of the sequence 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 are:",
    "In one word, the capital of France is ", "Tell me about the number 12: ", "How old are you? I am 10 years old",
    "Generate a JSON object for a person with name and age:",
]
"""Prompts of the ported tests, for the tokenizers to learn (with vLLM's example prompts, prompts/example.txt)."""
EXAMPLE_PROMPTS = os.path.join(os.path.dirname(__file__), "prompts", "example.txt")

HUB_MODELS = {
    "distilbert/distilgpt2": "qwen3",
    "openai-community/gpt2": "qwen3",
    "facebook/opt-125m": "qwen3",
    "Qwen/Qwen3-0.6B": "qwen3",
    "hmellor/tiny-random-LlamaForCausalLM": "llama",
    "meta-llama/Llama-3.2-1B-Instruct": "llama",
    "meta-llama/Llama-3.2-1B": "llama",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "llama",
    "BAAI/bge-base-en-v1.5": "qwen3",  # an embedding model: the tests start it with runner="pooling"
}


def _words(count: int) -> list[str]:
    """`count` distinct lower-case words (base-26 numerals, 3 or more letters), for a large vocabulary to learn."""
    words = []
    for i in range(count):
        word, n = "", i + 26 * 26
        while n:
            n, digit = divmod(n, 26)
            word = chr(ord("a") + digit) + word
        words.append(word)
    return words


def _tokenizer(path: str, vocab_size: int, specials: list[str], bos: str | None, chat_template: str) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (specials first: id 0 is EOS), trained on the
    checkpoints' corpus, the tests' prompts and enough made-up words that every id is a token it can produce."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(EXAMPLE_PROMPTS) as f:
        corpus = list(CORPUS) + PROMPTS * 20 + f.read().splitlines() * 20
    words = _words(vocab_size)
    corpus += [" ".join(words[i:i + 50]) for i in range(0, len(words), 50)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0], bos_token=bos)
    fast.chat_template = chat_template
    fast.save_pretrained(path)


def _build(kind: str, path: str) -> str:
    if kind == "llama":
        make_checkpoint(path, family="llama", vocab_size=32000, seed=LLAMA_SEED, tokenizer=False, bos_token_id=1)
        _tokenizer(path, 32000, ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                 "<|eot_id|>"], "<|begin_of_text|>", LLAMA3_CHAT_TEMPLATE)
    else:
        make_checkpoint(path, family="qwen3", vocab_size=2048, seed=12, tokenizer=False)
        _tokenizer(path, 2048, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None,
                   QWEN3_CHAT_TEMPLATE)
    return path


@cache
def _root() -> str:
    root = tempfile.mkdtemp(prefix="nanovllm-vllm-port-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@cache
def _checkpoint(kind: str) -> str:
    return _build(kind, os.path.join(_root(), kind))


def local_model(name: str) -> str:
    """The local checkpoint standing in for hub model `name` (built on first use); any other name (a path) is
    returned as it is."""
    kind = HUB_MODELS.get(name)
    return name if kind is None else _checkpoint(kind)
