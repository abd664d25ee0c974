"""Weights in and out: attnkit's own directories, Hugging Face layouts, GGUF files.

::

    pretrained.py   from_pretrained (dispatch through LOADERS), save_pretrained, load_tokenizer_for
    hf.py           Hugging Face directories: config.json + safetensors -> BERT / GPT-2 / Llama
    hf_config.py    config.json read field by field, types checked, unknown fields refused
    checkpoint.py   safetensors files, single or sharded, never unpickled
    bert.py         BERT  -> EncoderModel / EncoderClassifier
    gpt2.py         GPT-2 <-> DecoderLM
    llama.py        Llama -> DecoderLM (RoPE, RMSNorm, SwiGLU, grouped-query attention)
    gguf.py         GGUF files of Llama models, dequantized to float32
    tokenizer.py    tokenizer.json of a Hugging Face directory, the tokenizer inside a GGUF file
    embeddings.py   mean-pooled, L2-normalised sentence embeddings (sentence-transformers)
"""

from attnkit.interop.embeddings import cosine_similarities, sentence_embeddings
from attnkit.interop.gguf import load_gguf
from attnkit.interop.gpt2 import gpt2_from_hf_state_dict, gpt2_to_hf
from attnkit.interop.hf import load_hf_directory
from attnkit.interop.pretrained import (
    LOADERS,
    atomic_directory,
    from_pretrained,
    load_tokenizer_for,
    save_pretrained,
)
from attnkit.interop.tokenizer import PretrainedTokenizer

__all__ = [
    "LOADERS",
    "PretrainedTokenizer",
    "atomic_directory",
    "cosine_similarities",
    "from_pretrained",
    "gpt2_from_hf_state_dict",
    "gpt2_to_hf",
    "load_gguf",
    "load_hf_directory",
    "load_tokenizer_for",
    "save_pretrained",
    "sentence_embeddings",
]
