"""accel.quantize: weight-only int8 / int4 blocks for any attnkit model, their accuracy cost, and
save / load through safetensors (no pickle)."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

import attnkit as ak
from attnkit import accel
from attnkit.accel.packed import PackedLinear, dequantize
from attnkit.accel.quantize import dequantize_model
from attnkit.serialization import packed_layout


def small(family: str = "lm"):
    torch.manual_seed(0)
    if family == "lm":  # GPT-2 style: biases, learned positions, a tied head
        cfg = ak.ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_layers=2, d_ff=128)
        return ak.DecoderLM(cfg).eval()
    cfg = ak.ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_layers=2, d_ff=128)
    return ak.EncoderClassifier(cfg, 3).eval()


@pytest.mark.parametrize("scheme, kind", [("int8", "Q8_0"), ("int4", "Q4_1"), ("Q4_0", "Q4_0")])
def test_quantize_rounds_weights_as_llama_cpp_does(scheme, kind):
    model = small()
    floats = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    biases = {n: m.bias for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    accel.quantize(model, scheme)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert set(packed) == set(floats)  # every linear layer, the head too
    assert model.cfg.extra["packed"] == {n: kind for n in floats}
    assert model.cfg.tie_embeddings is False  # the head has blocks of its own now
    for name, layer in packed.items():
        want = gguf.quants.quantize(floats[name].numpy(), getattr(Q, kind))
        assert np.array_equal(layer.blocks.numpy(), want)  # llama.cpp's rounding, bit for bit
        if biases[name] is not None:
            assert torch.equal(layer.bias, biases[name].detach())


def test_quantized_outputs_stay_close_and_int8_is_closer():
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = small()(ids)
        errors = {
            s: (accel.quantize(small(), s)(ids) - want).abs().max().item() for s in ("int8", "int4")
        }
    assert 0 < errors["int8"] < errors["int4"] < 0.5 * want.abs().max().item()
    assert errors["int8"] < 0.02 * want.abs().max().item()


@pytest.mark.parametrize("family", ["lm", "classifier"])
def test_a_quantized_model_saves_and_loads_exactly(tmp_path, family):
    model = accel.quantize(small(family), "int4")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # from_pretrained readies a packed model for decoding: so does this
        want = accel.prepare(model, "decoding").model(ids)
    model.save_pretrained(tmp_path / "q")
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:  # blocks as uint8
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("blocks")}
    assert dtypes == {"U8"}
    assert not list((tmp_path / "q").glob("*.bin")) and not list((tmp_path / "q").glob("*.pt"))
    loaded = ak.from_pretrained(tmp_path / "q")
    assert packed_layout(loaded) == packed_layout(model) != {}
    with torch.no_grad():
        assert torch.equal(loaded(ids), want)


def test_from_pretrained_dequantizes_a_quantized_directory_only_when_asked(tmp_path):
    # dequantize=None (the default) and False load the blocks as saved; True turns them into
    # float32 layers holding the blocks' values (what a GPU or training needs).
    model = accel.quantize(small(), "int4")
    model.save_pretrained(tmp_path / "q")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids)
    for choice in (None, False):
        kept = ak.from_pretrained(tmp_path / "q", dequantize=choice)
        assert packed_layout(kept) == packed_layout(model) != {}
    floats = ak.from_pretrained(tmp_path / "q", dequantize=True)
    assert not packed_layout(floats) and "packed" not in floats.cfg.extra
    assert not any(m.training for m in floats.modules())  # eval mode, the new layers too
    assert torch.equal(floats.lm_head.weight, model.lm_head.dequantized())
    with torch.no_grad():
        torch.testing.assert_close(floats(ids), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError, match="dequantize must be None, True or False, got 'yes'"):
        ak.from_pretrained(tmp_path / "q", dequantize="yes")


@pytest.mark.parametrize("family", ["lm", "classifier"])
def test_dequantize_model_gives_float_layers_that_compute_the_same_and_train(family):
    packed = accel.quantize(small(family), "int4")
    model = accel.quantize(small(family), "int4")
    assert dequantize_model(model) == len(packed_layout(packed)) > 0
    assert not packed_layout(model) and "packed" not in model.cfg.extra
    for name, module in packed.named_modules():
        if isinstance(module, PackedLinear):
            assert torch.equal(model.get_submodule(name).weight, module.dequantized()), name
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), packed(ids), atol=1e-4, rtol=1e-4)
    model.train()(ids).square().mean().backward()  # every weight is a parameter again
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert dequantize_model(model) == 0  # nothing packed left


def test_quantized_models_are_not_averaged(tmp_path):
    from attnkit.training.averaging import average_models

    cfg = small().cfg
    for seed in (0, 1):
        torch.manual_seed(seed)
        accel.quantize(ak.DecoderLM(cfg), "int4").save_pretrained(tmp_path / f"q{seed}")
    with pytest.raises(ValueError, match="blocks do not average: average the float32 models, th"):
        average_models([tmp_path / "q0", tmp_path / "q1"], tmp_path / "mean")


def test_bad_arguments_and_a_bad_layout_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"scheme must be one of .*got 'int3'"):
        accel.quantize(small(), "int3")
    with pytest.raises(ValueError, match=r"group_size must be 32 .*got 64"):
        accel.quantize(small(), "int8", group_size=64)
    with pytest.raises(ValueError, match=r"skip names no module of the model: \['lm_haed'\]"):
        accel.quantize(small(), "int8", skip=["lm_haed"])
    kept = accel.quantize(small(), "int8", skip=["lm_head"])
    assert not isinstance(kept.lm_head, PackedLinear)
    kept.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["config"]["extra"]["packed"]["lm_head"] = "Q3_K"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"names 'lm_head' as 'Q3_K'"):
        ak.from_pretrained(tmp_path / "m")


def test_the_quantize_command(tmp_path):
    model = small()
    model.save_pretrained(tmp_path / "float")
    # what the source says about its data and decoding goes with the copy (evaluate reads it)
    recipe = {"name": "r", "task": "lm", "data": {"corpus": "shakespeare"}}
    (tmp_path / "float" / "recipe.json").write_text(json.dumps(recipe))
    (tmp_path / "float" / "decoding.json").write_text('{"num_beams": 3}')
    run = [sys.executable, "-m", "attnkit.cli", "quantize", str(tmp_path / "float")]
    done = subprocess.run(
        [*run, str(tmp_path / "q4"), "--scheme", "int4"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "linear layers as int4" in done.stdout
    assert json.loads((tmp_path / "q4" / "recipe.json").read_text()) == recipe
    assert (tmp_path / "q4" / "decoding.json").read_text() == '{"num_beams": 3}'
    loaded = ak.from_pretrained(tmp_path / "q4")
    blocks = loaded.lm_head.blocks
    torch.testing.assert_close(
        dequantize(blocks, "Q4_1").reshape(96, 64), model.lm_head.weight.detach(), atol=0.1, rtol=0
    )
    again = subprocess.run([*run, str(tmp_path / "q4")], capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "already exists" in again.stderr
