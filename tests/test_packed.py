"""Weights kept in llama.cpp's blocks (Q8_0, Q4_0, Q4_1): the packed kernel against the float32
product of the dequantized weights (gguf.quants' values), GGUF files read both ways, and the
real SmolLM2 file."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

import attnkit as ak
from attnkit.accel import native, packed
from attnkit.accel.packed import (
    BLOCK_BYTES,
    MAX_ROWS,
    PackedEmbedding,
    PackedLinear,
    dequantize,
)
from attnkit.interop.gguf import read_gguf

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
K_QUANTS = {"Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}  # GGUF super-blocks of 256 weights


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random blocks whose scales (and Q4_1 minimums) are finite float16 values, the extremes
    among them: the largest (65504, either sign), the smallest subnormal, zero. For Q4_K,
    random GGUF super-blocks repacked as PackedLinear keeps them."""
    if kind in K_QUANTS:
        repack = {"Q4_K": packed.repack_q4_k, "Q5_K": packed.repack_q5_k}
        return repack.get(kind, packed.repack_q6_k)(k_quant_file_blocks(kind, rows, cols, seed))
    rng = np.random.default_rng(seed)
    n_bytes = BLOCK_BYTES[kind]
    blocks = rng.integers(0, 256, (rows * cols // 32, n_bytes), dtype=np.uint8)
    scales = rng.normal(0, 0.05, len(blocks)).astype(np.float16)
    scales[:5] = [65504.0, -65504.0, 6e-8, 0.0, -1.0]
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    if kind == "Q4_1":
        minimums = rng.normal(0, 0.05, len(blocks)).astype(np.float16)
        minimums[-3:] = [65504.0, 6e-8, 0.0]
        blocks[:, 2:4] = minimums.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def k_quant_file_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random rows of a K-quant as a GGUF file stores them (Q4_K 144, Q5_K 176, Q6_K 210 bytes
    per 256 weights), with float16 factors that include the extremes: d and dmin at bytes 0
    and 2 (Q4_K, Q5_K), d at the end (Q6_K)."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[K_QUANTS[kind]][1]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for offset in (0, 2) if kind != "Q6_K" else (size - 2,):
        factors = rng.normal(0, 0.01, len(blocks)).astype(np.float16)
        factors[: min(4, len(blocks))] = [65504.0, 6e-8, 0.0, -1.0][: min(4, len(blocks))]
        blocks[:, offset : offset + 2] = factors.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_quants_bit_for_bit(kind):
    blocks = random_blocks(kind, 8, 256)
    if kind in K_QUANTS:  # the repacked blocks give what gguf makes of the file's super-blocks
        file_blocks = k_quant_file_blocks(kind, 8, 256)
        want = gguf.quants.dequantize(file_blocks.numpy(), K_QUANTS[kind]).ravel()
    else:
        want = gguf.quants.dequantize(blocks.numpy(), getattr(Q, kind)).ravel()
    assert np.array_equal(dequantize(blocks, kind).numpy(), want, equal_nan=True)


def test_q5_0_becomes_q8_0_bit_for_bit():
    """Gemma 3's Q4_K_M file keeps most products in Q5_0: read as Q8_0 blocks (q - 16 fits an
    int8), they dequantize to gguf.quants' Q5_0 values exactly."""
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (8 * 512 // 32, 22), dtype=np.uint8)
    scales = rng.normal(0, 0.05, len(blocks)).astype(np.float16)
    scales[:4] = [65504.0, -65504.0, 6e-8, 0.0]
    blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    file_rows = torch.from_numpy(blocks.reshape(8, -1))
    want = gguf.quants.dequantize(file_rows.numpy(), Q.Q5_0).ravel()
    got = dequantize(packed.repack_q5_0(file_rows), "Q8_0").numpy()
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS + 5])
def test_packed_products_equal_the_float32_product(kind, rows):
    """Any number of rows (more than MAX_ROWS take several kernel calls) give the dequantized
    product, to float32 accumulation-order error; each row the bits it gets alone."""
    assert native.library() is not None  # make test builds the kernels at install
    cols = 512 if kind in K_QUANTS else 320  # a K-quant row is whole super-blocks of 256
    blocks = random_blocks(kind, 96, cols, seed=rows)
    layer = PackedLinear(blocks, kind, cols)
    weight = dequantize(blocks, kind).reshape(96, cols)  # gguf.quants' values (tested above)
    assert torch.equal(packed._dequantized(blocks, kind, cols), weight)  # the kernel's, too
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = layer(x)
    want = F.linear(x.double(), weight.double())
    scale = x.abs().double() @ weight.abs().double().T  # the size of the terms summed
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert bool(((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all())
    with torch.no_grad():
        assert torch.equal(layer(x[-1:]), got[-1:])


@pytest.mark.parametrize("variant", [v for v in native.VARIANTS if native.runnable(v)])
def test_every_variant_this_cpu_runs_agrees_with_the_dequantized_product(variant):
    """Every variant built at install that this CPU can run (plain C on any), checked like the
    one in use."""
    kernel = native.load(variant)
    for kind in KINDS:
        blocks = random_blocks(kind, 40, 512, seed=3)
        weight = dequantize(blocks, kind).reshape(40, 512)
        out = torch.empty(40, 512)
        code = packed.KIND_CODES[kind]
        assert kernel.packed_dequantize(code, blocks.data_ptr(), out.data_ptr(), 40, 512, 2) == 0
        assert torch.equal(out, weight)
        for rows in (1, 5):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 40)
            pointers = (blocks.data_ptr(), x.data_ptr(), y.data_ptr())
            assert kernel.packed_matmul(code, *pointers, rows, 40, 512, 2) == 0
            want = x.double() @ weight.double().T
            scale = x.abs().double() @ weight.abs().double().T
            assert bool(((y.double() - want).abs() <= 1e-5 * scale + 1e-30).all()), (kind, rows)


def test_rows_are_computed_alone():
    """A row's result does not depend on the other rows in the call (batched decoding gives
    the same tokens as decoding alone)."""
    layer = PackedLinear(random_blocks("Q4_1", 64, 128), "Q4_1", 128)
    x = torch.randn(5, 128)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(5)])
    assert torch.equal(together, alone)


def test_gradients_and_no_compiler_fall_back_to_float32(monkeypatch):
    layer = PackedLinear(random_blocks("Q8_0", 16, 64), "Q8_0", 64)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantized().sum(0).expand(2, 64))
    with torch.no_grad():
        fast = layer(x)
    monkeypatch.setattr(packed.native, "library", lambda: None)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), fast, rtol=1e-5, atol=1e-5)


def test_the_kernel_is_an_operator_that_torch_compile_keeps():
    """torch.ops.attnkit.packed_linear: its schema, fake (meta) implementation and dynamic
    shapes pass torch's own operator checks, and it equals the eager path."""
    blocks = random_blocks("Q4_1", 48, 64)
    x = torch.randn(3, 64)
    torch.library.opcheck(packed.register_operator(), (x, blocks, 2, 48))
    with torch.no_grad():
        layer = PackedLinear(blocks, "Q4_1", 64)
        assert torch.equal(torch.ops.attnkit.packed_linear(x, blocks, 2, 48), layer(x))


def test_packed_table_and_chunked_products_equal_the_float32_ones(monkeypatch):
    """A PackedEmbedding lookup gives the dequantized rows; a long input's product through
    F.linear, dequantized a few output features at a time, equals the whole product."""
    blocks = random_blocks("Q4_1", 40, 64)
    table = PackedEmbedding(blocks, "Q4_1", 64)
    ids = torch.tensor([[3, 0, 39], [3, 7, 7]])
    assert torch.equal(table(ids), dequantize(blocks, "Q4_1").reshape(40, 64)[ids])
    layer = PackedLinear(blocks, "Q4_1", 64)
    x = torch.randn(MAX_ROWS + 4, 64)
    with torch.no_grad():
        whole = layer._dequantized_product(x)
        monkeypatch.setattr(packed, "DEQUANTIZED_ROWS", 16)  # 40 features: 16 + 16 + 8
        torch.testing.assert_close(layer._dequantized_product(x), whole, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="a row of 64 Q8_0 weights takes 68 bytes"):
        PackedEmbedding(blocks, "Q8_0", 64)


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        PackedLinear(torch.zeros(2, 34, dtype=torch.uint8), "Q3_K", 32)
    with pytest.raises(ValueError, match=r"a row of 64 Q8_0 weights takes 68 bytes, got 34"):
        PackedLinear(torch.zeros(2, 34, dtype=torch.uint8), "Q8_0", 64)
    with pytest.raises(ValueError, match="uint8"):
        PackedLinear(torch.zeros(2, 34), "Q8_0", 32)


def _float_path(model):
    """A model that from_pretrained readied for decoding, its products put back on the float32
    path (the explicit form): the path whose products equal the dequantized weights'."""
    return ak.accel.prepare(model, "decoding", exact=True).model


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=str)
def test_a_gguf_file_runs_packed_and_dequantized_alike(tmp_path, qtype):
    from test_interop_gguf import _hf_llama, write_gguf

    write_gguf(tmp_path / "m.gguf", _hf_llama(d_model=64, d_ff=96, vocab=101), qtype)
    floats = ak.from_pretrained(tmp_path / "m.gguf")
    packs = _float_path(ak.from_pretrained(tmp_path / "m.gguf", dequantize=False))
    layers = [m for m in packs.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 2 * 5 + 1  # in_proj, out_proj, gate, up, down per layer; the head
    assert isinstance(packs.embeddings.tokens, PackedEmbedding)  # the token table too
    assert packs.cfg.extra["weights"]["packed"] == {qtype.name: 12}
    # the table and the head read the file's own blocks (no copy); in_proj is a copy
    files = {t.name: t.data.ctypes.data for t in read_gguf(tmp_path / "m.gguf").tensors}
    assert packs.embeddings.tokens.blocks.data_ptr() == files["token_embd.weight"]
    assert packs.lm_head.blocks.data_ptr() == files["output.weight"]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(packs(ids), floats(ids), rtol=1e-4, atol=1e-4)
    want = floats.generate(ids, 12, do_sample=False)
    assert torch.equal(packs.generate(ids, 12, do_sample=False), want)
    packs.save_pretrained(tmp_path / "saved")  # the blocks as they are, table and all
    again = _float_path(ak.from_pretrained(tmp_path / "saved"))
    assert isinstance(again.embeddings.tokens, PackedEmbedding)
    with torch.no_grad():
        assert torch.equal(again(ids), packs(ids))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=str)
def test_a_k_quant_file_runs_packed_and_dequantized_alike(tmp_path, qtype):
    """Q4_K (the K-quant of most published GGUF files) and Q5_K are repacked at load, 32-weight
    groups with float32 scales, and give the dequantized model's logits and tokens."""
    from test_interop_gguf import _hf_llama, write_gguf

    write_gguf(tmp_path / "k.gguf", _hf_llama(d_model=256, d_ff=256, vocab=101), qtype)
    floats = ak.from_pretrained(tmp_path / "k.gguf")
    packs = _float_path(ak.from_pretrained(tmp_path / "k.gguf", dequantize=False))
    assert packs.cfg.extra["weights"] == {"packed": {qtype.name: 12}, "float32": {}}
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        want = floats(ids)
        difference = (packs(ids) - want).abs().max().item()
    assert difference <= 1e-5 * want.abs().max().item()
    assert torch.equal(
        packs.generate(ids, 12, do_sample=False), floats.generate(ids, 12, do_sample=False)
    )


@pytest.mark.needs("smollm2")
def test_smollm2_packed_decodes_the_same_tokens():
    from attnkit.interop import load_tokenizer_for

    floats = ak.from_pretrained("smollm2")
    packs = _float_path(ak.from_pretrained("smollm2", dequantize=False))
    # 150 Q4_1 linear layers; the Q8_0 table, looked up and (tied) the output layer
    assert packs.cfg.extra["weights"] == {"packed": {"Q4_1": 150, "Q8_0": 2}, "float32": {}}
    tokenizer = load_tokenizer_for("smollm2")
    for prompt in ("The capital of France is", "今天 下雨 我 没 带 伞"):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            difference = (packs(ids) - floats(ids)).abs().max()
        assert difference < 1e-3
        out = packs.generate(ids, 24, do_sample=False)
        assert torch.equal(out, floats.generate(ids, 24, do_sample=False))


def test_the_table_of_quantization_types_is_ggufs_and_the_kernels_own():
    """QUANT_TYPES against gguf's ids and block sizes, and against packed.h, where the C code
    defines its kinds and their bytes: each kernel kind's bytes per 32 weights, and each
    repacking giving rows of that size."""
    from attnkit.accel.block_formats import QUANT_TYPES

    kinds = native.kinds()
    assert set(BLOCK_BYTES) == {k.removesuffix("_BYTES") for k in kinds if k.endswith("_BYTES")}
    for name, t in QUANT_TYPES.items():
        qtype = Q[name]
        assert (qtype.value, *gguf.GGML_QUANT_SIZES[qtype]) == (t.ggml, t.block, t.bytes), name
        if t.kept is not None:
            assert kinds[f"{name}_BYTES"] == t.kept == BLOCK_BYTES[name]
            assert name in packed.KIND_CODES and kinds[name] == packed.KIND_CODES[name]
        if t.kernel is not None:  # a row of 256 weights, as the kernel will read it
            rows = torch.zeros(1, t.bytes * 256 // t.block, dtype=torch.uint8)
            kept = t.repack(rows) if t.repack else rows
            assert kept.shape == (1, 256 // 32 * BLOCK_BYTES[t.kernel]), name
        if t.written and t.block > 1:  # gguf.quants writes it
            assert gguf.quants.quantize(np.ones((1, 256), np.float32), qtype).shape[1] == (
                t.bytes * 256 // t.block
            )
