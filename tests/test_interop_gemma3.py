"""Gemma 3 from a Hugging Face directory against transformers' Gemma3ForCausalLM with the same
weights: logits over sequences longer than the sliding window (so that both the window layers
and the global ones matter), attention weights, and greedy continuations through the KV caches
(a rolling window cache on the window layers, a full one on the global layers)."""

import pytest
import torch
import transformers

import attnkit as ak


def _gemma3(tmp_path, **overrides):
    config = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,  # wider than hidden_size / heads, as in Gemma 3 270M (256 against 160)
        query_pre_attn_scalar=32,
        sliding_window=4,
        sliding_window_pattern=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    config.update(overrides)
    ref = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config))
    torch.manual_seed(0)
    with torch.no_grad():
        for _name, p in ref.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.3)  # Gemma's norms: 1 + weight
    ref.eval().save_pretrained(tmp_path / "gemma3")
    return ref, ak.from_pretrained(tmp_path / "gemma3")


def test_gemma3_logits_attentions_and_greedy_tokens_match_transformers(tmp_path):
    ref, ours = _gemma3(tmp_path)
    cfg = ours.cfg
    assert (cfg.head_dim, cfg.qk_norm, cfg.sandwich_norms, cfg.global_every) == (32, True, True, 2)
    assert [cfg.layer_attention(i)[0] for i in range(4)] == ["window", "full"] * 2
    ids = torch.randint(3, 101, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids, output_attentions=True)
        logits, attentions = ours(ids, return_attention=True)
        fused = ours(ids)
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused, expected.logits, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(attentions, expected.attentions, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    ref.generation_config.eos_token_id = None
    cfg.eos_id = None
    with torch.no_grad():
        theirs = ref.generate(
            ids[:1, :6], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    ours_tokens = ours.generate(ids[:1, :6], 12, do_sample=False)
    assert ours_tokens.tolist() == theirs.tolist()


LAYERS_OUT_OF_PATTERN = ["sliding_attention", "full_attention"] * 2
LAYERS_OUT_OF_PATTERN[2] = "full_attention"  # two global layers in a row


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"query_pre_attn_scalar": 16}, "query_pre_attn_scalar=16 differs from head_dim=32"),
        ({"layer_types": LAYERS_OUT_OF_PATTERN}, "do not repeat every 2 layers"),
    ],
)
def test_gemma3_configs_attnkit_cannot_represent_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _gemma3(tmp_path, **overrides)


# llama.cpp's greedy tokens for these prompts on the shipped file (llama-cpp-python 0.3.36,
# n_batch=1, temperature 0), recorded once; attnkit's tokenizer gives the same prompt ids.
LLAMA_CPP_GREEDY = {
    "The capital of France is": [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506],
    "def fibonacci(n):": [107, 140, 584, 538, 1251, 236743, 236771, 236787, 107, 144, 2060, 236743],
}


@pytest.mark.needs("gemma3")
def test_the_shipped_gemma3_gguf_generates_as_llama_cpp_does():
    """Gemma 3 270M (Q4_K_M) from its GGUF file: the tokenizer in the file, the packed layers
    (Q4_K, Q6_K and Q8_0 stay in their blocks, Q5_0 becomes Q8_0 blocks exactly), and
    greedy tokens that agree with llama.cpp's over the recorded prompts (the first 11 of 12 on
    the first: the 12th is a near tie that llama.cpp's 8-bit activations break the other
    way)."""
    from attnkit.interop import load_tokenizer_for

    model = ak.from_pretrained("gemma3", dequantize=False).eval()
    tokenizer = load_tokenizer_for("gemma3")
    packed = {"Q8_0": 56, "Q4_K": 27, "Q6_K": 9}
    assert model.cfg.extra["weights"] == {"packed": packed, "float32": {}}
    assert [model.cfg.layer_attention(i)[0] for i in range(6)] == ["window"] * 5 + ["full"]
    for prompt, expected in LLAMA_CPP_GREEDY.items():
        ids = tokenizer.encode(prompt)
        assert ids[0] == model.cfg.bos_id == 2
        out = model.generate(torch.tensor([ids]), len(expected), do_sample=False)
        assert out[0, len(ids) :].tolist() == expected, prompt


@pytest.mark.needs("gemma3")
def test_the_serving_engine_decodes_gemma3_as_generate_does():
    """The engine serves a model with window layers one request at a time, each on its own
    cache (ring buffers cannot be laid side by side into a batch): two requests in a row give
    generate()'s greedy tokens, and a chat turn ends at <end_of_turn>."""
    from attnkit.interop import load_tokenizer_for
    from attnkit.serve import Engine, Request

    model = ak.from_pretrained("gemma3", dequantize=False).eval()
    tokenizer = load_tokenizer_for("gemma3")
    engine = Engine(model, tokenizer, max_batch=4, start=False)
    assert engine.max_batch == 1 and tokenizer.token_to_id("<end_of_turn>") in engine.eos_ids
    try:
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            ids = tokenizer.encode(prompt)
            want = model.generate(torch.tensor([ids]), 8, do_sample=False)[0, len(ids) :]
            done = []
            engine.submit(Request(ids, 8, temperature=0.0), lambda e, d=done: d.append(e))
            engine.run(until=lambda d=done: any(e["type"] == "done" for e in d))
            got = [e["id"] for e in done if e["type"] == "token"]
            assert got == want.tolist(), prompt
    finally:
        engine.close()
