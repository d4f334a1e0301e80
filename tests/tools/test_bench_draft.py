"""bench.py --speculative with a draft model: the target quantized at load drafts for itself, and the row says so."""
import os

import pytest

import bench


def test_bench_runs_each_row_with_and_without_a_draft_model(tied_model, capsys, monkeypatch):
    from nanovllm.execution.draft_model import DraftModel

    monkeypatch.setattr(DraftModel, "forward_ratio", lambda self, num_seqs: 0.0)  # always speculate
    result = bench.main(["--model", tied_model, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "30",
                         "--max-input-len", "40", "--min-output-len", "24", "--max-output-len", "24",
                         "--temperature", "0", "--scheduling", "chunked", "--speculative", tied_model,
                         "--draft-quantization", "int8"])
    label = f"draft {os.path.basename(tied_model)} int8"
    plain, speculative = result["rows"]
    assert speculative["engine"] == f"nanovllm chunked, {label} speculation"
    assert plain["tokens"] == speculative["tokens"] == 48
    facts = result["engines"][f"torch chunked plain {label} speculation"]
    assert facts["outputs_digest"] == result["engines"]["torch chunked plain"]["outputs_digest"]
    assert facts["num_accepted_tokens"] > 0
    assert "outputs identical to those without speculation" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [(["--speculative", "/no/such/draft"], "must be 'ngram' or a draft"),
                                            (["--speculative", "ngram", "--draft-quantization", "int4"],
                                             "--draft-quantization quantizes a draft model")])
def test_bench_refuses_a_draft_it_cannot_run(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(flags)
    assert message in capsys.readouterr().err


def test_bench_chat_workload_needs_a_model_and_no_baseline(tied_model):
    for flags in (["--workload", "chat"], ["--workload", "chat", "--model", tied_model, "--baseline", "hf"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags)
