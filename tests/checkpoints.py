"""Small random checkpoints of each supported family (weights + tokenizer) built on the fly, and transformers'
greedy reference."""
import json
import math
import os

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "llama": (LlamaConfig, LlamaForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM),
            "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CORPUS = [
    "Hello, my name is Ada and I like to write small fast programs.",
    "List all primes below 50: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Paged attention stores keys and values in fixed-size blocks of memory.",
    "Continuous batching admits new requests as soon as old ones finish.",
] * 20


def make_tokenizer(path: str, vocab_size: int) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


@torch.no_grad()
def randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """Draw the norm weights and the biases too: transformers starts them at one and zero, which would hide a norm or
    a bias the engine forgets to load."""
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.normal_(0, 0.1)
        elif "norm" in name:
            param.add_(torch.randn_like(param) * 0.1)


def make_checkpoint(path: str, *, family: str = "qwen3", tie_word_embeddings: bool = True, vocab_size: int = 384,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    head_dim: int = 16, intermediate_size: int = 128, max_position_embeddings: int = 1024,
                    seed: int = 0, initializer_range: float = 0.1, rope_theta: float = 1e6,
                    rope_scaling: dict | None = None, hub_style: bool = True, max_shard_size: str | None = None,
                    tokenizer: bool = True, **family_settings) -> str:
    """Save a random model of `family` (a key of `FAMILIES`) as safetensors.

    Biases are drawn like the weights (transformers initializes them to zero, which would hide a
    missing bias). `rope_scaling` is a rope parameters dict such as `LLAMA3_ROPE`. `hub_style`
    writes config.json as hub checkpoints do (`rope_theta` and `rope_scaling` at the top level);
    otherwise as transformers 5 does (inside `rope_parameters`). `family_settings` go to the config
    (e.g. `attention_bias`, `mlp_bias`, a mixture of experts' `num_experts`).
    """
    torch.manual_seed(seed)
    config_class, model_class = FAMILIES[family]
    config = config_class(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, head_dim=head_dim,
                          max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                          rope_scaling=rope_scaling,
                          tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
                          eos_token_id=0, **family_settings)
    model = model_class(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, initializer_range)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if hub_style:
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            saved = json.load(f)
        saved.pop("rope_parameters", None)
        saved["rope_theta"] = rope_theta
        if rope_scaling:
            saved["rope_scaling"] = rope_scaling
        with open(config_path, "w") as f:
            json.dump(saved, f, indent=2)
    if tokenizer:
        make_tokenizer(path, vocab_size)
    return path


# Each new family's tiny config (the model_type transformers builds and its settings): GQA where the family has it,
# sliding windows shorter than the tests' prompts, every multiplier and cap away from 1 / off.
FAMILY_CONFIGS = {
    "mistral": ("mistral", dict(num_key_value_heads=2, head_dim=16, sliding_window=24)),
    "mistral_full": ("mistral", dict(num_key_value_heads=2, head_dim=16, sliding_window=None)),
    "gemma": ("gemma", dict(num_key_value_heads=2, head_dim=16, attention_bias=True)),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=16, sliding_window=24, query_pre_attn_scalar=12,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0, num_hidden_layers=3)),
    "gemma3": ("gemma3_text", dict(num_key_value_heads=2, head_dim=16, sliding_window=24, query_pre_attn_scalar=12,
                                   sliding_window_pattern=2, num_hidden_layers=3)),
    "phi3": ("phi3", dict(num_key_value_heads=2, sliding_window=40, partial_rotary_factor=0.5, pad_token_id=0)),
    "olmo2": ("olmo2", dict(num_key_value_heads=2, pad_token_id=0)),
    "granite": ("granite", dict(num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.5,
                                attention_multiplier=0.3, logits_scaling=2.0, attention_bias=True)),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5)),
    "gpt_neox_sequential": ("gpt_neox", dict(rotary_pct=0.25, use_parallel_residual=False)),
    "stablelm": ("stablelm", dict(num_key_value_heads=2, partial_rotary_factor=0.25, use_qkv_bias=True)),
    "stablelm_parallel": ("stablelm", dict(num_key_value_heads=4, partial_rotary_factor=0.5,
                                           use_parallel_residual=True)),
    "stablelm_qk_norm": ("stablelm", dict(num_key_value_heads=2, partial_rotary_factor=0.25, qk_layernorm=True)),
    "qwen2_window": ("qwen2", dict(num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=24,
                                   max_window_layers=1, num_hidden_layers=3)),
}


def make_family_checkpoint(path: str, family: str, *, tie_word_embeddings: bool = False, seed: int = 0,
                           hub_config: dict | None = None, **settings) -> str:
    """Save a random model of one of `FAMILY_CONFIGS` (hidden 64, 2 layers unless the family says, vocabulary 384,
    a 300-token tokenizer) as safetensors. Norm weights and biases are drawn too (transformers starts them at
    one/zero, which would hide a missing `1 + w` or bias). `hub_config` entries are written into config.json as hub
    checkpoints have them (e.g. `rope_theta` and `rope_scaling` at the top level)."""
    torch.manual_seed(seed)
    model_type, family_settings = FAMILY_CONFIGS[family]
    config = AutoConfig.for_model(model_type, **{
        "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 1024, "initializer_range": 0.1, "eos_token_id": 0,
        "tie_word_embeddings": tie_word_embeddings, **family_settings, **settings})
    model = AutoModelForCausalLM.from_config(config).float()
    randomize_norms_and_biases(model)
    model.save_pretrained(path)
    if hub_config:
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            saved = json.load(f)
        saved.pop("rope_parameters", None)
        saved.update(hub_config)
        with open(config_path, "w") as f:
            json.dump(saved, f, indent=2)
    make_tokenizer(path, 300)
    return path


def hf_reference(path: str) -> torch.nn.Module:
    """transformers' model of the directory `path` in float32 with eager attention: transformers 5.17 runs Gemma 2
    through SDPA, which drops its soft-capped scores."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_greedy(path: str | torch.nn.Module, prompts: list[list[int]], max_tokens: int,
              device: str = "cpu") -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time, float32, with its KV cache (`path`: a
    model directory, see `hf_reference`, or a transformers model already loaded)."""
    model = path if isinstance(path, torch.nn.Module) else hf_reference(path).to(device)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model(input_ids=ids, use_cache=True)
        past, tokens = out.past_key_values, []
        for _ in range(max_tokens):
            next_id = int(out.logits[0, -1].argmax())
            tokens.append(next_id)
            out = model(input_ids=torch.tensor([[next_id]], device=device), past_key_values=past, use_cache=True)
            past = out.past_key_values
        outputs.append(tokens)
    return outputs


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (pairs of rotary halves interleaved per head), which GGUF readers undo."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


GGUF_Q8_0_TENSORS = ("ffn_gate", "ffn_up", "ffn_down")


def add_bpe_vocab(writer, model_dir: str, eos_token_id: int) -> int:
    """The byte-level BPE tokenizer of `model_dir` (`make_tokenizer`) into a `gguf.GGUFWriter`, as llama.cpp's
    converter writes a GPT-2 style vocabulary; the number of tokens. Its BOS is its EOS, as in Qwen's files: without
    one, transformers 5.17's GGUF reader fails on the EOS (it reads the BOS id for it)."""
    import gguf

    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        bpe = json.load(f)["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_bos_token_id(eos_token_id)
    writer.add_eos_token_id(eos_token_id)
    return len(tokens)


def make_gguf(path: str, llama_dir: str, chat_template: str, rope_freqs: bool = False, qtype: str = "Q8_0",
              quantized: tuple[str, ...] = GGUF_Q8_0_TENSORS, architecture: str = "llama",
              raw_types: dict[str, int] | None = None) -> str:
    """Write the Llama checkpoint in `llama_dir` (see `make_checkpoint`) as a GGUF file, as llama.cpp's converter
    would: its byte-level BPE vocabulary, q/k rows permuted, the weights named in `quantized` (name fragments; "" for
    every 2-D weight) quantized to `qtype` (gguf.quants.quantize), the rest float32. `rope_freqs` adds the
    per-frequency rope factors llama.cpp writes for Llama 3.1 (all ones here). `architecture` is what the file says
    it is; `raw_types` labels tensors (by name) with another GGML type id, bytes unchanged (for bad files)."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(llama_dir, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    add_bpe_vocab(writer, llama_dir, config["eos_token_id"])
    writer.add_chat_template(chat_template)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in load_file(os.path.join(llama_dir, "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, layer, module = name.rsplit(".", 1)[0].split(".", 3)
            if module == "self_attn.q_proj":
                tensor = _llama_cpp_permute(tensor, heads)
            elif module == "self_attn.k_proj":
                tensor = _llama_cpp_permute(tensor, kv_heads)
            gguf_name = f"blk.{layer}.{names[module]}.weight"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        data = tensor.float().numpy()
        if gguf_name in (raw_types or {}):
            writer.add_tensor(gguf_name, data.view(np.uint8), raw_dtype=raw_types[gguf_name])
        elif data.ndim == 2 and any(q in gguf_name for q in quantized):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype]),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            writer.add_tensor(gguf_name, data)
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", torch.ones(config["head_dim"] // 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def teacher_forced(llm, token_ids: list[int]) -> tuple[float, list[int]]:
    """nanovllm's perplexity of `token_ids` (each token after the first, given those before it) and its most likely
    token at each of those positions, from prompt logprobs."""
    from nanovllm import SamplingParams

    output = llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    rows = output.prompt_logprobs[1:]
    nll = [-row[token].logprob for row, token in zip(rows, token_ids[1:])]
    top1 = [max(row, key=lambda t: row[t].logprob) for row in rows]  # the top-1 entry, or the prompt token tied with it
    return math.exp(sum(nll) / len(nll)), top1


@torch.inference_mode()
def hf_teacher_forced(model: str | torch.nn.Module, token_ids: list[int]) -> tuple[float, list[int]]:
    """`teacher_forced` for a transformers model (float32), or the directory of one (`hf_reference`)."""
    model = hf_reference(model) if isinstance(model, str) else model
    logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return math.exp(float(nll)), logits.argmax(-1).tolist()
