"""Triton kernels adding LoRA deltas on CUDA (BGMV style, as vLLM's punica kernels): every row gets
`scale * B @ (A @ x)` of its own adapter, from a step's packing (`layers.lora.Packed`, the CPU kernel's) joined into
fixed buffers (`layers.lora.Slots`: every slot's A stacked, every slice's B transposed one after another, the table of
slices with their offsets into those, each slot's first slice) and a slot per row.

Two kernels: a shrink, one program per (row, block of its slot's A rows), writes `A @ x` in float32; an expand, one
program per (row, block of output columns), adds to those columns each of the slot's slices that reaches them.
Everything a program needs is read on the GPU (no host sync, no shape that depends on the adapters), so a CUDA graph
captures them: its replays read whatever adapters the buffers hold and whatever slots the row table says. A row whose
slot is `num_slots` or more, or whose slot has no slice in this layer, is left as it was, bit for bit.

Products and sums in float32 (elementwise, no TF32), float16/bfloat16 operands widened; the kernels run under
`TRITON_INTERPRET=1` on the CPU, which is how the tests check them.
"""
import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_K, BLOCK_N = 16, 64, 64


@triton.jit
def _row_slices(row_slots_ptr, slot_slices_ptr, row, num_slots):
    """The slices `lo..hi` of the row's slot (none, `lo == hi`, for a row of the base: slot `num_slots` or more)."""
    slot = tl.load(row_slots_ptr + row)
    adapted = slot < num_slots
    return (tl.load(slot_slices_ptr + slot, mask=adapted, other=0),
            tl.load(slot_slices_ptr + slot + 1, mask=adapted, other=0))


@triton.jit
def _slot_a_rows(slices_ptr, lo, hi):
    """The first and past-the-last A row of the slices `lo..hi` (one slot's)."""
    first = tl.load(slices_ptr + lo * 6 + 1)
    end = first + tl.load(slices_ptr + lo * 6 + 2)
    for j in range(lo + 1, hi):
        start = tl.load(slices_ptr + j * 6 + 1)
        first = tl.minimum(first, start)
        end = tl.maximum(end, start + tl.load(slices_ptr + j * 6 + 2))
    return first, end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slices_ptr, slot_slices_ptr, row_slots_ptr, shrunk_ptr, num_slots, in_features,
                   x_stride, shrunk_stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """shrunk[row, r] = A[first + r] . x[row] for a block of the row's slot's A rows (`first`: the slot's first)."""
    row, block = tl.program_id(0), tl.program_id(1)
    lo, hi = _row_slices(row_slots_ptr, slot_slices_ptr, row, num_slots)
    if lo == hi:
        return
    first, end = _slot_a_rows(slices_ptr, lo, hi)
    if first + block * BLOCK_R >= end:
        return
    rs = first + block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < end
    x_row = x_ptr + row.to(tl.int64) * x_stride
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rs[:, None].to(tl.int64) * in_features + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(shrunk_ptr + row.to(tl.int64) * shrunk_stride + (rs - first), acc, mask=r_ok)


@triton.jit
def _expand_kernel(y_ptr, shrunk_ptr, bt_ptr, slices_ptr, scales_ptr, slot_slices_ptr, row_slots_ptr, num_slots,
                   out_features, y_stride, shrunk_stride, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[row, cols] += scale * shrunk[row, slice's A rows] @ B^T[:, cols] over the row's slot's slices reaching a
    block of columns (their ranks `BLOCK_R` at a time); columns no slice reaches are not written."""
    row, block = tl.program_id(0), tl.program_id(1)
    lo, hi = _row_slices(row_slots_ptr, slot_slices_ptr, row, num_slots)
    if lo == hi:
        return
    first, _ = _slot_a_rows(slices_ptr, lo, hi)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    shrunk_row = shrunk_ptr + row.to(tl.int64) * shrunk_stride - first
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    covered = tl.zeros([BLOCK_N], dtype=tl.int32)
    for j in range(lo, hi):
        offset = tl.load(slices_ptr + j * 6 + 3)
        size = tl.load(slices_ptr + j * 6 + 4)
        if (offset < block * BLOCK_N + BLOCK_N) & (offset + size > block * BLOCK_N):
            start = tl.load(slices_ptr + j * 6 + 1)
            rank = tl.load(slices_ptr + j * 6 + 2)
            b_start = tl.load(slices_ptr + j * 6 + 5)
            c_ok = (cols >= offset) & (cols < offset + size)
            part = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                rs = r0 + tl.arange(0, BLOCK_R)
                r_ok = rs < rank
                shrunk = tl.load(shrunk_row + start + rs, mask=r_ok, other=0.0)
                bt = tl.load(bt_ptr + b_start + rs[:, None].to(tl.int64) * size + (cols[None, :] - offset),
                             mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                part += tl.sum(shrunk[:, None] * bt, axis=0)
            acc += tl.load(scales_ptr + j) * part
            covered = covered | c_ok.to(tl.int32)
    write = (covered != 0) & (cols < out_features)
    y = y_ptr + row.to(tl.int64) * y_stride + cols
    base = tl.load(y, mask=write, other=0.0).to(tl.float32)
    tl.store(y, (base + acc).to(y_ptr.dtype.element_ty), mask=write)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slices: torch.Tensor,
             scales: torch.Tensor, row_slots: torch.Tensor, slot_slices: torch.Tensor, num_slots: int,
             slot_a_rows: int) -> None:
    """`y[r] += scale * B @ (A @ x[r])` of row r's slot (`row_slots[r]`, its first `x.size(0)` entries read), in
    place; the packed tensors as `lora_add` of the CPU kernels takes them. `slot_a_rows`: the most A rows a slot has.
    y `[rows, out]` and x `[rows, in]` with unit column stride."""
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora_add needs x and y with contiguous rows")
    rows, in_features = x.shape
    out_features = y.size(1)
    if rows == 0:
        return
    shrunk = torch.empty(rows, slot_a_rows, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, triton.cdiv(slot_a_rows, BLOCK_R))](
        x, a, slices, slot_slices, row_slots, shrunk, num_slots, in_features, x.stride(0), shrunk.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _expand_kernel[(rows, triton.cdiv(out_features, BLOCK_N))](
        y, shrunk, bt, slices, scales, slot_slices, row_slots, num_slots, out_features, y.stride(0),
        shrunk.stride(0), BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
