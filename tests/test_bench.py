"""bench.py runs end to end on a tiny model, with the transformers baseline, and reports consistent numbers."""
import json

import pytest

import bench


def test_bench_with_hf_baseline_on_a_tiny_checkpoint(tied_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--model", tied_model, "--device", "cpu", "--num-seqs", "3", "--min-input-len", "4",
                         "--max-input-len", "12", "--min-output-len", "2", "--max-output-len", "5",
                         "--baseline", "hf", "--hf-batch-size", "2", "--json", str(out)])
    ours, hf = result["rows"]
    requests = bench.make_requests(bench.parse_args(["--num-seqs", "3", "--min-input-len", "4", "--max-input-len", "12",
                                                     "--min-output-len", "2", "--max-output-len", "5"]), 384)
    assert (ours["engine"], hf["engine"]) == ("nanovllm", "transformers")
    assert ours["tokens"] == hf["tokens"] == sum(requests.max_tokens)
    assert result["workload"]["prompt_tokens"] == requests.prompt_tokens
    assert ours["ratio"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
    flops = 2 * result["parameters"] * (requests.prompt_tokens + ours["tokens"])
    assert ours["mfu"] == pytest.approx(flops / ours["seconds"] / (result["matmul_peak_gflops"] * 1e9))
    assert result["matmul_peak_gflops"] > 0 and ours["peak_mem_gib"] >= 0
    assert json.loads(out.read_text()) == result
    table = capsys.readouterr().out
    assert "| nanovllm" in table and "| transformers" in table


def test_bench_without_a_model_uses_random_weights_from_a_config(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True}))
    result = bench.main(["--config", str(config), "--device", "cpu", "--num-seqs", "2", "--min-input-len", "3",
                         "--max-input-len", "6", "--min-output-len", "2", "--max-output-len", "3"])
    (row,) = result["rows"]
    assert row["model"] == "tiny (random)" and row["ratio"] is None and row["tokens"] >= 4
    assert "| nanovllm" in capsys.readouterr().out


def test_bench_rejects_inverted_length_ranges(tied_model):
    with pytest.raises(SystemExit, match="--min-input-len"):
        bench.main(["--model", tied_model, "--device", "cpu", "--min-input-len", "9", "--max-input-len", "3"])
