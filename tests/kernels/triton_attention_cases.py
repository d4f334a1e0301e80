"""Paged-attention batches for the Triton attention tests, and the CPU cases run under TRITON_INTERPRET=1.

test_triton_attention.py runs this file in a fresh interpreter with TRITON_INTERPRET=1 (see
test_triton_kv.py for why) and asserts on the JSON line it prints; its CUDA tests import the
batch helpers below and run them compiled on the GPU.

A sequence is (q_len, context_len, seed): its queries, keys and values depend only on the seed, so
the same sequence can be placed in different batches, at different blocks, with different q
lengths. Cache slots no sequence owns hold NaN, so any read outside a context shows in the output. With a sliding
window, the blocks wholly before every query's window are released (-1 in the table), as the block manager does.
"""
import json
import random
from dataclasses import dataclass

import torch

from nanovllm.kernels.attention.context import Context
from nanovllm.kernels.attention.torch_backend import TorchBackend

Seq = tuple[int, int, int]  # (q_len, context_len, seed); context 0 with q_len 1 is a padding row
PAD: Seq = (1, 0, 0)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ctx: Context
    rows: list[slice]  # each sequence's rows of q
    scale: float
    window: int = 0
    softcap: float = 0.0

    def attend(self, backend) -> torch.Tensor:
        return backend.attend(self.q, self.k_cache, self.v_cache, self.ctx, self.scale, window=self.window,
                              softcap=self.softcap)

    def reference(self) -> torch.Tensor:
        """TorchBackend on CPU in float32, on the same values."""
        ctx = Context(**{name: value.cpu() if isinstance(value, torch.Tensor) else value
                         for name, value in vars(self.ctx).items()})
        return TorchBackend.attend(self.q.cpu().float(), self.k_cache.cpu().float(), self.v_cache.cpu().float(), ctx,
                                   self.scale, window=self.window, softcap=self.softcap)


def make_batch(seqs: list[Seq], *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, page: int = 16,
               dtype: torch.dtype = torch.float32, device: str = "cpu", layout_seed: int = 0, window: int = 0,
               softcap: float = 0.0) -> Batch:
    """One step over `seqs`, their blocks shuffled (by `layout_seed`) among twice as many as needed."""
    needed = [-(-context // page) for _, context, _ in seqs]
    num_blocks = 2 * sum(needed) + 1
    ids = random.Random(layout_seed).sample(range(num_blocks), sum(needed))
    k_cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    width, tables, queries = max(max(needed), 1), [], []
    for (q_len, context, seed), n in zip(seqs, needed):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(max(context, q_len), heads, head_dim, generator=gen)[-q_len:]
        k, v = torch.randn(2, context, kv_heads, head_dim, generator=gen)
        table, ids = ids[:n], ids[n:]
        slots = torch.tensor([table[i // page] * page + i % page for i in range(context)], dtype=torch.int64)
        k_cache.view(-1, kv_heads, head_dim)[slots] = k.to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = v.to(dtype)
        released = max(0, context - q_len - window + 1) // page if window else 0
        tables.append([-1] * released + table[released:] + [-1] * (width - n))
        queries.append(q)
    q_lens = [q_len for q_len, _, _ in seqs]
    contexts = [context for _, context, _ in seqs]
    cu_q = torch.tensor([0] + q_lens).cumsum(0).int()
    ctx = Context(cu_seqlens_q=cu_q.to(device), cu_seqlens_k=torch.tensor([0] + contexts).cumsum(0).int().to(device),
                  max_seqlen_q=max(q_lens), max_seqlen_k=max(contexts),
                  context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
                  block_tables=torch.tensor(tables, dtype=torch.int32, device=device))
    rows = [slice(int(cu_q[i]), int(cu_q[i + 1])) for i in range(len(seqs))]
    return Batch(q=torch.cat(queries).to(dtype).to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
                 ctx=ctx, rows=rows, scale=head_dim ** -0.5, window=window, softcap=softcap)

# Correctness against the torch reference: (name, seqs, make_batch options). Contexts span 1..4200,
# with padding rows, prefix-cached chunks (q_len < context), full prefills, and pure decode batches.
MIXED = [(1, 1, 1), (1, 300, 2), PAD, (37, 37, 3), (20, 100, 4), (3, 600, 5), (16, 16, 7)]
DECODE = [(1, 1, 11), (1, 17, 12), (1, 255, 13), (1, 256, 14), (1, 257, 15), PAD, (1, 700, 16)]
LONG = [(3, 2049, 8), (1, 2049, 9)]
SHORT_MIXED = [(1, 300, 2), PAD, (37, 37, 3), (20, 100, 4), (1, 1000, 6)]
SHORT_DECODE = [(1, 300, 2), PAD, (1, 1000, 6)]
CORRECTNESS = [
    ("mixed_d16_page16", MIXED + LONG, {}),
    ("mixed_d64_page256", MIXED, {"head_dim": 64, "page": 256}),
    ("decode_d64_page16", DECODE + LONG[1:], {"head_dim": 64}),
    ("decode_d16_page256", DECODE + [(1, 4200, 18)], {"page": 256}),  # 17 segments: a program takes two
    ("mixed_mha_d24_page32", [(9, 40, 21), (1, 300, 22), (30, 30, 23)],
     {"heads": 2, "kv_heads": 2, "head_dim": 24, "page": 32}),
    ("mixed_group3_d128_page16", [(5, 21, 31), (1, 600, 32), PAD], {"heads": 6, "kv_heads": 2, "head_dim": 128}),
    *((f"{kind}_{dtype}", seqs, {"head_dim": 64, "dtype": dtype})
      for dtype in ("float16", "bfloat16") for kind, seqs in (("mixed", SHORT_MIXED), ("decode", SHORT_DECODE))),
    ("window_mixed_d16_page16", MIXED + LONG, {"window": 100}),
    ("window_decode_d64_page16", DECODE + LONG[1:], {"head_dim": 64, "window": 300}),
    ("softcap_mixed_d16_page16", MIXED, {"softcap": 2.0}),
    ("softcap_window_decode_d16_page16", DECODE, {"softcap": 2.0, "window": 40}),
]
# Elementwise |out - ref| <= atol + rtol * |ref|, the reference in float32 on the same (rounded) inputs.
TOLERANCE = {"float32": (1e-5, 0.0), "float16": (1e-3, 1e-3), "bfloat16": (1e-2, 1.6e-2)}


def error_ratio(batch: Batch, out: torch.Tensor) -> float:
    """The largest error as a share of its tolerance: at most 1 passes; NaN anywhere gives NaN."""
    ref = batch.reference()
    atol, rtol = TOLERANCE[str(batch.q.dtype).removeprefix("torch.")]
    return ((out.float().cpu() - ref).abs() / (atol + rtol * ref.abs())).max().item()


def launch_segments(batch: Batch) -> int:
    from nanovllm.kernels.attention.triton_attention import split_segments

    return split_segments(batch.q.size(0), batch.ctx.context_lens.size(0), batch.k_cache.size(2),
                          batch.ctx.max_seqlen_q, batch.ctx.max_seqlen_k)


def correctness_cases(backend, device: str = "cpu", dtype: str | None = None) -> dict:
    """Per case: its error ratio and the split-KV segments its launch used (0: unified)."""
    results = {}
    for name, seqs, options in CORRECTNESS:
        batch = make_batch(seqs, **{**options, "dtype": DTYPES[dtype or options.get("dtype", "float32")]},
                           device=device)
        results[name] = {"error_ratio": error_ratio(batch, batch.attend(backend)), "segments": launch_segments(batch)}
    return results


def rows_of(batch: Batch, out: torch.Tensor, index: int, last: int | None = None) -> torch.Tensor:
    """Sequence `index`'s output rows (its last `last` rows when given)."""
    rows = out[batch.rows[index]]
    return rows if last is None else rows[-last:]


def bitwise_cases(backend, dtype: str, device: str = "cpu") -> dict:
    """A row's bits must not depend on its batch, its q length (cached prefix) or the path (split or unified)."""
    def run(seqs: list[Seq], layout_seed: int) -> tuple[Batch, torch.Tensor]:
        batch = make_batch(seqs, head_dim=32, dtype=DTYPES[dtype], device=device, layout_seed=layout_seed)
        return batch, batch.attend(backend)

    chunk, decode = (40, 300, 41), (1, 700, 42)
    alone, alone_out = run([chunk], 0)
    crowd, crowd_out = run([(1, 50, 43), PAD, (30, 30, 44), chunk, (1, 500, 45)], 1)
    full, full_out = run([(300, 300, 41)], 2)
    split, split_out = run([(1, 400, 46), decode, PAD], 3)
    mixed, mixed_out = run([(25, 25, 47), decode, (7, 290, 48)], 4)
    last, last_out = run([(1, 300, 41), (1, 20, 49)], 5)
    return {
        "alone_vs_crowded_batch": torch.equal(rows_of(alone, alone_out, 0), rows_of(crowd, crowd_out, 3)),
        "cached_prefix_vs_full_prefill": torch.equal(rows_of(alone, alone_out, 0), rows_of(full, full_out, 0, 40)),
        "split_decode_vs_mixed_step": torch.equal(rows_of(split, split_out, 1), rows_of(mixed, mixed_out, 1)),
        "split_decode_vs_full_prefill": torch.equal(rows_of(last, last_out, 0), rows_of(full, full_out, 0, 1)),
        "segments": {"split": launch_segments(split), "mixed": launch_segments(mixed), "last": launch_segments(last)},
    }


if __name__ == "__main__":
    from nanovllm.kernels.attention.triton_backend import TritonBackend

    print(json.dumps({"correctness": correctness_cases(TritonBackend),
                      "bitwise": bitwise_cases(TritonBackend, "float32")}))
