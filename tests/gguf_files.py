"""GGUF files of the tiny checkpoints in `checkpoints.py`, written as llama.cpp's `convert_hf_to_gguf.py` writes them:
its metadata keys per architecture, tensor names from gguf-py's own table (`gguf.get_tensor_name_map`) and its
tensor transforms (Llama's q/k rows permuted, Gemma's norms stored as 1 + w, GPT-NeoX's per-head q/k/v regrouped,
experts and StableLM's per-head norms stacked, Phi-3's LongRoPE factors as tensors), so that a test of nanovllm's
GGUF loader does not merely invert the loader."""
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from checkpoints import add_bpe_vocab
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")  # the tests that write GGUF files are skipped without it

ARCH = {"LlamaForCausalLM": "LLAMA", "MistralForCausalLM": "LLAMA", "MixtralForCausalLM": "LLAMA",
        "GraniteForCausalLM": "GRANITE", "GemmaForCausalLM": "GEMMA", "Gemma2ForCausalLM": "GEMMA2",
        "Gemma3ForCausalLM": "GEMMA3", "Phi3ForCausalLM": "PHI3", "Olmo2ForCausalLM": "OLMO2",
        "StableLmForCausalLM": "STABLELM", "GPTNeoXForCausalLM": "GPTNEOX", "Qwen2MoeForCausalLM": "QWEN2MOE",
        "Qwen3MoeForCausalLM": "QWEN3MOE", "Qwen2ForCausalLM": "QWEN2", "Qwen2Model": "QWEN2",
        "Qwen3ForCausalLM": "QWEN3", "Qwen3Model": "QWEN3", "BertModel": "BERT"}
# sentence-transformers' pooling modes as the converter's `_try_set_pooling_type` writes them
POOLING_TYPES = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
HEAD_NORM = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight$")


def _rope(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _theta(config: dict) -> float | None:
    rope = _rope(config)
    rope = rope.get("full_attention", rope)
    return config.get("rope_theta") or rope.get("rope_theta")


def _partial(config: dict) -> float:
    return config.get("partial_rotary_factor") or _rope(config).get("partial_rotary_factor") or \
        config.get("rotary_pct") or 1.0


def _metadata(w: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """`set_gguf_parameters` of the converter's model class for `arch`."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    if arch not in ("GPTNEOX", "BERT"):
        w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    if arch == "BERT":
        w.add_causal_attention(False)
    if config.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("layer_norm_eps") is not None:
        w.add_layer_norm_eps(config["layer_norm_eps"])
    if arch not in ("GEMMA", "GEMMA2", "STABLELM", "GPTNEOX") and _theta(config) is not None:
        w.add_rope_freq_base(_theta(config))
    if config.get("head_dim") and arch != "GRANITE":  # the Granite converter drops head_dim
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    rope = _rope(config).get("full_attention", _rope(config))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if experts := config.get("num_local_experts") or config.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("LLAMA", "GRANITE"):
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(config.get("head_dim") or hidden // heads)
        if config.get("sliding_window"):  # not written by llama.cpp's converter, but read when a file has it
            w.add_sliding_window(config["sliding_window"])
    if arch == "GRANITE":
        w.add_attention_scale(config["attention_multiplier"])
        w.add_embedding_scale(config["embedding_multiplier"])
        w.add_residual_scale(config["residual_multiplier"])
        w.add_logit_scale(config["logits_scaling"])
    if arch == "GEMMA2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
    if arch == "GEMMA3":
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window_pattern") != 1:
            w.add_sliding_window(config["sliding_window"])
        if (local := config.get("rope_local_base_freq") or _rope(config).get("sliding_attention", {}).get(
                "rope_theta")) is not None:
            w.add_rope_freq_base_swa(local)
    if arch == "PHI3":
        original = config.get("original_max_position_embeddings") or _rope(config)["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(_partial(config) * hidden) // heads)
        w.add_sliding_window(config.get("sliding_window") or 0)
        if _theta(config) is None:
            w.add_rope_freq_base(10000.0)  # the converter reads transformers' default
        if _rope(config).get("long_factor"):
            scale = config["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if arch in ("STABLELM", "GPTNEOX"):
        w.add_rope_dimension_count(int(_partial(config) * (hidden // heads)))
        w.add_parallel_residual(config.get("use_parallel_residual", True))
    if arch in ("QWEN2MOE", "QWEN3MOE"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _pooling(w: gguf.GGUFWriter, model_dir: str) -> None:
    """`_try_set_pooling_type`: a sentence-transformers directory's Pooling mode as `{arch}.pooling_type`."""
    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_file):
        return
    with open(modules_file) as f:
        folder = next(m["path"] for m in json.load(f) if m["type"].endswith("Pooling"))
    with open(os.path.join(model_dir, folder, "config.json")) as f:
        pooling = json.load(f)
    flags = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "lasttoken"}
    mode = next((mode for flag, mode in flags.items() if pooling.get(flag)), pooling.get("pooling_mode"))
    w.add_pooling_type(POOLING_TYPES[mode])


def add_wordpiece_vocab(w: gguf.GGUFWriter, model_dir: str, config: dict) -> int:
    """`BertModel.set_vocab`: the WordPiece vocabulary with a word's first piece spelled "\u2581piece" and its
    continuations bare ("##piece" -> "piece"), special tokens as control tokens, the token type count, and the
    special token ids (CLS as BOS, SEP as EOS, as `gguf.SpecialVocab` writes them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens)
    w.add_token_type_count(config.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_token_list([t if t in special else t[2:] if t.startswith("##") else "\u2581" + t for t in tokens])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    for add, token in ((w.add_bos_token_id, tokenizer.cls_token), (w.add_eos_token_id, tokenizer.sep_token),
                       (w.add_unk_token_id, tokenizer.unk_token), (w.add_sep_token_id, tokenizer.sep_token),
                       (w.add_pad_token_id, tokenizer.pad_token), (w.add_mask_token_id, tokenizer.mask_token)):
        add(vocab[token])
    return len(tokens)


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """`LlamaModel.permute`: each head's rotary halves interleaved."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _tensors(arch: str, config: dict, weights: dict[str, torch.Tensor], vocab: int):
    """The converter's `modify_tensors` (and `generate_extra_tensors`): (Hugging Face-style name, tensor)."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    experts: dict[tuple, torch.Tensor] = {}
    norms: dict[tuple, torch.Tensor] = {}
    for name, tensor in weights.items():
        if arch in ("GEMMA", "GEMMA2") and name == "lm_head.weight":
            continue
        if arch == "BERT" and name.startswith(("pooler.", "embeddings.position_ids")):
            continue  # BertModel.filter_tensors: BERT is converted for embeddings, without its pooler
        if arch == "GEMMA3" and "embed_tokens.weight" in name:
            tensor = tensor[:vocab]  # out-of-vocabulary rows removed
        if arch.startswith("GEMMA") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch in ("LLAMA", "GRANITE") and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _permute(tensor, heads)
        if arch in ("LLAMA", "GRANITE") and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _permute(tensor, kv_heads)
        if arch == "GPTNEOX" and "query_key_value" in name:
            per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])
            tensor = torch.cat([per_head[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3)])
        if found := EXPERT.match(name):
            experts[int(found.group(1)), found.group(2), found.group(4), int(found.group(3))] = tensor
            continue
        if found := HEAD_NORM.match(name):
            norms[int(found.group(1)), found.group(2), int(found.group(3))] = tensor
            continue
        yield name, tensor
    for layer, kind, proj in sorted({key[:3] for key in experts}):
        stacked = torch.stack([experts[layer, kind, proj, e] for e in range(sum(
            1 for key in experts if key[:3] == (layer, kind, proj)))])
        if kind == "block_sparse_moe":
            yield f"layers.{layer}.feed_forward.experts.{proj}.weight", stacked
        else:
            yield f"model.layers.{layer}.mlp.experts.{proj}.weight", stacked
    for layer, qk in sorted({key[:2] for key in norms}):
        count = heads if qk == "q" else kv_heads
        yield f"model.layers.{layer}.self_attn.{qk}_layernorm.weight", torch.stack(
            [norms[layer, qk, h] for h in range(count)])
    rope = _rope(config)
    if arch == "PHI3" and rope.get("long_factor"):
        yield "rope_factors_long", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short", torch.tensor(rope["short_factor"], dtype=torch.float32)


def _quantizable(gguf_name: str) -> bool:
    """What llama.cpp's quantizer rounds: matrices, but not norms and routers; nor BERT's token types, whose first
    row llama.cpp adds as it is stored."""
    return not any(s in gguf_name for s in ("_norm", "ffn_gate_inp", "rope_factors", "token_types"))


def write_gguf(path: str, model_dir: str, qtype: str = "F32", pooling_type: int | None = None) -> str:
    """Write the checkpoint in `model_dir` (a `checkpoints.py` model: safetensors, a byte-level BPE tokenizer; or a
    sentence-transformers embedder, its pooling written as `pooling_type`, a BERT one with its WordPiece vocabulary)
    as a GGUF file at `path`, every matrix but norms and routers in `qtype` (F32, or a type gguf-py quantizes).
    `pooling_type` is written instead of the directory's pooling (for files llama.cpp's converter would not write)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    arch = ARCH[config["architectures"][0]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]])
    _metadata(writer, arch, config)
    if pooling_type is None:
        _pooling(writer, model_dir)
    else:
        writer.add_uint32(gguf.Keys.LLM.POOLING_TYPE.format(arch=writer.arch), pooling_type)
    vocab = add_wordpiece_vocab(writer, model_dir, config) if arch == "BERT" else \
        add_bpe_vocab(writer, model_dir, config["eos_token_id"])
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    for name, tensor in _tensors(arch, config, weights, vocab):
        gguf_name = name if name.startswith("rope_factors") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf-py has no {arch} name for {name}")
        gguf_name = f"{gguf_name}.weight" if name.startswith("rope_factors") else gguf_name
        data = tensor.float().numpy()
        if qtype != "F32" and data.ndim >= 2 and gguf_name.endswith(".weight") and _quantizable(gguf_name):
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_lora(path: str, adapter_dir: str, model_dir: str) -> str:
    """Write the PEFT adapter in `adapter_dir` (on the checkpoint in `model_dir`) as llama.cpp's
    `convert_lora_to_gguf.py --outtype f32` writes it: `general.type = adapter`, `adapter.type = lora`,
    `adapter.lora.alpha` (the config's `lora_alpha` only), and per adapted tensor `<gguf name>.lora_a` (A as PEFT has
    it) and `.lora_b` (B through the base converter's transforms of that tensor's rows, `_tensors`)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        alpha = json.load(f)["lora_alpha"]
    arch = ARCH[config["architectures"][0]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch]])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(os.path.join(adapter_dir, "adapter_model.safetensors")).items():
        base = key.replace("base_model.model.", "")
        which = "A" if ".lora_A.weight" in base else "B"
        pairs.setdefault(base.replace(f".lora_{which}.weight", ".weight"), {})[which] = tensor
    for base, ab in pairs.items():
        (name, b), = _tensors(arch, config, {base: ab["B"]}, config["vocab_size"])
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(f"{gguf_name}.lora_a", np.ascontiguousarray(ab["A"].float().numpy()))
        writer.add_tensor(f"{gguf_name}.lora_b", np.ascontiguousarray(b.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
