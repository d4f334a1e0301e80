"""Incremental detokenization and stop strings with a real byte-level BPE tokenizer, against its full decode."""
import random

import pytest
from checkpoints import make_tokenizer
from transformers import AutoTokenizer

from nanovllm import SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer, NativeStream, PythonStream

SENTENCE = "The quick brown fox jumps over the lazy dog."
PROMPT = "Hello, my name is"


class WithoutRustBackend:
    """The same tokenizer seen as one without a Rust backend (as a pure-Python tokenizer is): the Python stream."""

    backend_tokenizer = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


@pytest.fixture(scope="module", params=["native", "python"])
def tokenizer(tmp_path_factory, request):
    path = str(tmp_path_factory.mktemp("bpe"))
    make_tokenizer(path, 384)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer if request.param == "native" else WithoutRustBackend(tokenizer)


def test_the_stream_follows_the_tokenizer(tokenizer):
    stream_class = PythonStream if isinstance(tokenizer, WithoutRustBackend) else NativeStream
    assert isinstance(IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams()).stream, stream_class)


def stream(tokenizer, token_ids: list[int], params: SamplingParams, prompt: str | list[int] = PROMPT,
           finish: bool = True):
    """Feed the tokens one at a time as the engine would; the deltas, the stop string and the detokenizer. The last
    token finishes the sequence (`finish`) unless a stop string ended it first."""
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, stop = [], None
    for i, token_id in enumerate(token_ids):
        update = detokenizer.update([token_id], finished=finish and i == len(token_ids) - 1)
        deltas.append(update.text)
        if update.stop:
            stop = update.stop
            break
    return deltas, stop, detokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_the_full_decode(tokenizer, skip_special_tokens):
    """Random token ids, special ones included, many of them bytes of multi-byte characters, after random prompts
    (some ending in half a character): the deltas add up to transformers' decode of the completion, and none
    before the last ends in a half character."""
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(200):
        token_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        deltas, stop, detokenizer = stream(tokenizer, token_ids, params, prompt)
        assert stop is None
        expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detokenizer.text == expected
        assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_tokens_taken_many_at_a_time_give_the_same_text(tokenizer, skip_special_tokens):
    """Without stop strings the engine detokenizes only when the text is read, many tokens per call (half
    characters and unknown ids inside a chunk included): the text is that of one token at a time."""
    rng = random.Random(1)
    params = SamplingParams(skip_special_tokens=skip_special_tokens, min_tokens=2)
    for _ in range(200):
        token_ids = [rng.randrange(len(tokenizer) + 8) for _ in range(rng.randrange(1, 30))]  # + ids it lacks
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        _, _, one_at_a_time = stream(tokenizer, token_ids, params, prompt)
        detokenizer, text, taken = IncrementalDetokenizer(tokenizer, prompt, params), "", 0
        while taken < len(token_ids):
            chunk = token_ids[taken:taken + rng.randrange(1, 6)]
            taken += len(chunk)
            text += detokenizer.update(chunk, finished=taken == len(token_ids)).text
        assert text == detokenizer.text == one_at_a_time.text


def test_multibyte_characters_are_held_until_complete(tokenizer):
    text = "日本語 😀 ok"
    token_ids = tokenizer.encode(text)
    assert "\ufffd" in tokenizer.decode(token_ids[:1])  # the characters' bytes are split across tokens
    deltas, _, _ = stream(tokenizer, token_ids, SamplingParams(), finish=False)
    assert "".join(deltas) == text
    assert deltas[:3] == ["", "", "日"]
    assert not any("\ufffd" in delta for delta in deltas)


def test_an_unfinished_character_is_released_when_the_sequence_ends(tokenizer):
    token_ids = tokenizer.encode("ok 😀")[:-1]
    deltas, _, _ = stream(tokenizer, token_ids, SamplingParams())
    assert deltas[-1].endswith("\ufffd") and not any(d.endswith("\ufffd") for d in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(token_ids)


def test_special_tokens_follow_skip_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    token_ids = tokenizer.encode(" fox") + [eos]
    deltas, _, _ = stream(tokenizer, token_ids, SamplingParams())
    assert deltas == [" fox", ""]
    deltas, _, _ = stream(tokenizer, token_ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == " fox" + tokenizer.eos_token


def test_a_stop_string_spanning_tokens_cuts_the_text(tokenizer):
    token_ids = tokenizer.encode(SENTENCE)
    stop = "fox ju"
    assert not any(stop in tokenizer.decode([t]) for t in token_ids)
    deltas, matched, detokenizer = stream(tokenizer, token_ids, SamplingParams(stop=[stop]))
    assert matched == stop
    assert "".join(deltas) == detokenizer.text == "The quick brown "
    assert tokenizer.decode(token_ids[:len(deltas)]).endswith(stop)  # it stopped at the token completing it


def test_include_stop_str_in_output_keeps_it_and_drops_the_rest_of_the_token(tokenizer):
    token_ids = tokenizer.encode(SENTENCE)
    deltas, matched, detokenizer = stream(tokenizer, token_ids,
                                          SamplingParams(stop="quick b", include_stop_str_in_output=True))
    assert matched == "quick b"
    assert "".join(deltas) == detokenizer.text == "The quick b"  # " brow" completed it; "row" is dropped


def test_the_earliest_stop_string_wins(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT),
                                         SamplingParams(stop=["lazy", "jumps", "quick"]))
    update = detokenizer.update(tokenizer.encode(SENTENCE))
    assert (update.text, update.stop) == ("The ", "quick")


def test_min_tokens_ignores_stop_strings_in_its_text(tokenizer):
    """As vLLM: a stop string counts only if it ends in the text of a token after the first min_tokens."""
    token_ids = tokenizer.encode(SENTENCE)
    for min_tokens, expected in [(0, "Th"), (1, "The quick brown fox jumps ov"), (9, "The quick brown fox jumps ov"),
                                 (10, "The quick brown fox jumps over th")]:
        deltas, matched, detokenizer = stream(tokenizer, token_ids, SamplingParams(stop="e", min_tokens=min_tokens))
        assert (matched, "".join(deltas), detokenizer.text) == ("e", expected, expected), min_tokens


def test_text_that_may_begin_a_stop_string_waits(tokenizer):
    token_ids = tokenizer.encode(SENTENCE)
    deltas, matched, _ = stream(tokenizer, token_ids[:6], SamplingParams(stop="fox ju"), finish=False)
    assert matched is None and "".join(deltas) == "The quick brown "  # "fox" may begin the stop string
    deltas, matched, detokenizer = stream(tokenizer, token_ids[:6], SamplingParams(stop="fox ju"))
    assert matched is None and "".join(deltas) == detokenizer.text == "The quick brown fox"  # released at the end
    deltas, _, _ = stream(tokenizer, token_ids[:6], SamplingParams(stop="fox ju", include_stop_str_in_output=True),
                          finish=False)
    assert "".join(deltas) == "The quick brown fox"


@pytest.mark.parametrize("text", ["Emoji: 😀 🎉 done", "Chinese: 你好", "Em dash — and “quotes”"])
def test_logprobs_decoded_tokens_complete_split_characters(tokenizer, text):
    """A logprob's `decoded_token` (vLLM's rule): a token ending inside a character split over byte tokens gets the
    character once the tokens before it complete it ("" until then), so the tokens' texts add up to the text."""
    from nanovllm.engine.request import decoded_token

    ids = tokenizer.encode(text)
    pieces = [decoded_token(tokenizer, t, ids[max(i - 4, 0):i]) for i, t in enumerate(ids)]
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # the text does split characters
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    assert "".join(pieces) == text
