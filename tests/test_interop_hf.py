"""Hugging Face directories (BERT, GPT-2, Llama) loaded by attnkit against the same directories
loaded by transformers: hidden states / logits on padded batches, attention weights, greedy
continuations, sharded checkpoints, and the tokenizer.json that comes with them."""

import pytest
import torch
import transformers

import attnkit as ak
from attnkit.interop import load_tokenizer_for
from attnkit.interop.tokenizer import PretrainedTokenizer
from ties import greedy_ties

ATOL = 1e-4


def _randomize(model, seed=0):
    """Weights large enough that a wrong mapping cannot hide in the noise (HF inits std 0.02)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.05)
            if "norm" in name.lower() and name.endswith("weight"):
                p.add_(1.0)
    return model.eval()


def _save(model, path, **kw):
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def _max_diff(a, b):
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------------------------
# BERT
# --------------------------------------------------------------------------------------------

BERT = dict(
    vocab_size=99,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=40,
    type_vocab_size=2,
    attn_implementation="eager",
)
# right padding, as BERT's tokenizers pad
BERT_IDS = torch.tensor([[2, 5, 6, 7, 8, 3, 0, 0], [2, 9, 10, 11, 12, 13, 14, 3]])
BERT_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8]).bool()
BERT_TYPES = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_hidden_states_pooler_and_attentions_match(tmp_path, act):
    ref = _randomize(transformers.BertModel(transformers.BertConfig(**BERT, hidden_act=act)))
    ours = ak.from_pretrained(_save(ref, tmp_path / "bert"))
    assert type(ours) is ak.EncoderModel and not ours.training
    assert ours.cfg.norm == "post" and ours.cfg.norm_eps == 1e-12 and ours.cfg.pooler
    with torch.no_grad():
        expected = ref(
            BERT_IDS,
            attention_mask=BERT_MASK.long(),
            token_type_ids=BERT_TYPES,
            output_attentions=True,
        )
        hidden, attentions = ours(BERT_IDS, BERT_MASK, BERT_TYPES, return_attention=True)
        fused = ours(BERT_IDS, BERT_MASK, BERT_TYPES)
    real = BERT_MASK
    assert _max_diff(hidden[real], expected.last_hidden_state[real]) < ATOL
    assert _max_diff(fused[real], expected.last_hidden_state[real]) < ATOL
    assert _max_diff(ours.pool(hidden), expected.pooler_output) < ATOL
    for mine, theirs in zip(attentions, expected.attentions, strict=True):
        assert _max_diff(mine[0, :, :6], theirs[0, :, :6]) < ATOL  # real query rows
        assert _max_diff(mine[1], theirs[1]) < ATOL


def test_bert_for_sequence_classification_gives_the_same_logits(tmp_path):
    config = transformers.BertConfig(**BERT, num_labels=3)
    ref = _randomize(transformers.BertForSequenceClassification(config))
    ours = ak.from_pretrained(_save(ref, tmp_path / "cls"))
    assert type(ours) is ak.EncoderClassifier and ours.classifier.out_features == 3
    with torch.no_grad():
        expected = ref(BERT_IDS, attention_mask=BERT_MASK.long(), token_type_ids=BERT_TYPES)
        logits = ours(BERT_IDS, BERT_MASK, BERT_TYPES)
    assert logits.shape == (2, 3)
    assert _max_diff(logits, expected.logits) < ATOL


def test_bert_for_masked_lm_loads_as_its_encoder(tmp_path):
    ref = _randomize(transformers.BertForMaskedLM(transformers.BertConfig(**BERT)))
    ours = ak.from_pretrained(_save(ref, tmp_path / "mlm"))
    with torch.no_grad():
        expected = ref.bert(BERT_IDS, attention_mask=BERT_MASK.long()).last_hidden_state
        hidden = ours(BERT_IDS, BERT_MASK)
    assert type(ours) is ak.EncoderModel and not ours.cfg.pooler
    assert _max_diff(hidden[BERT_MASK], expected[BERT_MASK]) < ATOL


# --------------------------------------------------------------------------------------------
# Decoders: GPT-2 and Llama
# --------------------------------------------------------------------------------------------

# left padding, as for generation; Hugging Face gets position ids counted from the mask
DEC_IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
DEC_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7]).bool()


def _hf_llama(tie, **overrides):
    config = dict(
        vocab_size=101,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        intermediate_size=96,
        max_position_embeddings=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    model = _randomize(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, **overrides))
    )
    if tie:
        model.tie_weights()
    return model


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=40, attn_implementation="eager"
    )
    return _randomize(transformers.GPT2LMHeadModel(config))


def _check_decoder(ref, ours):
    ref.generation_config.eos_token_id = None  # both run the full length, never stopping early
    ours.cfg.eos_id = None
    positions = ak.positions_from_mask(DEC_MASK)
    with torch.no_grad():
        expected = ref(
            DEC_IDS,
            attention_mask=DEC_MASK.long(),
            position_ids=positions,
            output_attentions=True,
        )
        logits, attentions = ours(DEC_IDS, DEC_MASK, return_attention=True)
        fused = ours(DEC_IDS, DEC_MASK)
    real = DEC_MASK
    diffs = {
        "logits": _max_diff(logits[real], expected.logits[real]),
        "fused": _max_diff(fused[real], expected.logits[real]),
        "attention": max(
            max(_max_diff(m[0, :, 3:], t[0, :, 3:]), _max_diff(m[1], t[1]))
            for m, t in zip(attentions, expected.attentions, strict=True)
        ),
    }
    assert all(d < ATOL for d in diffs.values()), diffs
    # greedy continuations, one prompt and a left-padded batch
    ties = 0
    for ids, mask in ((DEC_IDS[1:], None), (DEC_IDS, DEC_MASK)):
        hf_mask = torch.ones_like(ids) if mask is None else mask.long()
        with torch.no_grad():
            theirs = ref.generate(
                ids,
                attention_mask=hf_mask,
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        mine = ours.generate(ids, 12, attention_mask=mask)
        full = torch.cat([hf_mask, torch.ones(len(ids), 12, dtype=hf_mask.dtype)], dim=1)

        def hf_logits_at(b, i, theirs=theirs, full=full):  # the logits that chose token i
            with torch.no_grad():
                return ref(theirs[b : b + 1, :i], attention_mask=full[b : b + 1, :i]).logits[0, -1]

        # equal, or parted only at a near-tie of Hugging Face's best two logits (tests/ties.py)
        ties += greedy_ties(theirs, mine, hf_logits_at)
    assert ties <= 1  # rare: at most one of the 3 rows


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_with_grouped_query_attention_matches(tmp_path, tie):
    ref = _hf_llama(tie)
    ours = ak.from_pretrained(_save(ref, tmp_path / "llama"))
    cfg = ours.cfg
    assert type(ours) is ak.DecoderLM
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.norm_type) == (2, 500000.0, "rmsnorm")
    assert (ours.lm_head.weight is ours.embeddings.tokens.weight) == tie
    _check_decoder(ref, ours)


def test_gpt2_directory_matches(tmp_path):
    ref = _gpt2()
    ours = ak.from_pretrained(_save(ref, tmp_path / "gpt2"))
    assert ours.cfg.gelu_approximation == "tanh"
    _check_decoder(ref, ours)


def test_a_sharded_checkpoint_loads(tmp_path):
    ref = _hf_llama(tie=False)
    path = _save(ref, tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").is_file()
    assert not (path / "model.safetensors").exists()
    ours = ak.from_pretrained(path)
    with torch.no_grad():
        expected = ref(DEC_IDS[1:]).logits
    assert _max_diff(ours(DEC_IDS[1:]), expected) < ATOL


# --------------------------------------------------------------------------------------------
# Tokenizers of Hugging Face directories
# --------------------------------------------------------------------------------------------


def _wordpiece(path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = "the cat sat on a mat dog ran far away".split()
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    vocab.update({"##s": len(vocab), "##ing": len(vocab) + 1})
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.enable_padding(length=16)  # like all-MiniLM's tokenizer.json: must not leak into encode
    tok.save(str(path / "tokenizer.json"))


def test_the_tokenizer_json_of_a_hf_directory_is_wrapped(tmp_path):
    ref = transformers.BertModel(transformers.BertConfig(**BERT))
    path = _save(ref, tmp_path / "bert")
    _wordpiece(path)
    tok = load_tokenizer_for(path)
    assert isinstance(tok, PretrainedTokenizer)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    ids = tok.encode("The cats sat on a Mat!")
    assert ids == [2, 5, 6, 15, 7, 8, 9, 10, 1, 3]
    assert tok.encode("the cat", add_special_tokens=False) == [5, 6]
    assert tok.encode("the cat sat on a mat", max_length=5) == [2, 5, 6, 7, 3]
    assert tok.decode(ids) == "the cats sat on a mat"  # [UNK] is special: skipped
    assert tok.decode(ids, skip_special=False).startswith("[CLS]")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    assert reference("The cats sat on a Mat!")["input_ids"] == ids
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    # the model and its tokenizer go through attnkit's own format and come back
    model = ak.from_pretrained(path)
    model.save_pretrained(tmp_path / "mine", tokenizer=tok)
    again = load_tokenizer_for(tmp_path / "mine")
    assert isinstance(again, PretrainedTokenizer) and again.encode("the cat") == tok.encode(
        "the cat"
    )


def test_generate_command_reads_a_hf_directory_with_its_tokenizer(tmp_path, capsys):
    from attnkit.cli import main
    from attnkit.data import BPETokenizer

    trained = BPETokenizer.train(["to be or not to be, that is the question"] * 3, 300, 1)
    config = transformers.GPT2Config(vocab_size=trained.vocab_size, n_embd=32, n_layer=1, n_head=2)
    ref = _randomize(transformers.GPT2LMHeadModel(config))
    path = _save(ref, tmp_path / "gpt2")
    trained.save(path / "tokenizer.json")
    prompt = "to be"
    assert (
        main(["generate", "--model", str(path), prompt, "--greedy", "--max-new-tokens", "8"]) == 0
    )
    ids = torch.tensor([trained.encode(prompt)])
    with torch.no_grad():
        expected = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert capsys.readouterr().out == trained.decode(expected[0].tolist()) + "\n"


def test_half_precision_checkpoints_load_as_float32(tmp_path):
    ref = _hf_llama(tie=False).to(torch.bfloat16)
    ours = ak.from_pretrained(_save(ref, tmp_path / "bf16"))
    weight = ours.decoder.layers[0].ffn.gate.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, ref.model.layers[0].mlp.gate_proj.weight.float())
