"""The engine's settings as plain data, checked on construction; `nanovllm.engine.setup` resolves them against the
model and the machine."""
import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names, read as these
# kv_cache_dtype: "auto" keeps K/V in the model's dtype; vLLM's "fp8" ("fp8_e4m3") and "fp8_e5m2" store them in 8-bit
# floats (scale 1.0, as vLLM's default), each read back exactly and computed in the model's dtype; "int8" (llama.cpp's
# q8_0 in spirit) in 8-bit integers with a float32 scale per token and KV head: 16-bit accuracy in ~half the memory
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
QUANTIZATIONS = {"int8": "Q8_0", "int4": "Q4_1"}  # quantization= at load: the GGML block type each makes
# What logprobs and prompt logprobs hold (vLLM's `logprobs_mode`): log-probabilities or logits, of the model's logits
# ("raw", after a structured output's mask) or of those a token is drawn from ("processed": then penalties, min_tokens,
# allowed tokens, bad words, temperature, min-p, top-k and top-p); prompt tokens are not sampled: always raw
LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"]  # vLLM's type
LOGPROBS_MODES = get_args(LogprobsMode)
STRUCTURED_OUTPUT_BACKENDS = {"guidance": "llguidance", "xgrammar": "xgrammar"}  # grammar backend: its package
SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "quantization")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given
# The step cost model of the adaptive draft count, in units of one more row (token) in the forward: a step of B
# sequences and D drafts costs about fixed + (1 + per_sequence) * B + D: the fixed part reads the weights, each
# sequence brings its host work, sampling and attention besides its row. Fitted to step times with 2 to 16 requests
# (k=5, always on) on the 2-core CPU with SmolLM2-135M (README, speculative decoding); the CUDA figures are a guess,
# not measured: a GPU stays bound by reading the weights up to hundreds of rows. Where decode replays CUDA graphs, a
# step with drafts runs eagerly: the runner measures that price apart (`nanovllm.execution.cuda_graph.VerifyPrice`).
STEP_COST = {"cpu": (8, 8), "cuda": (256, 1)}
# vLLM V1's refusal of custom logits processors beside speculative decoding, in its words
SPEC_DECODE_REJECTS_LOGITS_PROCESSORS = "Custom logits processors are not supported when speculative decoding is " \
    "enabled."
# vLLM's refusal of custom logits processors beside a pooling model, in its words
POOLING_REJECTS_LOGITS_PROCESSORS = "Pooling models do not support custom logits processors."


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram" proposes the `num_speculative_tokens` tokens that followed the last earlier occurrence of
    the sequence's final n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`); "draft_model" runs
    `model` (a directory or a .gguf file with the target's vocabulary; with `quantization` "int8" or "int4" its
    weights are quantized at load, so `model` may be the target itself: self-speculation). With
    `disable_by_batch_size` running requests or more, nothing is proposed (None: never, as vLLM); below it, how many
    drafts each request gets is the adaptive rule's call (`nanovllm.spec_decode.proposer`), with `step_cost` the
    device's step cost model (`STEP_COST`, filled in by the engine's setup)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None
    disable_by_batch_size: int | None = None
    step_cost: tuple[int, int] = (0, 0)
    quantization: str | None = None


def _positive(key: str, value, what: str = "a positive integer") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config[{key!r}] must be {what}, got {value!r}")
    return value


def parse_speculative_config(spec: dict | None) -> SpeculativeConfig | None:
    """vLLM's `speculative_config` dictionary, checked and turned into plain data before any work: a
    `SpeculativeConfig` (None stays None), or a ValueError naming the bad key."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': "
                         f"4}}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS), key=str)
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) {unknown}; valid keys: {list(SPECULATIVE_KEYS)}")
    model = spec.get("model")
    if model in ("ngram", "[ngram]") and spec.get("method", "ngram") == "ngram":  # vLLM's older way to name the method
        model = None
        spec = {key: value for key, value in spec.items() if key != "model"} | {"method": "ngram"}
    method = spec.get("method", "draft_model" if model is not None else None)
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(SPECULATIVE_METHODS)} (or give 'model' "
                         f"for a draft model), got {method!r}")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config needs 'num_speculative_tokens', the tokens proposed per step (e.g. 4)")
    k = _positive("num_speculative_tokens", spec["num_speculative_tokens"])
    disable = spec.get("disable_by_batch_size")
    if disable is not None:
        disable = _positive("disable_by_batch_size", disable, "a positive integer or None")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config['model'] must be the draft model's directory or .gguf file, got "
                             f"{model!r}")
        lookup = [key for key in ("prompt_lookup_max", "prompt_lookup_min") if key in spec]
        if lookup:
            raise ValueError(f"speculative_config {lookup} apply to method 'ngram' only, not to a draft model")
        quantization = spec.get("quantization")
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config['quantization'] must be one of {[None, *QUANTIZATIONS]}, got "
                             f"{quantization!r}")
        return SpeculativeConfig(method, k, model=model, disable_by_batch_size=disable, quantization=quantization)
    if model is not None or spec.get("quantization") is not None:
        raise ValueError("speculative_config['model'] and 'quantization' are for a draft model; method 'ngram' takes "
                         "neither")
    high, low = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
    high = _positive("prompt_lookup_max", high) if high is not None else None
    low = _positive("prompt_lookup_min", low) if low is not None else None
    high = high or low or DEFAULT_PROMPT_LOOKUP
    low = low or high
    if low > high:
        raise ValueError(f"speculative_config['prompt_lookup_min'] ({low}) is larger than 'prompt_lookup_max' ({high})")
    return SpeculativeConfig(method, k, high, low, disable_by_batch_size=disable)


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into its output, read from the model's files
    (`nanovllm.models.sentence_transformers`): `pooling_type` one of `POOLING_TYPES` (the last token's, the mean over
    the prompt, the first token's); the embeddings' Dense layers (sentence-transformers' folders, in order) and
    whether they are normalized by default; a classifier's `num_labels` (0: an embedding model) and its activation
    ("softmax", "sigmoid" or "identity"); Matryoshka support (`is_matryoshka`; `matryoshka_dimensions`, when the
    config names them, the only `dimensions` allowed)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dense_dirs: tuple[str, ...] = ()
    num_labels: int = 0
    activation: str = "softmax"
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


def default_block_size(device: str) -> int:
    """Tokens per KV block unless set: 256 on CUDA (flash-attn 2's paged KV needs a multiple of 256), 16 on CPU, where
    the attention kernels take any size and small blocks let prompts share more of a cached prefix (extraction
    prompts sharing a ~150-token instruction and schema reuse all but its last partial block; with 256-token blocks,
    none of it) at no measured cost to decode (`bench.py --attention-micro --kvcache-block-size N`)."""
    return 256 if device == "cuda" else 16


@dataclass
class Config:
    """Everything the engine needs to know before it starts.

    `model` is a Hugging Face style directory (config.json, *.safetensors, tokenizer files), or a GGUF file (or a
    directory holding one), whose weights run as they are stored (config, tokenizer and tensor table come from its
    metadata, cached in the directory `gguf_metadata`). With `load_format="dummy"` the weights are random and only
    config.json is required. `tokenizer`, as vLLM's, is a directory to take the tokenizer from instead of the model's;
    `skip_tokenizer_init=True` (vLLM's) loads none: prompts are token ids and outputs have no text.
    `quantization` ("int8" or "int4") quantizes the linear weights of an unquantized checkpoint at load, to GGML's
    Q8_0 or Q4_1 blocks of 32 (round to nearest). `kv_cache_dtype` (one of `KV_CACHE_DTYPES`): "fp8" stores K/V in
    8-bit floats, twice the tokens in the same memory; the torch and Triton backends read them, flash-attn not. "int8"
    stores 8-bit integers with a scale per token and KV head (1.9x the tokens of a 16-bit cache, closer to it than
    fp8); the torch and Triton backends read them too. On the CPU an 8-bit cache's blocks hold a multiple of 16
    tokens (the compiled kernels keep K in tiles of 16).
    `attention_backend` names the attention kernels ("auto", "flash-attn", "flash-attn-4", "triton", "torch"; see
    `nanovllm.kernels.attention.select_backend`); like `device` and `dtype`, "auto" is replaced by what was chosen.
    On CPU the KV cache is sized from `cpu_kvcache_gib` (GiB of host memory); on CUDA from `gpu_memory_utilization`
    of the device memory. A positive `num_kvcache_blocks` (or vLLM's name for it, `num_gpu_blocks_override`) overrides
    both. `kvcache_block_size` (tokens per KV block, the prefix cache's unit) defaults to `default_block_size(device)`;
    `enable_prefix_caching=False` (vLLM's) serves no prompt from cached blocks. `max_model_len` defaults to the model's
    `max_position_embeddings` (without chunked prefill, at most `max_num_batched_tokens`), lowered when the KV cache
    is allocated to what it holds; a value given explicitly is never lowered.
    Worker processes (tensor-parallel ranks, data-parallel replicas) have `worker_start_timeout_s` to start and set
    up their engine; after that a collective waits at most `distributed_timeout_s` for a rank that stopped answering.
    `logprobs_mode` (vLLM's) says what logprobs and prompt logprobs hold: one of `LOGPROBS_MODES`.
    `disable_log_stats=False` (vLLM's; True by default, as vLLM's `LLM`) logs vLLM's periodic throughput line
    (`nanovllm.engine.stats_logger`); request metrics are filled either way.
    `enable_sleep_mode` (vLLM's) allows `LLM.sleep` and `LLM.wake_up` (`nanovllm.engine.llm_engine.LLMEngine.sleep`).
    `runner` (vLLM's): "generate" runs the model's LM head; "pooling" its hidden states, pooled, through `LLM.embed`,
    `classify`, `score`, `reward` and `encode` (`pooler` says how); "auto" picks "pooling" for classifiers
    (`*ForSequenceClassification`), base models (`*Model`) and sentence-transformers directories (`modules.json`).
    `speculative_config` is vLLM's dictionary (see `parse_speculative_config`), parsed into `speculative`; with a
    draft model, `draft` is its own resolved `Config`.
    `structured_outputs_config={"backend": ...}` picks the grammar backend of structured outputs, as vLLM's engine
    argument: "auto" (llguidance), "guidance" (llguidance) or "xgrammar" (needs `pip install xgrammar`); its
    `"jump_forward"` (nanovllm's; default True) proposes the tokens a grammar forces as drafts, verified in one step
    (`nanovllm.spec_decode.grammar_drafts`).
    `logits_processors` (vLLM V1's): custom logits processor classes, each a `nanovllm.logits_processor.LogitsProcessor`
    subclass or its "module:Class" name, built once by the sampler (per-request arguments in
    `SamplingParams.extra_args`); not with speculative decoding (vLLM V1's rule), and with them structured outputs
    do not jump forward (its drafts would be verified without the processors).
    `enable_lora` (vLLM's) serves LoRA adapters per request (`nanovllm.lora`): at most `max_loras` distinct adapters
    in one step, each of rank `max_lora_rank` at most, `max_cpu_loras` kept loaded (None: `max_loras`).

    The fields after `speculative_config` are not settings: `nanovllm.engine.setup.resolve_config` fills them in.
    """

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int = -1
    num_gpu_blocks_override: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    cpu_kvcache_gib: float = 4.0
    worker_start_timeout_s: float = 600.0
    distributed_timeout_s: float = 300.0
    seed: int = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    disable_log_stats: bool = True
    enable_sleep_mode: bool = False
    runner: str = "auto"
    speculative_config: dict | None = None
    speculative: SpeculativeConfig | None = field(init=False)
    draft: "Config | None" = field(init=False, default=None, repr=False)
    structured_outputs_config: dict | None = None
    logits_processors: list | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    hf_config: "PretrainedConfig" = field(init=False, repr=False)
    architecture: str = field(init=False, default="")  # the model family that runs hf_config
    pooler: PoolerConfig | None = field(init=False, default=None)  # runner "pooling": how outputs are pooled
    sliding_window: int = field(init=False, default=0)  # no layer reads K/V outside it (0: some layer reads all)
    gguf_metadata: str | None = field(init=False, default=None)
    torch_dtype: "torch.dtype" = field(init=False)
    kv_cache_torch_dtype: "torch.dtype" = field(init=False)
    max_model_len_given: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kvcache_block_size",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if name in ("max_model_len", "kvcache_block_size") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_model_len_given = self.max_model_len is not None
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 1):
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or a positive integer, "
                             f"got {self.num_kvcache_blocks}")
        if self.num_gpu_blocks_override is not None:
            blocks = self.num_gpu_blocks_override
            if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
                raise ValueError(f"num_gpu_blocks_override must be a positive integer or None, got {blocks!r}")
            if self.num_kvcache_blocks not in (-1, blocks):
                raise ValueError(f"num_gpu_blocks_override={blocks} and num_kvcache_blocks={self.num_kvcache_blocks} "
                                 "both set the KV cache's size: give one")
            self.num_kvcache_blocks = blocks
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ValueError(f"skip_tokenizer_init must be a bool, got {self.skip_tokenizer_init!r}")
        for name in ("cpu_kvcache_gib", "worker_start_timeout_s", "distributed_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.disable_log_stats, bool):
            raise ValueError(f"disable_log_stats must be a bool, got {self.disable_log_stats!r}")
        if not isinstance(self.enable_sleep_mode, bool):
            raise ValueError(f"enable_sleep_mode must be a bool, got {self.enable_sleep_mode!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {[None, *QUANTIZATIONS]}, got {self.quantization!r}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)} (or vLLM's {list(DTYPE_ALIASES)}), got "
                             f"{self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self.speculative = parse_speculative_config(self.speculative_config)
        self._check_lora()
        self._check_structured_outputs_config()
        self._check_logits_processors()

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        value = self.max_cpu_loras
        if isinstance(value, bool) or not isinstance(value, int) or value < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}) or None, got "
                             f"{value!r}")

    def _check_structured_outputs_config(self) -> None:
        options = self.structured_outputs_config
        if options is None:
            return
        names = ["auto", *STRUCTURED_OUTPUT_BACKENDS]
        if not isinstance(options, dict) or set(options) - {"backend", "jump_forward"}:
            raise ValueError(f"structured_outputs_config must be a dict with the keys 'backend' (one of {names}) and "
                             f"'jump_forward' (True or False), got {options!r}")
        if not isinstance(options.get("jump_forward", True), bool):
            raise ValueError(f"structured_outputs_config['jump_forward'] must be True or False, got "
                             f"{options['jump_forward']!r}")
        backend = options.get("backend", "auto")
        if backend not in names:
            raise ValueError(f"structured_outputs_config backend must be one of {names}, got {backend!r}")
        package = STRUCTURED_OUTPUT_BACKENDS[self.structured_outputs_backend]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"structured outputs backend {backend!r} needs the {package} package: pip install "
                             f"{package}")

    def _check_logits_processors(self) -> None:
        entries = self.logits_processors
        if entries is None:
            return
        if not isinstance(entries, (list, tuple)) or not all(
                isinstance(e, type) or isinstance(e, str) and len(e.split(":")) == 2 and all(e.split(":"))
                for e in entries):
            raise ValueError(f"logits_processors must be a list of LogitsProcessor subclasses or their "
                             f"'module:Class' names, got {entries!r}")
        if entries and self.speculative_config is not None:
            raise ValueError(f"{SPEC_DECODE_REJECTS_LOGITS_PROCESSORS} (logits_processors={list(entries)!r} with "
                             f"speculative_config={self.speculative_config!r}: drop one)")

    @property
    def structured_outputs_backend(self) -> str:
        """The grammar backend that runs: the one given, or for "auto" (the default) llguidance's, "guidance" (the
        README's measurements say why)."""
        backend = (self.structured_outputs_config or {}).get("backend", "auto")
        return "guidance" if backend == "auto" else backend

    @property
    def jump_forward(self) -> bool:
        """Whether the tokens a grammar forces are proposed as drafts (on unless turned off, or custom logits
        processors run: its drafts would be verified without them)."""
        return (self.structured_outputs_config or {}).get("jump_forward", True) and not self.logits_processors

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks one `max_model_len` sequence takes."""
        return -(-self.max_model_len // self.kvcache_block_size)


class VllmConfig:
    """The engine's settings under the names of vLLM's `VllmConfig`, as custom logits processors read them (the
    `vllm_config` their constructor gets): `scheduler_config` (`max_num_seqs`: most rows a step's logits have,
    `max_num_batched_tokens`, `max_model_len`), `model_config` (`model`, `max_model_len`, `hf_config`, `dtype`,
    `max_logprobs`, `logits_processors`, `get_vocab_size()`), `cache_config.block_size`,
    `parallel_config.tensor_parallel_size`, and `speculative_config`, None (processors run without speculation).
    `config` is nanovllm's `Config` itself, as `nanovllm.engine.setup.resolve_config` made it."""

    def __init__(self, config: Config):
        self.config = config
        self.scheduler_config = SimpleNamespace(max_num_seqs=config.max_num_seqs,
                                                max_num_batched_tokens=config.max_num_batched_tokens,
                                                max_model_len=config.max_model_len,
                                                enable_chunked_prefill=config.enable_chunked_prefill,
                                                policy=config.scheduling_policy)
        hf_config = getattr(config, "hf_config", None)
        self.model_config = SimpleNamespace(model=config.model, max_model_len=config.max_model_len, hf_config=hf_config,
                                            dtype=getattr(config, "torch_dtype", config.dtype),
                                            max_logprobs=config.max_logprobs, logprobs_mode=config.logprobs_mode,
                                            logits_processors=config.logits_processors,
                                            get_vocab_size=lambda: hf_config.vocab_size)
        self.cache_config = SimpleNamespace(block_size=config.kvcache_block_size,
                                            enable_prefix_caching=config.enable_prefix_caching)
        self.parallel_config = SimpleNamespace(tensor_parallel_size=config.tensor_parallel_size)
        self.speculative_config = None
