"""The encoder, the decoder and the whole encoder-decoder against torch.nn.Transformer* with the
same weights, in the paper's Post-LN order and in Pre-LN order (norm_first=True)."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.stacks import Decoder, Encoder

D, H, FF, L = 32, 4, 64, 2


def _cfg(norm, activation="relu"):
    return ak.ModelConfig.preset(
        "tiny",
        d_model=D,
        n_heads=H,
        d_ff=FF,
        n_layers=L,
        norm=norm,
        activation=activation,
        position="none",
        dropout=0.0,
    )


def _copy_attention(ours: ak.MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    ours.in_proj.weight.copy_(ref.in_proj_weight)
    ours.in_proj.bias.copy_(ref.in_proj_bias)
    ours.out_proj.load_state_dict(ref.out_proj.state_dict())


def _copy_ffn(ours: ak.FeedForward, ref) -> None:
    ours.up.load_state_dict(ref.linear1.state_dict())
    ours.down.load_state_dict(ref.linear2.state_dict())


@torch.no_grad()
def _copy_encoder(ours: Encoder, ref: nn.TransformerEncoder) -> None:
    for mine, theirs in zip(ours.layers, ref.layers, strict=True):
        _copy_attention(mine.self_attn, theirs.self_attn)
        _copy_ffn(mine.ffn, theirs)
        mine.norm1.load_state_dict(theirs.norm1.state_dict())
        mine.norm2.load_state_dict(theirs.norm2.state_dict())
    if ours.norm is not None:
        ours.norm.load_state_dict(ref.norm.state_dict())


@torch.no_grad()
def _copy_decoder(ours: Decoder, ref: nn.TransformerDecoder) -> None:
    for mine, theirs in zip(ours.layers, ref.layers, strict=True):
        _copy_attention(mine.self_attn, theirs.self_attn)
        _copy_attention(mine.cross_attn, theirs.multihead_attn)
        _copy_ffn(mine.ffn, theirs)
        for i in (1, 2, 3):
            getattr(mine, f"norm{i}").load_state_dict(getattr(theirs, f"norm{i}").state_dict())
    if ours.norm is not None:
        ours.norm.load_state_dict(ref.norm.state_dict())


def _randomise(module: nn.Module) -> None:
    """Non-trivial norms and biases, so that a swapped parameter cannot go unnoticed."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)


PADDING = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])  # torch: True = padding


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_matches_torch(norm, activation):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, activation=activation, batch_first=True, norm_first=norm == "pre"
    )
    ref = nn.TransformerEncoder(
        layer, L, norm=nn.LayerNorm(D) if norm == "pre" else None, enable_nested_tensor=False
    )
    _randomise(ref)
    ours = Encoder(_cfg(norm, activation))
    _copy_encoder(ours, ref)
    x = torch.randn(2, 7, D)
    expected = ref(x, src_key_padding_mask=PADDING)
    got, _ = ours(x, mask=~PADDING[:, None, None, :])
    real = ~PADDING
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    got_math, weights = ours(x, mask=~PADDING[:, None, None, :], return_attention=True)
    torch.testing.assert_close(got_math[real], expected[real], atol=1e-5, rtol=1e-5)
    assert len(weights) == L and weights[0].shape == (2, H, 7, 7)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_matches_torch(norm):
    torch.manual_seed(1)
    layer = nn.TransformerDecoderLayer(
        D, H, FF, dropout=0.0, batch_first=True, norm_first=norm == "pre"
    )
    ref = nn.TransformerDecoder(layer, L, norm=nn.LayerNorm(D) if norm == "pre" else None)
    _randomise(ref)
    ours = Decoder(_cfg(norm), cross_attention=True)
    _copy_decoder(ours, ref)
    tgt, memory = torch.randn(2, 5, D), torch.randn(2, 7, D)
    tgt_padding = torch.tensor([[False] * 5, [False] * 4 + [True]])
    expected = ref(
        tgt,
        memory,
        tgt_mask=~ak.causal_mask(5),  # torch: True = blocked
        tgt_is_causal=True,
        tgt_key_padding_mask=tgt_padding,
        memory_key_padding_mask=PADDING,
    )
    got, _, _ = ours(
        tgt,
        memory,
        self_mask=~tgt_padding[:, None, None, :],
        memory_mask=~PADDING[:, None, None, :],
    )
    real = ~tgt_padding
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_whole_encoder_decoder_matches_torch_transformer(norm):
    """Our Transformer (embeddings, masks built from (B, N) masks, teacher forcing, the LM head)
    against torch.nn.Transformer fed the same embeddings."""
    torch.manual_seed(2)
    cfg = _cfg(norm)
    ours = ak.Transformer(cfg).eval()
    ref = nn.Transformer(
        D, H, L, L, FF, dropout=0.0, batch_first=True, norm_first=norm == "pre"
    ).eval()
    if norm == "post":  # torch's stacks always end with a norm; the paper's Post-LN does not
        ref.encoder.norm = None
        ref.decoder.norm = None
    _randomise(ref)
    _copy_encoder(ours.encoder, ref.encoder)
    _copy_decoder(ours.decoder, ref.decoder)

    src = torch.randint(4, cfg.vocab_size, (2, 7))
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    src_mask[1, 5:] = False
    src[~src_mask] = cfg.pad_id
    targets = torch.randint(4, cfg.vocab_size, (2, 5))
    tgt = ak.shift_right(targets, cfg.bos_id)
    logits = ours(src, tgt, src_mask=src_mask)

    positions = torch.arange(7)
    hidden = ref(
        ours.src_embeddings(src, positions),
        ours.tgt_embeddings(tgt, positions[:5]),
        tgt_mask=~ak.causal_mask(5),  # torch: True = blocked
        tgt_is_causal=True,
        src_key_padding_mask=~src_mask,
        memory_key_padding_mask=~src_mask,
    )
    torch.testing.assert_close(logits, ours.lm_head(hidden), atol=1e-5, rtol=1e-5)
