"""A decoder-only attnkit model -> one GGUF file, written with ``gguf.GGUFWriter``.

The architecture is the one :func:`attnkit.interop.hf_export.hf_layout` picks: ``gpt2``
(learned positions, LayerNorm, GELU, biases) or ``llama`` (RoPE, RMSNorm, SwiGLU, GQA). The
tensors are named as llama.cpp's ``convert_hf_to_gguf.py`` names them, and Llama's query and key
rows are put in llama.cpp's RoPE order (:func:`permute`, the inverse of
:func:`attnkit.interop.gguf.unpermute`)::

    attnkit                        gpt2                    llama
    embeddings.tokens           -> token_embd              token_embd
    embeddings.positions        -> position_embd           (RoPE: none)
    layers.{i}.norm1            -> blk.{i}.attn_norm       blk.{i}.attn_norm
    layers.{i}.self_attn.in_proj -> blk.{i}.attn_qkv        blk.{i}.attn_q, attn_k, attn_v
    layers.{i}.self_attn.out_proj -> blk.{i}.attn_output    blk.{i}.attn_output
    layers.{i}.norm3            -> blk.{i}.ffn_norm        blk.{i}.ffn_norm
    layers.{i}.ffn.gate         ->                         blk.{i}.ffn_gate
    layers.{i}.ffn.up / .down   -> blk.{i}.ffn_up / _down  blk.{i}.ffn_up / _down
    decoder.norm                -> output_norm             output_norm
    lm_head                     -> output (untied only)    output (untied only)

Types: norms and biases are F32, as llama.cpp's converter keeps them. The matrices are
``dtype`` (F32, F16, BF16), or with ``quant`` the blocks of ``gguf.quants`` (Q8_0, Q4_0, Q4_1);
``position_embd`` keeps ``dtype``, and with Q4_0 / Q4_1 the token table and the output layer are
Q8_0 (llama-quantize keeps them at a higher precision too; ``gguf.quants`` writes no K-quants).
A matrix whose rows do not split into 32-value blocks keeps ``dtype``.

The tokenizer is embedded: attnkit's byte-level BPE as ``gpt2`` (tokens, merges, GPT-2's split,
``tokenizer.ggml.pre = "gpt-2"``); attnkit's char tokenizer as ``llama`` (SentencePiece: one
token per character, a space written "▁", no space prefix); a pretrained byte-level BPE with
the split llama.cpp names. No BOS is added to a prompt (attnkit's language models read none).

One difference is llama.cpp's, not the file's: its ``gpt2`` graph computes GELU with the tanh
approximation, so a model trained with the exact GELU (``gelu_approximation="none"``) runs there
with the approximation (a difference of at most 4.7e-4 per activation). ``export`` warns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnkit.interop.hf_export import hf_layout, refuse
from attnkit.models import DecoderLM

__all__ = ["FILE_TYPES", "gguf_name", "permute", "write_gguf"]

log = logging.getLogger("attnkit")
FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
}
_TENSOR_TYPES = {
    "f32": "F32",
    "f16": "F16",
    "bf16": "BF16",
    "q8_0": "Q8_0",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
}
NORMAL, UNKNOWN, CONTROL = 1, 2, 3  # llama.cpp's token types


def gguf_name(kind: str) -> str:
    """The file's name in the export directory: ``model-q8_0.gguf``."""
    return f"model-{kind}.gguf"


def permute(weight: Tensor, n_heads: int) -> Tensor:
    """Hugging Face's q / k rows -> llama.cpp's: each head's two RoPE halves interleaved."""
    rows, cols = weight.shape
    halves = weight.reshape(n_heads, 2, rows // n_heads // 2, cols)  # (heads, 2, d_head/2, in)
    return halves.transpose(1, 2).reshape(rows, cols)


def _tensors(model: DecoderLM, arch: str) -> dict[str, Tensor]:
    """GGUF name -> float32 tensor (torch order: (out, in))."""
    cfg = model.cfg
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["embeddings.tokens.weight"]}

    def norm(theirs: str, mine: str) -> None:
        out[f"{theirs}.weight"] = sd[f"{mine}.weight"]
        if f"{mine}.bias" in sd:
            out[f"{theirs}.bias"] = sd[f"{mine}.bias"]

    if arch == "gpt2":
        out["position_embd.weight"] = sd["embeddings.positions.embedding.weight"]
    norm("output_norm", "decoder.norm")
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    q_rows, kv_rows = cfg.n_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    for i in range(cfg.n_layers):
        blk, mine = f"blk.{i}", f"decoder.layers.{i}"
        norm(f"{blk}.attn_norm", f"{mine}.norm1")
        norm(f"{blk}.ffn_norm", f"{mine}.norm3")
        parts = {"attn_output": "self_attn.out_proj", "ffn_up": "ffn.up", "ffn_down": "ffn.down"}
        if arch == "gpt2":
            parts["attn_qkv"] = "self_attn.in_proj"
        else:
            parts["ffn_gate"] = "ffn.gate"
            q, k, v = sd[f"{mine}.self_attn.in_proj.weight"].split([q_rows, kv_rows, kv_rows])
            out[f"{blk}.attn_q.weight"] = permute(q, cfg.n_heads)
            out[f"{blk}.attn_k.weight"] = permute(k, cfg.kv_heads)
            out[f"{blk}.attn_v.weight"] = v
        for theirs, name in parts.items():
            norm(f"{blk}.{theirs}", f"{mine}.{name}")
    return out


def _stored(name: str, tensor: Tensor, dtype: str, quant: str | None):
    """(array, GGML type) for one tensor: F32 for vectors, else the export's type."""
    import gguf

    kind = "f32" if tensor.dim() == 1 else dtype
    if tensor.dim() == 2 and quant and name != "position_embd.weight":
        kind = quant
        if quant != "q8_0" and name in ("token_embd.weight", "output.weight"):
            kind = "q8_0"
        if tensor.shape[1] % 32:
            kind = dtype
    qtype = gguf.GGMLQuantizationType[_TENSOR_TYPES[kind]]
    if kind == "bf16":  # numpy has no bfloat16: its bits as uint16, which add_tensor takes raw
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), qtype
    array = tensor.numpy().astype(np.float32)
    if kind in ("f32", "f16"):
        return array.astype(np.float16 if kind == "f16" else np.float32), qtype
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(
    model, path: Path, *, dtype: str, quant: str | None, tokenizer, chat_template: str | None = None
) -> None:
    """Write ``model`` and its tokenizer to the GGUF file ``path``."""
    import gguf

    if not isinstance(model, DecoderLM):
        family = type(model).__name__
        raise refuse(
            "model",
            family,
            "GGUF",
            "GGUF holds the decoder-only models (DecoderLM); "
            "use format='hf' for encoders and translators",
        )
    arch = hf_layout(model)  # gpt2 or llama; refuses what neither computes
    cfg = model.cfg
    if tokenizer is None:
        raise ValueError("tokenizer is required for GGUF: llama.cpp reads it from the file")
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.vocab_size}"
        )
    vocabulary = _vocabulary(tokenizer)  # refuses a tokenizer it cannot write, before writing
    if arch == "gpt2" and cfg.gelu_approximation == "none":
        log.warning(
            "llama.cpp's gpt2 graph computes GELU with the tanh approximation; this "
            "model was trained with the exact GELU"
        )
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(path.parent.name)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[quant or dtype]])
    writer.add_context_length(cfg.max_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_block_count(cfg.n_layers)
    writer.add_head_count(cfg.n_heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(cfg.norm_eps)
    else:
        writer.add_head_count_kv(cfg.kv_heads)
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_rope_dimension_count(cfg.d_head)
        writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, vocabulary, tokenizer, chat_template)
    for name, tensor in _tensors(model, arch).items():
        array, qtype = _stored(name, tensor, dtype, quant)
        writer.add_tensor(name, array, raw_dtype=qtype)
    if quant:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vocabulary(tokenizer) -> dict:
    """The ``tokenizer.ggml.*`` values for ``tokenizer``; a ValueError for one GGUF cannot hold."""
    from attnkit.data.tokenizer import CharTokenizer
    from attnkit.interop.tokenizer import PRE_TOKENIZERS, pre_tokenizer

    n = tokenizer.vocab_size
    tokens = [tokenizer.id_to_token(i) for i in range(n)]
    special = {getattr(tokenizer, f"{r}_id", None) for r in ("pad", "bos", "eos", "unk", "cls")}
    types = [CONTROL if i in special else NORMAL for i in range(n)]
    if isinstance(tokenizer, CharTokenizer):  # SentencePiece, one token per character
        if "▁" in tokens:
            raise refuse(
                "tokenizer",
                "a char vocabulary holding '▁'",
                "GGUF",
                "SentencePiece writes a space as '▁'; use format='hf'",
            )
        types[tokenizer.unk_id] = UNKNOWN
        return {
            "model": "llama",
            "tokens": [t.replace(" ", "▁") for t in tokens],
            "types": types,
            "scores": [0.0] * n,
        }
    data = json.loads(tokenizer.hf.to_str())
    model = data.get("model") or {}
    found = data.get("pre_tokenizer")
    names = [name for name in PRE_TOKENIZERS if name not in ("default", "gpt2")]  # aliases
    pre = next((name for name in names if _json_of(pre_tokenizer(name)) == found), None)
    if model.get("type") != "BPE" or model.get("byte_fallback") or pre is None:
        raise refuse(
            "tokenizer",
            f"{model.get('type')} with pre-tokenizer {(found or {}).get('type')}",
            "GGUF",
            "attnkit writes byte-level BPE (GPT-2's or a named llama.cpp split) and "
            "its char tokenizer; use format='hf'",
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    for added in data.get("added_tokens", []):
        if added.get("special"):
            types[added["id"]] = CONTROL
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges}


def _json_of(pre) -> dict:
    """A pre-tokenizer as it appears in a tokenizer.json."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre
    return json.loads(tokenizer.to_str())["pre_tokenizer"]


def _add_tokenizer(writer, vocabulary: dict, tokenizer, chat_template: str | None) -> None:
    writer.add_tokenizer_model(vocabulary["model"])
    if "pre" in vocabulary:
        writer.add_tokenizer_pre(vocabulary["pre"])
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    if "scores" in vocabulary:
        writer.add_token_scores(vocabulary["scores"])
        writer.add_add_space_prefix(False)
    if "merges" in vocabulary:
        writer.add_token_merges(vocabulary["merges"])
    ids = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
    }
    for role, add in ids.items():
        token_id = getattr(tokenizer, f"{role}_id", None)
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
