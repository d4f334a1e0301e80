"""Speculative decoding's figures, as `LLM.stats()` reports them."""


def spec_decode_stats(num_draft_tokens: int, num_accepted_tokens: int, num_spec_rows: int) -> dict[str, int | float]:
    """The counters (drafts verified, drafts accepted, verification rows: a sequence's decode with drafts), and what
    they come to: the share of drafts accepted, and tokens per verification row (accepted drafts plus the token
    sampled after them; vLLM's mean acceptance length). Figures are 0 before any draft was verified."""
    return {"num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted_tokens,
            "num_spec_rows": num_spec_rows,
            "spec_acceptance_rate": num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0,
            "spec_mean_accepted_length": 1 + num_accepted_tokens / num_spec_rows if num_spec_rows else 0.0}
