"""Weights in and out: attnkit's own directories, Hugging Face layouts, GGUF files."""

from attnkit.interop.gpt2 import gpt2_from_hf_state_dict, gpt2_to_hf
from attnkit.interop.pretrained import (
    atomic_directory,
    from_pretrained,
    load_tokenizer_for,
    save_pretrained,
)

__all__ = [
    "atomic_directory",
    "from_pretrained",
    "gpt2_from_hf_state_dict",
    "gpt2_to_hf",
    "load_tokenizer_for",
    "save_pretrained",
]
