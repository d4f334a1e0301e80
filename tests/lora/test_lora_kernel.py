"""The CPU kernel that adds LoRA deltas (`lora_add`), against a float64 reference computed row by row: slices of
several ranks and scales, adapters that skip a slice or the whole layer, base rows, row counts around its tiles; and
a row's result bit for bit the same whatever shares its call and however many threads run it."""
import pytest
import torch
from lora_deltas import IN, OUTS, STEP, layer_adapters, reference, row_adapters

from nanovllm.kernels.cpu import cpu_kernels
from nanovllm.layers.lora import LoRALayer, LoRAStep, LoRAWeights, clear_lora_step, set_lora_step

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels cannot be built here")


@pytest.fixture(autouse=True)
def no_step_left_behind():
    yield
    clear_lora_step()


def layer_and_step(dtype: torch.dtype, rows_adapters: list[int]) -> tuple[LoRALayer, dict[int, LoRAWeights]]:
    weights = layer_adapters(dtype)
    layer = LoRALayer(IN, sum(OUTS), kernel=True)
    for adapter_id, w in weights.items():
        layer.add_adapter(adapter_id, w)
    index = [STEP.index(i) if i else len(STEP) for i in rows_adapters]
    set_lora_step(LoRAStep(STEP, torch.tensor(index, dtype=torch.int64)))
    return layer, weights


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 17])
def test_deltas_against_a_float64_reference(dtype, tolerance, rows):
    rows_adapters = row_adapters(rows)
    layer, weights = layer_and_step(dtype, rows_adapters)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, IN, generator=generator).to(dtype)
    y = torch.randn(rows, sum(OUTS), generator=generator).to(dtype)
    expected = reference(x, y, weights, rows_adapters)
    out = layer.add_to(x, y.clone())
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= tolerance * scale
    for row, adapter_id in enumerate(rows_adapters):
        if adapter_id not in weights:  # the base, and adapter 3: untouched
            assert torch.equal(out[row], y[row])


def test_a_row_is_bitwise_the_same_whatever_shares_its_call_and_threads():
    row_adapters = [1, 2, 1, 0, 4, 1, 1, 2, 1, 1]
    layer, _ = layer_and_step(torch.float32, row_adapters)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(len(row_adapters), IN, generator=generator), torch.randn(len(row_adapters), sum(OUTS))
    together = layer.add_to(x, y.clone())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = layer.add_to(x, y.clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for row, adapter_id in enumerate(row_adapters):
        alone, _ = layer_and_step(torch.float32, [adapter_id])
        assert torch.equal(alone.add_to(x[row:row + 1], y[row:row + 1].clone())[0], together[row])
