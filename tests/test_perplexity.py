"""attnkit perplexity: llama-perplexity's measure (windows, the second half of each scored),
against the same sum written out here, and the command's one-line refusals."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.data import CharTokenizer
from attnkit.training.perplexity import perplexity


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=40, max_len=64, bos_id=1)
    return ak.DecoderLM(cfg).eval()


def test_perplexity_scores_the_second_half_of_each_window_after_bos():
    model = _model()
    ids = torch.randint(3, 40, (150,), generator=torch.Generator().manual_seed(1))
    result = perplexity(model, ids, context=32)
    assert (result.windows, result.tokens, result.context) == (4, 4 * 15, 32)  # 150 // 32 = 4
    losses = []
    for w in range(4):  # written out: BOS first, then score tokens 17..31 from their prefixes
        window = ids[w * 32 : (w + 1) * 32].clone()
        window[0] = 1
        for j in range(16, 31):
            with torch.no_grad():
                logits = model(window[None, : j + 1])[0, -1]
            losses.append(-torch.log_softmax(logits.double(), -1)[window[j + 1]].item())
    mean = sum(losses) / len(losses)
    assert result.value == pytest.approx(math.exp(mean), rel=1e-5)
    spread = torch.tensor(losses).std().item() / math.sqrt(len(losses))
    assert result.error == pytest.approx(math.exp(mean) * spread, rel=1e-4)
    assert perplexity(model, ids, context=32, windows=2).windows == 2


def test_perplexity_refuses_bad_input_in_one_line():
    model = _model()
    with pytest.raises(ValueError, match="fewer than one window of 32"):
        perplexity(model, list(range(3, 20)), context=32)
    with pytest.raises(ValueError, match="longer than the model's 64 positions"):
        perplexity(model, list(range(3, 30)) * 10, context=128)
    with pytest.raises(TypeError, match="decoder-only"):
        perplexity(ak.EncoderModel(model.cfg), [3] * 100, context=32)


def test_the_perplexity_command(tmp_path, capsys):
    text = "to be or not to be, that is the question. " * 40
    tok = CharTokenizer.train([text])
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tok.vocab_size, max_len=64)
    ak.DecoderLM(cfg).save_pretrained(tmp_path / "m", tokenizer=tok)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert main(["perplexity", str(tmp_path / "m"), str(tmp_path / "t.txt"), "--ctx", "64"]) == 0
    out = capsys.readouterr().out
    assert "tokens scored in 26 windows of 64" in out  # 1,720 characters // 64
    value = float(out.split("perplexity ")[1].split()[0])
    assert f"({26 * 31:,} tokens scored" in out  # each window scores its second half, less one
    # the figure computed here from its definition: each window of 64 tokens, its first made
    # BOS where the model has one, the mean negative log-likelihood of tokens 33..63
    model = ak.from_pretrained(tmp_path / "m")
    ids = torch.tensor(tok.encode(text))
    losses = []
    with torch.no_grad():
        for w in range(26):
            window = ids[w * 64 : (w + 1) * 64].clone()
            if model.cfg.bos_id is not None:
                window[0] = model.cfg.bos_id
            logits = model(window[None])[0, 32:-1]
            losses.append(torch.nn.functional.cross_entropy(logits, window[33:], reduction="none"))
    assert value == pytest.approx(math.exp(float(torch.cat(losses).mean())), rel=1e-4)
    for argv, message in [
        ([str(tmp_path / "m"), "missing.txt"], "TEXT: no such file"),
        ([str(tmp_path / "m"), str(tmp_path / "t.txt"), "--ctx", "2"], "--ctx: must be at least"),
        ([str(tmp_path / "m"), str(tmp_path / "t.txt"), "--ctx", "128"], "--ctx=128 is longer"),
        ([str(tmp_path / "m"), str(tmp_path / "t.txt"), "--windows", "0"], "--windows"),
        ([str(tmp_path / "nothing"), str(tmp_path / "t.txt")], "MODEL"),
        ([str(tmp_path / "m"), str(tmp_path / "t.txt"), "--int8"], "--int8: needs packed"),
    ]:
        assert main(["perplexity", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.needs("smollm2")
def test_the_integer_path_costs_little_perplexity(capsys):
    """SmolLM2's packed weights on the integer path (the default, as generate and serve run
    them) and with --exact (float32 activations) on the same two windows of Shakespeare,
    against every weight in float32: --exact is the float32 perplexity to rounding order, and
    the integer path stays within 1% of it (llama.cpp's own integer path: bench/perplexity.py).
    """
    values = {}
    for option in ([], ["--dequantize"], ["--exact"]):
        argv = ["perplexity", "smollm2", "shakespeare", "--windows", "2", "--ctx", "512"]
        assert main([*argv, *option]) == 0
        out = capsys.readouterr().out
        assert ("int8 activations" in out) == (option == [])
        values[tuple(option)] = float(out.split("perplexity ")[1].split()[0])
    exact = values[("--dequantize",)]
    print(f"\nperplexity: float32 {exact:.4f}, int8 {values[()]:.4f}")
    assert values[("--exact",)] == pytest.approx(exact, rel=1e-4)
    assert values[()] != values[("--exact",)]
    assert values[()] == pytest.approx(exact, rel=0.01)
    assert main(["perplexity", "smollm2", "shakespeare", "--int8", "--exact"]) == 2
    assert "not both" in capsys.readouterr().err
