"""A GGUF file's model config, rebuilt from its metadata: llama.cpp's keys (what `convert_hf_to_gguf.py` writes) turned
into the transformers config of the family that runs the file, one function per `general.architecture`.

What the file does not state is what llama.cpp assumes when it runs the file (Gemma 2's window 4096, Qwen3-MoE's
renormalized top-k, ...), so a file means here what it means there.
"""
from collections.abc import Callable

SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp: every n-th layer global, the others sliding
LARGEST_GEMMA = {"gemma2": 46, "gemma3": 62}  # the 27B's layer count: its queries are scaled by hidden / heads
# llama.cpp's `{arch}.pooling_type` (what its converter writes from a sentence-transformers Pooling module) as
# sentence-transformers' pooling mode
POOLING_MODES = {1: "mean", 2: "cls", 3: "lasttoken"}
POOLING_NONE, POOLING_RANK = 0, 4


class Metadata:
    """A GGUF file's metadata (`fields`: key -> value, arrays but the vocabulary read whole) and tensor names, read
    under the file's architecture."""

    def __init__(self, fields: dict, tensors: dict[str, list[int]], path: str):
        self.fields, self.tensors, self.path = fields, tensors, path
        self.arch = fields.get("general.architecture")

    def get(self, key: str, default=None):
        return self.fields.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: the GGUF metadata lacks {self.arch}.{key}, which a {self.arch} model "
                             "needs; convert the model again with llama.cpp's convert_hf_to_gguf.py")
        return value

    def has(self, tensor_kind: str) -> bool:
        """Whether some layer has tensor `tensor_kind` (e.g. "attn_q.bias")."""
        return any(name.startswith("blk.") and name.split(".", 2)[2] == tensor_kind for name in self.tensors)


def _common(m: Metadata) -> dict:
    heads = m.require("attention.head_count")
    hidden = m.require("embedding_length")
    config = {
        "max_position_embeddings": m.require("context_length"), "hidden_size": hidden,
        "num_hidden_layers": m.require("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": m.get("attention.head_count_kv") or heads,
        "head_dim": m.get("attention.key_length") or hidden // heads,
        "vocab_size": m.tensors["token_embd.weight"][1],
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "eos_token_id": m.fields.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": m.fields.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": m.fields.get("tokenizer.ggml.padding_token_id"),
    }
    if (ff := m.get("feed_forward_length")) is not None:
        config["intermediate_size"] = ff
    for key, name in (("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
                      ("attention.layer_norm_epsilon", "layer_norm_eps")):
        if (eps := m.get(key)) is not None:
            config[name] = eps
    rope = {"rope_type": "default", "rope_theta": m.get("rope.freq_base", 10000.0)}
    scaling = m.get("rope.scaling.type")
    if scaling == "linear" or scaling is None and m.get("rope.scaling.factor") is not None:
        rope.update(rope_type="linear", factor=m.get("rope.scaling.factor"))
    elif scaling not in (None, "none", "longrope"):
        raise ValueError(f"{m.path}: rope scaling {scaling!r} in GGUF files is not supported by nanovllm (linear and "
                         "Phi-3's LongRoPE are); load the model's Hugging Face checkpoint instead")
    config["rope_parameters"] = rope
    return config


def _partial_rotary(m: Metadata, config: dict) -> float:
    return (m.get("rope.dimension_count") or config["head_dim"]) / config["head_dim"]


def _windows(m: Metadata, config: dict, default_window: int = 0) -> None:
    """Gemma 2/3's sliding window and which layers use it (`attention.sliding_window_pattern`: a flag per layer, or
    n for every n-th layer global)."""
    window = m.get("attention.sliding_window", default_window)
    if not window:
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
        return
    pattern = m.get("attention.sliding_window_pattern", SWA_PATTERN[m.arch])
    if isinstance(pattern, int):
        pattern = [pattern == 0 or i % pattern < pattern - 1 for i in range(config["num_hidden_layers"])]
    config["sliding_window"] = window
    config["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]


def _llama(m: Metadata) -> dict:
    """llama: Llama, Mistral (a sliding window in the metadata) and Mixtral (experts), as llama.cpp names them all."""
    config = _common(m)
    config.update(attention_bias=m.has("attn_q.bias"), mlp_bias=m.has("ffn_up.bias"))
    if m.get("expert_count"):
        config.update(num_local_experts=m.get("expert_count"), num_experts_per_tok=m.require("expert_used_count"),
                      sliding_window=m.get("attention.sliding_window"))
        config["intermediate_size"] = m.get("expert_feed_forward_length") or config["intermediate_size"]
        return config | {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    if m.get("attention.sliding_window"):
        config["sliding_window"] = m.get("attention.sliding_window")
        return config | {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    return config | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def _qwen2(m: Metadata) -> dict:
    return _common(m) | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def _qwen3(m: Metadata) -> dict:
    return _common(m) | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                         "attention_bias": m.has("attn_q.bias")}


def _moe(m: Metadata) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's experts: every layer sparse (llama.cpp has no dense layers for them)."""
    config = _common(m)
    config.update(num_experts=m.require("expert_count"), num_experts_per_tok=m.require("expert_used_count"),
                  moe_intermediate_size=m.require("expert_feed_forward_length"), decoder_sparse_step=1,
                  mlp_only_layers=[])
    config.setdefault("intermediate_size", config["moe_intermediate_size"])
    return config


def _qwen2moe(m: Metadata) -> dict:
    """llama.cpp runs Qwen2-MoE without renormalizing the top-k weights (Qwen1.5-MoE's `norm_topk_prob: false`)."""
    return _moe(m) | {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "norm_topk_prob": False,
                      "qkv_bias": m.has("attn_q.bias"),
                      "shared_expert_intermediate_size": m.require("expert_shared_feed_forward_length")}


def _qwen3moe(m: Metadata) -> dict:
    """llama.cpp renormalizes Qwen3-MoE's top-k weights (`norm_topk_prob: true`, as every Qwen3-MoE release)."""
    return _moe(m) | {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True,
                      "attention_bias": m.has("attn_q.bias")}


def _gemma(m: Metadata) -> dict:
    return _common(m) | {"model_type": "gemma", "architectures": ["GemmaForCausalLM"],
                         "hidden_act": "gelu_pytorch_tanh", "attention_bias": m.has("attn_q.bias")}


def _query_pre_attn_scalar(m: Metadata, config: dict) -> int:
    if config["num_hidden_layers"] == LARGEST_GEMMA[m.arch]:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma2(m: Metadata) -> dict:
    """Gemma 2: llama.cpp's defaults are the released models' (window 4096, every other layer sliding)."""
    config = _common(m) | {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                           "hidden_activation": "gelu_pytorch_tanh", "attention_bias": m.has("attn_q.bias"),
                           "attn_logit_softcapping": m.get("attn_logit_softcapping"),
                           "final_logit_softcapping": m.get("final_logit_softcapping")}
    _windows(m, config, default_window=4096)
    return config | {"query_pre_attn_scalar": _query_pre_attn_scalar(m, config)}


def _gemma3(m: Metadata) -> dict:
    """Gemma 3 (text): local layers rotate with base `rope.freq_base_swa` (10000 unless stated) and no scaling."""
    config = _common(m) | {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                           "hidden_activation": "gelu_pytorch_tanh", "attention_bias": m.has("attn_q.bias"),
                           "final_logit_softcapping": m.get("final_logit_softcapping")}
    _windows(m, config)
    local = {"rope_type": "default", "rope_theta": m.get("rope.freq_base_swa", 10000.0)}
    config["rope_parameters"] = {"full_attention": config["rope_parameters"], "sliding_attention": local}
    return config | {"query_pre_attn_scalar": _query_pre_attn_scalar(m, config)}


def _phi3(m: Metadata, rope_factors: dict[str, list[float]]) -> dict:
    """Phi-3: a window of 0 is none (Phi-4); LongRoPE's factors are the `rope_factors_long/short` tensors."""
    config = _common(m) | {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                           "sliding_window": m.get("attention.sliding_window") or None}
    config["rope_parameters"]["partial_rotary_factor"] = _partial_rotary(m, config)
    if rope_factors:
        config["rope_parameters"].update(
            rope_type="longrope", long_factor=rope_factors["rope_factors_long.weight"],
            short_factor=rope_factors["rope_factors_short.weight"],
            original_max_position_embeddings=m.require("rope.scaling.original_context_length"))
        config["original_max_position_embeddings"] = m.require("rope.scaling.original_context_length")
    return config


def _olmo2(m: Metadata) -> dict:
    return _common(m) | {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"],
                         "attention_bias": m.has("attn_q.bias")}


def _granite(m: Metadata) -> dict:
    return _common(m) | {"model_type": "granite", "architectures": ["GraniteForCausalLM"],
                         "attention_bias": m.has("attn_q.bias"), "mlp_bias": m.has("ffn_up.bias"),
                         "attention_multiplier": m.require("attention.scale"),
                         "embedding_multiplier": m.require("embedding_scale"),
                         "residual_multiplier": m.require("residual_scale"), "logits_scaling": m.require("logit_scale")}


def _stablelm(m: Metadata) -> dict:
    """StableLM: q/k/v bias, a parallel residual (no `ffn_norm`) and per-head q/k LayerNorms as the tensors say."""
    config = _common(m) | {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"],
                           "use_qkv_bias": m.has("attn_q.bias"), "qk_layernorm": m.has("attn_q_norm.weight"),
                           "use_parallel_residual": bool(m.get("use_parallel_residual", not m.has("ffn_norm.weight")))}
    config["rope_parameters"]["partial_rotary_factor"] = _partial_rotary(m, config)
    return config


def _gptneox(m: Metadata) -> dict:
    config = _common(m) | {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
                           "use_parallel_residual": bool(m.get("use_parallel_residual", True)),
                           "attention_bias": m.has("attn_qkv.bias")}
    config["rotary_pct"] = _partial_rotary(m, config)
    config["rope_parameters"]["partial_rotary_factor"] = config["rotary_pct"]
    return config


def _bert(m: Metadata) -> dict:
    """BERT (llama.cpp's `bert`: BertModel and its sentence-transformers embedders). The file keeps no activation:
    BERT's own, erf GELU, as transformers runs the checkpoint."""
    config = {key: value for key, value in _common(m).items() if key not in ("num_key_value_heads", "head_dim",
                                                                           "rope_parameters", "tie_word_embeddings")}
    return config | {"model_type": "bert", "architectures": ["BertModel"], "hidden_act": "gelu",
                     "type_vocab_size": m.tensors["token_types.weight"][1] if "token_types.weight" in m.tensors else 1}


CONFIGS: dict[str, Callable[..., dict]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen2moe": _qwen2moe, "qwen3moe": _qwen3moe,
    "gemma": _gemma, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "olmo2": _olmo2, "granite": _granite,
    "stablelm": _stablelm, "gptneox": _gptneox, "bert": _bert}


def gguf_config(metadata: Metadata, rope_factors: dict[str, list[float]]) -> dict:
    """The transformers config dict (with `model_type` and `architectures`) of a file of a supported architecture;
    `rope_factors` holds Phi-3's LongRoPE factor tensors when the file has them."""
    if metadata.arch == "phi3":
        return _phi3(metadata, rope_factors)
    return CONFIGS[metadata.arch](metadata)


def pooling_mode(metadata: Metadata) -> str | None:
    """How an embedding file pools its hidden states (`{arch}.pooling_type`), as sentence-transformers names it;
    None for a file that states no pooling (or llama.cpp's 0, "none", which it reads as the same: a generating model).
    A ValueError for a reranker (4, "rank": its `cls.output` head), an unknown value, or a BERT file without one."""
    value = metadata.get("pooling_type")
    if value in POOLING_MODES:
        return POOLING_MODES[value]
    if value == POOLING_RANK:
        raise ValueError(f"{metadata.path} is a reranker (pooling_type 4, rank: a classification head over the pooled "
                         "state), which nanovllm does not run from GGUF files; a cross-encoder's Hugging Face "
                         "checkpoint (a *ForSequenceClassification) runs with LLM.score")
    if value not in (None, POOLING_NONE):
        raise ValueError(f"{metadata.path}: unknown {metadata.arch}.pooling_type {value!r}; nanovllm pools GGUF "
                         f"embedding files by llama.cpp's {POOLING_MODES} (0: none, a generating model)")
    if metadata.arch == "bert":
        raise ValueError(f"{metadata.path} is a BERT file that states no pooling (pooling_type "
                         f"{'none' if value is None else value}: llama.cpp's per-token embeddings), which nanovllm "
                         f"does not give from GGUF files; convert the model with its sentence-transformers Pooling "
                         f"module (llama.cpp's convert_hf_to_gguf.py writes it as pooling_type {POOLING_MODES})")
    return None
