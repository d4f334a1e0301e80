"""The engine's settings as plain data, checked on construction; `nanovllm.engine.setup` resolves them against the
model and the machine."""
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanovllm.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8", "int4")
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar")


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
    config.json is required. `tokenizer`, as vLLM's, is a directory to take the tokenizer from instead of the model's.
    `quantization` ("int8" or "int4") quantizes the linear weights of an unquantized checkpoint at load, to GGML's
    Q8_0 or Q4_1 blocks of 32 (round to nearest).
    `attention_backend` names the attention kernels ("auto", "flash-attn", "flash-attn-4", "triton", "torch"; see
    `nanovllm.backends.select_backend`); like `device` and `dtype`, "auto" is replaced by what was chosen.
    On CPU the KV cache is sized from `cpu_kvcache_gib` (GiB of host memory); on CUDA from `gpu_memory_utilization`
    of the device memory. A positive `num_kvcache_blocks` overrides both. `kvcache_block_size` (tokens per KV block,
    the prefix cache's unit) defaults to `default_block_size(device)`. `max_model_len` defaults to the model's
    `max_position_embeddings` (without chunked prefill, at most `max_num_batched_tokens`), lowered when the KV cache
    is allocated to what it holds; a value given explicitly is never lowered.
    Worker processes (tensor-parallel ranks, data-parallel replicas) have `worker_start_timeout_s` to start and set
    up their engine; after that a collective waits at most `distributed_timeout_s` for a rank that stopped answering.
    `speculative_config` is vLLM's dictionary (see `nanovllm.spec_decode.config`), parsed into `speculative`; with a
    draft model, `draft` is its own resolved `Config`.
    `structured_outputs_config={"backend": ...}` picks the grammar backend of structured outputs, as vLLM's engine
    argument: "auto" (llguidance), "guidance" (llguidance) or "xgrammar" (needs `pip install xgrammar`); its
    `"jump_forward"` (nanovllm's; default True) proposes the tokens a grammar forces as drafts, verified in one step
    (`nanovllm.spec_decode.grammar_drafts`).

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
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    cpu_kvcache_gib: float = 4.0
    worker_start_timeout_s: float = 600.0
    distributed_timeout_s: float = 300.0
    seed: int = 0
    max_logprobs: int = 20
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    tokenizer: str | None = None
    quantization: str | None = None
    speculative_config: dict | None = None
    speculative: SpeculativeConfig | None = field(init=False)
    draft: "Config | None" = field(init=False, default=None, repr=False)
    structured_outputs_config: dict | None = None
    hf_config: "PretrainedConfig" = field(init=False, repr=False)
    gguf_metadata: str | None = field(init=False, default=None)
    torch_dtype: "torch.dtype" = field(init=False)
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
        for name in ("cpu_kvcache_gib", "worker_start_timeout_s", "distributed_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        self.speculative = parse_speculative_config(self.speculative_config)
        self._check_structured_outputs_config()

    def _check_structured_outputs_config(self) -> None:
        options = self.structured_outputs_config
        if options is None:
            return
        if not isinstance(options, dict) or set(options) - {"backend", "jump_forward"}:
            raise ValueError("structured_outputs_config must be a dict with the keys 'backend' (one of "
                             f"{list(STRUCTURED_OUTPUT_BACKENDS)}) and 'jump_forward' (True or False), got {options!r}")
        if not isinstance(options.get("jump_forward", True), bool):
            raise ValueError(f"structured_outputs_config['jump_forward'] must be True or False, got "
                             f"{options['jump_forward']!r}")
        backend = options.get("backend", "auto")
        if backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {list(STRUCTURED_OUTPUT_BACKENDS)}, "
                             f"got {backend!r}")
        package = {"guidance": "llguidance", "xgrammar": "xgrammar"}.get(backend, "llguidance")
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"structured outputs backend {backend!r} needs the {package} package: pip install "
                             f"{package}")

    @property
    def structured_outputs_backend(self) -> str:
        """The grammar backend's name as given ("auto" unless chosen)."""
        return (self.structured_outputs_config or {}).get("backend", "auto")

    @property
    def jump_forward(self) -> bool:
        """Whether the tokens a grammar forces are proposed as drafts (on unless turned off)."""
        return (self.structured_outputs_config or {}).get("jump_forward", True)

    @property
    def blocks_per_sequence(self) -> int:
        """KV blocks one `max_model_len` sequence takes."""
        return -(-self.max_model_len // self.kvcache_block_size)
