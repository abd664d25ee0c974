"""RoBERTa and XLM-RoBERTa directories loaded by attnkit against the same directories loaded by
transformers (small random configurations): hidden states on a right-padded batch, the pooler,
sequence-classification logits, the masked-LM checkpoint read as its encoder, and a
SentencePiece-style tokenizer.json read as transformers reads it."""

import pytest
import torch
import transformers

import attnkit as ak
from test_interop_hf import _max_diff, _randomize

ATOL = 1e-4

ROBERTA = dict(
    vocab_size=99,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=20,  # 2 rows before the first token: attnkit's max_len is 18
    type_vocab_size=1,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    attn_implementation="eager",
)
# <s> ... </s>, right-padded with <pad> = 1, as RoBERTa's tokenizers pad
IDS = torch.tensor([[0, 5, 6, 7, 8, 2, 1, 1], [0, 9, 10, 11, 12, 13, 14, 2]])
MASK = IDS != 1
FAMILIES = {
    "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hidden_states_and_pooler_match_on_a_right_padded_batch(tmp_path, family):
    config_class, model_class = FAMILIES[family]
    ref = _randomize(model_class(config_class(**ROBERTA)))
    ref.save_pretrained(tmp_path / family, safe_serialization=True)
    ours = ak.from_pretrained(tmp_path / family)
    assert type(ours) is ak.EncoderModel and ours.cfg.max_len == 18 and ours.cfg.pooler
    assert ours.cfg.norm_eps == ref.config.layer_norm_eps and ours.cfg.pad_id == 1
    with torch.no_grad():
        expected = ref(IDS, attention_mask=MASK.long())
        hidden = ours(IDS, MASK)
    assert _max_diff(hidden[MASK], expected.last_hidden_state[MASK]) < ATOL
    assert _max_diff(ours.pool(hidden), expected.pooler_output) < ATOL
    # the longest input attnkit takes is the longest Hugging Face takes: 20 - 2 positions
    long = torch.full((1, 18), 7)
    with torch.no_grad():
        assert _max_diff(ours(long), ref(long).last_hidden_state) < ATOL


@pytest.mark.parametrize(
    "classes",
    [
        transformers.RobertaForSequenceClassification,
        transformers.XLMRobertaForSequenceClassification,
    ],
)
def test_sequence_classification_gives_the_same_logits(tmp_path, classes):
    config_class = transformers.RobertaConfig
    if classes is transformers.XLMRobertaForSequenceClassification:
        config_class = transformers.XLMRobertaConfig
    ref = _randomize(classes(config_class(**ROBERTA, num_labels=3)))
    ref.save_pretrained(tmp_path / "cls", safe_serialization=True)
    ours = ak.from_pretrained(tmp_path / "cls")
    assert type(ours) is ak.EncoderClassifier and ours.classifier.out_features == 3
    with torch.no_grad():
        expected = ref(IDS, attention_mask=MASK.long()).logits
        logits = ours(IDS, MASK)
    assert _max_diff(logits, expected) < ATOL


def test_masked_lm_loads_as_its_encoder(tmp_path):
    ref = _randomize(transformers.RobertaForMaskedLM(transformers.RobertaConfig(**ROBERTA)))
    ref.save_pretrained(tmp_path / "mlm", safe_serialization=True)
    ours = ak.from_pretrained(tmp_path / "mlm")
    with torch.no_grad():
        expected = ref.roberta(IDS, attention_mask=MASK.long()).last_hidden_state
        hidden = ours(IDS, MASK)
    assert type(ours) is ak.EncoderModel and not ours.cfg.pooler
    assert _max_diff(hidden[MASK], expected[MASK]) < ATOL


def test_a_position_table_too_short_for_the_padding_offset_is_refused(tmp_path):
    ref = transformers.RobertaModel(
        transformers.RobertaConfig(**{**ROBERTA, "max_position_embeddings": 2})
    )
    ref.save_pretrained(tmp_path / "short", safe_serialization=True)
    with pytest.raises(ValueError, match="leaves no positions after pad_token_id=1"):
        ak.from_pretrained(tmp_path / "short")


def _sentencepiece_tokenizer(path):
    """A tiny XLM-R-style tokenizer.json: Unigram pieces with "▁" for spaces, <s> ... </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = ["▁the", "▁cat", "▁sat", "▁on", "▁a", "▁mat", "▁", "s", "t", "a", "c", "m"]
    vocab = [(s, 0.0) for s in specials] + [(p, -1.0 - i / 10) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))


def test_the_sentencepiece_tokenizer_json_comes_with_the_model(tmp_path):
    """The directory's tokenizer.json gives the ids transformers' tokenizer gives, with <s>,
    </s> and <pad> where RoBERTa puts them, and the model reads them as Hugging Face's does."""
    ref = _randomize(transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**ROBERTA)))
    ref.save_pretrained(tmp_path / "xlmr", safe_serialization=True)
    _sentencepiece_tokenizer(tmp_path / "xlmr")
    tok = ak.interop.load_tokenizer_for(tmp_path / "xlmr")
    assert (tok.bos_id, tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    ids = tok.encode("the cats sat on a mat")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "xlmr" / "tokenizer.json")
    )
    assert ids == reference("the cats sat on a mat")["input_ids"]
    assert ids[0] == 0 and ids[-1] == 2 and len(ids) == 9  # "▁cat" + "s"
    assert tok.decode(ids) == "the cats sat on a mat"
    model = ak.from_pretrained(tmp_path / "xlmr")
    with torch.no_grad():
        assert (
            _max_diff(model(torch.tensor([ids])), ref(torch.tensor([ids])).last_hidden_state) < ATOL
        )
