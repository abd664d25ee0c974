"""The integer path of the packed kernel (llama.cpp's arithmetic): x quantized per block of 32
to int8 with a float scale, integer dot products with the weights' integers. Its result is the
product of the dequantized weights with the quantized-then-dequantized x, to float32
accumulation-order error: the integer sums are exact. Checked for every kernel variant this CPU
runs, against that reference computed here in float64."""

import pytest
import torch
import torch.nn.functional as F

from attnkit.accel import native, packed
from attnkit.accel.packed import (
    IntegerPackedLinear,
    PackedLinear,
    dequantize,
    int8_path,
    use_integer_products,
)
from test_packed import KINDS, random_blocks

VARIANTS = [v for v in native.VARIANTS if native.runnable(v)]


def quantized(x: torch.Tensor) -> torch.Tensor:
    """x as the integer path reads it: per block of 32, dx = max|x| / 127 and
    qx = round(x * (1 / dx)) (ties to even), all in float32; returned as qx * dx."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)
    assert q.abs().max() <= 127
    return (q * d).reshape(x.shape)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """Random rows, one with ties (2.5, -3.5: rounded to even) in a block whose scale is 1."""
    x = x.clone()
    x[0, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.25] * 26)
    return x


def check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, what) -> None:
    xq = quantized(x).double()
    want = xq @ weight.double().T
    scale = xq.abs() @ weight.abs().double().T  # the size of the terms summed
    assert bool(((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all()), what


def test_the_reference_rounds_ties_to_even():
    x = rows_of(torch.zeros(1, 64))
    assert quantized(x)[0, :6].tolist() == [127.0, 2.0, -4.0, 0.0, -0.0, 2.0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_this_cpu_runs_computes_the_integer_product(variant):
    """Blocks repacked into tiles, and the tiles' product with x rounded to int8."""
    kernel = native.load(variant)
    tile = kernel.packed_tile_rows()
    assert tile == (16 if variant in ("amx", "vnni") else 8)
    for kind in KINDS:
        blocks = random_blocks(kind, 48, 512, seed=5)
        weight = dequantize(blocks, kind).reshape(48, 512)
        code = packed.KIND_CODES[kind]
        tiles = torch.empty(48, 512 // 32 * packed.TILE_BYTES[kind], dtype=torch.uint8)
        assert kernel.packed_tile(code, blocks.data_ptr(), tiles.data_ptr(), 48, 512, 2) == 0
        for rows in (1, 5, packed.MAX_ROWS):
            x = rows_of(torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)))
            y = torch.empty(rows, 48)
            tile_pointers = (tiles.data_ptr(), x.data_ptr(), y.data_ptr())
            tile_code = packed.TILE_CODES[kind]
            assert kernel.packed_matmul_tiles(tile_code, *tile_pointers, rows, 48, 512, 2) == 0
            check(y, x, weight, (variant, kind, rows, "tiles"))
        too_many = packed.MAX_ROWS + 1
        assert kernel.packed_matmul_tiles(tile_code, *tile_pointers, too_many, 48, 512, 2) == -1
        assert kernel.packed_tile(2, blocks.data_ptr(), tiles.data_ptr(), 48, 500, 2) == -1


def integer_product(variant, kind, blocks, x, n):
    """y = x W^T on the integer path, by ``variant``'s kernels and tiles."""
    kernel = native.load(variant)
    height = kernel.packed_tile_rows()
    tiles = torch.empty(
        -(-n // height) * height, 512 // 32 * packed.TILE_BYTES[kind], dtype=torch.uint8
    )
    code = packed.KIND_CODES[kind]
    assert kernel.packed_tile(code, blocks.data_ptr(), tiles.data_ptr(), n, 512, 2) == 0
    y = torch.empty(len(x), n)
    status = kernel.packed_matmul_tiles(
        packed.TILE_CODES[kind], tiles.data_ptr(), x.data_ptr(), y.data_ptr(), len(x), n, 512, 2
    )
    assert status == 0
    return y


@pytest.mark.parametrize("kind", KINDS)
def test_variants_give_the_integer_product_the_same_bits(kind):
    """Exact integer dot products, the scales applied in one order: every variant this CPU runs
    gives generic's y bit for bit, for whole tiles and a last partial one (45 rows)."""
    blocks = random_blocks(kind, 45, 512, seed=11)
    x = rows_of(torch.randn(packed.MAX_ROWS, 512, generator=torch.Generator().manual_seed(3)))
    want = integer_product("generic", kind, blocks, x, 45)
    check(want, x, dequantize(blocks, kind).reshape(45, 512), kind)
    for variant in VARIANTS:
        assert torch.equal(integer_product(variant, kind, blocks, x, 45), want), variant


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_linear_on_the_integer_path(kind):
    """Through the layer: any number of rows on the integer path (a prompt too), in calls of
    MAX_ROWS, each row alone; a layer whose rows make no whole tiles gets a last tile padded
    with zero weights."""
    cols = 512
    blocks = random_blocks(kind, 64, cols, seed=7)
    weight = dequantize(blocks, kind).reshape(64, cols)
    layer = IntegerPackedLinear(blocks, kind, cols)
    assert "int8 activations" in repr(layer)
    assert layer.tiles is not None  # tiles of 16 or 8 rows
    assert "tiles" not in layer.state_dict()  # rebuilt from the blocks, never saved
    x = torch.randn(packed.MAX_ROWS + 3, cols, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        prompt = layer(torch.cat([x, x]))
    check(got, x, weight, kind)
    assert torch.equal(got, alone)
    check(prompt, torch.cat([x, x]), weight, (kind, "prompt"))
    odd = IntegerPackedLinear(blocks[:41].contiguous(), kind, cols)  # a partial tile
    assert odd.integer
    with torch.no_grad():
        assert torch.equal(odd(x), got[:, :41])  # the padding rows change nothing
    model = use_integer_products(torch.nn.Sequential(layer), False)  # swapped back
    assert type(model[0]) is PackedLinear and model[0].blocks is layer.blocks
    assert not model[0].integer and "tiles" not in dict(model[0].named_buffers())


def test_the_integer_error_is_the_rounding_of_x():
    """On Gaussian activations against Q4_1 weights, the integer path's relative error is
    about what 8-bit rounding of x gives (max |x| / 254 per block), far below the weights' own
    4-bit error; and use_integer_products swaps every packed layer of a model."""
    blocks = random_blocks("Q4_1", 256, 1024, seed=11)
    weight = dequantize(blocks, "Q4_1").reshape(256, 1024)[16:]  # past the extreme scales
    layer = PackedLinear(blocks[16:].contiguous(), "Q4_1", 1024)  # 240 rows: whole tiles
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(3))
    exact = F.linear(x.double(), weight.double())
    with torch.no_grad():
        floats = layer(x)
        model = use_integer_products(torch.nn.Sequential(layer))
        assert type(model[0]) is IntegerPackedLinear and model[0].blocks is layer.blocks
        integers = model[0](x)
    error = float((integers.double() - exact).norm() / exact.norm())
    print(f"\nint8 activations ({int8_path()}): relative error {error:.2e}")
    assert float((floats.double() - exact).norm() / exact.norm()) < 1e-6
    assert 1e-4 < error < 1e-2
