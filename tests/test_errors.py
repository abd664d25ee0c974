"""Bad input fails early, with an error that names the problem."""

import pytest
import torch

import attnkit as ak
import attnkit.generation

q = torch.randn(2, 4, 5, 8)
k = torch.randn(2, 4, 6, 8)
v = torch.randn(2, 4, 6, 8)
sdpa = ak.scaled_dot_product_attention

CASES = [
    ("mismatched d_k", lambda: sdpa(q, torch.randn(2, 4, 6, 7), v), ValueError, "d_k"),
    ("k and v lengths", lambda: sdpa(q, k, torch.randn(2, 4, 5, 8)), ValueError, "same length M"),
    ("batch dims", lambda: sdpa(q, torch.randn(3, 4, 6, 8), v), ValueError, "leading"),
    ("ranks differ", lambda: sdpa(q, k[0], v[0]), ValueError, "number of dimensions"),
    ("1-d query", lambda: sdpa(torch.randn(8), k, v), ValueError, r"\(\.\.\., length, dim\)"),
    ("integer q", lambda: sdpa(q.long(), k, v), TypeError, "floating-point"),
    ("dtypes differ", lambda: sdpa(q.double(), k, v), TypeError, "one dtype"),
    ("not a tensor", lambda: sdpa(q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
    ("mask shape", lambda: sdpa(q, k, v, torch.ones(5, 5, dtype=torch.bool)), ValueError, "broadcast"),
    ("mask expands batch", lambda: sdpa(q, k, v, torch.ones(3, 1, 5, 6) > 0), ValueError, "(2, 4, 5, 6)"),
    ("int mask", lambda: sdpa(q, k, v, torch.ones(5, 6, dtype=torch.long)), TypeError, "bool"),
    ("dropout", lambda: sdpa(q, k, v, dropout_p=1.5), ValueError, "dropout_p"),
    ("implementation", lambda: sdpa(q, k, v, implementation="flash"), ValueError, "implementation"),
    ("old knob", lambda: sdpa(q, k, v, return_weights=True, implementation="fused"), ValueError, "implementation must be one of"),
    ("causal size", lambda: ak.causal_mask(-1), ValueError, "non-negative"),
    ("padding ids float", lambda: ak.padding_mask(torch.randn(2, 3), 0), TypeError, "integer"),
    ("padding ids 3-d", lambda: ak.padding_mask(torch.ones(2, 3, 4, dtype=torch.long), 0), ValueError, "(B, M)"),
    ("heads divide", lambda: ak.MultiHeadAttention(30, 4), ValueError, "n_heads=4 must divide d_model=30"),
    ("kv heads", lambda: ak.MultiHeadAttention(32, 4, n_kv_heads=3), ValueError, "multiple of n_kv_heads=3"),
    ("zero heads", lambda: ak.MultiHeadAttention(32, 0), ValueError, "n_heads must be a positive int"),
    ("mha dropout", lambda: ak.MultiHeadAttention(32, 4, dropout=1.0), ValueError, "dropout"),
    ("rope and alibi", lambda: ak.MultiHeadAttention(32, 4, rope=ak.RotaryEmbedding(8), alibi=ak.ALiBi(4)), ValueError, "not both"),
    ("rope width", lambda: ak.MultiHeadAttention(32, 4, rope=ak.RotaryEmbedding(16)), ValueError, "d_head=8"),
    ("alibi heads", lambda: ak.MultiHeadAttention(32, 4, alibi=ak.ALiBi(8)), ValueError, "n_heads=4"),
    ("mha input width", lambda: ak.MultiHeadAttention(32, 4)(torch.randn(2, 5, 16)), ValueError, "d_model=32"),
    ("mha context batch", lambda: ak.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(3, 5, 32)), ValueError, "B=2"),
    ("mha positions", lambda: ak.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), positions=torch.arange(4)), ValueError, "N=5"),
    ("odd sinusoid", lambda: ak.sinusoidal_table(10, 7), ValueError, "even"),
    ("odd rope", lambda: ak.RotaryEmbedding(7), ValueError, "even"),
    ("float positions", lambda: ak.LearnedPositions(4, 4)(torch.zeros(1, 2)), TypeError, "integer"),
    ("cache overflow", lambda: ak.KVCache(1, 1, 2, 4).append(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)), ValueError, "do not fit"),
    ("cache shape", lambda: ak.KVCache(1, 2, 4, 4).append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)), ValueError, "H_kv=2"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------------------------
# Models and configs: every check runs before any computation
# --------------------------------------------------------------------------------------------

cfg = ak.ModelConfig.preset("tiny", vocab_size=50, max_len=8)
lm = ak.DecoderLM(cfg)
mt = ak.Transformer(cfg)
enc = ak.EncoderModel(cfg)
ids = torch.tensor([[5, 6, 7]])

MODEL_CASES = [
    ("id too large", lambda: lm(torch.tensor([[5, 50]])), ValueError, r"token id 50, outside the vocabulary \[0, 50\)"),
    ("negative id", lambda: enc(torch.tensor([[-1, 5]])), ValueError, "token id -1"),
    ("float ids", lambda: lm(ids.float()), TypeError, "integer token ids"),
    ("1-d ids", lambda: lm(torch.tensor([5, 6])), ValueError, r"\(B, N\)"),
    ("empty batch", lambda: lm(torch.zeros(0, 3, dtype=torch.long)), ValueError, "empty"),
    ("too long learned", lambda: lm(torch.ones(1, 9, dtype=torch.long)), ValueError, "max_len=8"),
    ("too long sinusoidal src", lambda: ak.Transformer(cfg.replace(position="sinusoidal"))(torch.ones(1, 9, dtype=torch.long), ids), ValueError, "max_len=8"),
    ("batch mismatch", lambda: mt(torch.ones(2, 3, dtype=torch.long), ids), ValueError, "same batch size"),
    ("mask shape", lambda: lm(ids, torch.ones(1, 4, dtype=torch.bool)), ValueError, r"\(1, 3\)"),
    ("float mask", lambda: enc(ids, torch.ones(1, 3)), TypeError, "bool"),
    ("src mask shape", lambda: mt(ids, ids, src_mask=torch.ones(1, 2, dtype=torch.bool)), ValueError, "src_mask"),
    ("tgt mask shape", lambda: mt(ids, ids, tgt_mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "tgt_mask"),
    ("token types absent", lambda: enc(ids, token_type_ids=torch.zeros_like(ids)), ValueError, "type_vocab_size=0"),
    ("classes", lambda: ak.EncoderClassifier(cfg, 1), ValueError, "num_classes"),
    ("pooling", lambda: ak.EncoderClassifier(cfg, 2, pooling="max"), ValueError, "pooling"),
    ("unknown preset", lambda: ak.ModelConfig.preset("gpt5"), ValueError, "unknown preset 'gpt5'"),
    ("unknown field", lambda: ak.ModelConfig.preset("tiny", d_modle=64), ValueError, "d_modle"),
    ("heads divide", lambda: ak.ModelConfig(d_model=64, n_heads=5), ValueError, "n_heads=5 must divide d_model=64"),
    ("kv heads", lambda: ak.ModelConfig(n_kv_heads=3), ValueError, "n_kv_heads=3"),
    ("norm choice", lambda: ak.ModelConfig(norm="middle"), ValueError, "norm must be one of"),
    ("position choice", lambda: ak.ModelConfig(position="xpos"), ValueError, "position"),
    ("dropout", lambda: ak.ModelConfig(dropout=1.0), ValueError, "dropout"),
    ("pad id", lambda: ak.ModelConfig(vocab_size=10, pad_id=10), ValueError, "pad_id"),
    ("window size", lambda: ak.ModelConfig(attention="window"), ValueError, "window"),
    ("alibi linear", lambda: ak.ModelConfig(attention="linear", position="alibi"), ValueError, "ALiBi"),
    ("experts", lambda: ak.ModelConfig(n_experts=2, moe_top_k=3), ValueError, "moe_top_k=3"),
    ("from_dict unknown", lambda: ak.ModelConfig.from_dict({"layers": 2}), ValueError, "layers"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "call", "error", "message"), MODEL_CASES, ids=[c[0] for c in MODEL_CASES]
)
def test_bad_model_input_raises_a_clear_error(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------------------------
# Generation: every option and the request itself are checked before a token is made
# --------------------------------------------------------------------------------------------

gen_cfg = ak.ModelConfig.preset("tiny", vocab_size=50, max_len=8)
gen_lm = ak.DecoderLM(gen_cfg)
gen_mt = ak.Transformer(gen_cfg.replace(position="sinusoidal"))
prompt = torch.tensor([[5, 6, 7]])

GENERATION_CASES = [
    ("no new tokens", lambda: gen_lm.generate(prompt, 0), ValueError, "max_new_tokens must be a positive int, got 0"),
    ("bool tokens", lambda: gen_lm.generate(prompt, True), ValueError, "max_new_tokens"),
    ("temperature", lambda: gen_lm.generate(prompt, 2, do_sample=True, temperature=0), ValueError, "temperature must be > 0"),
    ("top_k", lambda: gen_lm.generate(prompt, 2, do_sample=True, top_k=0), ValueError, "top_k must be a positive int"),
    ("top_p", lambda: gen_lm.generate(prompt, 2, do_sample=True, top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    ("beams", lambda: gen_lm.generate(prompt, 2, num_beams=0), ValueError, "num_beams must be a positive int"),
    ("beams and sampling", lambda: gen_lm.generate(prompt, 2, num_beams=2, do_sample=True), ValueError, "cannot be combined with do_sample"),
    ("eos id", lambda: gen_lm.generate(prompt, 2, eos_id=50), ValueError, r"eos_id must be a token id in \[0, 50\)"),
    ("1-d prompt", lambda: gen_lm.generate(torch.tensor([5, 6]), 2), ValueError, r"\(B, N\)"),
    ("id too large", lambda: gen_lm.generate(torch.tensor([[5, 60]]), 2), ValueError, "token id 60"),
    ("too long", lambda: gen_lm.generate(prompt, 6), ValueError, "lower max_new_tokens to at most 5"),
    ("too long target", lambda: gen_mt.generate(prompt, 8), ValueError, "lower max_new_tokens to at most 7"),
    ("prompt mask", lambda: gen_lm.generate(prompt, 2, attention_mask=torch.ones(1, 2, dtype=torch.bool)), ValueError, "attention_mask"),
    ("not a generator", lambda: ak.generation.generate(enc, ids, 2), TypeError, "generate needs a DecoderLM or a Transformer"),
    ("unknown option", lambda: gen_lm.generate(prompt, 2, beams=2), TypeError, "beams"),
    ("source mask by the LM's name", lambda: gen_mt.generate(prompt, 2, attention_mask=torch.ones(1, 3)), TypeError, "pass the source.s mask as src_mask="),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "call", "error", "message"), GENERATION_CASES, ids=[c[0] for c in GENERATION_CASES]
)
def test_bad_generation_requests_raise_a_clear_error(name, call, error, message):
    with pytest.raises(error, match=message):
        call()
