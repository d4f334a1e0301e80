"""The scheduler's LoRA rule without a model: at most `max_loras` adapters among the running sequences, a request of
one more adapter held back and never starved; KV blocks named under the sequence's adapter."""
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler, SchedulerConfig
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4)


def sequence(seq_id: int, lora_int_id: int, length: int = 3) -> Sequence:
    seq = Sequence(seq_id, list(range(1, length + 1)), 4, PARAMS)
    seq.lora_int_id = lora_int_id
    return seq


def scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=256,
                                     enable_chunked_prefill=True, scheduling_policy="fcfs", max_loras=max_loras))


def run(s: Scheduler, steps: int, arrivals: dict[int, list[Sequence]]) -> list[set[int]]:
    """`steps` steps, each sequence decoding until it has 2 tokens past its prompt; the adapters of each step."""
    adapters = []
    for step in range(steps):
        for seq in arrivals.get(step, []):
            s.add(seq)
        batch = s.schedule()
        adapters.append({seq.lora_int_id for seq in batch.seqs if seq.lora_int_id})
        for seq, _ in s.new_tokens(batch, [7] * sum(batch.samples)):
            seq.append_token(7)
            if seq.num_completion_tokens == 2:
                s.finish(seq, "length")
    return adapters


def test_at_most_max_loras_adapters_per_step_and_base_requests_pass():
    s = scheduler(max_loras=2)
    seqs = [sequence(0, 1), sequence(1, 2), sequence(2, 3), sequence(3, 0), sequence(4, 1)]
    adapters = run(s, 1, {0: seqs})
    assert adapters == [{1, 2}]
    assert [seq.seq_id for seq in s.running] == [0, 1, 3]  # 3 is held back, and 1's second request behind it too


def test_a_held_back_adapter_is_never_starved():
    """Adapter 1 and 2 requests keep arriving; adapter 3's gets in once the running adapters drain."""
    s = scheduler(max_loras=2)
    held = sequence(2, 3)
    arrivals = {0: [sequence(0, 1), sequence(1, 2), held]}
    arrivals.update({step: [sequence(10 * step, 1), sequence(10 * step + 1, 2)] for step in range(1, 12)})
    adapters = run(s, 12, arrivals)
    assert all(len(step) <= 2 for step in adapters)
    assert held.is_finished or held in s.running
    assert any(3 in step for step in adapters)


def test_blocks_are_named_under_the_adapter():
    manager = BlockManager(16, 4)
    base, adapted, same = sequence(0, 0, 9), sequence(1, 5, 9), sequence(2, 5, 9)
    assert manager.allocate(base, 9) and manager.allocate(adapted, 9)
    assert manager.cached_prefix(sequence(3, 0, 9)) == base.block_table[:2]
    assert manager.cached_prefix(same) == adapted.block_table[:2]
    assert manager.cached_prefix(sequence(4, 6, 9)) == []
    assert set(base.block_table).isdisjoint(adapted.block_table)
