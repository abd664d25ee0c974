"""DecoderLM against Hugging Face's GPT2LMHeadModel with the same weights: logits on a padded
batch, attention weights, greedy continuations, and the round trip of the weights."""

import pytest
import torch
import transformers

import attnkit as ak
from attnkit.interop import from_hf, to_hf
from ties import greedy_ties


def _pair(gelu="tanh", seed=0):
    cfg = ak.ModelConfig.preset(
        "tiny",
        vocab_size=97,
        d_model=48,
        n_heads=4,
        n_layers=2,
        d_ff=96,
        max_len=40,
        gelu_approximation=gelu,
        eos_id=None,
        bos_id=None,
    )
    torch.manual_seed(seed)
    ours = ak.DecoderLM(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.05)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    hf_config, state = to_hf(ours)
    config = transformers.GPT2Config(**hf_config, attn_implementation="eager")
    ref = transformers.GPT2LMHeadModel(config).eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("attn.bias" in m or "masked_bias" in m for m in missing)
    return ours, ref


@pytest.mark.parametrize("gelu", ["tanh", "none"])
def test_logits_and_attentions_match_gpt2_on_a_left_padded_batch(gelu):
    ours, ref = _pair(gelu)
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7]).bool()
    positions = ak.positions_from_mask(mask)
    with torch.no_grad():
        expected = ref(
            ids, attention_mask=mask.long(), position_ids=positions, output_attentions=True
        )
        logits, attentions = ours(ids, mask, return_attention=True)
    real = mask
    torch.testing.assert_close(logits[real], expected.logits[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours(ids, mask)[real], expected.logits[real], atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(attentions, expected.attentions, strict=True):
        # HF gives padded query rows arbitrary weights; compare the real query rows
        torch.testing.assert_close(mine[0, :, 3:], theirs[0, :, 3:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine[1], theirs[1], atol=1e-4, rtol=1e-4)


def test_greedy_continuations_match_gpt2_generate():
    ours, ref = _pair()
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    mine = ours.generate(prompt, 20)

    def hf_logits_at(b, i):  # Hugging Face's logits that chose its token i
        with torch.no_grad():
            return ref(expected[b : b + 1, :i]).logits[0, -1]

    # the same tokens, except after a step where GPT-2's best two logits are within float32
    # noise of each other (tests/ties.py fails on any other difference)
    greedy_ties(expected, mine, hf_logits_at)


def test_weights_round_trip_through_the_gpt2_layout():
    ours, _ = _pair()
    hf_config, state = to_hf(ours)
    back = from_hf(hf_config, state)
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
