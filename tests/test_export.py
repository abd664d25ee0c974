"""attnkit.export, proven by the readers on the other side.

Every family is exported from a small random model and from a short training run, then loaded
by ``transformers`` (with no weight missing or unused): the same logits (1e-4), the same greedy
and beam outputs, the same tokenizer ids on the notes' sentences. GGUF files are read back by
the ``gguf`` package (every key and tensor), by transformers' GGUF loader and by attnkit's own
packed loader.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import attnkit as ak
from attnkit.data import BPETokenizer, CharTokenizer
from attnkit.interop.pretrained import load_tokenizer_for
from attnkit.serve.chat import chat_template_for
from ties import greedy_ties

NOTES = [
    "The animal didn't cross the street because it was too tired.",
    "今天 下雨 我 没 带 伞",
    "我 用 毒 毒 毒 蛇",
]
CORPUS = [
    *NOTES,
    "ROMEO. But soft, what light through yonder window breaks?",
    "It is the east, and Juliet is the sun.",
    "今天下雨，我没带伞。我用毒蛇。",
    "The street was wide and the animal was tired.",
]


def _tokenizers():
    return {
        "char": CharTokenizer.train(CORPUS),
        "bpe": BPETokenizer.train(CORPUS * 4, vocab_size=300, min_frequency=1),
    }


TOKENIZERS = _tokenizers()
LM_SHAPES = {
    "gpt2": dict(position="learned", norm_type="layernorm", activation="gelu"),
    "llama": dict(
        position="rope", norm_type="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2,
        tie_embeddings=False,
    ),
}  # fmt: skip


def _cfg(tokenizer, **overrides):
    base = dict(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                max_len=64, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)  # fmt: skip
    return ak.ModelConfig.preset("tiny", **{**base, **overrides})


def _randomize(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.05)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return model.eval()


def _batch(tokenizer, texts, prefix=(), suffix=()):
    rows = [[*prefix, *tokenizer.encode(t), *suffix][:62] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
    return ids, mask


def _trained(model, tokenizer, steps=40):
    """A short training run on the corpus: the weights of a model that learned something."""
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        if isinstance(model, ak.Transformer):
            src, src_mask = _batch(tokenizer, CORPUS, suffix=[tokenizer.eos_id])
            tgt, tgt_mask = _batch(tokenizer, CORPUS[::-1], suffix=[tokenizer.eos_id])
            inputs = ak.shift_right(tgt, tokenizer.bos_id)
            loss = model.loss(src, inputs, tgt.masked_fill(~tgt_mask, -100), src_mask)
        elif isinstance(model, ak.EncoderClassifier):
            ids, mask = _batch(tokenizer, CORPUS, prefix=[tokenizer.cls_id])
            labels = torch.tensor([len(t) % 2 for t in CORPUS])
            loss = torch.nn.functional.cross_entropy(model(ids, mask), labels)
        else:
            ids, mask = _batch(tokenizer, CORPUS)
            loss = model.loss(ids[:, :-1], ids[:, 1:].masked_fill(~mask[:, 1:], -100), mask[:, :-1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _model(family, shape, kind, tokenizer, **extra):
    if family == "lm":
        model = ak.DecoderLM(_cfg(tokenizer, **LM_SHAPES[shape], **extra))
    elif family == "translation":
        cfg = _cfg(tokenizer, norm="post", position="sinusoidal", activation="relu",
                   scale_embeddings=True)  # fmt: skip
        model = ak.Transformer(cfg)
    else:
        post = shape == "bert"
        cfg = _cfg(tokenizer, norm="post" if post else "pre", embedding_norm=post, pooler=post)
        model = ak.EncoderClassifier(cfg, 2, labels=["negative", "positive"])
    return _trained(model, tokenizer) if kind == "trained" else _randomize(model)


def _load(path, cls):
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("shape,tok", [("gpt2", "char"), ("llama", "bpe")])
def test_language_models_run_in_transformers(tmp_path, kind, shape, tok):
    tokenizer = TOKENIZERS[tok]
    ours = _model("lm", shape, kind, tokenizer)
    ak.export(ours, tmp_path / "out", format="hf", tokenizer=tokenizer)
    theirs = _load(tmp_path / "out", transformers.AutoModelForCausalLM)
    assert theirs.config.model_type == shape
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in NOTES:
        assert hf_tokenizer(text).input_ids == tokenizer.encode(text)
    ids, mask = _batch(tokenizer, NOTES)
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(ours(ids, mask)[mask], expected[mask], atol=1e-4, rtol=1e-4)
    prompt = torch.tensor([tokenizer.encode("The animal")])
    options = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=16)
    with torch.no_grad():
        greedy = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        mine = ours.generate(prompt, 16, eos_id=None)
        assert (
            greedy_ties(greedy, mine, lambda b, i: theirs(greedy[b : b + 1, :i]).logits[0, -1]) == 0
        )
        beams = theirs.generate(prompt, num_beams=3, length_penalty=0.0, **options)
    assert torch.equal(
        beams, ours.generate(prompt, 16, num_beams=3, length_penalty=0.0, eos_id=None)
    )


@pytest.mark.parametrize("kind", ["random", "trained"])
def test_the_translator_runs_in_transformers_as_marian(tmp_path, kind):
    tokenizer = TOKENIZERS["bpe"]
    ours = _model("translation", None, kind, tokenizer)
    ak.export(ours, tmp_path / "out", format="hf", tokenizer=tokenizer)
    theirs = _load(tmp_path / "out", transformers.AutoModelForSeq2SeqLM)
    assert type(theirs).__name__ == "MarianMTModel"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in NOTES:  # a source ends with <eos>, as the recipes encode it
        assert hf_tokenizer(text).input_ids == tokenizer.encode(text, add_eos=True)
    src, src_mask = _batch(tokenizer, NOTES, suffix=[tokenizer.eos_id])
    tgt = ak.shift_right(_batch(tokenizer, NOTES[::-1])[0], tokenizer.bos_id)
    back = ak.from_pretrained(tmp_path / "out")  # attnkit reads the layout it writes
    with torch.no_grad():
        expected = theirs(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt)
        torch.testing.assert_close(ours(src, tgt, src_mask), expected.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(back(src, tgt, src_mask), expected.logits, atol=1e-4, rtol=1e-4)
        for beams in (1, 3):
            got = theirs.generate(src, attention_mask=src_mask.long(), num_beams=beams,
                                  max_new_tokens=12, do_sample=False)  # fmt: skip
            mine = ours.generate(src, 12, src_mask=src_mask, num_beams=beams)
            width = max(got.shape[1], mine.shape[1])
            pad = tokenizer.pad_id
            assert torch.equal(
                torch.nn.functional.pad(got, (0, width - got.shape[1]), value=pad),
                torch.nn.functional.pad(mine, (0, width - mine.shape[1]), value=pad),
            )


@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("shape", ["bert", "xlm-roberta-xl"])
def test_classifiers_run_in_a_transformers_pipeline(tmp_path, kind, shape):
    tokenizer = TOKENIZERS["char"]
    ours = _model("classification", shape, kind, tokenizer)
    ak.export(ours, tmp_path / "out", format="hf", tokenizer=tokenizer)
    theirs = _load(tmp_path / "out", transformers.AutoModelForSequenceClassification)
    assert theirs.config.model_type == shape
    assert theirs.config.id2label == {0: "negative", 1: "positive"}
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in NOTES:  # [CLS] in front, as the classification recipes encode it
        assert hf_tokenizer(text).input_ids == [tokenizer.cls_id, *tokenizer.encode(text)]
    ids, mask = _batch(tokenizer, NOTES, prefix=[tokenizer.cls_id])
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask.long()).logits
        torch.testing.assert_close(ours(ids, mask), expected, atol=1e-4, rtol=1e-4)
    back = ak.from_pretrained(tmp_path / "out")  # attnkit reads the layout it writes
    assert type(back) is ak.EncoderClassifier and back.labels == ours.labels
    with torch.no_grad():
        torch.testing.assert_close(back(ids, mask), expected, atol=1e-4, rtol=1e-4)
    classify = transformers.pipeline("text-classification", model=str(tmp_path / "out"))
    for text, row in zip(NOTES, ours(ids, mask).softmax(-1).tolist(), strict=True):
        answer = classify(text)[0]
        assert answer["label"] == ours.labels[max(range(2), key=row.__getitem__)]
        assert answer["score"] == pytest.approx(max(row), abs=1e-4)


def test_the_shipped_minilm_exports_as_bert(tmp_path):
    ak.export(
        ak.from_pretrained("minilm"), tmp_path / "out", tokenizer=load_tokenizer_for("minilm")
    )
    theirs = _load(tmp_path / "out", transformers.AutoModel)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours, tokenizer = ak.from_pretrained("minilm"), load_tokenizer_for("minilm")
    for text in NOTES:
        ids = tokenizer.encode(text)
        assert hf_tokenizer(text).input_ids == ids
        with torch.no_grad():
            hidden = theirs(torch.tensor([ids])).last_hidden_state
            torch.testing.assert_close(ours(torch.tensor([ids])), hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_shipped_decoders_export_to_both_formats_and_read_back(tmp_path, name):
    """The shipped SmolLM2 (llama) and Gemma 3 files, dequantized, out as a Hugging Face
    directory in bfloat16 (transformers reads it: the logits to bfloat16's rounding) and as a
    Q8_0 GGUF file (read back by gguf's reader and by attnkit: the logits to Q8_0's); the
    tokenizer and the chat template go along."""
    ours, tokenizer = ak.from_pretrained(name), load_tokenizer_for(name)
    template = chat_template_for(name)
    ids = torch.tensor([tokenizer.encode(NOTES[0])])
    with torch.no_grad():
        want = ours(ids)
    scale = want.abs().max()
    out = ak.export(ours, tmp_path / "hf", dtype="bf16", tokenizer=tokenizer,
                    chat_template=template)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == {"smollm2": "llama", "gemma3": "gemma3_text"}[name]
    assert config["torch_dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert transformers.AutoTokenizer.from_pretrained(out)(NOTES[0]).input_ids == ids[0].tolist()
    with torch.no_grad():
        assert (theirs(ids).logits - want).abs().max() <= 0.05 * scale
    path = ak.export(ours, tmp_path / "gguf", format="gguf", quant="q8_0", tokenizer=tokenizer,
                     chat_template=template)  # fmt: skip
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == ours.cfg.extra["source"]
    assert fields["general.name"].contents() == "gguf"
    assert fields["tokenizer.chat_template"].contents() == template
    read = ak.from_pretrained(path)
    assert read.cfg.to_dict() | {"extra": {}, "norm_eps": 0} == ours.cfg.to_dict() | {
        "extra": {}, "norm_eps": 0}  # fmt: skip
    with torch.no_grad():
        assert (read(ids) - want).abs().max() <= 0.05 * scale
    assert load_tokenizer_for(path).encode(NOTES[0]) == ids[0].tolist()


# (quantization, tolerance of the file's logits against the model's, relative to their scale)
GGUF_TYPES = [("f32", None, 1e-5), ("f16", None, 5e-3), ("bf16", None, 3e-2),
              ("f32", "q8_0", 2e-2), ("f32", "q4_0", 2e-1), ("f32", "q4_1", 2e-1)]  # fmt: skip


@pytest.mark.parametrize("dtype,quant,tolerance", GGUF_TYPES)
@pytest.mark.parametrize("shape,tok", [("gpt2", "char"), ("llama", "bpe")])
def test_gguf_files_read_back_by_gguf_transformers_and_attnkit(
    tmp_path, dtype, quant, tolerance, shape, tok
):
    tokenizer = TOKENIZERS[tok]
    # llama.cpp's gpt2 graph has the tanh GELU: the GPT-2-shaped model is trained with it
    extra = {"gelu_approximation": "tanh"} if shape == "gpt2" else {}
    ours = _model("lm", shape, "trained", tokenizer, **extra)
    path = ak.export(ours, tmp_path / "out", format="gguf", dtype=dtype, quant=quant,
                     tokenizer=tokenizer, chat_template="{{ messages }}")  # fmt: skip
    assert path == tmp_path / "out" / f"model-{quant or dtype}.gguf"
    assert (tmp_path / "out" / "README.md").read_text().startswith("# ")
    _check_with_gguf_reader(path, ours, tokenizer, shape, dtype, quant)
    read = ak.from_pretrained(path)
    ids, mask = _batch(tokenizer, NOTES)
    with torch.no_grad():
        scale = ours(ids, mask)[mask].abs().max()
        error = (read(ids, mask)[mask] - ours(ids, mask)[mask]).abs().max()
    assert error <= tolerance * scale, (float(error), float(scale))
    name = path.name
    # transformers' GGUF reader of gpt2 takes neither context_length nor feed_forward_length
    extra = dict(n_positions=ours.cfg.max_len, n_inner=ours.cfg.d_ff) if shape == "gpt2" else {}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=name, **extra)
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask.long()).logits[mask]
        torch.testing.assert_close(read(ids, mask)[mask], expected, atol=1e-4, rtol=1e-4)
    assert load_tokenizer_for(path).encode(NOTES[0], add_special_tokens=False) == (
        tokenizer.encode(NOTES[0])
    )
    packed = ak.from_pretrained(path, dequantize=False)
    prompt = torch.tensor([tokenizer.encode("The animal")])
    assert torch.equal(
        packed.generate(prompt, 24, eos_id=None), read.generate(prompt, 24, eos_id=None)
    )
    if quant is None and dtype == "f32":
        assert torch.equal(
            read.generate(prompt, 24, eos_id=None), ours.generate(prompt, 24, eos_id=None)
        )


# llama.cpp's tensor names for the Hugging Face ones, as its converter's TensorNameMap has them
GGUF_NAMES = {
    "gpt2": {"transformer.wte": "token_embd", "transformer.wpe": "position_embd",
             "transformer.ln_f": "output_norm", "ln_1": "attn_norm", "attn.c_attn": "attn_qkv",
             "attn.c_proj": "attn_output", "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up",
             "mlp.c_proj": "ffn_down"},
    "llama": {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
              "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
}  # fmt: skip


def _gguf_tensors(model, arch):
    """What llama.cpp's converter would write for ``model``, from its Hugging Face state dict
    (which transformers checks above): GGUF names, GPT-2's Conv1D weights transposed back,
    Llama's q / k rows in llama.cpp's order (the converter's own permute)."""
    from test_interop_gguf import llama_cpp_permute

    cfg, (_, state) = model.cfg, ak.interop.to_hf(model)
    found = {}
    for name, tensor in state.items():
        stem, part = name.rsplit(".", 1)
        array = tensor.numpy()
        if name == "lm_head.weight":
            if not cfg.tie_embeddings:
                found["output.weight"] = array
            continue
        layer = re.fullmatch(r"(?:transformer\.h|model\.layers)\.(\d+)\.(.*)", stem)
        if layer is None:
            found[f"{GGUF_NAMES[arch][stem]}.{part}"] = array
            continue
        i, inner = layer.groups()
        if arch == "gpt2" and part == "weight" and inner.endswith(("c_attn", "c_proj", "c_fc")):
            array = array.T
        if inner in ("self_attn.q_proj", "self_attn.k_proj"):
            array = llama_cpp_permute(array, cfg.n_heads, cfg.n_heads if "q_" in inner
                                      else cfg.kv_heads)  # fmt: skip
        found[f"blk.{i}.{GGUF_NAMES[arch][inner]}.{part}"] = array
    return found


def _stored(array, kind):
    """``array`` as a GGUF file stores it in type ``kind`` (the bytes)."""
    if kind == Q.F32:
        return array.astype(np.float32)
    if kind == Q.F16:
        return array.astype(np.float16)
    if kind == Q.BF16:
        return torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind)


def _check_with_gguf_reader(path, model, tokenizer, arch, dtype, quant):
    """Every key and every tensor, as gguf's own reader sees them: the keys' values, and each
    tensor's type and bytes against the model's weights stored by gguf.quants itself."""
    cfg = model.cfg
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tokens = [tokenizer.id_to_token(i) for i in range(cfg.vocab_size)]
    bpe = isinstance(tokenizer, BPETokenizer)
    types = [3] * 5 + [1] * (cfg.vocab_size - 5)  # the specials (0-4): control tokens
    if not bpe:
        types[tokenizer.unk_id] = 2  # SentencePiece's unknown
    expected = {
        "GGUF.version": 3, "GGUF.tensor_count": len(reader.tensors), "GGUF.kv_count": None,
        "general.architecture": arch, "general.name": "out",
        f"{arch}.context_length": cfg.max_len, f"{arch}.embedding_length": cfg.d_model,
        f"{arch}.feed_forward_length": cfg.d_ff, f"{arch}.block_count": cfg.n_layers,
        f"{arch}.attention.head_count": cfg.n_heads, f"{arch}.vocab_size": cfg.vocab_size,
        "tokenizer.ggml.model": "gpt2" if bpe else "llama",
        "tokenizer.ggml.tokens": tokens if bpe else [t.replace(" ", "▁") for t in tokens],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": tokenizer.bos_id,
        "tokenizer.ggml.eos_token_id": tokenizer.eos_id,
        "tokenizer.ggml.padding_token_id": tokenizer.pad_id,
        "tokenizer.ggml.unknown_token_id": tokenizer.unk_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": "{{ messages }}",
        "general.file_type": int(gguf.LlamaFileType[
            {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}.get(
                dtype if quant is None else "", f"MOSTLY_{(quant or '').upper()}")]),
    }  # fmt: skip
    if quant:
        expected["general.quantization_version"] = gguf.GGML_QUANT_VERSION
    if arch == "llama":
        expected.update({"llama.attention.head_count_kv": cfg.kv_heads,
                         "llama.attention.key_length": cfg.d_head,
                         "llama.attention.value_length": cfg.d_head,
                         "llama.rope.freq_base": cfg.rope_theta,
                         "llama.rope.dimension_count": cfg.d_head,
                         "llama.attention.layer_norm_rms_epsilon": pytest.approx(cfg.norm_eps),
                         "tokenizer.ggml.pre": "gpt-2"})  # fmt: skip
    else:
        expected["gpt2.attention.layer_norm_epsilon"] = pytest.approx(cfg.norm_eps)
    if bpe:
        merges = fields["tokenizer.ggml.merges"]
        assert len(merges) == cfg.vocab_size - BPETokenizer.MIN_VOCAB_SIZE
        expected["tokenizer.ggml.merges"] = merges  # (their own test: the tokenizer's read-back)
    else:
        expected.update({"tokenizer.ggml.scores": [0.0] * cfg.vocab_size,
                         "tokenizer.ggml.add_space_prefix": False})  # fmt: skip
    assert set(fields) == set(expected), set(fields) ^ set(expected)
    for key, value in expected.items():
        if value is not None:
            assert fields[key] == value, (key, fields.get(key), value)
    weights = _gguf_tensors(model, arch)
    assert {t.name for t in reader.tensors} == set(weights)
    for tensor in reader.tensors:
        name, array = tensor.name, weights[tensor.name]
        kind = Q.F32 if array.ndim == 1 else Q[dtype.upper()]
        if array.ndim == 2 and quant and name != "position_embd.weight":
            big = name in ("token_embd.weight", "output.weight")  # Q8_0 beside 4-bit blocks
            kind = Q.Q8_0 if big else Q[quant.upper()]
        assert tensor.tensor_type == kind, name
        assert np.asarray(tensor.data).tobytes() == _stored(array, kind).tobytes(), name


def test_refusals_are_one_line_and_write_nothing(tmp_path):
    tokenizer = TOKENIZERS["char"]
    lm = ak.DecoderLM(_cfg(tokenizer))
    out = tmp_path / "out"
    cases = [
        (lm, dict(format="onnx"), "format must be one of ['hf', 'gguf'], got 'onnx'"),
        (lm, dict(format="hf", quant="q8_0"), "quant='q8_0' needs format='gguf'"),
        (lm, dict(format="gguf", quant="q2_k"), "quant must be one of"),
        (lm, dict(dtype="f64"), "dtype must be one of"),
        (ak.DecoderLM(_cfg(tokenizer, position="alibi")), {}, "cannot export position='alibi'"),
        (ak.DecoderLM(_cfg(tokenizer, attention="window", window=8)), {},
         "cannot export attention='window' to GPT-2"),
        (ak.DecoderLM(_cfg(tokenizer, n_experts=4)), dict(format="gguf"),
         "cannot export n_experts=4 to GPT-2"),
        (ak.EncoderClassifier(_cfg(tokenizer), 2, pooling="mean"), {},
         "cannot export pooling='mean'"),
        (ak.Transformer(_cfg(tokenizer, norm="post", position="learned")), {},
         "cannot export position='learned' to Marian"),
        (ak.Transformer(_cfg(tokenizer, norm="post", position="sinusoidal")),
         dict(format="gguf"), "cannot export model='Transformer' to GGUF"),
    ]  # fmt: skip
    for model, options, message in cases:
        with pytest.raises((ValueError, TypeError)) as error:
            ak.export(model, out, tokenizer=tokenizer, **options)
        assert message in str(error.value) and "\n" not in str(error.value)
        assert not out.exists() and not list(tmp_path.iterdir())
    out.mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        ak.export(lm, out, tokenizer=tokenizer)


def test_the_command_exports_a_checkpoint_and_refuses_in_one_line(tmp_path):
    tokenizer = TOKENIZERS["char"]
    model = _model("lm", "gpt2", "random", tokenizer)
    model.save_pretrained(tmp_path / "ckpt", tokenizer=tokenizer)
    command = [sys.executable, "-m", "attnkit"]
    env = {**os.environ, "PYTHONPATH": str(Path(ak.__file__).parents[1])}

    def run(*args):
        return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, env=env)

    done = run(
        "export", tmp_path / "ckpt", tmp_path / "gguf", "--format", "gguf", "--quant", "q8_0"
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gguf" / "model-q8_0.gguf").is_file()
    for args, message in [
        ((tmp_path / "ckpt", tmp_path / "gguf"), "already exists"),
        ((tmp_path / "ckpt", tmp_path / "x", "--quant", "q4_0"), "only --format gguf"),
        ((tmp_path / "ckpt", tmp_path / "x", "--format", "onnx"), "invalid choice: 'onnx'"),
        (("minilm", tmp_path / "x", "--format", "gguf"), "GGUF holds the decoder-only models"),
    ]:
        failed = run("export", *args)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert not (tmp_path / "x").exists()
