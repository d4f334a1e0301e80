"""Triton paged attention (`kernels/attention/triton_attention.py`): equal to the torch backend, and bitwise
deterministic.

On CPU the kernels run under TRITON_INTERPRET=1 in a fresh interpreter (`triton_attention_cases.py`,
which prints its results as JSON; see test_triton_kv.py for why a fresh one), and are compiled (not
run) for NVIDIA GPUs. On a GPU the marked tests run the same cases compiled, plus no-host-sync and
CUDA-graph capture checks.

The path a launch takes (split-KV or unified) is chosen by `split_segments` from shapes and Python
ints alone, and the launches read no tensor value on the host: the CUDA tests below prove it by
running `attend` under `torch.cuda.set_sync_debug_mode("error")` and inside a captured graph.
"""

import pytest
import torch
from interpreted import run_interpreted
from nvidia_compile import ELEMENT, compile_for_nvidia, require_nvidia_backend
from triton_attention_cases import CORRECTNESS, PAD, Batch, bitwise_cases, correctness_cases, error_ratio, make_batch

pytest.importorskip("triton")

CASE_NAMES = [name for name, _, _ in CORRECTNESS]
BITWISE_CHECKS = ["alone_vs_crowded_batch", "cached_prefix_vs_full_prefill", "split_decode_vs_mixed_step",
                  "split_decode_vs_full_prefill"]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted("triton_attention_cases.py", timeout=600)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_interpreted_matches_torch_backend(interpreted, name):
    assert interpreted["correctness"][name]["error_ratio"] <= 1.0


def test_interpreted_decode_batches_split_keys_and_others_do_not(interpreted):
    segments = {name: result["segments"] for name, result in interpreted["correctness"].items()}
    assert all(segments[name] > 1 for name in CASE_NAMES if name.startswith("decode_")), segments
    assert all(segments[name] == 0 for name in CASE_NAMES if name.startswith("mixed_")), segments


@pytest.mark.parametrize("check", BITWISE_CHECKS)
def test_interpreted_rows_are_bitwise_independent_of_batch_prefix_and_path(interpreted, check):
    assert interpreted["bitwise"][check]


def test_interpreted_bitwise_cases_cover_both_paths(interpreted):
    segments = interpreted["bitwise"]["segments"]
    assert segments["split"] > 1 and segments["last"] > 1 and segments["mixed"] == 0, segments


def test_split_segments_depends_only_on_shapes_and_ints():
    from nanovllm.kernels.attention.triton_attention import SEGMENT, SPLIT_KV_MAX_PROGRAMS, split_segments

    assert split_segments(4, 4, 8, 1, 4096) == 4096 // SEGMENT  # a captured decode graph: max_seqlen_k fixed
    assert split_segments(4, 4, 8, 1, 3 * SEGMENT + 1) == 4
    assert split_segments(4, 4, 8, 1, SEGMENT) == 0  # one segment: nothing to split
    assert split_segments(9, 4, 8, 6, 4096) == 0  # prefill or mixed step
    large = SPLIT_KV_MAX_PROGRAMS // 8
    assert split_segments(large, large, 8, 1, 4096) == 0  # enough (sequence, KV head) programs already


@pytest.mark.parametrize("change, message", [
    (lambda b: b.q.double(), "float16, bfloat16 or float32"),
    (lambda b: b.q.half(), "same dtype"),
    (lambda b: b.q[:, :3], "multiple of kv_heads"),
    (lambda b: b.q[..., ::2].contiguous(), "do not fit caches"),
    (lambda b: b.q.transpose(1, 2).contiguous().transpose(1, 2), "contiguous along head_dim"),
])
def test_attend_rejects_inputs_it_cannot_serve(change, message):
    from nanovllm.kernels.attention.triton_backend import TritonBackend

    batch = make_batch([(3, 5, 1)])
    with pytest.raises(ValueError, match=message):
        TritonBackend.attend(change(batch), batch.k_cache, batch.v_cache, batch.ctx, batch.scale)


def compile_attention(capability: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                      page: int, softcap: bool = False, cache: str | None = None) -> None:
    """Both kernels, with the argument types the backend gives them; pointers and strides hinted. `cache`: the KV
    cache's element type where it is not the queries' ("*fp8e4nv": kv_cache_dtype="fp8", "*u8": "int8")."""
    from nanovllm.kernels.attention import triton_attention as ta

    element = ELEMENT[dtype]
    types = {"out_ptr": element, "q_ptr": element, "k_cache_ptr": cache or element, "v_cache_ptr": cache or element,
             "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "qk_scale": "fp32",
             "score_scale": "fp32", "softcap": "fp32"}
    constants = {**ta.kernel_constants(heads, kv_heads, head_dim, page, dtype), "SOFTCAP": softcap,
                 "INT8": cache == "*u8"}
    kernels = ((ta._attention_kernel, constants, ta.ATTENTION_LAUNCH),
               (ta._reduce_segments_kernel, ta.reduce_constants(constants), ta.REDUCE_LAUNCH))
    compile_for_nvidia(kernels, capability, types, "*i32", lambda param: not param.do_not_specialize and (
        param.name.endswith("_ptr") or param.name.startswith("stride")))


@pytest.mark.parametrize("capability, dtype, heads, kv_heads, head_dim, page, softcap, cache", [
    (90, torch.bfloat16, 16, 8, 128, 256, False, None),  # Qwen3-0.6B on an H100
    (80, torch.float32, 14, 2, 24, 16, False, None),  # a group of 7, true float32 dots, head_dim padded to 32
    (90, torch.bfloat16, 8, 4, 256, 256, True, None),  # Gemma 2: capped scores
    (90, torch.bfloat16, 16, 8, 128, 256, False, "*fp8e4nv"),  # kv_cache_dtype="fp8"
    (80, torch.float16, 14, 2, 64, 16, True, "*u8"),  # kv_cache_dtype="int8"
])
def test_kernels_compile_for_nvidia_gpus(capability, dtype, heads, kv_heads, head_dim, page, softcap, cache):
    require_nvidia_backend()
    compile_attention(capability, dtype, heads, kv_heads, head_dim, page, softcap, cache)


# The compiled kernels on a GPU.

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_matches_torch_backend(dtype):
    from nanovllm.kernels.attention.triton_backend import TritonBackend

    results = correctness_cases(TritonBackend, device="cuda", dtype=dtype)
    assert all(result["error_ratio"] <= 1.0 for result in results.values()), results


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_rows_are_bitwise_independent_of_batch_prefix_and_path(dtype):
    from nanovllm.kernels.attention.triton_backend import TritonBackend

    results = bitwise_cases(TritonBackend, dtype, device="cuda")
    assert all(results[check] for check in BITWISE_CHECKS), results


def decode_batch(num_seqs: int) -> Batch:
    """A bfloat16 decode step with a padding row, contexts up to 1500."""
    return make_batch([(1, 1 + 37 * i % 1500, i) for i in range(num_seqs - 1)] + [PAD], head_dim=64,
                      dtype=torch.bfloat16, device="cuda")


@pytest.mark.cuda
def test_cuda_attend_never_syncs_with_the_host():
    from nanovllm.kernels.attention.triton_backend import TritonBackend

    batches = [decode_batch(5), make_batch([(1, 300, 1), (20, 100, 2), PAD], dtype=torch.float16, device="cuda")]
    for batch in batches:
        batch.attend(TritonBackend)  # compiles first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            batch.attend(TritonBackend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("num_seqs", [6, 300])  # split-KV, and unified (300 sequences x 2 KV heads)
def test_cuda_graph_replays_decode_like_eager(num_seqs):
    from nanovllm.kernels.attention.triton_attention import split_segments
    from nanovllm.kernels.attention.triton_backend import TritonBackend

    batch = decode_batch(num_seqs)
    batch.ctx.max_seqlen_k = 2048  # the static bound a decode graph is captured with
    assert (split_segments(num_seqs, num_seqs, 2, 1, 2048) > 0) == (num_seqs == 6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        batch.attend(TritonBackend)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batch.attend(TritonBackend)

    # A later step over the same cache: shorter contexts, one more padding row, new queries.
    batch.ctx.context_lens.copy_(batch.ctx.context_lens // 2)
    batch.ctx.context_lens[0] = 0
    batch.ctx.block_tables[0] = -1
    batch.q.copy_(torch.randn_like(batch.q))
    graph.replay()
    eager = batch.attend(TritonBackend)
    assert torch.equal(out, eager)
    assert error_ratio(batch, out) <= 1.0
    assert not out[0].any()
