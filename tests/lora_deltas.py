"""LoRA layers' inputs for the kernel tests (the CPU kernel's in tests/lora, Triton's in tests/kernels): adapters of
several ranks and scales on a fused layer of three odd-sized output slices, and the float64 reference computed row by
row."""
import torch

from nanovllm.layers.lora import LoRASlice, LoRAWeights

IN, OUTS = 40, (24, 8, 17)


def adapter(generator: torch.Generator, ranks: tuple[int, ...], dtype: torch.dtype, in_features: int = IN,
            outs: tuple[int, ...] = OUTS) -> LoRAWeights:
    """An adapter on the slices (of sizes `outs`) whose rank is not 0, each with its own scale."""
    slices, a, first, offset = [], [], 0, 0
    for index, (rank, size) in enumerate(zip(ranks, outs)):
        if rank:
            a.append(torch.randn(rank, in_features, generator=generator))
            b = torch.randn(size, rank, generator=generator)
            slices.append(LoRASlice(offset, size, b.to(dtype), first, first + rank, 0.5 + index))
            first += rank
        offset += size
    return LoRAWeights(torch.cat(a).to(dtype), slices)


STEP = (1, 2, 3, 4)  # a step's adapters: 3 does not adapt the layer


def layer_adapters(dtype: torch.dtype, ranks: tuple[tuple[int, ...], ...] = ((4, 2, 3), (0, 5, 0), (1, 1, 1)),
                   in_features: int = IN, outs: tuple[int, ...] = OUTS) -> dict[int, LoRAWeights]:
    """Adapters 1, 2 and 4 of slice ranks `ranks`: by default one on every slice, one on the middle slice alone, one
    of rank 1."""
    generator = torch.Generator().manual_seed(0)
    return {i: adapter(generator, r, dtype, in_features, outs) for i, r in zip((1, 2, 4), ranks)}


def row_adapters(rows: int) -> list[int]:
    """Each of `rows` rows' adapter (0: the base) among `STEP`'s, mixed."""
    return [(0, 1, 2, 3, 4, 1, 1)[(r * 5) % 7] for r in range(rows)]


def reference(x: torch.Tensor, y: torch.Tensor, weights: dict[int, LoRAWeights], row_adapters: list[int]):
    out = y.double().clone()
    for row, adapter_id in enumerate(row_adapters):
        if adapter_id in weights:
            w = weights[adapter_id]
            shrunk = w.a.double() @ x[row].double()
            for s in w.slices:
                out[row, s.offset:s.offset + s.size] += s.scale * (s.b.double() @ shrunk[s.rank_from:s.rank_to])
    return out
