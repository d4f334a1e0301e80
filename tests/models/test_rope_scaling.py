"""RoPE scaling: the cos/sin tables bitwise transformers' (its `ROPE_INIT_FUNCTIONS` through its rotary module), and
greedy output token-exact with prompts and completions past the original context (64 positions)."""
import random

import pytest
import torch
from checkpoints import LLAMA3_ROPE, hf_greedy, make_checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

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
