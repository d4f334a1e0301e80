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
    assert ours["attention"] == "torch" and hf["attention"] == "sdpa" and hf["ratio"] == 1.0
    assert ours["tokens"] == hf["tokens"] == sum(requests.max_tokens)
    assert result["workload"]["prompt_tokens"] == requests.prompt_tokens
    assert ours["ratio"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
    flops = 2 * result["parameters"] * (requests.prompt_tokens + ours["tokens"])
    assert ours["mfu"] == pytest.approx(flops / ours["seconds"] / (result["matmul_peak_gflops"] * 1e9))
    assert result["matmul_peak_gflops"] > 0 and ours["peak_mem_gib"] >= 0
    assert json.loads(out.read_text()) == result
    table = capsys.readouterr().out
    assert "| nanovllm" in table and "| transformers" in table


@pytest.fixture
def tiny_config(tmp_path) -> str:
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True}))
    return str(config)


def test_bench_without_a_model_uses_random_weights_from_a_config(tiny_config, capsys):
    result = bench.main(["--config", tiny_config, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "3",
                         "--max-input-len", "6", "--min-output-len", "2", "--max-output-len", "3"])
    (row,) = result["rows"]
    assert row["model"] == "tiny (random)" and row["ratio"] is None and row["tokens"] >= 4
    assert "| nanovllm" in capsys.readouterr().out


def test_bench_rejects_inverted_length_ranges(tied_model):
    with pytest.raises(SystemExit, match="--min-input-len"):
        bench.main(["--model", tied_model, "--device", "cpu", "--min-input-len", "9", "--max-input-len", "3"])


def test_bench_runs_the_workload_once_per_attention_backend(tiny_config, capsys):
    """One row per listed backend ("auto" resolved, "all" expanded, repeats dropped); ratios against the first."""
    result = bench.main(["--config", tiny_config, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "3",
                         "--max-input-len", "6", "--min-output-len", "2", "--max-output-len", "3",
                         "--attention-backend", "torch,auto,all"])
    rows = result["rows"]
    assert [r["attention"] for r in rows] == ["torch", "torch"]
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["ratio"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert capsys.readouterr().out.count("| nanovllm | torch") == 2


def test_attention_micro_benchmark_times_each_backend_that_runs(tiny_config, tmp_path, capsys):
    out = tmp_path / "micro.json"
    result = bench.main(["--config", tiny_config, "--device", "cpu", "--attention-micro", "--micro-batch", "4",
                         "--micro-max-context", "40", "--kvcache-block-size", "16", "--json", str(out)])
    (row,) = result["attention_micro"]
    assert row["backend"] == "torch" and row["batch"] == 4 and row["max_context"] == 40 and row["dtype"] == "float32"
    assert row["us_per_call"] > 0 and row["ratio"] == 1.0 and row["max_abs_diff"] == 0.0
    assert json.loads(out.read_text()) == result
    assert "| torch" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--attention-backend", "flash"], "--attention-backend: unknown flash"),
    (["--attention-micro", "--attention-backend", "flash-attn-4"], "flash-attn-4 needs a CUDA GPU"),
])
def test_bench_rejects_attention_backends_it_cannot_run(tiny_config, capsys, flags, message):
    with pytest.raises(SystemExit) as error:
        bench.main(["--config", tiny_config, "--device", "cpu", *flags])
    assert error.value.code != 0 and message in f"{error.value.code} {capsys.readouterr().err}"
