"""``export(model, path, format=...)``: an attnkit model out, as a directory other tools read.

::

    format  OUT/ holds                                          read by
    "hf"    config.json, generation_config.json, model.safetensors,   transformers (AutoModel...,
            tokenizer.json, tokenizer_config.json, README.md           AutoTokenizer), vLLM, TGI
    "gguf"  model-<type>.gguf (weights, tokenizer, chat template),     llama.cpp, Ollama,
            README.md                                                  LM Studio, transformers

Which Hugging Face class each model becomes is :mod:`attnkit.interop.hf_export`'s table; GGUF
takes the decoder-only models, as ``gpt2`` or ``llama`` (:mod:`attnkit.interop.gguf_export`).
Everything is checked before anything is written, and the directory appears whole or not at
all (built beside ``path`` and renamed). A model with no counterpart in the format is a
ValueError naming the field and the formats that would take it.

The tokenizer goes with the model, as the model was trained to read it: a classifier's text gets
``[CLS]`` in front, a translator's source ``<eos>`` at the end (attnkit's recipes do that), a
language model's prompt nothing. attnkit's char tokenizer is written as a BPE with no merges
(each character its own token): the same ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

from attnkit.accel.block_formats import QUANT_TYPES
from attnkit.files import atomic_directory
from attnkit.interop.hf_export import to_hf

__all__ = ["DTYPES", "FORMATS", "QUANTIZATIONS", "export", "hf_tokenizer"]

FORMATS = ("hf", "gguf")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# the block types export writes (gguf.quants), from the table of quantization types
QUANTIZATIONS = tuple(n.lower() for n, t in QUANT_TYPES.items() if t.written and t.block > 1)
SPECIAL_ROLES = ("pad", "bos", "eos", "unk", "cls")


def _check(format: str, dtype: str, quant: str | None, path: Path) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if quant is not None and format != "gguf":
        raise ValueError(
            f"quant={quant!r} needs format='gguf': a Hugging Face directory holds {list(DTYPES)}"
        )
    if quant is not None and quant not in QUANTIZATIONS:
        raise ValueError(f"quant must be one of {list(QUANTIZATIONS)} or None, got {quant!r}")
    if path.exists():
        raise FileExistsError(f"{path} exists; export writes a new directory (remove it first)")


def export(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    format: str = "hf",
    dtype: str = "f32",
    quant: str | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
    card: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and its ``tokenizer``) to the new directory ``path`` in ``format``.

    ``dtype``: the weights' type ("f32", "f16", "bf16"); ``quant`` (GGUF only): "q8_0",
    "q4_0" or "q4_1" blocks for the linear layers. ``chat_template``: a Jinja template stored
    with the tokenizer. ``card``: figures for the model card (README.md), e.g. the recipe and
    the last validation loss. Returns the path of the main file (the GGUF file) or directory.
    """
    path = Path(path)
    _check(format, dtype, quant, path)
    if tokenizer is not None and tokenizer.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                         f"vocab_size is {model.cfg.vocab_size}")  # fmt: skip
    if format == "hf":
        config, state = to_hf(model, getattr(model, "labels", None))  # refuses before writing
        config["torch_dtype"] = str(DTYPES[dtype]).removeprefix("torch.")  # as stored
        files = _hf_files(model, config, tokenizer, chat_template)
        with atomic_directory(path) as tmp:
            save_file(
                {k: v.to(DTYPES[dtype], copy=True) for k, v in _untied(config, state).items()},
                tmp / "model.safetensors",
                metadata={"format": "pt"},
            )
            for name, text in files.items():
                (tmp / name).write_text(text, encoding="utf-8")
            (tmp / "README.md").write_text(model_card(model, "hf", dtype, None, card), "utf-8")
        return path
    from attnkit.interop.gguf_export import gguf_name, write_gguf

    name = gguf_name(quant or dtype)
    with atomic_directory(path) as tmp:
        write_gguf(
            model,
            tmp / name,
            dtype=dtype,
            quant=quant,
            tokenizer=tokenizer,
            chat_template=chat_template,
            name=(card or {}).get("name") or path.name,
        )
        (tmp / "README.md").write_text(model_card(model, "gguf", dtype, quant, card), "utf-8")
    return path / name


def _untied(config: dict, state: dict) -> dict:
    """A tied output layer is stored once, as transformers stores it."""
    if not config.get("tie_word_embeddings"):
        return state
    drop = {
        "lm_head.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
    }
    return {k: v for k, v in state.items() if k not in drop}


def _special_tokens(tokenizer) -> dict[str, str]:
    """{role: token text} for the roles the tokenizer fills."""
    found = {}
    for role in SPECIAL_ROLES:
        token_id = getattr(tokenizer, f"{role}_id", None)
        if token_id is not None:
            found[role] = tokenizer.id_to_token(token_id)
    return found


def hf_tokenizer(tokenizer, family: str) -> HFTokenizer:
    """A ``tokenizers.Tokenizer`` that encodes as attnkit's ``tokenizer`` does for a model of
    ``family`` (its ``family``: "decoder-only", "encoder-decoder", ...)."""
    from attnkit.data.tokenizer import CharTokenizer, Tokenizer

    token = tokenizer.id_to_token
    if isinstance(tokenizer, CharTokenizer):  # one token per character: BPE with no merges
        vocab = {token(i): i for i in range(tokenizer.vocab_size)}
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=token(tokenizer.unk_id)))
        hf.decoder = decoders.Fuse()
    else:
        hf = HFTokenizer.from_str(tokenizer.hf.to_str())
    if isinstance(tokenizer, Tokenizer):  # attnkit's own: special tokens only on request
        hf.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in tokenizer.special_tokens]
        )
        cls_, eos = token(tokenizer.cls_id), token(tokenizer.eos_id)
        template = {
            "encoder-classifier": (f"{cls_} $A", cls_, tokenizer.cls_id),
            "encoder-decoder": (f"$A {eos}", eos, tokenizer.eos_id),
        }.get(family)
        if template is None:
            hf.post_processor = None
        else:
            single, text, token_id = template
            hf.post_processor = processors.TemplateProcessing(
                single=single, pair=f"{single} $B:1", special_tokens=[(text, token_id)]
            )
    return hf


def _hf_files(model, config: dict, tokenizer, chat_template: str | None) -> dict[str, str]:
    cfg = model.cfg
    generation = {
        k: config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(k) is not None
    }
    if model.family == "encoder-decoder":
        generation["decoder_start_token_id"] = cfg.bos_id
    files = {
        "config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps(generation, indent=2),
    }
    if tokenizer is None:
        return files
    hf = hf_tokenizer(tokenizer, model.family)
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_len,
        "clean_up_tokenization_spaces": False,
        **{f"{role}_token": text for role, text in _special_tokens(tokenizer).items()},
    }
    if chat_template:
        settings["chat_template"] = chat_template
    files["tokenizer.json"] = hf.to_str(pretty=True)
    files["tokenizer_config.json"] = json.dumps(settings, indent=2, ensure_ascii=False)
    return files


def model_card(model, format: str, dtype: str, quant: str | None, card: dict | None) -> str:
    """README.md: what the model is, its configuration, and the figures its run recorded."""
    cfg = model.cfg
    kind = {
        "decoder-only": "decoder-only language model",
        "encoder-decoder": "encoder-decoder translator",
        "encoder-classifier": "encoder classifier",
        "encoder-only": "encoder",
    }[model.family]
    weights = quant.upper() if quant else dtype
    layout = "GGUF" if format == "gguf" else "a Hugging Face directory"
    lines = [
        f"# {(card or {}).get('name', 'attnkit model')}",
        "",
        f"A {kind} made with attnkit, exported as {layout} "
        f"({weights} weights, {model.num_parameters():,} parameters).",
        "",
        "## Configuration",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {value} |" for name, value in cfg.to_dict().items() if name != "extra"]
    for title, value in (card or {}).items():
        if title == "name":
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "```",
            json.dumps(value, indent=1, ensure_ascii=False)
            if not isinstance(value, str)
            else value,
            "```",
        ]
    return "\n".join(lines) + "\n"
