"""Routed experts of a mixture-of-experts MLP, stacked `[num_experts, ...]` and computed grouped by expert.

Each token goes to its `top_k` experts by softmax over the router logits (optionally renormalized over those k,
Mixtral's and Qwen3-MoE's `norm_topk_prob`). The (token, expert) pairs are sorted by expert so that each expert runs
one SiLU-gated MLP over all of its tokens: a matmul per expert, never a loop over tokens. On the CPU each expert's
weights are prepacked for oneDNN like every other linear weight (see `layers/prepack.py`): at decode sizes a step
touches every expert with a few rows each, where the plain product spends more time re-packing the weight than
multiplying.

On CUDA the experts run as two Triton kernels over the same sorted pairs (`kernels/triton_moe.py`), with no host
sync, so CUDA graphs capture the decode step.

Tensor parallel splits every expert's intermediate dimension (gate/up rows, down columns), like the dense MLP, so
each rank computes a partial sum of every token's output; the caller's all-reduce completes it (once for the routed
and the shared experts together, `models/sparse_moe.py`).

Experts given as GGML blocks (a GGUF file's 3-D expert tensors, one expert at a time) stay in blocks on the CPU: each
projection becomes one `GGMLWeight` per expert, which `grouped_experts` runs like the packed float weights.
"""
import torch
from torch import nn

from nanovllm.distributed.process_group import tp_rank_and_size
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.ggml_weight import GGMLTensor, GGMLWeight
from nanovllm.layers.linear import linear


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their weights: softmax in float32, top k, optionally divided by their sum."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor | nn.ParameterList | nn.ModuleList,
                    down: torch.Tensor | nn.ParameterList | nn.ModuleList) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), one SiLU-gated MLP call per expert on its tokens.

    `gate_up[e]` is expert e's `[2 * intermediate, hidden]` ([gate | up]) and `down[e]` its `[hidden, intermediate]`,
    plain, oneDNN-packed or GGML blocks (`GGMLWeight`). A token's contributions are summed in expert order, as
    transformers sums them.
    """
    top_k = ids.size(1)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            out[start:end] = linear(silu_and_mul(linear(rows[start:end], gate_up[expert])), down[expert])
            start = end
    out.mul_(weights.flatten().index_select(0, order).to(out.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, out)


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated MLPs and the top-k routing between them; input the router's logits.

    Parameters match transformers' stacked layout (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj`
    `[E, H, I]`); `weight_loader` takes either a whole stacked tensor or one expert's projection, `shard` =
    (expert, 0 for gate / 1 for up) for `gate_up_proj` and (expert, 0) for `down_proj`, and keeps this rank's slice.
    An expert's projection given as GGML blocks is kept aside in `ggml_parts` until `install_ggml_weights`.
    With tensor parallelism the output is this rank's partial sum, for the caller to all-reduce.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.top_k, self.renormalize = top_k, renormalize
        self.num_experts, self.hidden_size, self.full_intermediate = num_experts, hidden_size, intermediate_size
        self.intermediate = intermediate_size // self.tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        self.gate_up_proj.weight_loader = self.gate_up_loader
        self.down_proj.weight_loader = self.down_loader
        self.ggml_parts: dict[str, list[list[tuple[int, GGMLTensor]]]] = {
            name: [[] for _ in range(num_experts)] for name in ("gate_up_proj", "down_proj")}
        self.compute = grouped_experts
        if self.gate_up_proj.is_cuda:
            try:
                from nanovllm.kernels.triton_moe import fused_experts  # Triton: only where there is a GPU
            except ImportError:
                raise ValueError("mixture-of-experts models on CUDA compute their experts with Triton, which does "
                                 "not import here; install it (pip install triton)") from None
            self.compute = fused_experts

    def _rank_slice(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        return weight.narrow(dim, self.tp_rank * self.intermediate, self.intermediate)

    def _check(self, loaded: torch.Tensor, expected: tuple[int, ...], what: str, expert: int = 0) -> None:
        if tuple(loaded.shape) != expected or expert >= self.num_experts:
            found = f"has shape {tuple(loaded.shape)}" if expert < self.num_experts else "is in the checkpoint"
            raise ValueError(f"{what} {found}, but the model config implies {self.num_experts} experts of shape "
                             f"{expected} (hidden size {self.hidden_size}, expert intermediate size "
                             f"{self.full_intermediate}). The checkpoint and its config.json do not match; fix "
                             "config.json or use the config the weights were saved with.")

    def gate_up_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None) -> None:
        experts, hidden, full = self.num_experts, self.hidden_size, self.full_intermediate
        if shard is None:
            self._check(loaded, (experts, 2 * full, hidden), "the stacked experts' gate/up projection")
            param.data.copy_(self._rank_slice(loaded.view(experts, 2, -1, hidden), 2).reshape(param.shape))
        else:
            expert, half = shard
            self._check(loaded, (full, hidden), f"expert {expert}'s {('gate', 'up')[half]} projection", expert)
            if isinstance(loaded, GGMLTensor):
                self.ggml_parts["gate_up_proj"][expert].append((half * self.intermediate, self._rank_slice(loaded, 0)))
                return
            param.data[expert].narrow(0, half * self.intermediate, self.intermediate).copy_(
                self._rank_slice(loaded, 0))

    def down_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int] | None = None) -> None:
        experts, hidden, full = self.num_experts, self.hidden_size, self.full_intermediate
        if shard is None:
            self._check(loaded, (experts, hidden, full), "the stacked experts' down projection")
            param.data.copy_(self._rank_slice(loaded, 2))
        else:
            self._check(loaded, (hidden, full), f"expert {shard[0]}'s down projection", shard[0])
            if isinstance(loaded, GGMLTensor):
                self.ggml_parts["down_proj"][shard[0]].append((0, self._rank_slice(loaded, 1)))
                return
            param.data[shard[0]].copy_(self._rank_slice(loaded, 1))

    def install_ggml_weights(self) -> None:
        """A projection whose experts came as GGML blocks becomes one `GGMLWeight` per expert (or, all of them
        F32/F16/BF16, the stacked float parameter)."""
        for name, experts in self.ggml_parts.items():
            if not any(experts):
                continue
            stacked = getattr(self, name)
            weights = [GGMLWeight.assemble(parts, stacked.size(1), stacked.dtype) for parts in experts]
            delattr(self, name)
            if all(w.is_float for w in weights):
                setattr(self, name, nn.Parameter(torch.stack([w.dequantize(stacked.dtype) for w in weights]),
                                                 requires_grad=False))
            else:
                setattr(self, name, nn.ModuleList(weights))
            for parts in experts:
                parts.clear()

    @torch.no_grad()
    def prepack(self) -> None:
        """Replace the stacked weights by one oneDNN-packed matrix per expert (CPU; see `layers/prepack.py`)."""
        for name in ("gate_up_proj", "down_proj"):
            stacked = getattr(self, name)
            if not isinstance(stacked, nn.Parameter):
                continue
            delattr(self, name)
            setattr(self, name, nn.ParameterList(
                nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.contiguous()), requires_grad=False)
                for w in stacked))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.compute(x, weights, ids, self.gate_up_proj, self.down_proj)
