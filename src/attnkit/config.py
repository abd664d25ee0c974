"""ModelConfig: every choice a Transformer makes, in one typed, validated dataclass.

One flat config serves all three families (encoder-only, encoder-decoder, decoder-only); named
presets reproduce the paper's models and the well-known checkpoints::

    cfg = ModelConfig.preset("paper-base")              # Table 3 of the paper, ~63M parameters
    cfg = ModelConfig.preset("tiny", position="rope")   # any field can be overridden

Impossible combinations fail on construction with a ValueError that names the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from attnkit import checks

__all__ = ["PRESETS", "ModelConfig"]

NORMS = ("post", "pre")
NORM_TYPES = ("layernorm", "rmsnorm")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "none")
ACTIVATIONS = ("relu", "gelu", "swiglu", "geglu")
GELU_APPROXIMATIONS = ("none", "tanh")
ATTENTIONS = ("full", "window", "linear")
# RoPE scalings (position.rope_frequencies computes them) -> the numbers each needs
ROPE_SCALINGS = {
    "linear": ("factor",),  # every frequency divided by factor
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "frequencies": ("factors",),  # one divisor per frequency (a GGUF file's rope_freqs)
}


@dataclass
class ModelConfig:
    """The shape and the choices of one Transformer.

    Sizes: ``vocab_size``, ``d_model`` (D), ``n_heads`` (h; d_k = d_v = D / h), ``n_layers`` (per
    stack: the encoder-decoder has ``n_layers`` of each), ``d_ff`` (the FFN's inner width),
    ``max_len`` (longest sequence for absolute positions; also the KV cache's default size).

    Choices: ``norm`` is where LayerNorm sits, ``"post"`` (the paper: LayerNorm(x + Sublayer(x)))
    or ``"pre"`` (x + Sublayer(LayerNorm(x)), with a final norm after the stack); ``norm_type``
    LayerNorm or RMSNorm; ``position`` how order enters; ``activation`` of the FFN;
    ``tie_embeddings`` shares the token embedding with the output projection (and, in the
    encoder-decoder, between source and target: the paper's three-way tying).
    """

    vocab_size: int = 512
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    max_len: int = 128
    dropout: float = 0.0
    attention_dropout: float = 0.0
    pad_id: int = 0
    bos_id: int | None = 1
    eos_id: int | None = 2
    norm: str = "pre"
    norm_type: str = "layernorm"
    norm_eps: float = 1e-5
    position: str = "learned"
    rope_theta: float = 10000.0
    activation: str = "gelu"
    gelu_approximation: str = "none"
    bias: bool = True
    qkv_bias: bool = False  # biases on the query, key and value projections alone (Qwen2)
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (the paper)
    embedding_norm: bool = False  # a norm right after the embeddings (BERT)
    type_vocab_size: int = 0  # token types (BERT's segment A / B); 0 = none
    pooler: bool = False  # BERT's pooler: tanh(W h_[CLS] + b), used by the classifier
    n_kv_heads: int | None = None  # None = n_heads; fewer = grouped-query attention
    attention: str = "full"
    window: int | None = None
    head_dim: int | None = None  # None = d_model / n_heads; Gemma 3 sets it apart
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Gemma 3)
    sandwich_norms: bool = False  # Pre-LN plus a norm on each sublayer's output (Gemma 2, 3)
    global_every: int = 0  # with attention="window": every k-th layer attends fully (Gemma 3)
    rope_local_theta: float | None = None  # RoPE base of the window layers (None: rope_theta)
    rotary_dim: int | None = None  # RoPE on each head's first rotary_dim dimensions (Phi-3)
    rope_scaling: dict[str, Any] | None = None  # position.ROPE_SCALINGS: longer contexts
    n_experts: int = 0  # 0 = a dense FFN
    moe_top_k: int = 2
    label_smoothing: float = 0.0  # recorded for training (the paper: 0.1)
    # softmax attention's implementation, a name of backends.ATTENTION ("sdpa", "math", or one a
    # speed lever registers): the run's choice, not saved with the model (as Hugging Face's)
    attn_implementation: str = "sdpa"
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (source checkpoint...)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_len"):
            checks.positive_int(f"ModelConfig.{name}", getattr(self, name))
        # d_ff = 0 (with bias=False): the FFN adds nothing, an attention-only model
        checks.positive_int("ModelConfig.d_ff", self.d_ff, minimum=0)
        for name, choices in (
            ("norm", NORMS),
            ("norm_type", NORM_TYPES),
            ("position", POSITIONS),
            ("activation", ACTIVATIONS),
            ("gelu_approximation", GELU_APPROXIMATIONS),
            ("attention", ATTENTIONS),
        ):
            checks.one_of(f"ModelConfig.{name}", getattr(self, name), choices)
        for name in ("dropout", "attention_dropout", "label_smoothing"):
            checks.number_in(f"ModelConfig.{name}", getattr(self, name), 0.0, 1.0)
        if not isinstance(self.norm_eps, int | float) or not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if self.head_dim is not None:
            checks.positive_int("ModelConfig.head_dim", self.head_dim)
        elif self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} must divide d_model={self.d_model} "
                "(or set head_dim)"
            )
        if not isinstance(self.global_every, int) or self.global_every < 0:
            raise ValueError(
                f"ModelConfig.global_every must be an int >= 0, got {self.global_every!r}"
            )
        if self.global_every and self.attention != "window":
            raise ValueError("ModelConfig: global_every needs attention='window'")
        if self.sandwich_norms and self.norm != "pre":
            raise ValueError("ModelConfig: sandwich_norms needs norm='pre'")
        if self.n_kv_heads is not None:
            checks.positive_int("ModelConfig.n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"ModelConfig: n_heads={self.n_heads} must be a multiple of "
                    f"n_kv_heads={self.n_kv_heads}"
                )
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(
                f"ModelConfig: sinusoidal positions need an even d_model, got {self.d_model}"
            )
        if self.position == "rope" and self.d_head % 2:
            raise ValueError(
                f"ModelConfig: rope needs an even head width, got d_head={self.d_head}"
            )
        if self.position == "rope" and not self.rope_theta > 1:
            raise ValueError(f"ModelConfig.rope_theta must be > 1, got {self.rope_theta!r}")
        if self.rotary_dim is not None:
            checks.positive_int("ModelConfig.rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or self.rotary_dim > self.d_head or self.position != "rope":
                raise ValueError(
                    f"ModelConfig.rotary_dim must be even, at most d_head={self.d_head} and "
                    f"with position='rope', got {self.rotary_dim} with {self.position!r}"
                )
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"ModelConfig.qkv_bias must be true or false, got {self.qkv_bias!r}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if value is None and name != "pad_id":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value < self.vocab_size
            ):
                raise ValueError(
                    f"ModelConfig.{name} must be a token id in [0, vocab_size={self.vocab_size}), "
                    f"got {value!r}"
                )
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ValueError(
                f"ModelConfig.type_vocab_size must be an int >= 0, got {self.type_vocab_size!r}"
            )
        if self.attention == "window":
            if self.window is None:
                raise ValueError("ModelConfig: attention='window' needs window=<int >= 1>")
            checks.positive_int("ModelConfig.window", self.window)
        if self.attention == "linear" and self.position == "alibi":
            raise ValueError("ModelConfig: ALiBi cannot be combined with linear attention")
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be an int >= 0, got {self.n_experts!r}")
        if self.n_experts:
            checks.positive_int("ModelConfig.moe_top_k", self.moe_top_k)
            if self.moe_top_k > self.n_experts:
                raise ValueError(
                    f"ModelConfig: moe_top_k={self.moe_top_k} exceeds n_experts={self.n_experts}"
                )

    def _check_rope_scaling(self) -> None:
        scaling, where = self.rope_scaling, "ModelConfig.rope_scaling"
        kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
        if kind not in ROPE_SCALINGS:
            raise ValueError(
                f"{where}: rope_type {kind!r} is not implemented; attnkit implements "
                f"{sorted(ROPE_SCALINGS)} (docs/MODELS.md)"
            )
        if sorted(scaling) != sorted(["rope_type", *ROPE_SCALINGS[kind]]):
            raise ValueError(f"{where}: {kind!r} takes {list(ROPE_SCALINGS[kind])}, got {scaling}")
        if kind == "frequencies":
            factors, n = scaling["factors"], (self.rotary_dim or self.d_head) // 2
            if not (isinstance(factors, list) and len(factors) == n and all(
                isinstance(f, int | float) and f > 0 for f in factors
            )):  # fmt: skip
                raise ValueError(f"{where}: factors must be {n} numbers > 0, got {factors!r}")
        elif not all(isinstance(scaling[k], int | float) and scaling[k] > 0 for k in scaling
                     if k != "rope_type"):  # fmt: skip
            raise ValueError(f"{where}: every value must be a number > 0, got {scaling}")

    @property
    def d_head(self) -> int:
        """d_k = d_v = d_model / n_heads, or ``head_dim`` where it is set."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    def layer_attention(self, layer: int) -> tuple[str, int | None, float]:
        """(attention, window, RoPE base) of self-attention layer ``layer``: with
        ``global_every`` k, layers k - 1, 2k - 1, ... attend fully with ``rope_theta`` and the
        rest over the window with ``rope_local_theta``."""
        if self.global_every and (layer + 1) % self.global_every == 0:
            return "full", None, self.rope_theta
        if self.global_every:
            return "window", self.window, self.rope_local_theta or self.rope_theta
        return self.attention, self.window, self.rope_theta

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def position_limit(self) -> int | None:
        """The most positions a sequence may have: max_len where the positions are a table
        (learned, sinusoidal); None where they are computed (rotary, ALiBi) or absent."""
        return self.max_len if self.position in ("learned", "sinusoidal") else None

    # ----------------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named configuration, with any field overridden: ``preset("tiny", n_layers=4)``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        _check_fields(overrides, f"preset {name!r}")
        values = {**PRESETS[name]["config"], **overrides}
        return cls(**values)

    def replace(self, **changes: Any) -> ModelConfig:
        _check_fields(changes, "ModelConfig.replace")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as saved (``attn_implementation``, the run's choice, left out)."""
        values = dataclasses.asdict(self)
        del values["attn_implementation"]
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        if not isinstance(values, dict):
            raise TypeError(f"ModelConfig.from_dict expects a dict, got {type(values).__name__}")
        _check_fields(values, "ModelConfig.from_dict")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


def _check_fields(values: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(known)}")


_PAPER = dict(
    vocab_size=37000,  # the paper's shared source-target BPE vocabulary (section 5.1)
    d_model=512,
    n_heads=8,
    n_layers=6,
    d_ff=2048,
    max_len=1024,
    dropout=0.1,
    norm="post",
    position="sinusoidal",
    activation="relu",
    tie_embeddings=True,  # source embedding = target embedding = output projection
    scale_embeddings=True,  # "we multiply those weights by sqrt(d_model)" (section 3.4)
    label_smoothing=0.1,
)

# Each preset: the family it is meant for (for `attnkit models`) and its config values.
PRESETS: dict[str, dict[str, Any]] = {
    "paper-base": {"family": "encoder-decoder", "config": _PAPER},
    "paper-big": {
        "family": "encoder-decoder",
        "config": {**_PAPER, "d_model": 1024, "n_heads": 16, "d_ff": 4096, "dropout": 0.3},
    },
    "gpt2-small": {
        "family": "decoder-only",
        "config": dict(
            vocab_size=50257,
            d_model=768,
            n_heads=12,
            n_layers=12,
            d_ff=3072,
            max_len=1024,
            dropout=0.1,
            attention_dropout=0.1,
            norm="pre",
            position="learned",
            activation="gelu",
            gelu_approximation="tanh",
            tie_embeddings=True,
            pad_id=50256,
            bos_id=50256,
            eos_id=50256,
        ),
    },
    "bert-base": {
        "family": "encoder-only",
        "config": dict(
            vocab_size=30522,
            d_model=768,
            n_heads=12,
            n_layers=12,
            d_ff=3072,
            max_len=512,
            dropout=0.1,
            attention_dropout=0.1,
            norm="post",
            norm_eps=1e-12,
            position="learned",
            activation="gelu",
            embedding_norm=True,
            type_vocab_size=2,
            tie_embeddings=False,
            pad_id=0,
            bos_id=101,  # [CLS]
            eos_id=102,  # [SEP]
        ),
    },
    "lm-small": {
        "family": "decoder-only",
        "config": dict(
            vocab_size=8192,
            d_model=256,
            n_heads=8,
            n_layers=4,
            d_ff=1024,
            max_len=256,
            norm="pre",
            position="learned",
            activation="gelu",
            tie_embeddings=True,
        ),
    },
    "mt-small": {
        "family": "encoder-decoder",
        "config": dict(
            vocab_size=8192,
            d_model=256,
            n_heads=8,
            n_layers=3,
            d_ff=1024,
            max_len=256,
            norm="post",
            position="sinusoidal",
            activation="relu",
            tie_embeddings=True,
            scale_embeddings=True,
        ),
    },
    "tiny": {
        "family": "any",
        "config": dict(
            vocab_size=512,
            d_model=64,
            n_heads=4,
            n_layers=2,
            d_ff=256,
            max_len=128,
            norm="pre",
            position="learned",
            activation="gelu",
        ),
    },
}
