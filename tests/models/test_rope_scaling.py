"""RoPE scaling: the cos/sin tables bitwise transformers' (its `ROPE_INIT_FUNCTIONS` through its rotary module), and
greedy output token-exact with prompts and completions past the original context (64 positions).

`dynamic` rescales only past `max_position_embeddings`, which nanovllm never runs (max_model_len is capped there):
its tests cover the whole allowed range. LongRoPE (Phi-3) switches from its short to its long factors past the
original context, per token as transformers does (by the length each token is computed at)."""
import random

import pytest
import torch
from checkpoints import LLAMA3_ROPE, hf_greedy, make_checkpoint, make_family_checkpoint
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.hf_config import head_dim, rope_scaling, rope_theta

ORIGINAL = 64
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                    "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    "llama3": LLAMA3_ROPE,
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
MAX_TOKENS = 24
PROMPTS = [[random.Random(n).randrange(384) for _ in range(n)] for n in (5, 60, 150)]


@pytest.mark.parametrize("name", SCALINGS)
def test_cos_sin_table_is_transformers(name):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                         rope_theta=5e5, rope_scaling=dict(SCALINGS[name]))
    ours = RotaryEmbedding(head_dim(config), 256, rope_theta(config), rope_scaling(config)).cos_sin_cache
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(256)[None])
    half = head_dim(config) // 2
    assert torch.equal(ours, torch.cat((cos[0, :, :half], sin[0, :, :half]), -1))


@pytest.mark.parametrize("name", SCALINGS)
def test_prompts_past_the_original_context_match_transformers(tmp_path, name):
    path = make_checkpoint(str(tmp_path / name), family="llama", seed=7, max_position_embeddings=256,
                           rope_theta=5e5, rope_scaling=SCALINGS[name], tie_word_embeddings=False)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    with LLM(path, device="cpu", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                              ignore_eos=True),
                                                     use_tqdm=False)] == expected


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}


def test_longrope_tables_are_transformers_short_and_long():
    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                        original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.5,
                        rope_scaling=dict(LONGROPE))
    ours = RotaryEmbedding(16, 256, rope_theta(config), rope_scaling(config), 8)
    hf = Phi3RotaryEmbedding(config)
    for length, rows in ((ORIGINAL, slice(0, 256)), (ORIGINAL + 1, slice(256, 512))):
        cos, sin = hf(torch.zeros(1), torch.arange(length)[None])  # the forward's longest position picks the set
        assert torch.equal(ours.cos_sin_cache[rows][:length], torch.cat((cos[0, :, :4], sin[0, :, :4]), -1))


def test_phi3_longrope_past_the_original_context_matches_transformers(tmp_path):
    """Prompts of 5 (short factors throughout), 60 (short in the prompt, long for the tokens generated past 64) and
    150 positions (long throughout), run in 64-token chunks; prefix caching is off for this model (a prompt's K/V
    depend on its length)."""
    path = make_family_checkpoint(str(tmp_path / "phi3"), "phi3", max_position_embeddings=256, sliding_window=None,
                                  hub_config={"original_max_position_embeddings": ORIGINAL, "rope_scaling": LONGROPE})
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    with LLM(path, device="cpu", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
        assert [o["token_ids"] for o in llm.generate(PROMPTS[::-1], greedy, use_tqdm=False)] == expected[::-1]
        assert llm.stats()["num_cached_tokens"] == 0
