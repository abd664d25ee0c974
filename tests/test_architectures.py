"""Qwen2, Qwen3, Phi-3 and Mistral from files the other side made (tests/data/architectures,
made by make.py there): small random models saved by transformers' own classes, converted to
GGUF by llama.cpp's convert_hf_to_gguf.py and quantized by llama.cpp itself.

Each is read from its Hugging Face directory (logits against transformers, over sequences longer
than Phi-3's and Mistral's windows), from its F32 and F16 GGUF files, and from its Q8_0 and
Q4_K_M files with the weights packed, on the default integer path and the C stack; and each is
exported back to both formats, read by transformers and compared with llama.cpp's own file."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

import attnkit as ak
from attnkit import accel
from attnkit.accel import PackedStack
from attnkit.accel.packed_step import why_not
from attnkit.interop import load_tokenizer_for
from attnkit.interop.architectures import ARCHITECTURES
from attnkit.serve.chat import chat_template_for, render_chat
from ties import greedy_ties, lm_logits_at

HERE = Path(__file__).parent / "data" / "architectures"
NAMES = ["qwen2", "qwen3", "phi3", "mistral", "llama3"]
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)  # fmt: skip
FEATURES = {  # what each fixture's config must come out as
    "qwen2": dict(qkv_bias=True, tie_embeddings=True, rope_theta=1e6, attention="full"),
    "qwen3": dict(qk_norm=True, head_dim=32, rope_theta=1e6, attention="full"),
    "phi3": dict(rotary_dim=12, attention="window", window=48),
    "mistral": dict(attention="window", window=32, head_dim=None),
    "llama3": dict(rope_scaling=LLAMA3, rope_theta=5e5, tie_embeddings=True),
}
HF_SOURCE = {"llama3": "llama"}  # the description each is read by, where not its own name
GGUF_SOURCE = {"mistral": "llama", "llama3": "llama"}


def _ids(n, rows=2, seed=0):
    return torch.randint(3, 512, (rows, n), generator=torch.Generator().manual_seed(seed))


def _hf(name):
    return HERE / name / "hf"


def _gguf(name, kind):
    return HERE / name / f"{name}-{kind}.gguf"


@pytest.mark.parametrize("name", NAMES)
def test_hugging_face_directories_compute_what_transformers_does(name):
    ours = ak.from_pretrained(_hf(name))
    for field, value in FEATURES[name].items():
        assert getattr(ours.cfg, field) == value, field
    assert ours.cfg.extra["source"] == HF_SOURCE.get(name, name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(_hf(name), dtype=torch.float32).eval()
    ids = _ids(70)  # longer than Phi-3's window (48) and Mistral's (32)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
        expected = ref.generate(ids[:, :8], max_new_tokens=40, do_sample=False,
                                eos_token_id=None, pad_token_id=0)  # fmt: skip
    ours.cfg.eos_id = None  # (eos_id=None means the config's)
    got = ours.generate(ids[:, :8], 40)  # cached: the windows' rings wrap
    assert greedy_ties(expected, got, lm_logits_at(ours, expected)) == 0


@pytest.mark.parametrize("name", NAMES)
def test_llama_cpps_gguf_files_hold_the_same_model(name):
    """F32 to float32 rounding, F16 to its own; Mistral's file has no window (llama.cpp's
    converter drops it), so the sequence stays inside it."""
    ours = ak.from_pretrained(_hf(name))
    ids = _ids(30)
    with torch.no_grad():
        want = ours(ids)
        scale = want.abs().max()
        for kind, bound in (("f32", 1e-5), ("f16", 5e-3)):
            read = ak.from_pretrained(_gguf(name, kind))
            assert read.cfg.extra["source"] == GGUF_SOURCE.get(name, name)
            error = (read(ids) - want).abs().max()
            assert error <= bound * scale, (kind, float(error), float(scale))
    tokenizer = load_tokenizer_for(_gguf(name, "f32"))
    text = "The animal didn't cross the street because it was too tired. 今天 下雨"
    assert tokenizer.encode(text) == load_tokenizer_for(_hf(name)).encode(text)


def _logit_error(a, b):
    return float((a - b).abs().max() / b.abs().max())


# the integer path's error against the same file's weights in float32, relative to the largest
# logit: its int8 activations (measured 1.2-2.3% on these fixtures, under every kernel variant)
INT8_ERROR = 0.06


@pytest.mark.variants
@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_files_decode_packed_in_c_on_the_integer_path(name, kind):
    """Q8_0 and Q4_K_M (with Q5_0, Q4_K and Q6_K tensors in it), packed: the default path of
    ``accel.prepare(model, "decoding")`` runs every layer in C on int8 activations; its logits
    against the same weights in float32, and its greedy tokens where the margins allow. The C
    stack's float path (``exact=True``: Qwen2's biases, Phi-3's partial RoPE, the windows' rings)
    equals the float32 model to rounding."""
    floats = ak.from_pretrained(_gguf(name, kind))
    exact = ak.from_pretrained(_gguf(name, kind), dequantize=False)
    exact = accel.prepare(exact, "decoding", exact=True).model
    assert type(exact.decoder) is PackedStack, why_not(exact)
    with torch.no_grad():
        assert _logit_error(exact(_ids(60)), floats(_ids(60))) <= 1e-5
    model = ak.from_pretrained(_gguf(name, kind), dequantize=False)
    assert model.cfg.extra["weights"]["float32"] == {}
    model = accel.prepare(model, "decoding").model
    assert type(model.decoder) is PackedStack, why_not(model)
    assert min(model.decoder.layers_in_c()[0].kind) >= 8  # every product in tiles
    ids = _ids(30)
    with torch.no_grad():
        error = _logit_error(model(ids), floats(ids))
    assert error <= INT8_ERROR, error
    prompt = ids[:, :6]
    floats.cfg.eos_id = model.cfg.eos_id = None  # never stop early
    want, got = floats.generate(prompt, 24), model.generate(prompt, 24)
    differ = (want != got).any(dim=1).nonzero().flatten().tolist()
    for b in differ:  # only where the float model's best two logits are within the error
        i = int((want[b] != got[b]).nonzero()[0])
        best, second = lm_logits_at(floats, want)(b, i).topk(2).values.tolist()
        assert best - second <= 2 * INT8_ERROR * abs(best), (b, i, best, second)


@pytest.mark.parametrize("name", NAMES)
def test_exports_are_read_by_transformers_and_equal_llama_cpps_files(name, tmp_path):
    """The Hugging Face export keeps the architecture and its logits (transformers reads it);
    the GGUF export holds what llama.cpp's converter wrote from the same directory: the same
    keys that attnkit reads, the same tensors with the same values."""
    ours = ak.from_pretrained(_hf(name))
    tokenizer = load_tokenizer_for(_hf(name))
    out = ak.export(ours, tmp_path / "hf", tokenizer=tokenizer)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ref.config.model_type == ARCHITECTURES[HF_SOURCE.get(name, name)].hf_types[0]
    ids = _ids(40)
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
    if name == "mistral":  # llama.cpp's llama graph has no window: the window-less file exports
        with pytest.raises(ValueError, match="cannot export attention='window' to Mistral"):
            ak.export(ours, tmp_path / "refused", format="gguf", tokenizer=tokenizer)
        assert not (tmp_path / "refused").exists()
        ours = ak.from_pretrained(_gguf(name, "f32"))
    path = ak.export(ours, tmp_path / "gguf", format="gguf", tokenizer=tokenizer,
                     chat_template=chat_template_for(_hf(name)))  # fmt: skip
    mine, theirs = gguf.GGUFReader(path), gguf.GGUFReader(_gguf(name, "f32"))
    arch = theirs.fields["general.architecture"].contents()
    assert mine.fields["general.architecture"].contents() == arch
    assert mine.fields["general.name"].contents() == "gguf"  # the export's name, not its temp
    kept = [k for k in theirs.fields if k.startswith((f"{arch}.", "tokenizer."))]
    for key in kept:
        if key not in (f"{arch}.rope.scaling.original_context_length", "tokenizer.ggml.pre"):
            assert mine.fields[key].contents() == theirs.fields[key].contents(), key
    tensors = {t.name: t for t in theirs.tensors}
    assert {t.name for t in mine.tensors} == set(tensors)
    for t in mine.tensors:
        assert t.tensor_type == tensors[t.name].tensor_type, t.name
        assert np.array_equal(t.data, tensors[t.name].data), t.name
    read = ak.from_pretrained(path)
    assert read.cfg.norm_eps == pytest.approx(ours.cfg.norm_eps)  # float32 in the file
    same = {"extra": {}, "norm_eps": 0, "rope_scaling": 0}  # Llama 3's: rope_freqs in GGUF
    assert read.cfg.to_dict() | same == ours.cfg.to_dict() | same
    with torch.no_grad():
        torch.testing.assert_close(read(ids), ours(ids), atol=1e-4, rtol=1e-4)


def test_qwen3s_template_renders_its_think_turns_as_transformers_does():
    """Qwen3's own template (the fixture's, from llama.cpp's models/templates): an earlier
    answer's reasoning is dropped from the history, the last kept, and enable_thinking=False
    opens an empty think block."""
    template = chat_template_for(_gguf("qwen3", "q8_0"))
    assert template == chat_template_for(_hf("qwen3"))
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "今天 下雨 吗?"},
        {"role": "assistant", "content": "<think>\nThe user asks.\n</think>\n\n是的。"},
        {"role": "user", "content": "我 没 带 伞"},
    ]
    tokenizer = transformers.AutoTokenizer.from_pretrained(_hf("qwen3"))
    for variables in ({}, {"enable_thinking": False}):
        want = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **variables
        )
        assert render_chat(template, messages, **variables) == want
    assert "The user asks" not in want and want.endswith("<think>\n\n</think>\n\n")


def test_phi3s_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does():
    """llama.cpp's own test of Phi-3's vocabulary (its models/ggml-vocab-phi-3.gguf with the
    texts and the token ids llama.cpp gives them, copied into tests/data/architectures/vocab):
    the tokenizer attnkit rebuilds from the file's metadata gives the same ids for every text,
    leading spaces (SentencePiece's dummy prefix) and byte fallback among them."""
    vocab = HERE / "vocab" / "ggml-vocab-phi-3.gguf"
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    tokenizer = load_tokenizer_for(vocab)
    assert len(texts) == 47
    for text, ids in zip(texts, expected, strict=False):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()]


def _copy(src: Path, dst: Path, **changes) -> Path:
    """A copy of a Hugging Face directory with ``config.json``'s keys changed."""
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def _gguf_copy(src: Path, dst: Path, keys=(), rows=None) -> Path:
    """A copy of an F32 GGUF file with metadata ``keys`` added ((name, value, type) each) and
    ``rows = (tensor, n)`` keeping the first n rows of one tensor."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(name, field.contents())
            else:
                writer.add_key_value(name, field.contents(), kind)
    for name, value, kind in keys:
        writer.add_key_value(name, value, kind)
    for t in reader.tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, data[: rows[1]] if rows and rows[0] == t.name else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_what_attnkit_cannot_read_is_refused_in_one_line(tmp_path):
    """An architecture it does not know (naming the ones it does), a RoPE scaling it does not
    implement (YaRN; Phi-3.5's and Phi-4-mini's LongRoPE), a fused tensor of the wrong size:
    one line each, in both formats."""
    string = gguf.GGUFValueType.STRING
    cases = [
        (_copy(_hf("qwen2"), tmp_path / "falcon", model_type="falcon"),
         r"model type 'falcon' is not supported; attnkit reads Hugging Face directories of "
         r"\['bert', 'gemma3_text', 'gpt2', 'llama', 'marian', 'mistral', 'phi3', 'qwen2',"),
        (_copy(_hf("phi3"), tmp_path / "longrope", rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "long_factor": [1.0] * 6, "short_factor": [1.0] * 6}),
         r"rope_type='longrope': this RoPE scaling is not implemented in attnkit \(it "
         r"implements \['linear', 'llama3'\]; docs/MODELS.md\)"),
        (_gguf_copy(_gguf("qwen2", "f32"), tmp_path / "yarn.gguf",
                    keys=[("qwen2.rope.scaling.type", "yarn", string)]),
         r"qwen2.rope.scaling.type='yarn': this RoPE scaling is not implemented"),
        (_gguf_copy(_gguf("phi3", "f32"), tmp_path / "qkv.gguf", rows=("blk.1.attn_qkv.weight",
                                                                        96)),
         r"the tensor 'blk.1.attn_qkv.weight' has shape \(96, 64\), expected \(128, 64\)"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            ak.from_pretrained(path)
        assert "\n" not in str(error.value)
    state = dict(transformers.AutoModelForCausalLM.from_pretrained(_hf("phi3")).state_dict())
    state["model.layers.0.mlp.gate_up_proj.weight"] = torch.zeros(500, 64)
    with pytest.raises(ValueError, match=r"gate_up_proj.weight' has shape \(500, 64\), expected "
                       r"\(512, 64\)") as error:  # fmt: skip
        ak.interop.from_hf(transformers.AutoConfig.from_pretrained(_hf("phi3")).to_dict(), state)
    assert "\n" not in str(error.value)
