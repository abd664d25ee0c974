"""Weights in and out: Hugging Face model layouts <-> attnkit models."""

from attnkit.interop.gpt2 import gpt2_from_hf_state_dict, gpt2_to_hf

__all__ = ["gpt2_from_hf_state_dict", "gpt2_to_hf"]
