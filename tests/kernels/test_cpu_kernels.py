"""The compiled CPU kernels: decode attention against a float64 reference, the fused small ops against the torch
code they replace, rows bitwise the same whatever the batch, and an engine that falls back cleanly without them."""
import io
import logging
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy

import nanovllm.kernels.cpu as cpu_kernels_module
from nanovllm import LLM, SamplingParams
from nanovllm.cache import exclusive
from nanovllm.kernels import fused as compile_mod
from nanovllm.kernels.cpu import build_directory, cpu_kernels, paged_decode
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rotary

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="no C++ compiler: the kernel cannot be built here (the engine falls back)")


def make_case(lengths: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_row) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()  # scattered, not adjacent
    tables, used = [], 0
    width = max(blocks_per_row)
    for n in blocks_per_row:
        tables.append(order[used:used + n] + [-1] * (width - n))
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, lengths, scale, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """float64, one row at a time: the cached keys gathered through the table (the last `window` of them), scores
    capped by softcap * tanh(score / softcap), softmax, weighted values."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.size(1) // k_cache.size(2)
    for i, n in enumerate(lengths.tolist()):
        k = k_cache[tables[i, :-(-n // k_cache.size(1))].long()].flatten(0, 1)[:n].double()
        v = v_cache[tables[i, :-(-n // k_cache.size(1))].long()].flatten(0, 1)[:n].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, heads, dim]
        if window:
            k, v = k[-window:], v[-window:]
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@needs_compiler
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (3, 3, 16), (8, 1, 32), (9, 3, 64), (10, 1, 128)])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_against_a_float64_reference(block_size, heads, kv_heads, head_dim, dtype, atol):
    lengths = [1, 7, 16, 17, 300, 513]
    q, k_cache, v_cache, tables, lens = make_case(lengths, block_size, heads, kv_heads, head_dim, dtype)
    out = paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens, 0.125), atol=atol, rtol=0)


@needs_compiler
@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (256, 16)])
@pytest.mark.parametrize("window, softcap", [(5, 0.0), (40, 0.0), (300, 0.0), (0, 1.5), (40, 1.5)])
def test_decode_with_a_window_or_capped_scores_against_a_float64_reference(block_size, head_dim, window, softcap):
    """Blocks wholly before a row's window are released (-1 in the table, as the block manager leaves them) and
    never read."""
    lengths = [1, 7, 16, 17, 300, 513]
    q, k_cache, v_cache, tables, lens = make_case(lengths, block_size, 4, 2, head_dim, torch.float32)
    released = tables.clone()
    for i, n in enumerate(lengths):
        released[i, :max(0, n - window) // block_size if window else 0] = -1
    out = paged_decode(q, k_cache, v_cache, released, lens, 0.125, window, softcap)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens, 0.125, window, softcap),
                               atol=1e-5, rtol=0)


@needs_compiler
def test_a_row_is_bitwise_the_same_whatever_its_batch_and_thread_count():
    q, k_cache, v_cache, tables, lens = make_case([5, 260, 33, 1, 700], 16, 4, 2, 64, torch.float32, seed=1)
    together = paged_decode(q, k_cache, v_cache, tables, lens, 0.1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(len(lens)):
            alone = paged_decode(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], 0.1)
            assert torch.equal(alone[0], together[i])
    finally:
        torch.set_num_threads(threads)
    flipped = paged_decode(q.flip(0), k_cache, v_cache, tables.flip(0), lens.flip(0), 0.1)
    assert torch.equal(flipped.flip(0), together)
    padded = paged_decode(torch.cat([q, q[:1]]), k_cache, v_cache, torch.cat([tables, tables[:1]]),
                          torch.cat([lens, torch.tensor([0], dtype=torch.int32)]), 0.1)
    assert torch.equal(padded[:-1], together) and not padded[-1].any(), "a padding row attends to nothing"


def test_without_the_kernels_the_engine_falls_back_and_stays_exact(tied_model, monkeypatch, caplog):
    """A failed build (no compiler, say): attention, the KV store and the small ops all run on torch's operators."""
    import torch.utils.cpp_extension

    def failed_build(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    prompts = [[1, 2, 3, 4, 5], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = hf_greedy(tied_model, prompts, 8)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failed_build)
    cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "nanovllm"), LLM(tied_model, device="cpu", dtype="float32",
                                                               kvcache_block_size=16, max_model_len=128) as llm:
            assert compile_mod._cpu_kernels is None
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert caplog.text.count("could not be built") == 1 and "c++: not found" in caplog.text
    finally:
        cpu_kernels.cache_clear()


@needs_compiler
def test_the_kernel_builds_here():
    assert cpu_kernels() is not None



@needs_compiler
def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path, monkeypatch):
    """torch's own lock is a file, which a build killed midway leaves behind: every later start waited on it
    forever."""
    assert cpu_kernels() is not None
    built = build_directory()
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    shutil.copytree(built, build_directory())
    (build_directory() / "lock").touch()
    code = "from nanovllm.kernels.cpu import cpu_kernels; assert cpu_kernels() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_build_held_elsewhere_past_the_wait_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels_module, "BUILD_WAIT_S", 0.5)
    with exclusive(build_directory() / "build.lock", 1), caplog.at_level(logging.WARNING, "nanovllm"):
        assert cpu_kernels.__wrapped__() is None
    assert "another process has held" in caplog.text and "torch's operators" in caplog.text


def test_a_build_says_where_how_far_it_has_got_and_how_long_it_took(tmp_path, monkeypatch):
    """A fake build that lasts until a progress line is out; a warm start says nothing."""
    import torch.utils.cpp_extension

    stderr = io.StringIO()

    def slow_build(name, sources, build_directory, **kwargs):
        deadline = time.monotonic() + 60
        while "nanovllm: ... building the CPU kernels (" not in stderr.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(build_directory, f"{name}.so").touch()

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels_module, "PROGRESS_EVERY_S", 0.01)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", slow_build)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert cpu_kernels.__wrapped__() is not None
    lines = stderr.getvalue().splitlines()
    assert lines[0].startswith(f"nanovllm: building the CPU kernels into {build_directory()}, "
                               f"{len(cpu_kernels_module.SOURCES)} C++ files")
    assert any(line.startswith("nanovllm: ... building the CPU kernels (") and line.endswith(" s so far)")
               for line in lines[1:-1])
    assert lines[-1].startswith("nanovllm: built the CPU kernels in ")
    assert cpu_kernels.__wrapped__() is not None and stderr.getvalue().splitlines() == lines


def test_the_package_data_holds_every_kernel_source():
    """A wheel carries only the files package-data names: without the header, every installed build failed."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["nanovllm"]
    package = Path(cpu_kernels_module.__file__).parent.parent
    for source in cpu_kernels_module.CSRC.iterdir():
        assert any(source.relative_to(package).match(pattern) for pattern in patterns), source.name


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="x86-64 paths, g++")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_the_kernels_compile_for_a_cpu_without_avx512_or_avx2(march):
    """The build is -march=native: a CPU without AVX-512 (v3: AVX2) or without AVX2 (plain x86-64, as any other
    architecture) compiles only the paths it has. The portable build once failed on a struct kept inside the AVX2
    guard, which this machine's build never sees."""
    include = Path(torch.__file__).parent / "include"
    sources = sorted(cpu_kernels_module.CSRC.glob("*.cpp"))
    procs = [subprocess.Popen(["g++", "-std=c++17", f"-march={march}", "-fopenmp", "-fsyntax-only", "-w",
                               "-isystem", str(include), "-isystem", str(include / "torch/csrc/api/include"),
                               str(source)], stderr=subprocess.PIPE, text=True) for source in sources]
    for source, proc in zip(sources, procs):
        _, errors = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{source.name} -march={march}:\n{errors[:2000]}"


def torch_check_messages(source: str) -> list[str]:
    """The message arguments of each TORCH_CHECK in a C++ source, split at its top-level commas."""
    checks = []
    for match in re.finditer(r"\bTORCH_CHECK\(", source):
        parts, depth, quoted, i = [""], 1, False, match.end()
        while depth:
            c = source[i]
            if quoted and c == "\\":
                parts[-1] += source[i:i + 2]
                i += 2
                continue
            quoted ^= c == '"'
            depth += 0 if quoted else (c == "(") - (c == ")")
            if c == "," and depth == 1 and not quoted:
                parts.append("")
            elif depth:
                parts[-1] += c
            i += 1
        checks.append(parts[1:])
    return checks


def test_kernel_errors_are_formatted_without_iostreams():
    """TORCH_CHECK formats several message arguments with an ostringstream inside the library. Where the compiler
    links libstdc++ statically into it, that copy's locale is never set up: numbers vanished from the messages
    (g++ 12 with -static-libstdc++) or the process segfaulted instead of raising (an H100 machine, g++ 13.3). So each
    check passes one message, a literal or `nanovllm::message(...)` (csrc/check.h)."""
    checks = 0
    for path in sorted(cpu_kernels_module.CSRC.glob("*.cpp")):
        for args in torch_check_messages(path.read_text()):
            assert len(args) <= 1, f"{path.name}: TORCH_CHECK(..., {', '.join(a.strip() for a in args)})"
            checks += 1
    assert checks > 40
    with pytest.raises(RuntimeError, match="ggml_embedding: id 5 is outside the 4 rows"):
        cpu_kernels().ggml_embedding(torch.zeros(4, 34, dtype=torch.uint8), torch.tensor([5]), 8, 32, torch.float32)


def fused_cases(dtype: torch.dtype, tokens: int):
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (6 + 2 * 2) * 32, generator=generator).to(dtype)
    q, k, v = qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1)  # strided views, as the decoder's split leaves them
    return generator, q.view(tokens, 6, 32), k.view(tokens, 2, 32), v.view(tokens, 2, 32)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 600])  # one thread inline, and rows split over threads
def test_fused_ops_compute_what_the_torch_code_computes(dtype, tokens):
    kernels = cpu_kernels()
    generator, q, k, v = fused_cases(dtype, tokens)
    weight = (torch.rand(32, generator=generator) + 0.5).to(dtype)
    close = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)  # bf16: one ulp
    torch.testing.assert_close(kernels.rms_norm(q, weight, 1e-6), rms_norm.__wrapped__(q, weight, 1e-6), **close)
    x, residual = q.flatten(1), k.repeat(1, 3, 1).flatten(1)
    hidden = (torch.rand(x.size(1), generator=generator) + 0.5).to(dtype)
    for got, want in zip(kernels.add_rms_norm(x, residual, hidden, 1e-5),
                         add_rms_norm.__wrapped__(x, residual, hidden, 1e-5)):
        torch.testing.assert_close(got, want, **close)
    positions = torch.randint(0, 1000, (tokens,), generator=generator)
    table = RotaryEmbedding(32, 1000, 10000.0).cos_sin_cache
    rotated = kernels.apply_rotary(positions, q, k, table)
    for got, want in zip(rotated, apply_rotary.__wrapped__(positions, q, k, table)):
        assert torch.equal(got, want), "the same roundings in the same order: bitwise equal"
    gate_up = torch.randn(tokens, 2 * 96, generator=generator).mul(4).to(dtype)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), silu_and_mul.__wrapped__(gate_up), **close)


@needs_compiler
def test_a_fused_row_is_bitwise_the_same_whatever_its_batch():
    kernels = cpu_kernels()
    _, q, k, _ = fused_cases(torch.float32, 600)
    weight = torch.rand(32) + 0.5
    together = kernels.rms_norm(q, weight, 1e-6)
    gate_up = q.flatten(1)
    mlp = kernels.silu_and_mul(gate_up)
    for i in (0, 299, 599):
        assert torch.equal(kernels.rms_norm(q[i:i + 1], weight, 1e-6), together[i:i + 1])
        assert torch.equal(kernels.silu_and_mul(gate_up[i:i + 1]), mlp[i:i + 1])


@needs_compiler
def test_greedy_tokens_are_torch_s_argmax_ties_nans_and_infinities_included():
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 49152), (40, 1000), (3, 130), (2, 1)):  # rows split over threads; lengths not of 64
        logits = torch.randn(rows, vocab, generator=generator)
        assert torch.equal(kernels.greedy_tokens(logits), logits.argmax(dim=-1))
    logits = torch.zeros(6, 200)
    logits[0, 70] = logits[0, 150] = 1.0  # a tie: the first
    logits[1, 199] = float("inf")
    logits[2, :] = float("-inf")  # nothing allowed: the first, as torch
    logits[3, 5] = 3.0
    logits[3, 130] = logits[3, 140] = float("nan")  # a NaN wins, the first of them, even after the maximum
    logits[4, 0] = float("nan")
    logits[5, 64] = 2.0  # the first value of the second block of 64
    assert kernels.greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist() == [70, 199, 0, 130, 0, 64]
    assert torch.equal(kernels.greedy_tokens(logits[::2]), logits[::2].argmax(dim=-1))  # rows not contiguous


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_store_writes_every_slot_and_skips_padding(dtype):
    _, _, k, v = fused_cases(dtype, 40)
    k_cache, v_cache = torch.zeros(5, 16, 2, 32, dtype=dtype), torch.zeros(5, 16, 2, 32, dtype=dtype)
    slots = torch.randperm(80)[:40]
    slots[::7] = -1
    cpu_kernels().store_kvcache(k, v, k_cache, v_cache, slots)
    valid = slots >= 0
    assert torch.equal(k_cache.view(80, 2, 32)[slots[valid]], k[valid])
    assert torch.equal(v_cache.view(80, 2, 32)[slots[valid]], v[valid])
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert not k_cache.view(80, 2, 32)[untouched].any() and not v_cache.view(80, 2, 32)[untouched].any()


def test_each_copy_of_the_sources_builds_in_its_own_directory(tmp_path, monkeypatch):
    """ninja's build file names the sources by path: two clones sharing a cache must not rebuild over each other."""
    here = build_directory()
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_kernels_module.CSRC, copy)
    monkeypatch.setattr(cpu_kernels_module, "CSRC", copy)
    assert build_directory() != here
    monkeypatch.undo()
    assert build_directory() == here
