"""Start-up choices (attention backend, compilation, KV sizing) with CUDA and flash-attn availability faked."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import nanovllm.backends as backends
from nanovllm.backends import TorchBackend, choose_backend, importable, select_backend
from nanovllm.backends.flash_backend import FlashBackend
from nanovllm.utils import compile as compile_mod
from nanovllm.utils.compile import fused_op, set_compile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
has_triton = importable("triton")


@pytest.fixture(autouse=True)
def fresh_warnings():
    backends._warn_once.cache_clear()
    yield
    backends._warn_once.cache_clear()


def select(device="cuda", dtype=torch.bfloat16, block_size=256, flash=True, triton=True):
    return select_backend(device, dtype, block_size, has_flash_attn=flash, has_triton=triton)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_cpu_always_gets_the_torch_backend(flash, block_size):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select("cpu", torch.float32, block_size, flash=flash) is TorchBackend


@pytest.mark.skipif(not has_triton, reason="triton not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [256, 512])
def test_cuda_with_flash_attn_gets_flash_backend_and_triton_store(dtype, block_size):
    from nanovllm.backends.triton_kv import store_kvcache

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = select(dtype=dtype, block_size=block_size)
    assert issubclass(backend, FlashBackend)
    assert backend.attend is FlashBackend.attend
    assert backend.store_kvcache is store_kvcache
    assert backend.capturable and backend.name == "flash-attn+triton"


@pytest.mark.parametrize("block_size", [16, 128, 300])
def test_flash_backend_rejects_block_size_not_multiple_of_256(block_size):
    with pytest.raises(ValueError, match=rf"kvcache_block_size={block_size} .*multiple of 256"):
        select(block_size=block_size)


@pytest.mark.skipif(not has_triton, reason="triton not installed")
def test_cuda_without_flash_attn_warns_once_and_runs_torch_attention():
    with pytest.warns(RuntimeWarning, match="flash-attn is not installed") as record:
        first = select(flash=False, block_size=16)
        second = select(flash=False, block_size=16)
    assert len(record) == 1
    assert first is second and issubclass(first, TorchBackend)
    assert first.attend is TorchBackend.attend
    assert first.store_kvcache is not TorchBackend.store_kvcache and not first.capturable


@pytest.mark.skipif(not has_triton, reason="triton not installed")
def test_cuda_float32_falls_back_to_torch_attention_with_any_block_size():
    with pytest.warns(RuntimeWarning, match="flash-attn does not support torch.float32") as record:
        backend = select(dtype=torch.float32, block_size=16)
    assert len(record) == 1
    assert issubclass(backend, TorchBackend) and backend.attend is TorchBackend.attend and not backend.capturable


def test_cuda_without_triton_keeps_torch_store_and_disables_graphs():
    with pytest.warns(RuntimeWarning, match="triton is not installed.*without CUDA graphs"):
        backend = select(triton=False)
    assert backend is FlashBackend
    assert backend.store_kvcache is TorchBackend.store_kvcache and not backend.capturable


def test_choose_backend_on_cpu_probes_nothing(monkeypatch):
    def probe(name):
        raise AssertionError(f"probed {name} on CPU")

    monkeypatch.setattr(backends, "importable", probe)
    assert choose_backend("cpu", torch.float32, 16) is TorchBackend


def test_importable():
    assert importable("json")
    assert not importable("nanovllm_no_such_module")


def test_import_and_cpu_engine_work_without_flash_attn_and_triton(tied_model):
    code = (
        "import sys; sys.modules['flash_attn'] = None; sys.modules['triton'] = None\n"
        "import nanovllm, nanovllm.backends.flash_backend\n"
        "from nanovllm import LLM, SamplingParams\n"
        f"llm = LLM({tied_model!r}, device='cpu', kvcache_block_size=16, max_model_len=64)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
        "assert len(out[0]['token_ids']) == 3, out\n"
        "assert llm.model_runner.backend.name == 'torch' and llm.model_runner.graphs is None\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_cpu_engine_skips_warmup_graphs_and_compile(tied_model, monkeypatch):
    import nanovllm.execution.model_runner as model_runner
    from nanovllm import LLM

    def no_warmup(*args):
        raise AssertionError("the GPU warm-up ran on CPU")

    monkeypatch.setattr(model_runner, "gpu_kv_cache_bytes", no_warmup)
    monkeypatch.setattr(compile_mod, "_enabled", True)
    with LLM(tied_model, device="cpu", kvcache_block_size=16, max_model_len=64) as llm:
        runner = llm.model_runner
        assert runner.backend is TorchBackend and runner.graphs is None
        assert not compile_mod._enabled


def test_fused_op_compiles_lazily_once_and_only_when_enabled(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda *args: ("compiled", fn(*args))

    monkeypatch.setattr(torch, "compile", fake_compile)
    double = fused_op(lambda x: 2 * x)
    try:
        set_compile(False)
        assert double(3) == 6 and calls == []
        set_compile(True)
        assert double(3) == ("compiled", 6)
        assert double(4) == ("compiled", 8)
        assert calls == [{"dynamic": True}]
        set_compile(False)
        assert double(5) == 10
    finally:
        set_compile(False)
