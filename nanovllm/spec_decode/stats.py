"""Speculative decoding's figures, as `LLM.stats()` reports them, and the replicas' figures as one engine's."""

RATES = ("spec_acceptance_rate", "spec_mean_accepted_length")


def spec_decode_stats(num_draft_tokens: int, num_accepted_tokens: int, num_spec_rows: int,
                      num_accepted_per_position: list[int]) -> dict[str, int | float | list[int]]:
    """The counters (drafts verified, drafts accepted, verification rows: a sequence's decode with drafts; drafts
    accepted at each draft position), and what they come to: the share of drafts accepted, and tokens per
    verification row (accepted drafts plus the token sampled after them; vLLM's mean acceptance length). Figures are
    0 before any draft was verified."""
    return {"num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted_tokens,
            "num_spec_rows": num_spec_rows,
            "num_accepted_per_position": num_accepted_per_position,
            "spec_acceptance_rate": num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0,
            "spec_mean_accepted_length": 1 + num_accepted_tokens / num_spec_rows if num_spec_rows else 0.0}


def combine_stats(replicas: list[dict]) -> dict:
    """Several engines' `stats()` as one's: every counter (`num_*`; a list counts position by position) summed,
    and the rates recomputed from the summed counters, never summed themselves."""
    keys = dict.fromkeys(key for stats in replicas for key in stats if key.startswith("num_") and key != "num_requests")
    total = {}
    for key in keys:
        values = [stats[key] for stats in replicas if key in stats]
        if isinstance(values[0], list):
            width = max(map(len, values))
            total[key] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            total[key] = sum(values)
    if any(rate in stats for stats in replicas for rate in RATES):
        total.update(spec_decode_stats(total["num_draft_tokens"], total["num_accepted_tokens"],
                                       total["num_spec_rows"], total["num_accepted_per_position"]))
    return total
