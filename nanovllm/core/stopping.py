"""When a sequence ends with the token it just got: the rule the engine applies after every sampled token."""
from nanovllm.core.sequence import Sequence


def token_finish(seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> tuple[str, int | None] | None:
    """Why `seq` ends with its last token, as `(finish_reason, stop_reason)`, or None: a stop token ("stop", its id)
    or EOS unless ignored ("stop", None), neither before `min_tokens`; then `max_tokens` or `max_model_len`
    ("length", None). A stop string found in the text (by the engine's detokenizer) ends it as well, and comes
    first."""
    params, token_id, generated = seq.params, seq.token_ids[-1], seq.num_completion_tokens
    if generated >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop", token_id
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
    if generated >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length", None
    return None
