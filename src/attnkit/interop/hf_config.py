"""Reading a Hugging Face ``config.json``: every field typed, every field accounted for.

A loader asks for the fields it needs (``cfg.get_int("hidden_size")``), declares the fields that
must keep their default because attnkit cannot represent anything else
(``cfg.expect("attention_bias", False)``), and at the end calls :meth:`HFConfig.check_unknown`.
A field that nobody read and that is not on the list of fields that never change the forward
pass (:data:`NEUTRAL_FIELDS`: dropout rates, generation defaults, bookkeeping) is an error: a
field attnkit does not know might change the model, and a silently wrong model is worse than a
refusal. Every error names the file, the field, the value found and what was expected::

    ValueError: /m/config.json: hidden_size must be an int >= 1, got '32' (str)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.files import read_json

__all__ = ["GENERIC_DEFAULTS", "NEUTRAL_FIELDS", "REQUIRED", "HFConfig"]

REQUIRED: Any = object()  # a default that means: the field must be there

# Fields any Hugging Face config may carry that do not change what a model computes in eval
# mode: bookkeeping, the special ids (read where they matter), an FFN computed in chunks (the
# same numbers), and generation defaults (attnkit's generate takes them as arguments).
NEUTRAL_FIELDS = frozenset(
    """
    _name_or_path architectures model_type transformers_version dtype torch_dtype use_cache
    initializer_range gradient_checkpointing id2label label2id problem_type finetuning_task
    tokenizer_class task_specific_params output_attentions output_hidden_states return_dict
    torchscript tie_word_embeddings bos_token_id eos_token_id pad_token_id sep_token_id
    decoder_start_token_id prefix chunk_size_feed_forward classifier_dropout attn_implementation
    use_bfloat16 tf_legacy_loss

    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
    temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores
    return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
    """.split()
)

# Fields any config may carry, fine at these values (the defaults) and refused at any other.
GENERIC_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "pruned_heads": ({},),
    "is_encoder_decoder": (False,),
    "add_cross_attention": (False,),
    "tie_encoder_decoder": (False,),
    "cross_attention_hidden_size": (None,),
}


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


class HFConfig:
    """The fields of one ``config.json`` (or any dict of them), read with their types checked.

    ``source`` names the file in every error message.
    """

    def __init__(self, data: dict[str, Any], source: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        self.data = data
        self.source = source
        self._read: set[str] = set()

    @classmethod
    def from_file(cls, path: Path) -> HFConfig:
        return cls(read_json(path), str(path))

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def get(self, name: str, default: Any = None) -> Any:
        """The raw value (marks the field as read); ``default`` when absent."""
        self._read.add(name)
        return self.data.get(name, default)

    def _value(self, name: str, default: Any) -> Any:
        self._read.add(name)
        if name in self.data and self.data[name] is not None:
            return self.data[name]
        if default is REQUIRED:
            raise self.error(f"the field {name!r} is missing (or null)")
        return default

    def get_int(self, name: str, default: Any = REQUIRED, *, minimum: int = 1) -> int:
        value = self._value(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"{name} must be an int >= {minimum}, got {_describe(value)}")
        return value

    def get_float(self, name: str, default: Any = REQUIRED, *, minimum: float = 0.0) -> float:
        """A number >= minimum (ints accepted)."""
        value = self._value(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
            raise self.error(f"{name} must be a number >= {minimum}, got {_describe(value)}")
        return float(value)

    def get_positive(self, name: str, default: Any = REQUIRED) -> float:
        value = self.get_float(name, default)
        if value <= 0:
            raise self.error(f"{name} must be a number > 0, got {value!r}")
        return value

    def get_dropout(self, name: str, default: float = 0.0) -> float:
        value = self.get_float(name, default)
        if value >= 1:
            raise self.error(f"{name} must be a dropout rate in [0, 1), got {value!r}")
        return value

    def get_bool(self, name: str, default: Any = REQUIRED) -> bool:
        value = self._value(name, default)
        if not isinstance(value, bool):
            raise self.error(f"{name} must be true or false, got {_describe(value)}")
        return value

    def get_choice(self, name: str, choices: dict[str, Any] | tuple, default: Any = REQUIRED):
        """A string among ``choices``; with a dict, the value it maps to."""
        value = self._value(name, default)
        if not isinstance(value, str) or value not in choices:
            raise self.error(
                f"{name}={value!r} is not supported by attnkit; expected one of {sorted(choices)}"
            )
        return choices[value] if isinstance(choices, dict) else value

    def get_token_id(self, name: str, vocab_size: int) -> int | None:
        """A special token id, None when absent or outside the vocabulary. A list (Llama 3 has
        several EOS ids) gives its first entry."""
        value = self.get(name)
        if isinstance(value, list) and value:
            value = value[0]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{name} must be a token id (int), got {_describe(value)}")
        return value if 0 <= value < vocab_size else None

    def expect(self, name: str, *allowed: Any, why: str = "") -> None:
        """Refuse a field whose value attnkit cannot represent (absent is fine)."""
        self._read.add(name)
        if name not in self.data:
            return
        value = self.data[name]
        if not any(value == a and type(value) is type(a) for a in allowed):
            shown = " or ".join(repr(a) for a in allowed)
            raise self.error(
                f"{name}={value!r} is not supported by attnkit (expected {shown})"
                + (f": {why}" if why else "")
            )

    def ignore(self, *names: str) -> None:
        """Fields this architecture carries that do not change the forward pass."""
        self._read.update(names)

    def check_unknown(self) -> None:
        """Refuse fields that no one read and that are not known to be neutral."""
        if "quantization_config" in self.data:
            raise self.error(
                "the weights are quantized (quantization_config is set); attnkit reads "
                "float checkpoints only (or GGUF files, which it dequantizes)"
            )
        for name, allowed in GENERIC_DEFAULTS.items():
            if name not in self._read:  # (unless the architecture said what it takes)
                self.expect(name, *allowed)
        unknown = sorted(set(self.data) - self._read - NEUTRAL_FIELDS)
        if unknown:
            raise self.error(
                f"unknown field(s) {unknown}: attnkit cannot tell whether they change the model, "
                "so it refuses to load it"
            )
