"""Every decoder family as an embedder, through the shared decoder: a base model (`*Model`, as sentence-transformers
saves it, without the family's prefix) embeds its last token, normalized, as transformers' hidden states do."""
import pytest
import torch
from checkpoints import FAMILY_CONFIGS, make_tokenizer
from pooling_checkpoints import TEXTS, _randomized
from transformers import AutoConfig, AutoModel

from nanovllm import LLM

GQA = dict(num_key_value_heads=2, head_dim=16)
FAMILIES = {"qwen3": ("qwen3", GQA), "llama": ("llama", GQA),
            "qwen2_moe": ("qwen2_moe", dict(GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32)),
            **{name: FAMILY_CONFIGS[name] for name in ("mistral", "gemma", "gemma2", "gemma3", "phi3", "olmo2",
                                                       "granite", "gpt_neox", "stablelm")}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_base_model_embeds_its_last_token(tmp_path, family):
    model_type, settings = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{
        "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 256, "initializer_range": 0.1, "eos_token_id": 0,
        **settings})
    torch.manual_seed(0)
    model = _randomized(AutoModel.from_config(config, attn_implementation="eager"), 0).eval()  # Gemma 2's capped scores
    model.save_pretrained(tmp_path)
    make_tokenizer(str(tmp_path), 300)
    with LLM(str(tmp_path), device="cpu", dtype="float32") as llm:
        assert llm.config.runner == "pooling"
        outputs = llm.embed(TEXTS, use_tqdm=False)
    for output in outputs:
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([output.prompt_token_ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.nn.functional.cosine_similarity(torch.tensor(output.outputs.embedding), want, dim=0) >= 0.99999
