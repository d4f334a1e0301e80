"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's final n tokens."""
from array import array

_ITEM = array("i").itemsize


def ngram_proposal(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of `token_ids` of
    `max_n` down to `min_n` tokens; [] when none occurs. The search is `bytes.rfind` over the ids packed as int32, so
    it runs in C: a match at an offset that is not a whole token is skipped."""
    data = array("i", token_ids).tobytes()
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        pattern, end = data[-n * _ITEM:], len(data) - _ITEM  # an earlier occurrence ends before the last token
        while (found := data.rfind(pattern, 0, end)) != -1:
            if found % _ITEM == 0:
                start = found // _ITEM + n
                return token_ids[start:start + k]
            end = found + len(pattern) - 1
    return []
