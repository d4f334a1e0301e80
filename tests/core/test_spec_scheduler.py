"""Speculative decoding's bookkeeping, without a model: n-gram proposals, drafts in the step's token budget, the KV
blocks of rejected drafts released and only accepted tokens named for prefix caching."""
from dataclasses import replace

from nanovllm.config import STEP_COST, parse_speculative_config
from nanovllm.core.scheduler import Scheduler, SchedulerConfig
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.spec_decode.ngram import ngram_proposal
from nanovllm.spec_decode.proposer import NgramProposer, acceptance, drafts_pay, keep_drafts

BS = 4


def test_ngram_proposal_follows_the_latest_longest_match():
    assert ngram_proposal([1, 2, 3, 4, 5, 1, 2], 1, 3, 4) == [3, 4, 5, 1]
    assert ngram_proposal([1, 2, 9, 7, 2, 8, 1, 2], 1, 2, 2) == [9, 7]  # the 2-gram [1, 2] beats the later [2]
    assert ngram_proposal([5, 2, 6, 2, 7, 2], 1, 1, 3) == [7, 2]  # the latest occurrence, cut at the end
    assert ngram_proposal([7, 8, 9], 1, 2, 3) == []
    assert ngram_proposal([1, 2, 3, 1, 2], 3, 3, 3) == []  # shorter than prompt_lookup_min
    assert ngram_proposal([256, 1, 0, 0, 1], 2, 2, 3) == []  # the bytes of [256, 1] hold [0, 1] off a token boundary
    assert ngram_proposal([256, 1, 0, 0, 1, 0, 0, 1], 2, 2, 3) == [0, 0, 1]


def make_scheduler(num_blocks: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=num_blocks, block_size=BS, max_num_seqs=4,
                                     max_num_batched_tokens=budget, enable_chunked_prefill=True,
                                     scheduling_policy="fcfs"))


def prefilled(s: Scheduler, prompt: list[int], max_tokens: int = 16, sampled: int = 6) -> Sequence:
    """A sequence whose prompt was computed and that sampled `sampled`."""
    seq = Sequence(0, prompt, BS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add(seq)
    batch = s.schedule()
    (_, (token,)), = s.new_tokens(batch, [sampled])
    seq.append_token(token)
    return seq


def test_drafts_are_verified_as_one_chunk_and_rejected_blocks_are_freed():
    s = make_scheduler()
    seq = prefilled(s, [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed
    seq.spec_token_ids = [7, 8, 9, 10, 11]
    batch = s.schedule()
    assert (batch.starts, batch.num_tokens, batch.drafts, batch.samples) == ([6], [6], [[7, 8, 9, 10, 11]], [True])
    assert len(seq.block_table) == 3  # positions 0..11
    named = [s.block_manager.blocks[b].hash != -1 for b in seq.block_table]
    assert named == [True, False, False]  # drafts are never named before they are accepted
    (_, tokens), = s.new_tokens(batch, [7, 8, 42], num_accepted=[2])
    for token in tokens:
        seq.append_token(token)
    s.settle(seq)
    assert seq.token_ids[6:] == [6, 7, 8, 42] and seq.num_computed_tokens == 9
    assert len(seq.block_table) == 3 and s.block_manager.num_free_blocks == 5
    second = s.block_manager.blocks[seq.block_table[1]]
    assert second.token_ids == [5, 6, 6, 7] and s.block_manager.hash_to_block_id[second.hash] == second.block_id
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_spec_rows) == (5, 2, 1)

    seq.spec_token_ids = [1, 2, 3]
    batch = s.schedule()
    assert len(seq.block_table) == 4
    (_, tokens), = s.new_tokens(batch, [5], num_accepted=[0])
    seq.append_token(tokens[0])
    s.settle(seq)
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3  # the block only drafts used is free again
    assert s.block_manager.num_free_blocks == 5


def test_drafts_count_against_the_token_budget():
    s = make_scheduler(budget=8)
    seq = prefilled(s, [1, 2, 3])
    seq.spec_token_ids = list(range(10, 20))
    other = Sequence(1, [9] * 5, BS, SamplingParams(max_tokens=4))
    s.add(other)
    batch = s.schedule()
    assert batch.drafts[0] == list(range(10, 17)) and batch.num_tokens == [8]  # the budget keeps 7 of 10 drafts
    assert other not in batch.seqs


def test_without_blocks_for_its_drafts_a_sequence_decodes_plainly():
    s = make_scheduler(num_blocks=2)
    seq = prefilled(s, [1, 2, 3, 4, 5, 6])
    seq.spec_token_ids = [7, 8, 9]  # would need a third block
    batch = s.schedule()
    assert batch.num_tokens == [1] and batch.drafts == [[]] and s.num_preemptions == 0


def test_proposer_respects_max_tokens_max_model_len_penalties_and_batch_size():
    spec = replace(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                                             "disable_by_batch_size": 3}), step_cost=STEP_COST["cpu"])
    proposer = NgramProposer(spec, max_model_len=14)
    s = make_scheduler()
    seq = prefilled(s, [1, 2, 3, 4, 5, 6, 1], max_tokens=3, sampled=2)
    proposer.propose([seq])
    assert seq.spec_token_ids == [3]  # 1 generated: one draft and the token after it reach max_tokens=3
    seq.params.max_tokens = 16
    proposer.propose([seq])
    assert seq.spec_token_ids == [3, 4, 5, 6]
    seq.token_ids += [3, 4, 5, 6, 1]
    seq.num_computed_tokens = len(seq.token_ids) - 1
    proposer.propose([seq])
    assert seq.spec_token_ids == [2]  # 13 of max_model_len=14 tokens
    seq.token_ids[-3:] = [1, 2]
    seq.num_computed_tokens -= 1
    proposer.propose([seq, seq, seq])
    assert seq.spec_token_ids == []
    seq.params.repetition_penalty = 1.2
    proposer.propose([seq])
    assert seq.spec_token_ids == []


def test_adaptive_rule_keeps_drafts_that_pay_for_their_rows():
    def decoding(accepted: int, trials: int) -> Sequence:
        seq = Sequence(0, [1, 2, 3], BS, SamplingParams())
        seq.spec_accepted, seq.spec_trials = accepted, trials
        return seq

    good, poor = decoding(90, 100), decoding(5, 100)
    assert acceptance(good) == (90 + 1.4) / 102
    alone = keep_drafts({good: [7] * 5}, num_seqs=1, num_rows=1, step_cost=(8, 8))
    assert alone == {good: 5}
    assert keep_drafts({poor: [7] * 5}, num_seqs=1, num_rows=1, step_cost=(8, 8)) == {poor: 1}
    # at 64 sequences a step costs 8 + 9 * 64 rows for 64 tokens: a poor draft (0.07) is not worth its row
    many = {decoding(90, 100): [7] * 5 for _ in range(32)} | {decoding(5, 100): [7] * 5 for _ in range(32)}
    kept = keep_drafts(many, num_seqs=64, num_rows=64, step_cost=(8, 8))
    assert sorted(set(kept.values())) == [0, 5] and sum(kept.values()) == 32 * 5
    # where a row costs as much as the step's fixed part, only drafts likelier than a token per cost are kept
    assert set(keep_drafts({good: [7] * 5}, num_seqs=64, num_rows=64, step_cost=(0, 0)).values()) == {0}


def test_drafts_pay_a_verify_step_that_costs_more_only_with_enough_expected_tokens():
    """Where a plain step replays a CUDA graph and a verify step cannot (costing `price` plain steps), drafts are
    kept while their expected tokens per cost beat the plain step's: at batch 1 on CUDA (a step costs 256 + 1 + 1
    rows), five likely drafts (4.6 tokens expected) pay a verify step of 3 plain steps, not one of 5."""
    def decoding(accepted: int, trials: int, drafts: int) -> Sequence:
        seq = Sequence(0, [1, 2, 3], BS, SamplingParams())
        seq.num_computed_tokens = 2
        seq.spec_accepted, seq.spec_trials, seq.spec_token_ids = accepted, trials, [7] * drafts
        return seq

    good, poor = decoding(90, 100, 5), decoding(5, 100, 5)
    expected = 1 + sum(acceptance(good) ** j for j in range(1, 6))
    assert 4.5 < expected < 4.7
    cuda = STEP_COST["cuda"]
    assert drafts_pay([good], cuda, price=1.0) and drafts_pay([good], cuda, price=3.0)
    assert not drafts_pay([good], cuda, price=5.0)
    assert drafts_pay([poor], cuda, price=1.0) and not drafts_pay([poor], cuda, price=1.1)
    # at batch 64 one sequence's drafts hardly raise the step's tokens: not worth a step that costs 1.5 plain ones
    batch = [good] + [decoding(0, 0, 0) for _ in range(63)]
    assert drafts_pay(batch, cuda, price=1.0) and not drafts_pay(batch, cuda, price=1.5)


def test_vllm_older_ngram_model_name_is_the_ngram_method():
    """vLLM's `{"model": "ngram"}` (and "[ngram]") names prompt lookup, as `{"method": "ngram"}` does."""
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    for name in ("ngram", "[ngram]"):
        assert parse_speculative_config({"model": name, "num_speculative_tokens": 3}) == ngram
