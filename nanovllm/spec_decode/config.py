"""`speculative_config`, vLLM's dictionary, checked and turned into plain data before any work."""
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "quantization")
QUANTIZATIONS = (None, "int8", "int4")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given
# The step cost model of the adaptive draft count, in units of one more row (token) in the forward: a step of B
# sequences and D drafts costs about fixed + (1 + per_sequence) * B + D: the fixed part reads the weights, each
# sequence brings its host work, sampling and attention besides its row. Fitted to step times with 2 to 16 requests
# (k=5, always on) on the 2-core CPU with SmolLM2-135M (README, speculative decoding); the CUDA figures are a guess,
# not measured: a GPU stays bound by reading the weights up to hundreds of rows.
STEP_COST = {"cpu": (8, 8), "cuda": (256, 1)}


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
    """vLLM's `speculative_config` as a `SpeculativeConfig` (None stays None); a ValueError naming the bad key."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': "
                         f"4}}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KEYS), key=str)
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) {unknown}; valid keys: {list(KEYS)}")
    model = spec.get("model")
    method = spec.get("method", "draft_model" if model is not None else None)
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)} (or give 'model' for a draft "
                         f"model), got {method!r}")
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
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config['quantization'] must be one of {list(QUANTIZATIONS)}, got "
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
