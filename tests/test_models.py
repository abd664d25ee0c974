"""The three families: padding never changes real tokens' outputs (right and left padding), the
future never changes the past, positions are really used, attention over padding is zero,
cached decoding equals a full forward, and each family can overfit four examples."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak

POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "none"]
FAMILIES = ["encoder", "classifier", "encoder-decoder", "decoder"]
V = 50


def make(family, position="learned", **overrides):
    values = dict(vocab_size=V, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=64, dropout=0.0)
    values.update(overrides)
    cfg = ak.ModelConfig.preset("tiny", position=position, **values)
    torch.manual_seed(0)
    if family == "encoder":
        return ak.EncoderModel(cfg).eval()
    if family == "classifier":
        return ak.EncoderClassifier(cfg, num_classes=3).eval()
    if family == "encoder-decoder":
        return ak.Transformer(cfg).eval()
    return ak.DecoderLM(cfg).eval()


def run(model, ids, mask=None):
    """Per-token outputs (B, N, ...) for token-level families, (B, C) for the classifier. The
    encoder-decoder reads ids as the source and a fixed target."""
    if isinstance(model, ak.Transformer):
        tgt = torch.tensor([[1, 7, 8, 9]]).expand(ids.shape[0], 4)
        return model(ids, tgt, src_mask=mask)
    return model(ids, mask)


def pad_batch(rows, side, pad_id=0):
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        sl = slice(n - len(r), n) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = True
    return ids, mask


ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_never_changes_real_outputs(family, position, side):
    model = make(family, position)
    ids, mask = pad_batch(ROWS, side)
    with torch.no_grad():
        batched = run(model, ids, mask)
        for i, row in enumerate(ROWS):
            alone = run(model, torch.tensor([row]))
            if family in ("classifier", "encoder-decoder"):
                torch.testing.assert_close(batched[i], alone[0], atol=1e-5, rtol=1e-5)
            else:
                torch.testing.assert_close(batched[i][mask[i]], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("position", POSITIONS)
def test_padded_target_in_the_encoder_decoder(position, side):
    model = make("encoder-decoder", position)
    src = torch.tensor([[5, 6, 7, 8]] * 2)
    tgt, tgt_mask = pad_batch([[1, 9, 10, 11, 12], [1, 13]], side)
    with torch.no_grad():
        batched = model(src, tgt, tgt_mask=tgt_mask)
        alone = model(src[1:], torch.tensor([[1, 13]]))
    torch.testing.assert_close(batched[1][tgt_mask[1]], alone[0], atol=1e-5, rtol=1e-5)


@settings(max_examples=10, deadline=None)
@given(
    position=st.sampled_from(POSITIONS),
    cut=st.integers(1, 9),
    seed=st.integers(0, 1000),
    family=st.sampled_from(["decoder", "encoder-decoder"]),
)
def test_the_future_never_changes_the_past(position, cut, seed, family):
    model = make(family, position)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 10), generator=g)
    changed = ids.clone()
    changed[:, cut:] = torch.randint(3, V, (2, 10 - cut), generator=g)
    with torch.no_grad():
        if family == "decoder":
            a, b = model(ids), model(changed)
        else:
            src = torch.randint(3, V, (2, 6), generator=g)
            a, b = model(src, ids), model(src, changed)
    torch.testing.assert_close(a[:, :cut], b[:, :cut], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, cut:], b[:, cut:])  # and the future is not ignored


@pytest.mark.parametrize("position", POSITIONS)
def test_positions_are_used(position):
    """Without positions an encoder is permutation-equivariant; with them it must not be."""
    model = make("encoder", position)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        permuted_out = model(ids[:, perm])
        out_permuted = model(ids)[:, perm]
    equivariant = torch.allclose(permuted_out, out_permuted, atol=1e-5)
    assert equivariant == (position == "none")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_attention_weights_sum_to_one_and_skip_padding(family, position):
    model = make(family, position)
    ids, mask = pad_batch(ROWS, "right")
    with torch.no_grad():
        plain = run(model, ids, mask)
        if isinstance(model, ak.Transformer):
            tgt = torch.tensor([[1, 7, 8, 9]]).expand(3, 4)
            out, attentions = model(ids, tgt, src_mask=mask, return_attention=True)
            maps = attentions["encoder"] + attentions["cross"]
            assert len(attentions["decoder"]) == 2
            assert all(w.shape == (3, 4, 4, 4) for w in attentions["decoder"])
        else:
            out, maps = model(ids, mask, return_attention=True)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)  # math path == fused path
    assert len(maps) == (4 if family == "encoder-decoder" else 2)
    for w in maps:  # keys: the (padded) source / input, of length 7
        assert w.shape[:2] == (3, 4) and w.shape[-1] == 7
        assert torch.all(w[~mask[:, None, None, :].expand_as(w)] == 0)  # padding gets nothing
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))  # real keys get all


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_decoder_lm_cached_forward_equals_full_forward(position, n_kv_heads):
    model = make("decoder", position, n_kv_heads=n_kv_heads)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, max_len=16)
        steps = [model(ids[:, :4], cache=cache)]
        for t in range(4, 9):
            steps.append(model(ids[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
def test_decoder_lm_cache_with_left_padding(position):
    model = make("decoder", position)
    ids, mask = pad_batch([[5, 6, 7, 8, 9], [10, 11]], "left")
    with torch.no_grad():
        cache = model.new_cache(2, max_len=8)
        first = model(ids, mask, cache=cache)
        step_ids = torch.tensor([[20], [21]])
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        step = model(step_ids, step_mask, cache=cache)
        alone = model(torch.tensor([[10, 11, 21]]))
    torch.testing.assert_close(first[1, 3:], alone[0, :2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1, 0], alone[0, 2], atol=1e-5, rtol=1e-5)


def test_encoder_decoder_cached_decoding_equals_full_decoding():
    model = make("encoder-decoder", "sinusoidal", n_kv_heads=2)
    src = torch.randint(3, V, (2, 6), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(src, tgt)
        memory = model.encode(src)
        cache = model.new_cache(2, src_len=6, max_len=8)
        steps = [model.decode(tgt[:, t : t + 1], memory, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_shift_right_is_teacher_forcing():
    targets = torch.tensor([[7, 8, 9, 2], [5, 2, 0, 0]])
    assert ak.shift_right(targets, bos_id=1).tolist() == [[1, 7, 8, 9], [1, 5, 2, 0]]


def test_paper_tying_shares_one_matrix_three_ways():
    model = ak.Transformer(ak.ModelConfig.preset("tiny", tie_embeddings=True))
    assert model.src_embeddings.tokens.weight is model.tgt_embeddings.tokens.weight
    assert model.lm_head.weight is model.src_embeddings.tokens.weight
    untied = ak.Transformer(ak.ModelConfig.preset("tiny", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.src_embeddings.tokens.weight
    assert untied.num_parameters() > model.num_parameters()


# --------------------------------------------------------------------------------------------
# Overfitting four examples: every family can learn
# --------------------------------------------------------------------------------------------


def _fit(model, loss_of_batch, steps=300, lr=3e-3):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = loss_of_batch()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    return loss.item()


EXAMPLES = torch.tensor(
    [
        [5, 9, 14, 22, 30, 7, 2],
        [6, 11, 11, 40, 3, 2, 0],
        [17, 8, 25, 2, 0, 0, 0],
        [33, 12, 4, 19, 21, 2, 0],
    ]
)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_decoder_lm_overfits(position):
    model = make("decoder", position)
    ids, targets = EXAMPLES[:, :-1], EXAMPLES[:, 1:]
    mask = ids != 0

    def loss():
        logits = model(ids, mask)
        return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=0)

    assert _fit(model, loss) < 0.05


def test_encoder_decoder_overfits():
    model = make("encoder-decoder", "sinusoidal", norm="post", activation="relu")
    src, targets = EXAMPLES, EXAMPLES.flip(1)
    tgt_in = ak.shift_right(targets, bos_id=1)

    def loss():
        logits = model(src, tgt_in, src_mask=src != 0)
        return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=0)

    assert _fit(model, loss) < 0.05


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_overfits(pooling):
    cfg = make("encoder").cfg
    torch.manual_seed(0)
    model = ak.EncoderClassifier(cfg, num_classes=3, pooling=pooling)
    labels = torch.tensor([0, 1, 2, 1])

    def loss():
        return F.cross_entropy(model(EXAMPLES, EXAMPLES != 0), labels)

    assert _fit(model, loss) < 0.05


def test_encoder_model_overfits_a_token_task():
    model = make("encoder", "learned")
    head = torch.nn.Linear(32, V)
    targets = EXAMPLES.roll(1, dims=1)
    params = torch.nn.ModuleList([model, head])

    def loss():
        return F.cross_entropy(head(model(EXAMPLES)).transpose(1, 2), targets)

    assert _fit(params, loss) < 0.05


def test_an_attention_only_model_is_d_ff_0_without_biases():
    """d_ff = 0 and bias = False: every FFN adds exactly zero, so each layer is x + attention;
    a negative width is refused in one line."""
    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=50, d_ff=0, bias=False)
    model = ak.DecoderLM(cfg).eval()
    x = torch.randn(2, 5, cfg.d_model)
    for layer in model.decoder.layers:
        assert torch.equal(layer.ffn(x), torch.zeros_like(x))
    ids = torch.randint(0, 50, (2, 9))
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and model.decoder.layers[0].self_attn.in_proj.weight.grad.any()
    with pytest.raises(ValueError, match="d_ff"):
        ak.ModelConfig.preset("tiny", vocab_size=50, d_ff=-1)
