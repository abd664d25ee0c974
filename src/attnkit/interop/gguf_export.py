"""A decoder-only attnkit model -> one GGUF file, written with ``gguf.GGUFWriter``.

The architecture is the model's description (:func:`attnkit.interop.hf_export.hf_layout` with
``where="gguf"``: the one it was read from, else the first that holds it), and the description
says everything else: the ``<arch>.*`` keys (:func:`~attnkit.interop.architecture.gguf_metadata`)
and the tensors, named as llama.cpp's ``convert_hf_to_gguf.py`` names them and laid out as it
does (Llama's q and k rows in llama.cpp's RoPE order, Phi-3's fused blocks;
:func:`~attnkit.interop.weights.weights_to`). A Llama 3 RoPE scaling goes in as
``rope_freqs``, as the converter writes it.

Types: norms and biases are F32, as llama.cpp's converter keeps them. The matrices are
``dtype`` (F32, F16, BF16), or with ``quant`` the blocks of ``gguf.quants`` (Q8_0, Q4_0, Q4_1;
the types :data:`~attnkit.accel.block_formats.QUANT_TYPES` marks written);
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

from attnkit.accel.block_formats import QUANT_TYPES
from attnkit.interop.architecture import gguf_metadata
from attnkit.interop.architectures import ARCHITECTURES
from attnkit.interop.hf_export import hf_layout, refuse
from attnkit.interop.weights import weights_to
from attnkit.models import DecoderLM
from attnkit.position import rope_factors, rope_frequencies

__all__ = ["gguf_name", "write_gguf"]

log = logging.getLogger("attnkit")
NORMAL, UNKNOWN, CONTROL = 1, 2, 3  # llama.cpp's token types


def gguf_name(kind: str) -> str:
    """The file's name in the export directory: ``model-q8_0.gguf``."""
    return f"model-{kind}.gguf"


def _stored(name: str, tensor: Tensor, dtype: str, quant: str | None):
    """(array, GGML type) for one tensor: F32 for vectors, else the export's type."""
    import gguf

    kind = "f32" if tensor.dim() == 1 else dtype
    if tensor.dim() == 2 and quant and name != "position_embd.weight":
        kind = quant
        if quant != "q8_0" and name in ("token_embd.weight", "output.weight"):
            kind = "q8_0"
        if tensor.shape[1] % QUANT_TYPES[kind.upper()].block:
            kind = dtype
    qtype = gguf.GGMLQuantizationType(QUANT_TYPES[kind.upper()].ggml)
    if kind == "bf16":  # numpy has no bfloat16: its bits as uint16, which add_tensor takes raw
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), qtype
    array = tensor.numpy().astype(np.float32)
    if kind in ("f32", "f16"):
        return array.astype(np.float16 if kind == "f16" else np.float32), qtype
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(
    model, path: Path, *, dtype: str, quant: str | None, tokenizer,
    chat_template: str | None = None, name: str | None = None,
) -> None:  # fmt: skip
    """Write ``model`` and its tokenizer to the GGUF file ``path`` (``name``: the model's name
    in ``general.name``)."""
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
    arch = ARCHITECTURES[hf_layout(model, "gguf")]  # refuses what no GGUF layout computes
    cfg = model.cfg
    if tokenizer is None:
        raise ValueError("tokenizer is required for GGUF: llama.cpp reads it from the file")
    vocabulary = _vocabulary(tokenizer)  # refuses a tokenizer it cannot write, before writing
    if arch.name == "gpt2" and cfg.gelu_approximation == "none":
        log.warning(
            "llama.cpp's gpt2 graph computes GELU with the tanh approximation; this "
            "model was trained with the exact GELU"
        )
    writer = gguf.GGUFWriter(path, arch.gguf)
    writer.add_name(name or cfg.extra.get("name") or f"attnkit-{arch.name}")
    kind = (quant or dtype).upper()
    writer.add_file_type(gguf.LlamaFileType["ALL_F32" if kind == "F32" else f"MOSTLY_{kind}"])
    for key, value in gguf_metadata(arch, cfg).items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
        add[type(value)](key, value)
    _add_tokenizer(writer, vocabulary, chat_template)
    tensors = weights_to(arch, "gguf", cfg, model.state_dict())
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] != "linear":  # Llama 3's factors
        plain = rope_frequencies(cfg.rotary_dim or cfg.d_head, cfg.rope_theta)
        tensors["rope_freqs.weight"] = rope_factors(plain, cfg.rope_scaling)
    for tensor_name, tensor in tensors.items():
        array, qtype = _stored(tensor_name, tensor, dtype, quant)
        writer.add_tensor(tensor_name, array, raw_dtype=qtype)
    if quant:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# tokenizer.ggml.<key> -> how GGUFWriter writes it (uint32 ids, int32 token types, ...)
_WRITERS = {
    "model": "add_tokenizer_model", "pre": "add_tokenizer_pre", "tokens": "add_token_list",
    "token_type": "add_token_types", "scores": "add_token_scores", "merges": "add_token_merges",
    "add_bos_token": "add_add_bos_token",
    "add_eos_token": "add_add_eos_token", "add_sep_token": "add_add_sep_token",
    "add_space_prefix": "add_add_space_prefix",
}  # fmt: skip


def _vocabulary(tokenizer) -> dict:
    """The ``tokenizer.ggml.*`` values for ``tokenizer`` (a GGUF file's own tokenizer: the
    values it was read from); a ValueError for one GGUF cannot hold."""
    from attnkit.data.tokenizer import CharTokenizer
    from attnkit.interop.tokenizer import GGUF_IDS, PRE_TOKENIZERS, pre_tokenizer

    if getattr(tokenizer, "gguf", None):
        return dict(tokenizer.gguf)
    n = tokenizer.vocab_size
    tokens = [tokenizer.id_to_token(i) for i in range(n)]
    special = {getattr(tokenizer, f"{r}_id", None) for r in ("pad", "bos", "eos", "unk", "cls")}
    found = {key: getattr(tokenizer, f"{role}_id", None) for role, key in GGUF_IDS.items()}
    found = {k: v for k, v in found.items() if v is not None}
    found.update(add_bos_token=False, add_eos_token=False)  # attnkit's models read none
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
        tokens = [t.replace(" ", "▁") for t in tokens]
        return {"model": "llama", "tokens": tokens, "token_type": types, "scores": [0.0] * n,
                "add_space_prefix": False, **found}  # fmt: skip
    data = json.loads(tokenizer.hf.to_str())
    model = data.get("model") or {}
    split = data.get("pre_tokenizer")
    names = [name for name in PRE_TOKENIZERS if name not in ("default", "gpt2")]  # aliases
    pre = next((name for name in names if _json_of(pre_tokenizer(name)) == split), None)
    if model.get("type") != "BPE" or model.get("byte_fallback") or pre is None:
        raise refuse(
            "tokenizer",
            f"{model.get('type')} with pre-tokenizer {(split or {}).get('type')}",
            "GGUF",
            "attnkit writes byte-level BPE (GPT-2's or a named llama.cpp split), its char "
            "tokenizer and the tokenizer of a GGUF file; use format='hf'",
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    for added in data.get("added_tokens", []):
        if added.get("special"):
            types[added["id"]] = CONTROL
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "token_type": types,
            "merges": merges, **found}  # fmt: skip


def _json_of(pre) -> dict:
    """A pre-tokenizer as it appears in a tokenizer.json."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre
    return json.loads(tokenizer.to_str())["pre_tokenizer"]


def _add_tokenizer(writer, vocabulary: dict, chat_template: str | None) -> None:
    import gguf

    for key, value in vocabulary.items():
        if key in _WRITERS:
            getattr(writer, _WRITERS[key])(value)
        elif key.endswith("_id"):  # a special token's id: uint32, as llama.cpp reads it
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            kind = gguf.GGUFValueType.get_type(value)
            writer.add_key_value(f"tokenizer.ggml.{key}", value, kind)
    if chat_template:
        writer.add_chat_template(chat_template)
