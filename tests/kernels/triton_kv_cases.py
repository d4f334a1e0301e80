"""Compares the Triton KV-cache writer with the torch writer; run by test_triton_kv.py in a fresh interpreter.

Prints one JSON line: per dtype, whether the caches match bit for bit and how many cache rows
each writer changed.
"""
import json

import torch

from nanovllm.kernels.attention.torch_backend import TorchBackend
from nanovllm.kernels.attention.triton_kv import store_kvcache

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 5, 4, 2, 12  # a 24-wide row: not a power of two
SLOT_MAPPING = [17, -1, 3, 0, 19, -1, 8, 12, 4]  # out of order, with padding, across blocks


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> int:
    """Cache slots (K and V counted separately) whose content differs."""
    return int((before != after).view(2, NUM_BLOCKS * BLOCK_SIZE, -1).any(-1).sum())


def compare(dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    num_tokens, row = len(SLOT_MAPPING), KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, 3 * row, generator=gen).to(dtype)  # k and v are strided views, as in the model
    k = qkv[:, row:2 * row].view(num_tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, 2 * row:].view(num_tokens, KV_HEADS, HEAD_DIM)
    slots = torch.tensor(SLOT_MAPPING, dtype=torch.int64)
    initial = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    ref, out = initial.clone(), initial.clone()
    TorchBackend.store_kvcache(k, v, ref[0], ref[1], slots)
    store_kvcache(k, v, out[0], out[1], slots)
    return {"k_equal": torch.equal(ref[0], out[0]), "v_equal": torch.equal(ref[1], out[1]),
            "rows_changed_torch": changed_rows(initial, ref), "rows_changed_triton": changed_rows(initial, out),
            "rows_expected": 2 * sum(s >= 0 for s in SLOT_MAPPING)}


if __name__ == "__main__":
    print(json.dumps({name: compare(dtype) for name, dtype in DTYPES.items()}))
