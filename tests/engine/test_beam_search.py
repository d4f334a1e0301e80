"""`LLM.beam_search` (vLLM's definition, `nanovllm.beam_search`) through the whole engine, CPU, float32: against every
continuation of a tiny vocabulary scored by transformers (where the width covers them all, the best sequences of all;
narrower, vLLM's algorithm run on transformers' scores), width 1 against greedy, prompts alone and together, EOS,
the length penalty, forks that wait (no room, no copies) and preemption, other callers' requests in the same steps,
vLLM's way through one-token requests, every block freed, and bad values refused."""
import threading

import pytest
import torch
from checkpoints import make_checkpoint
from test_engine_parity import assert_all_blocks_free, random_prompts
from transformers import AutoModelForCausalLM

from nanovllm import LLM, BeamSearchParams, SamplingParams
from nanovllm.beam_search import BeamSearchOutput, get_beam_search_score
from nanovllm.engine.beam_search import EngineBeamSearch, PromptSearch, search_by_requests, token_decoder

VOCAB, EOS = 8, 0  # make_checkpoint's models end with token 0
CPU = dict(device="cpu", dtype="float32", max_model_len=256)
PROMPTS = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 2, 6], [7, 6, 5, 4, 3, 2, 1, 7, 6, 5, 4, 3, 2, 1, 7]]


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory) -> str:
    """A model with 8 tokens and no tokenizer: every continuation of a few tokens can be scored."""
    return make_checkpoint(str(tmp_path_factory.mktemp("vocab8")), vocab_size=VOCAB, tokenizer=False, seed=5,
                           initializer_range=0.3)


@pytest.fixture(scope="module")
def llm(tiny_vocab):
    with LLM(tiny_vocab, kvcache_block_size=4, **CPU) as engine:  # small blocks: forks at and off block boundaries
        yield engine


@pytest.fixture(scope="module")
def scores(tiny_vocab):
    """Memoized next-token logprobs of transformers' float32 model: tokens -> VOCAB floats."""
    model = AutoModelForCausalLM.from_pretrained(tiny_vocab, dtype=torch.float32).eval()
    memo: dict[tuple[int, ...], list[float]] = {}

    @torch.inference_mode()
    def next_logprobs(sequences: list[list[int]]) -> list[list[float]]:
        todo = [s for s in sequences if tuple(s) not in memo]
        for length in {len(s) for s in todo}:
            batch = [s for s in todo if len(s) == length]
            logits = model(input_ids=torch.tensor(batch)).logits[:, -1].float()
            for s, row in zip(batch, torch.log_softmax(logits, -1).tolist()):
                memo[tuple(s)] = row
        return [memo[tuple(s)] for s in sequences]

    return next_logprobs


def score(tokens: list[int], cum: float, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`, written out."""
    return cum / ((len(tokens) - (tokens[-1] == EOS)) ** length_penalty)


def every_continuation(scores, prompt: list[int], max_tokens: int, ignore_eos: bool) -> list[tuple[list[int], float]]:
    """Every sequence beam search could end with (up to EOS, unless ignored, or `max_tokens`), and its cumulative
    logprob by transformers."""
    ended, live = [], [(prompt, 0.0)]
    for step in range(max_tokens):
        rows = scores([tokens for tokens, _ in live])
        extended = [(tokens + [t], cum + row[t]) for (tokens, cum), row in zip(live, rows) for t in range(VOCAB)]
        live = []
        for tokens, cum in extended:
            (ended if tokens[-1] == EOS and not ignore_eos or step == max_tokens - 1 else live).append((tokens, cum))
    return ended


def vllm_beam_search(scores, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """vLLM's `LLM.beam_search` at temperature 0, on transformers' scores: each beam extended by its 2 * beam_width
    most likely tokens, EOS ones set aside, the beam_width best by score go on (stable sorts)."""
    key = lambda beam: score(*beam, params.length_penalty)  # noqa: E731
    beams, completed = [(prompt, 0.0)], []
    for _ in range(params.max_tokens):
        new = []
        for (tokens, cum), row in zip(beams, scores([tokens for tokens, _ in beams])):
            for t in sorted(range(VOCAB), key=lambda t: -row[t])[:2 * params.beam_width]:
                (completed if t == EOS and not params.ignore_eos else new).append((tokens + [t], cum + row[t]))
        beams = sorted(new, key=key, reverse=True)[:params.beam_width]
    return sorted(completed + beams, key=key, reverse=True)[:params.beam_width]


def check(output: BeamSearchOutput, prompt: list[int], expected: list[tuple[list[int], float]],
          params: BeamSearchParams) -> None:
    """`output` has the `expected` beams (tokens, transformers' cumulative logprob), each with its finish reason
    and one logprobs dict per generated token holding the token chosen."""
    assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
    for seq, (tokens, cum) in zip(output.sequences, expected):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
        stopped = tokens[-1] == EOS and not params.ignore_eos
        assert (seq.finish_reason, seq.stop_reason) == (("stop", EOS) if stopped else ("length", None))
        assert len(seq.logprobs) == len(tokens) - len(prompt)
        assert sum(step[t].logprob for step, t in zip(seq.logprobs, tokens[len(prompt):])) == \
            pytest.approx(seq.cum_logprob, abs=1e-9)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_width_covering_every_continuation_returns_the_best_of_all(llm, scores, length_penalty, ignore_eos):
    """With 2 * beam_width >= the vocabulary every token is a candidate, and with beam_width >= VOCAB ** 2 every
    two-token prefix lives on, so 3 steps see every continuation: the result is the best beam_width of all of them
    by vLLM's score, with their cumulative logprobs, from transformers."""
    params = BeamSearchParams(beam_width=VOCAB ** 2, max_tokens=3, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        every = every_continuation(scores, prompt, 3, ignore_eos)
        best = sorted(every, key=lambda e: score(*e, length_penalty), reverse=True)[:params.beam_width]
        check(output, prompt, best, params)
        if not ignore_eos:
            assert any(s.finish_reason == "stop" for s in output.sequences)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("beam_width,max_tokens,length_penalty,ignore_eos",
                         [(1, 4, 1.0, False), (2, 4, 1.0, False), (2, 6, 0.5, False), (3, 5, 2.0, True),
                          (2, 12, 1.0, True)])
def test_a_narrow_search_is_vllms_algorithm_on_transformers_scores(llm, scores, beam_width, max_tokens,
                                                                   length_penalty, ignore_eos):
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        check(output, prompt, vllm_beam_search(scores, prompt, params), params)
        assert all(len(step) == min(2 * beam_width, VOCAB) for s in output.sequences for step in s.logprobs)
    assert_all_blocks_free(llm)


def test_width_one_ignoring_eos_is_greedy(tied_model):
    prompts = random_prompts([5, 30, 17], seed=3)
    with LLM(tied_model, **CPU) as llm:
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0),
                              use_tqdm=False)
        beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=20, ignore_eos=True))
        for prompt, g, b in zip(prompts, greedy, beams):
            (seq,) = b.sequences
            assert seq.tokens == prompt + g.outputs[0].token_ids
            assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-5)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # vLLM's: the prompt's text too
            assert seq.finish_reason == "length"
        assert_all_blocks_free(llm)


def test_prompts_together_equal_each_alone_and_prompt_forms(tied_model):
    prompts = random_prompts([3, 16, 31, 40], seed=8)
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    with LLM(tied_model, **CPU) as llm:
        together = llm.beam_search(prompts, params)
        alone = [llm.beam_search([prompt], params)[0] for prompt in prompts]
        text = llm.get_tokenizer().decode(prompts[1])
        forms = llm.beam_search([{"prompt_token_ids": prompts[0]}, {"prompt": text}, prompts[2]], params)
        limited = llm.beam_search(prompts, params, concurrency_limit=1)
        assert_all_blocks_free(llm)
    for a, b in zip(together, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)
    assert [s.tokens for s in forms[0].sequences] == [s.tokens for s in together[0].sequences]
    assert forms[1].sequences[0].tokens[:len(llm.get_tokenizer().encode(text))] == llm.get_tokenizer().encode(text)
    assert [[s.tokens for s in o.sequences] for o in limited] == [[s.tokens for s in o.sequences] for o in together]


def test_vllms_way_through_one_token_requests_gives_the_same_beams(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.7)
    engine = llm.beam_search(PROMPTS, params)
    sampling = SamplingParams(temperature=0, max_tokens=1, detokenize=False, logprobs=2 * params.beam_width)
    searches = [PromptSearch(p, params, EOS, llm.max_model_len)
                for p in llm.prompts.check_prompts(PROMPTS, sampling, None)]
    search_by_requests(lambda beams: llm.generate(beams, sampling, use_tqdm=False), searches, concurrency_limit=2)
    requests = [search.output(None, token_decoder(None)) for search in searches]
    for a, b in zip(engine, requests):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)


@pytest.mark.parametrize("settings", [dict(num_kvcache_blocks=12, max_model_len=32), dict(max_num_seqs=3),
                                      dict(copies=False)], ids=["preempted", "forks-wait-for-room", "no-copies"])
def test_forks_that_wait_or_are_preempted_give_the_same_beams(tiny_vocab, llm, settings, monkeypatch):
    """A fork that cannot run beside its parent waits and is computed when admitted (its full blocks from the prefix
    cache); beams that sampled are preempted when they hold the room their search waits for."""
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    expected = llm.beam_search(PROMPTS, params)
    if settings.pop("copies", True) is False:  # as under tensor parallelism
        init = EngineBeamSearch.__init__

        def no_copies(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.copies = False

        monkeypatch.setattr(EngineBeamSearch, "__init__", no_copies)
    with LLM(tiny_vocab, kvcache_block_size=4, **{**CPU, **settings}) as small:
        outputs = small.beam_search(PROMPTS, params)
        stats = small.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    if "num_kvcache_blocks" in settings:
        assert stats["num_preemptions"] > 0
    else:
        assert stats["num_cached_tokens"] > 0  # waiting forks found their parents' blocks
    for a, b in zip(expected, outputs):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_beams_take_no_drafts_under_speculative_decoding(tiny_vocab, llm, speculative):
    """Beams sample one token a step, without drafts; speculation goes on for other requests."""
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    expected = llm.beam_search(PROMPTS, params)
    spec = {"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 1} if speculative == "ngram" \
        else {"model": tiny_vocab}
    with LLM(tiny_vocab, kvcache_block_size=4, speculative_config={**spec, "num_speculative_tokens": 3},
             **CPU) as spec_llm:
        outputs = spec_llm.beam_search(PROMPTS, params)
        greedy = spec_llm.generate(PROMPTS * 3, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                   use_tqdm=False)
        stats = spec_llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_draft_tokens"] > 0
    for a, b in zip(expected, outputs):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)
    assert [o.outputs[0].token_ids for o in greedy] == \
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 3, SamplingParams(temperature=0, max_tokens=30,
                                                                                   ignore_eos=True), use_tqdm=False)]


def test_other_requests_share_the_steps(tied_model):
    prompts = random_prompts([7, 20, 12], seed=4)
    others = random_prompts([9, 25, 40, 3], seed=5)
    params = BeamSearchParams(beam_width=3, max_tokens=16)
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tied_model, **CPU) as llm:
        beams_alone = llm.beam_search(prompts, params)
        greedy_alone = llm.generate(others, sampling, use_tqdm=False)
        greedy = []
        thread = threading.Thread(target=lambda: greedy.extend(llm.generate(others, sampling, use_tqdm=False)))
        thread.start()
        beams = llm.beam_search(prompts, params)
        thread.join()
        assert_all_blocks_free(llm)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in greedy_alone]
    assert [[s.tokens for s in o.sequences] for o in beams] == [[s.tokens for s in o.sequences] for o in beams_alone]


def test_sampled_candidates_at_a_temperature(llm):
    """At temperature > 0 the token each beam samples is a candidate too, with the top ones."""
    params = BeamSearchParams(beam_width=2, max_tokens=8, temperature=1.5)
    for output in llm.beam_search(PROMPTS, params):
        for seq in output.sequences:
            assert seq.cum_logprob == pytest.approx(sum(step[t].logprob for step, t in
                                                        zip(seq.logprobs, seq.tokens[-len(seq.logprobs):])))
            assert all(len(step) in (4, 5) for step in seq.logprobs)
    assert_all_blocks_free(llm)


def test_max_model_len_ends_the_beams(tiny_vocab):
    with LLM(tiny_vocab, kvcache_block_size=4, device="cpu", dtype="float32", max_model_len=20) as llm:
        outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
        assert [{len(s.tokens) for s in o.sequences} for o in outputs] == [{20}] * 3
        assert all(s.finish_reason == "length" for o in outputs for s in o.sequences)
        assert_all_blocks_free(llm)


def test_the_score():
    assert get_beam_search_score([1, 2, 3, 4], -2.0, EOS) == -0.5
    assert get_beam_search_score([1, 2, 3, EOS], -2.0, EOS) == pytest.approx(-2 / 3)  # EOS does not count
    assert get_beam_search_score([1, 2, 3, 4], -2.0, EOS, length_penalty=2.0) == -0.125


@pytest.mark.parametrize("make,match", [
    (lambda: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (lambda: BeamSearchParams(beam_width=True, max_tokens=4), "beam_width"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1), "temperature must be a number >= 0"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos must be True or False"),
])
def test_bad_params_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_calls_are_refused_before_any_work(llm, tied_model):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
    with pytest.raises(ValueError, match="lora_request must be a nanovllm.lora.request.LoRARequest"):
        llm.beam_search(PROMPTS, params, lora_request=object())
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(PROMPTS, params, concurrency_limit=0)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.beam_search([[1, 2, VOCAB]], params)
    with pytest.raises(ValueError, match="is empty"):
        llm.beam_search([[]], params)
    assert llm.beam_search([], params) == []
    assert llm.is_finished()
    assert_all_blocks_free(llm)
    with LLM(tied_model, **CPU) as big_vocab:  # 2 * 11 candidates' logprobs are more than max_logprobs=20, as in vLLM
        with pytest.raises(ValueError, match="Requested sample logprobs of 22, which is greater than max allowed: 20"):
            big_vocab.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=4))


def test_data_parallel_replicas_search_through_one_token_requests(tiny_vocab, llm):
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    expected = llm.beam_search(PROMPTS, params)
    with LLM(tiny_vocab, data_parallel_size=2, kvcache_block_size=4, **CPU) as replicas:
        outputs = replicas.beam_search(PROMPTS, params)
        assert replicas.is_finished()
        assert_all_blocks_free(replicas)
    for a, b in zip(expected, outputs):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)
