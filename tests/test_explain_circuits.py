"""Circuits: the detector, copying and composition scores of every head, checked against
TransformerLens on the same GPT-2-shaped weights, against an eigenvalue computation done here,
on a two-layer attention-only model whose induction circuit is set by hand, and on SmolLM2."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.explain.circuits import (
    DETECTORS,
    circuit_scores,
    composition_scores,
    detection_pattern,
    detector_scores,
    head_weights,
    ov_copying_scores,
    weight_shares,
)
from test_explain_methods import _gpt2_dir

NAMES = {
    "previous-token": "previous_token_head",
    "duplicate-token": "duplicate_token_head",
    "induction": "induction_head",
}


def test_the_scores_equal_transformer_lens_on_gpt2(tmp_path):
    from transformer_lens import head_detector
    from transformer_lens.model_bridge import TransformerBridge

    _, path = _gpt2_dir(tmp_path)
    ours = ak.from_pretrained(path).eval()
    bridge = TransformerBridge.boot_transformers(path, device="cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 12, 5, 6]])
    _, cache = bridge.run_with_cache(ids)
    with torch.no_grad():
        _, attentions = ours(ids, return_attention=True)
    attentions = [a[0] for a in attentions]
    for name in DETECTORS:
        theirs_pattern = getattr(head_detector, f"get_{NAMES[name]}_detection_pattern")(ids)
        pattern = detection_pattern(name, ids[0])
        assert torch.equal(pattern, theirs_pattern.float()), name
        theirs = torch.tensor(
            [
                [
                    head_detector.compute_head_attention_similarity_score(
                        cache[f"blocks.{layer}.attn.hook_pattern"][0, head],
                        theirs_pattern,
                        exclude_bos=False,
                        exclude_current_token=False,
                        error_measure="mul",
                    )
                    for head in range(4)
                ]
                for layer in range(3)
            ],
            dtype=torch.float64,
        )
        got = detector_scores(attentions, pattern, marked=False)
        torch.testing.assert_close(got, theirs, atol=1e-5, rtol=0)
    for mode in "QKV":
        theirs = bridge.all_composition_scores(mode).scores.double()
        torch.testing.assert_close(composition_scores(ours)[mode], theirs, atol=1e-5, rtol=0)


def test_the_copying_score_is_the_eigenvalues_of_the_ov_circuit(tmp_path):
    """sum Re(lambda) / sum |lambda| over the eigenvalues of the full (V x V) matrix
    W_E W_V W_O W_U, computed here with torch.linalg."""
    _, path = _gpt2_dir(tmp_path)
    model = ak.from_pretrained(path).eval()
    scores = ov_copying_scores(model)
    w_e = model.embeddings.tokens.weight.double()
    w_u = model.lm_head.weight.double().T
    for layer, block in enumerate(model.decoder.layers):
        _, _, w_v, w_o = head_weights(block.self_attn)
        for head in range(4):
            full = w_e @ w_v[head] @ w_o[head] @ w_u  # (V, V)
            eigenvalues = torch.linalg.eigvals(full)
            expected = eigenvalues.real.sum() / eigenvalues.abs().sum()
            assert abs(float(scores[layer, head]) - float(expected)) < 1e-6


def _induction_model(vocab=32, positions=32):
    """A two-layer attention-only DecoderLM (its FFNs zero) whose weights are set by hand:
    layer 0's head attends to the previous position and writes the token it finds there into a
    block of its own; layer 1's head matches its query's token against that block (K-
    composition), so it attends to the position after an earlier copy of the current token,
    and writes that position's token into the block the output layer reads."""
    tok, pos, prev, out = 0, vocab, vocab + positions, 2 * vocab + positions
    d = 3 * vocab + positions
    cfg = ak.ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_heads=1,
        n_layers=2,
        d_ff=4,
        max_len=positions,
        norm="pre",
        norm_type="rmsnorm",
        dropout=0.0,
        position="learned",
        tie_embeddings=False,
        bias=False,
    )
    model = ak.DecoderLM(cfg).eval()
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    eye = torch.eye(vocab)
    with torch.no_grad():
        model.embeddings.tokens.weight[:, tok : tok + vocab] = eye
        model.embeddings.positions.embedding.weight[:, pos : pos + positions] = torch.eye(positions)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        first, second = (layer.self_attn for layer in model.decoder.layers)
        q, k, v = (w.view(d, d) for w in first.in_proj.weight.split(d))
        for i in range(1, positions):  # query at position i meets the key of position i - 1
            q[i, pos + i] = 4.0
            k[i, pos + i - 1] = 4.0
        v[:vocab, tok : tok + vocab] = eye  # the token found there ...
        first.out_proj.weight[prev : prev + vocab, :vocab] = eye / 5  # ... into its own block
        q, k, v = (w.view(d, d) for w in second.in_proj.weight.split(d))
        q[:vocab, tok : tok + vocab] = 4.0 * eye  # the current token ...
        k[:vocab, prev : prev + vocab] = 20.0 * eye  # ... against the token before each key
        v[:vocab, tok : tok + vocab] = eye
        second.out_proj.weight[out : out + vocab, :vocab] = eye
        model.lm_head.weight[:, out : out + vocab] = 10.0 * eye
    return model


def test_a_hand_built_induction_head_is_found_and_a_random_model_is_not():
    model = _induction_model()
    torch.manual_seed(0)
    ids = torch.cat([torch.randperm(32)[:12]] * 2)[None]  # no token twice within a copy
    with torch.no_grad():
        _, attentions = model(ids, return_attention=True)
    attentions = [a[0] for a in attentions]
    scores = {n: detector_scores(attentions, detection_pattern(n, ids[0])) for n in DETECTORS}
    assert scores["previous-token"][0, 0] > 0.9  # layer 0: the previous-token head
    assert scores["induction"][1, 0] > 0.9  # layer 1: the induction head
    assert scores["previous-token"][1, 0] < 0.1 and scores["duplicate-token"][1, 0] < 0.1
    assert scores["induction"][0, 0] < 0.1 and scores["duplicate-token"][0, 0] < 0.1
    shares = weight_shares(attentions[1][0], ids[0])  # where the induction head looks
    assert shares["induction"] > 0.9 and shares["previous-token"] < 0.1
    assert weight_shares(attentions[0][0], ids[0])["previous-token"] > 0.9
    composition = composition_scores(model)
    # K-composition: layer 0 writes the block layer 1's keys read (1 / sqrt(32) for two aligned
    # rank-32 maps), and nothing its queries or values read
    assert composition["K"][0, 0, 1, 0] == pytest.approx(32**-0.5)
    assert composition["Q"][0, 0, 1, 0] < 1e-9 and composition["V"][0, 0, 1, 0] < 1e-9
    with torch.no_grad():
        logits = model(ids)[0]
    # the second copy is predicted from the first (but for its first token: layer 0 finds no
    # previous token at position 0 and writes position 0's own, which that token matches too)
    assert torch.equal(logits[13:-1].argmax(-1), ids[0, 14:])

    torch.manual_seed(1)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=64, n_layers=2, n_heads=4)
    random = circuit_scores(ak.DecoderLM(cfg).eval(), half=20)
    for name in DETECTORS:
        assert random["detectors"][name].max() < 0.35, name  # near chance (1 / the row's length)
    assert random["loss"]["second"] > 3.0  # log(64) = 4.2: no better than guessing


@pytest.mark.needs("smollm2")
def test_smollm2_has_induction_heads(capsys):
    from attnkit.cli import main

    assert main(["explain", "circuits", "smollm2", "Hi"]) == 2  # one token: nothing to score
    assert "at least 2" in capsys.readouterr().err
    model = ak.from_pretrained("smollm2", dequantize=True).eval()
    scores = circuit_scores(model, half=30)
    induction = scores["detectors"]["induction"]
    assert induction.max() > 0.5 and scores["loss"]["second"] < scores["loss"]["first"] - 2
    assert scores["copying"].shape == induction.shape == (30, 9)


def test_the_command_prints_every_heads_scores_and_refuses_in_one_line(tmp_path, capsys):
    import json

    from attnkit.cli import main

    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=64, n_layers=2, n_heads=4)
    ak.DecoderLM(cfg).save_pretrained(tmp_path / "lm")
    assert main(["explain", "circuits", str(tmp_path / "lm"), "--repeat", "10", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    heads = {f"{layer}.{head}" for layer in range(2) for head in range(4)}
    for name in (*DETECTORS, "copying"):
        assert set(scores[name]) == heads, name
    assert set(scores["composition"]) == {"Q", "K", "V"}
    assert len(scores["composition"]["K"]) == 64 and "0.1>1.2" in scores["composition"]["K"]
    assert scores["loss"]["second"] > 0

    png, svg, html = (tmp_path / f"circuits.{e}" for e in ("png", "svg", "html"))
    argv = ["explain", "circuits", str(tmp_path / "lm"), "--repeat", "10", "--png", str(png)]
    assert main([*argv, "--svg", str(svg), "--html", str(html)]) == 0
    shown = capsys.readouterr().out
    assert "induction" in shown and "K-composition" in shown and png.stat().st_size > 10_000
    assert "where each best head's attention goes" in shown and svg.stat().st_size > 10_000
    page = html.read_text()
    assert "circuits.png" in page and "strongest heads (layer.head score)" in page
    for name in DETECTORS:  # each detector's best head, its attention over the 21 tokens
        assert f'"name": "{name}: head ' in page or f"{name}: head " in page, name

    linear = ak.ModelConfig.preset("tiny", vocab_size=64, n_layers=2, attention="linear")
    ak.DecoderLM(linear).save_pretrained(tmp_path / "linear")
    for args, says in (
        (["explain", "circuits"], "required: MODEL"),
        (["explain", "circuits", str(tmp_path / "linear")], "linear attention"),
        (["explain", "circuits", str(tmp_path / "lm"), "--repeat", "1"], "--repeat"),
        (["explain", "circuits", str(tmp_path / "nothing")], "MODEL"),
        (["explain", "circuits", str(tmp_path / "lm"), "--html", "r.txt"], "must end in .html"),
    ):
        assert main(args) == 2, args
        error = capsys.readouterr().err.strip()
        assert says in error and len(error.splitlines()) == 1, error


@pytest.mark.needs("shakespeare")
def test_a_run_records_its_heads_and_the_command_plots_them(tmp_path, capsys):
    """train.watch records every head's induction and previous-token scores and the
    in-context score at each evaluation; 'explain circuits RUN_DIR' reads them back."""
    import json

    from attnkit.cli import main
    from test_training_cli import SHAKESPEARE, records, tiny

    out = tmp_path / "run"
    watch = ["--set", 'train.watch=["induction", "previous-token"]']
    assert main(["train", SHAKESPEARE, "--out", str(out), *tiny(), *watch]) == 0
    capsys.readouterr()
    validation = records(out, "validation")
    assert [r["step"] for r in validation] == [20, 40]
    for record in validation:
        assert set(record["heads"]) == {"induction", "previous-token"}
        assert set(record["heads"]["induction"]) == {"0.0", "0.1"}  # 1 layer x 2 heads
        assert isinstance(record["in_context"], float)

    png = tmp_path / "heads.png"
    assert main(["explain", "circuits", str(out), "--png", str(png)]) == 0
    shown = capsys.readouterr().out
    assert "in-context" in shown and "induction: the best head's score rose most at step" in shown
    assert png.stat().st_size > 10_000
    assert main(["explain", "circuits", str(out), "--json"]) == 0
    seen = json.loads(capsys.readouterr().out)
    assert seen["steps"] == [20, 40] and len(seen["scores"]["induction"]["0.1"]) == 2

    plain = tmp_path / "plain"
    assert main(["train", SHAKESPEARE, "--out", str(plain), *tiny(**{"train.steps": 20})]) == 0
    capsys.readouterr()
    assert main(["explain", "circuits", str(plain)]) == 2
    error = capsys.readouterr().err.strip()
    assert "records no head scores" in error and len(error.splitlines()) == 1
    assert (
        main(
            [
                "train",
                SHAKESPEARE,
                "--out",
                str(tmp_path / "x"),
                *tiny(),
                "--set",
                'train.watch=["copying"]',
            ]
        )
        == 2
    )
    assert "train.watch must be a list of" in capsys.readouterr().err
