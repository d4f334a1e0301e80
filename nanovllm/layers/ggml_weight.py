"""Weights that stay in GGML's block formats inside the model: how a layer receives, slices and runs them.

`GGMLTensor` is one checkpoint weight `[rows, in_features]` as GGML blocks (a GGUF tensor, memory-mapped, or a float
weight quantized at load). The layers' weight loaders slice it as they slice float tensors: output rows freely,
input columns only at block boundaries. `GGMLWeight` is what a layer runs once loaded: its rows as segments of one
type each (a fused projection may join shards of different types, as Q4_K_M files mix Q4_K and Q6_K), computed by
`nanovllm.kernels.ggml`, as the file has them or, once `repack`ed for the CPU's kernels, in tiles of `lanes` rows.
"""
import torch
from torch import nn

from nanovllm.kernels.ggml import (
    BLOCK,
    FLOAT_TYPES,
    Q4_0,
    Q4_1,
    Q8_0,
    ggml_dequantize,
    ggml_embedding,
    ggml_linear,
    ggml_quantize,
    repack,
    repack_lanes,
    row_bytes,
    type_name,
    unpack,
)


class GGMLTensor:
    """A weight `[rows, in_features]` held as `data`, uint8 `[rows, row_bytes]` of GGML type `qtype`."""

    def __init__(self, data: torch.Tensor, qtype: int, in_features: int):
        if data.dtype != torch.uint8 or data.dim() != 2 or data.size(1) != row_bytes(qtype, in_features):
            raise ValueError(f"GGML {type_name(qtype)} rows of {in_features} values take "
                             f"{row_bytes(qtype, in_features)} bytes, got a {data.dtype} tensor {tuple(data.shape)}")
        self.data, self.qtype, self.in_features = data, qtype, in_features

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.size(0), self.in_features))

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def dim(self) -> int:
        return 2

    def rows(self, index: torch.Tensor | slice) -> "GGMLTensor":
        return GGMLTensor(self.data[index], self.qtype, self.in_features)

    def __getitem__(self, rows: slice) -> "GGMLTensor":
        return self.rows(rows)

    def narrow(self, dim: int, start: int, length: int) -> "GGMLTensor":
        if dim == 0:
            return self.rows(slice(start, start + length))
        values, size = BLOCK[self.qtype]
        if start % values or length % values:
            raise ValueError(f"a tensor-parallel rank takes input columns {start}..{start + length} of a "
                             f"{type_name(self.qtype)} weight, whose {values}-value blocks cannot be split: choose "
                             f"a tensor_parallel_size that leaves each rank whole blocks (input size "
                             f"{self.in_features})")
        part = self.data.narrow(1, start // values * size, length // values * size).contiguous()
        return GGMLTensor(part, self.qtype, length)

    def chunk(self, chunks: int, dim: int = 0) -> list["GGMLTensor"]:
        if dim != 0:
            raise ValueError("GGML weights are chunked along their rows only")
        step = -(-self.size(0) // chunks)
        return [self.rows(slice(start, start + step)) for start in range(0, self.size(0), step)]

    def padded(self, rows: int) -> "GGMLTensor":
        """These rows then zero rows up to `rows` (all-zero blocks are zeros in every GGML type)."""
        if rows == self.size(0):
            return self
        data = torch.zeros(rows, self.data.size(1), dtype=torch.uint8)
        data[:self.size(0)] = self.data
        return GGMLTensor(data, self.qtype, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ggml_dequantize(self.data, self.qtype, self.in_features, dtype)


def quantize(weight: torch.Tensor, qtype: int) -> GGMLTensor:
    """`weight` `[rows, in_features]` rounded to nearest into GGML blocks of `qtype` (Q8_0, Q4_0 or Q4_1)."""
    return GGMLTensor(ggml_quantize(weight.detach().cpu(), qtype), qtype, weight.size(1))


REQUANTIZABLE = frozenset({Q8_0, Q4_0, Q4_1, *FLOAT_TYPES})
"""The GGML types a float weight can be put into here (`requantize`): `ggml_quantize`'s and the float ones."""


def requantize(weight: torch.Tensor, qtype: int) -> GGMLTensor:
    """A float `weight` `[rows, in_features]` as GGML blocks of `qtype`, one of `REQUANTIZABLE`: rounded to nearest
    (Q8_0, Q4_0, Q4_1, as a weight quantized at load), or converted (F32, F16, BF16)."""
    if qtype not in FLOAT_TYPES:
        return quantize(weight, qtype)
    data = weight.detach().to(device="cpu", dtype=FLOAT_TYPES[qtype]).contiguous().view(torch.uint8)
    return GGMLTensor(data.reshape(weight.size(0), -1), qtype, weight.size(1))


class GGMLWeight(nn.Module):
    """A layer's weight `[rows, in_features]` as GGML row segments, one type each, in row order.

    `dtype` is the model's activation dtype: what an embedding lookup returns. `lanes`: 0 while the segments hold their
    rows as the file does, else the rows of the tiles `repack` put them in."""

    def __init__(self, segments: list[GGMLTensor], dtype: torch.dtype):
        super().__init__()
        self.qtypes = [s.qtype for s in segments]
        self.in_features = segments[0].in_features
        self.dtype = dtype
        self.lanes = 0
        for i, segment in enumerate(segments):
            self.register_buffer(f"segment{i}", segment.data, persistent=False)

    @classmethod
    def assemble(cls, parts: list[tuple[int, GGMLTensor]], rows: int, dtype: torch.dtype) -> "GGMLWeight":
        """The weight made of `parts` (first row, rows), which must cover rows 0..rows-1 once; neighbouring parts of
        one type are joined into one segment."""
        segments: list[list[GGMLTensor]] = []
        end = 0
        for start, part in sorted(parts, key=lambda p: p[0]):
            if start != end:
                raise ValueError(f"GGML weight parts leave rows {end}..{start} unfilled or filled twice")
            if segments and segments[-1][0].qtype == part.qtype:
                segments[-1].append(part)
            else:
                segments.append([part])
            end += part.size(0)
        if end != rows:
            raise ValueError(f"GGML weight parts fill {end} rows of {rows}")
        joined = [group[0] if len(group) == 1 else
                  GGMLTensor(torch.cat([p.data for p in group]), group[0].qtype, group[0].in_features)
                  for group in segments]
        return cls(joined, dtype)

    def repack(self) -> None:
        """Reorder the segments' bytes in place of the file's into the tiles the CPU kernels stream (a few times
        faster at one or a few activation rows, `nanovllm.kernels.ggml.repack`), where every segment's type and row
        count allow it on the kernels' path; else leave them as they are."""
        lanes = {repack_lanes(qtype) for qtype in self.qtypes}
        if self.lanes or len(lanes) != 1 or not (lanes := lanes.pop()) \
                or any(s.data.size(0) % lanes or s.data.device.type != "cpu" for s in self.segments):
            return
        for i, segment in enumerate(self.segments):
            setattr(self, f"segment{i}", repack(segment.data, segment.qtype, lanes))
        self.lanes = lanes

    def write_rows(self, start: int, rows: GGMLTensor) -> None:
        """Overwrite rows `start`.. with `rows` in place (a weight reloaded: kernels and a `DecoderStack` holding the
        segments see the new bytes); they must lie in one segment of their type. Repacked segments take them through
        their tiles: the tiles the rows touch are unpacked, written and repacked."""
        end = 0
        for i, qtype in enumerate(self.qtypes):
            segment = getattr(self, f"segment{i}")
            begin, end = end, end + segment.size(0)
            if begin <= start < end:
                if start + rows.size(0) > end or qtype != rows.qtype or rows.in_features != self.in_features:
                    raise RuntimeError(f"GGML rows {start}..{start + rows.size(0)} of type {type_name(rows.qtype)} do "
                                     f"not fit segment {i} (rows {begin}..{end}, {type_name(qtype)})")
                first, last = start - begin, start - begin + rows.size(0)
                if not self.lanes:
                    segment[first:last].copy_(rows.data)
                    return
                tiles = slice(first // self.lanes * self.lanes, -(-last // self.lanes) * self.lanes)
                plain = unpack(segment[tiles], qtype, self.lanes)
                plain[first - tiles.start:last - tiles.start] = rows.data
                segment[tiles].copy_(repack(plain, qtype, self.lanes))
                return
        raise RuntimeError(f"GGML rows from {start} lie outside this weight's {end} rows")

    @property
    def segments(self) -> list[GGMLTensor]:
        """The segments as they are held (in tiles of `lanes` rows once repacked)."""
        return [GGMLTensor(getattr(self, f"segment{i}"), qtype, self.in_features)
                for i, qtype in enumerate(self.qtypes)]

    def _file_rows(self, segment: GGMLTensor) -> GGMLTensor:
        return GGMLTensor(unpack(segment.data, segment.qtype, self.lanes), segment.qtype, self.in_features) \
            if self.lanes else segment

    @property
    def is_float(self) -> bool:
        return all(qtype in FLOAT_TYPES for qtype in self.qtypes)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([self._file_rows(s).dequantize(dtype) for s in self.segments])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.qtypes) == 1:
            return ggml_linear(x, self.segment0, self.qtypes[0], self.in_features, bias, self.lanes)
        y = torch.cat([ggml_linear(x, s.data, s.qtype, self.in_features, lanes=self.lanes) for s in self.segments],
                      dim=-1)
        return y if bias is None else y + bias

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup; the weight is one segment, a GGUF token embedding)."""
        return ggml_embedding(self.segment0, ids, self.qtypes[0], self.in_features, self.dtype, self.lanes)
