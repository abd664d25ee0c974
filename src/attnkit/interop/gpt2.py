"""GPT-2 (Hugging Face layout) <-> attnkit's DecoderLM.

GPT-2 is a Pre-LN decoder with learned positions, GELU (the tanh approximation, "gelu_new"),
biases everywhere and the LM head tied to the token embedding. Its linear layers are
``Conv1D`` modules whose weight is stored transposed, (in, out) instead of torch's (out, in),
and its attention keeps Q, K and V in one ``c_attn`` matrix, in the same order as attnkit's
``in_proj``. The mapping, per layer::

    h.{i}.ln_1          -> decoder.layers.{i}.norm1
    h.{i}.attn.c_attn   -> decoder.layers.{i}.self_attn.in_proj   (transposed)
    h.{i}.attn.c_proj   -> decoder.layers.{i}.self_attn.out_proj  (transposed)
    h.{i}.ln_2          -> decoder.layers.{i}.norm3
    h.{i}.mlp.c_fc      -> decoder.layers.{i}.ffn.up              (transposed)
    h.{i}.mlp.c_proj    -> decoder.layers.{i}.ffn.down            (transposed)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit.config import ModelConfig
from attnkit.models import DecoderLM

__all__ = ["gpt2_config_from_hf", "gpt2_from_hf_state_dict", "gpt2_to_hf"]

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}

_LAYER_MAP = [  # (GPT-2 name, attnkit name, transposed)
    ("ln_1.weight", "norm1.weight", False),
    ("ln_1.bias", "norm1.bias", False),
    ("attn.c_attn.weight", "self_attn.in_proj.weight", True),
    ("attn.c_attn.bias", "self_attn.in_proj.bias", False),
    ("attn.c_proj.weight", "self_attn.out_proj.weight", True),
    ("attn.c_proj.bias", "self_attn.out_proj.bias", False),
    ("ln_2.weight", "norm3.weight", False),
    ("ln_2.bias", "norm3.bias", False),
    ("mlp.c_fc.weight", "ffn.up.weight", True),
    ("mlp.c_fc.bias", "ffn.up.bias", False),
    ("mlp.c_proj.weight", "ffn.down.weight", True),
    ("mlp.c_proj.bias", "ffn.down.bias", False),
]


def gpt2_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a GPT-2 ``config.json`` dict."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _GELU:
        raise ValueError(
            f"GPT-2 activation_function {activation!r} is not supported; expected one of "
            f"{sorted(_GELU)}"
        )
    d_model = hf.get("n_embd", 768)
    eos = hf.get("eos_token_id")
    vocab = hf.get("vocab_size", 50257)
    eos = eos if isinstance(eos, int) and 0 <= eos < vocab else None
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=hf.get("n_head", 12),
        n_layers=hf.get("n_layer", 12),
        d_ff=hf.get("n_inner") or 4 * d_model,
        max_len=hf.get("n_positions", 1024),
        dropout=0.0,
        norm="pre",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        position="learned",
        activation="gelu",
        gelu_approximation=_GELU[activation],
        tie_embeddings=hf.get("tie_word_embeddings", True),
        pad_id=eos if eos is not None else 0,
        bos_id=eos,
        eos_id=eos,
        extra={"source": "gpt2"},
    )


def gpt2_from_hf_state_dict(cfg: ModelConfig, state: dict[str, Tensor]) -> DecoderLM:
    """A DecoderLM holding a GPT-2 state dict (``transformer.`` prefixes optional)."""
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    ours: dict[str, Tensor] = {
        "embeddings.tokens.weight": state["wte.weight"],
        "embeddings.positions.embedding.weight": state["wpe.weight"],
        "decoder.norm.weight": state["ln_f.weight"],
        "decoder.norm.bias": state["ln_f.bias"],
    }
    for i in range(cfg.n_layers):
        for theirs, mine, transposed in _LAYER_MAP:
            tensor = state[f"h.{i}.{theirs}"]
            ours[f"decoder.layers.{i}.{mine}"] = tensor.t() if transposed else tensor
    if cfg.tie_embeddings:
        ours["lm_head.weight"] = ours["embeddings.tokens.weight"]
    else:
        ours["lm_head.weight"] = state["lm_head.weight"]
    model = DecoderLM(cfg)
    model.load_state_dict({k: v.contiguous() for k, v in ours.items()}, strict=True)
    return model.eval()


def gpt2_to_hf(model: DecoderLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """GPT-2 ``config.json`` values and a ``GPT2LMHeadModel`` state dict for a DecoderLM that
    has GPT-2's shape (Pre-LN, learned positions, GELU, biases, LayerNorm)."""
    cfg = model.cfg
    if not (
        cfg.norm == "pre"
        and cfg.position == "learned"
        and cfg.activation == "gelu"
        and cfg.bias
        and cfg.norm_type == "layernorm"
        and cfg.kv_heads == cfg.n_heads
    ):
        raise ValueError(
            "gpt2_to_hf needs a GPT-2-shaped DecoderLM: norm='pre', position='learned', "
            "activation='gelu', bias=True, norm_type='layernorm', no grouped-query attention"
        )
    hf_config = {
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new" if cfg.gelu_approximation == "tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
    }
    sd = model.state_dict()
    state = {
        "transformer.wte.weight": sd["embeddings.tokens.weight"],
        "transformer.wpe.weight": sd["embeddings.positions.embedding.weight"],
        "transformer.ln_f.weight": sd["decoder.norm.weight"],
        "transformer.ln_f.bias": sd["decoder.norm.bias"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        for theirs, mine, transposed in _LAYER_MAP:
            tensor = sd[f"decoder.layers.{i}.{mine}"]
            state[f"transformer.h.{i}.{theirs}"] = tensor.t() if transposed else tensor
    return hf_config, {k: v.detach().clone().contiguous() for k, v in state.items()}
