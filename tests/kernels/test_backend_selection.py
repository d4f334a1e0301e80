"""Start-up choices (attention backend, compilation) with the GPU and the installed libraries faked."""
import importlib.util
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy
from interpreted import interpreter_unusable

import nanovllm.kernels.attention as backends
from nanovllm.kernels import fused as compile_mod
from nanovllm.kernels.attention import Platform, importable, load_backend, registry, select_backend, unsupported
from nanovllm.kernels.attention.flash4_backend import Flash4Backend
from nanovllm.kernels.attention.flash_backend import FlashBackend
from nanovllm.kernels.attention.torch_backend import TorchBackend
from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.kernels.fused import fused_op, set_fused_ops

REPO_ROOT = str(Path(__file__).resolve().parents[2])
EVERYTHING = ("flash-attn", "flash-attn-4", "triton")
H100, A100, RTX4090, RTX5090, B200, T4, P100 = (9, 0), (8, 0), (8, 9), (12, 0), (10, 0), (7, 5), (6, 0)
has_triton = importable("triton")


def gpu(capability=H100, installed=EVERYTHING) -> Platform:
    return Platform("cuda", capability, installed=lambda name: name in installed)


def cpu(interpret=False, installed=("triton",)) -> Platform:
    def probe(name):
        if not interpret:
            raise AssertionError(f"probed {name} on a CPU without TRITON_INTERPRET")
        return name in installed

    return Platform("cpu", installed=probe, triton_interpret=interpret)


def select(requested="auto", platform=None, dtype=torch.bfloat16, block_size=256, head_dim=128):
    return select_backend(requested, platform or gpu(), dtype, block_size, head_dim)


@pytest.mark.parametrize("installed, capability, expected", [
    (EVERYTHING, H100, "flash-attn"),
    (("flash-attn-4", "triton"), H100, "flash-attn-4"),
    (("flash-attn-4", "triton"), B200, "flash-attn-4"),
    (("flash-attn-4", "triton"), A100, "triton"),
    (("flash-attn-4", "triton"), RTX5090, "triton"),
    (EVERYTHING, RTX4090, "flash-attn"),
    (("triton",), H100, "triton"),
    ((), H100, "torch"),
    (EVERYTHING, P100, "torch"),
])
def test_auto_on_cuda_takes_the_first_backend_that_runs(installed, capability, expected):
    assert select(platform=gpu(capability, installed))[0] == expected


def test_auto_says_why_it_passed_backends_over():
    name, passed_over = select(platform=gpu(A100, ("flash-attn-4", "triton")))
    assert name == "triton"
    assert passed_over["flash-attn"].startswith("is not installed; pip install 'nanovllm[flash-attn]'")
    assert "compute capability 9.x" in passed_over["flash-attn-4"] and "this GPU has compute capability 8.0" in \
        passed_over["flash-attn-4"]


def test_auto_skips_flash_attn_for_float32_and_flash_attn_2_for_small_blocks():
    name, passed_over = select(dtype=torch.float32, block_size=16)
    assert name == "triton"
    assert "float16 and bfloat16 only, not float32" in passed_over["flash-attn"]
    assert "float16 and bfloat16 only, not float32" in passed_over["flash-attn-4"]
    name, passed_over = select(block_size=16)
    assert name == "flash-attn-4" and "multiple of 256, got 16" in passed_over["flash-attn"]


@pytest.mark.parametrize("capability, head_dim, runs", [(H100, 256, True), (B200, 256, False), (B200, 128, True),
                                                        (H100, 20, False), (H100, 96, True)])
def test_flash_attn_4_head_dims(capability, head_dim, runs):
    reason = unsupported("flash-attn-4", gpu(capability), torch.bfloat16, 256, head_dim)
    assert (reason is None) == runs
    if not runs:
        assert f"this model's is {head_dim}" in reason


@pytest.mark.parametrize("interpret", [False, True])
def test_auto_on_cpu_is_torch_and_probes_nothing(interpret):
    platform = Platform("cpu", installed=lambda name: pytest.fail(f"probed {name}"), triton_interpret=interpret)
    assert select(platform=platform, dtype=torch.float32, block_size=16) == ("torch", {})


@pytest.mark.parametrize("requested, platform, dtype, block_size, message", [
    ("flash-attn", gpu(installed=("triton",)), torch.bfloat16, 256,
     r"is not installed; pip install 'nanovllm\[flash-attn\]'"),
    ("flash-attn-4", gpu(installed=()), torch.bfloat16, 256,
     r"is not installed; pip install 'nanovllm\[flash-attn-4\]'"),
    ("flash-attn-4", gpu(A100, installed=()), torch.bfloat16, 256,
     r"has a paged KV cache on compute capability 9.x .*this GPU has compute capability 8.0"),
    ("flash-attn", gpu(T4), torch.float16, 256, r"8.0 \(Ampere\) or newer; this GPU has compute capability 7.5"),
    ("flash-attn-4", gpu(), torch.float32, 256, "float16 and bfloat16 only, not float32"),
    ("flash-attn", gpu(), torch.bfloat16, 16, r"kvcache_block_size that is a multiple of 256, got 16"),
    ("flash-attn", cpu(), torch.float32, 256, "needs a CUDA GPU"),
    ("flash-attn-4", cpu(interpret=True), torch.bfloat16, 256, "needs a CUDA GPU"),
    ("triton", cpu(), torch.float32, 16, "needs a CUDA GPU .*TRITON_INTERPRET=1"),
    ("triton", cpu(interpret=True, installed=()), torch.float32, 16, "is not installed"),
    ("triton", gpu(T4), torch.bfloat16, 16, "bfloat16 from compute capability 8.0 .*use dtype='float16'"),
    ("triton", gpu(P100), torch.float16, 16, "7.0 or newer; this GPU has compute capability 6.0"),
])
def test_a_named_backend_that_cannot_run_is_a_clear_error(requested, platform, dtype, block_size, message):
    with pytest.raises(ValueError, match=rf"attention_backend='{requested}' cannot run here: {requested} .*{message}"):
        select(requested, platform, dtype, block_size)


@pytest.mark.parametrize("requested, platform, dtype, block_size", [
    ("triton", cpu(interpret=True), torch.float32, 16),
    ("triton", gpu(T4), torch.float16, 16),
    ("torch", gpu(), torch.bfloat16, 256),
    ("flash-attn-4", gpu(B200), torch.float16, 16),
    ("flash-attn", gpu(RTX4090), torch.bfloat16, 512),
])
def test_a_named_backend_that_can_run_is_taken(requested, platform, dtype, block_size):
    assert select(requested, platform, dtype, block_size) == (requested, {})


def test_load_backend_on_cpu_is_the_torch_kernel_with_its_own_writer():
    backend = load_backend("torch", cpu())
    assert backend.attend is TorchBackend.attend and backend.store_kvcache is TorchBackend.store_kvcache
    assert backend.name == "torch" and not backend.capturable


@pytest.mark.skipif(not has_triton, reason="triton not installed")
@pytest.mark.parametrize("name, kernel, capturable", [("flash-attn", FlashBackend, True),
                                                       ("flash-attn-4", Flash4Backend, True)])
def test_on_cuda_kv_writes_use_triton_and_capturable_attention_enables_graphs(name, kernel, capturable):
    from nanovllm.kernels.attention.triton_kv import store_kvcache

    backend = load_backend(name, gpu())
    assert backend.attend is kernel.attend and backend.store_kvcache is store_kvcache
    assert backend.capturable == capturable and backend.name == f"{name}+triton"
    torch_backend = load_backend("torch", gpu())
    assert torch_backend.store_kvcache is TorchBackend.store_kvcache and not torch_backend.capturable


@pytest.mark.parametrize("name, kernel", [("flash-attn", FlashBackend), ("flash-attn-4", Flash4Backend)])
def test_without_triton_kv_writes_use_torch_and_nothing_is_captured(name, kernel):
    backend = load_backend(name, gpu(installed=(name,)))
    assert backend.attend is kernel.attend and backend.store_kvcache is TorchBackend.store_kvcache
    assert backend.name == name and not backend.capturable


def test_triton_backend_loads_by_its_path_when_present():
    module = pytest.importorskip("nanovllm.kernels.attention.triton_backend")
    backend = load_backend("triton", gpu())
    assert backend.attend is module.TritonBackend.attend and backend.store_kvcache is module.TritonBackend.store_kvcache
    assert backend.name == "triton" and backend.capturable


def test_a_backend_is_one_registry_row(monkeypatch):
    """Selection reads only the declarations: a new row (a CPU kernel, say) is chosen by "auto" where it serves."""
    cpu_kernel = backends.BackendSpec("cpu-kernel", "nanovllm.kernels.attention.torch_backend:TorchBackend",
                                      devices=("cpu",), dtypes=(torch.float32,), own_kv_writer=True)
    monkeypatch.setattr(registry, "BACKENDS", {"cpu-kernel": cpu_kernel, **registry.BACKENDS})
    assert select(platform=cpu(), dtype=torch.float32) == ("cpu-kernel", {})
    assert select(platform=gpu(installed=()), dtype=torch.float32)[0] == "torch"
    assert load_backend("cpu-kernel", cpu()).attend is TorchBackend.attend


def test_choose_backend_logs_the_choice_and_why(monkeypatch, caplog):
    monkeypatch.setattr(Platform, "probe", classmethod(lambda cls, device: gpu(A100, ("flash-attn-4",))))
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        assert backends.choose_backend("auto", "cuda", torch.bfloat16, 256, 128) == "torch"
    (record,) = caplog.records
    assert record.name == "nanovllm" and record.levelno == logging.INFO
    assert record.getMessage().startswith("attention backend: torch (flash-attn is not installed")
    assert "flash-attn-4 has a paged KV cache on compute capability 9.x" in record.getMessage()
    assert "triton is not installed; pip install 'nanovllm[cuda]'" in record.getMessage()
    assert "decode runs without CUDA graphs, since triton is not installed" in record.getMessage()


def test_flash_attn_4_namespace_package_is_not_flash_attn_2(monkeypatch):
    """Installing flash-attn 4 leaves a `flash_attn` package without flash-attn 2's functions."""
    namespace, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    importable.cache_clear()
    try:
        assert importable("flash_attn")
        assert not registry.library_installed("flash-attn")
        assert registry.library_installed("flash-attn-4")
    finally:
        importable.cache_clear()


def test_importable():
    assert importable("json") and importable("json", "dumps")
    assert not importable("json", "no_such_function")
    assert not importable("nanovllm_no_such_module")


def test_engine_setting_is_checked_resolved_and_logged(tied_model, caplog):
    from nanovllm import LLM

    with pytest.raises(ValueError, match="attention_backend='flash-attn-4' cannot run here: flash-attn-4 needs a "
                                         "CUDA GPU"):
        LLM(tied_model, device="cpu", dtype="float32", attention_backend="flash-attn-4")
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=64) as llm:
            assert llm.config.attention_backend == "torch"
            assert llm.engine.model_runner.backend == load_backend("torch", cpu())
    assert [r.getMessage() for r in caplog.records if r.name == "nanovllm"] == ["attention backend: torch"]


def test_import_and_cpu_engine_work_without_flash_attn_and_triton(tied_model):
    code = (
        "import sys; sys.modules['flash_attn'] = None; sys.modules['triton'] = None\n"
        "import nanovllm, nanovllm.kernels.attention.flash_backend, nanovllm.kernels.attention.flash4_backend\n"
        "from nanovllm import LLM, SamplingParams\n"
        f"llm = LLM({tied_model!r}, device='cpu', dtype='float32', kvcache_block_size=16, max_model_len=64)\n"
        "params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)\n"
        "out = llm.generate([[1, 2, 3]], params, use_tqdm=False)\n"
        "assert len(out[0]['token_ids']) == 3, out\n"
        "assert llm.engine.model_runner.backend.name == 'torch' and llm.engine.model_runner.graphs is None\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_cpu_engine_skips_warmup_graphs_and_compile(tied_model, monkeypatch):
    import nanovllm.execution.kv_cache as kv_cache
    from nanovllm import LLM

    def no_warmup(*args):
        raise AssertionError("the GPU warm-up ran on CPU")

    monkeypatch.setattr(kv_cache, "_gpu_budget", no_warmup)
    monkeypatch.setattr(compile_mod, "_compiled", True)
    with LLM(tied_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=64) as llm:
        runner = llm.engine.model_runner
        assert runner.backend.name == "torch" and runner.graphs is None
        assert not compile_mod._compiled
        assert compile_mod._cpu_kernels is cpu_kernels(), "the small ops run as the compiled CPU kernels"


def test_fused_op_compiles_lazily_once_and_only_when_enabled(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda *args: ("compiled", fn(*args))

    monkeypatch.setattr(torch, "compile", fake_compile)
    double = fused_op(lambda x: 2 * x)
    try:
        set_fused_ops(compiled=False, cpu_kernels=None)
        assert double(3) == 6 and calls == []
        set_fused_ops(compiled=True, cpu_kernels=None)
        assert double(3) == ("compiled", 6)
        assert double(4) == ("compiled", 8)
        assert calls == [{"dynamic": True}]
        set_fused_ops(compiled=False, cpu_kernels=None)
        assert double(5) == 10
    finally:
        set_fused_ops(compiled=False, cpu_kernels=None)


def test_fused_op_runs_its_cpu_kernel_for_cpu_inputs_only_when_given():
    kernels = types.SimpleNamespace(triple=lambda x: ("kernel", 3 * x))
    triple = fused_op(lambda x: 3 * x, cpu_kernel="triple")
    x = torch.ones(2)
    try:
        set_fused_ops(compiled=False, cpu_kernels=None)
        assert torch.equal(triple(x), 3 * x)
        set_fused_ops(compiled=False, cpu_kernels=kernels)
        assert triple(x)[0] == "kernel" and torch.equal(triple(x)[1], 3 * x)
        assert triple(torch.ones(2, device="meta")).device.type == "meta"  # not on the CPU: as written
    finally:
        set_fused_ops(compiled=False, cpu_kernels=None)


def test_triton_backend_runs_the_engine_on_cpu_under_the_interpreter(tied_model):
    """attention_backend="triton" with TRITON_INTERPRET=1: the Triton kernels through the whole engine, token-exact
    against transformers (in a fresh interpreter: Triton reads the variable when it is imported)."""
    if importlib.util.find_spec("nanovllm.kernels.attention.triton_backend") is None:
        pytest.skip("the Triton attention backend is not in this checkout")
    pytest.importorskip("triton")
    if reason := interpreter_unusable():
        pytest.skip(reason)
    shared = list(range(1, 21))
    prompts = [shared + [30], shared + [31, 32], [40] * 5]
    expected = hf_greedy(tied_model, prompts, 6)
    code = (
        "from nanovllm import LLM, SamplingParams\n"
        "greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        f"with LLM({tied_model!r}, device='cpu', dtype='float32', attention_backend='triton', "
        "kvcache_block_size=16, max_model_len=64) as llm:\n"
        "    assert llm.engine.model_runner.backend.name == 'triton', llm.engine.model_runner.backend\n"
        f"    runs = [[o['token_ids'] for o in llm.generate({prompts!r}, greedy, use_tqdm=False)] for _ in range(2)]\n"
        "    assert llm.stats()['num_cached_tokens'] > 0\n"
        "print(runs)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str([expected, expected])
