"""One description per architecture: how its files map to attnkit, read in every direction.

An :class:`Architecture` says once, for one family of checkpoints (the descriptions are in
:mod:`attnkit.interop.architectures`):

- its names: the Hugging Face ``model_type`` and classes, the GGUF ``general.architecture``;
- ``fixed``: the :class:`~attnkit.config.ModelConfig` values every model of it has (RMSNorm,
  SwiGLU, ...), and ``free``: the features a model of it may have or not (a sliding window);
- ``fields``: each a :class:`Field`, a ModelConfig field beside its ``config.json`` key and its
  GGUF metadata key, with the default a file that lacks the key means;
- ``hf_fixed``: ``config.json`` keys whose one value is what attnkit computes (read: refused at
  any other value; written: that value);
- ``top`` and ``layer``: each tensor as a row ``(attnkit, Hugging Face, GGUF)`` (or the
  description's ``formats``), which :mod:`attnkit.interop.weights` reads in both directions.

RoPE (``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` /
``partial_rotary_factor``; GGUF's ``rope.*`` keys and ``rope_freqs``), sliding windows
(``sliding_window``, ``layer_types``), the special token ids and a classifier's labels are read
and written here for every architecture alike::

    config_from_hf / config_to_hf      config.json        <-> ModelConfig
    config_from_gguf / gguf_metadata   <arch>.* metadata  <-> ModelConfig
    refusal                            a ModelConfig an architecture cannot hold, and why
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attnkit.config import ROPE_SCALINGS, ModelConfig
from attnkit.interop.hf_config import REQUIRED, HFConfig
from attnkit.interop.tokenizer import GGUF_IDS

__all__ = [
    "Architecture",
    "Field",
    "config_from_gguf",
    "config_from_hf",
    "config_to_hf",
    "gguf_metadata",
    "refusal",
]

# A model's features beyond its sizes, at the values a plain decoder has: an architecture
# takes a model only where each is its own fixed value or one it declares free.
PLAIN = dict(
    attention="full", window=None, global_every=0, rope_local_theta=None, qk_norm=False,
    sandwich_norms=False, qkv_bias=False, rotary_dim=None, rope_scaling=None,
    scale_embeddings=False, embedding_norm=False, type_vocab_size=0, n_experts=0, pooler=False,
)  # fmt: skip
# the rope_types a config.json may name (a GGUF file's factors are not one)
_HF_SCALINGS = {k: v for k, v in ROPE_SCALINGS.items() if k != "frequencies"}


@dataclass(frozen=True)
class Field:
    """A ModelConfig field ``ours`` (or a tuple of them), its ``config.json`` key ``hf`` and its
    GGUF key ``gguf`` (after ``<arch>.``); None where a format does not hold it. ``default``:
    what a file that lacks the key means (a callable of the values read so far, or REQUIRED).
    ``kind``: "int", "positive" (a float > 0), "dropout", or a dict of the file's values to
    attnkit's (``hidden_act`` -> ``(activation, gelu_approximation)``)."""

    ours: str | tuple[str, ...]
    hf: str | None
    gguf: str | None
    default: Any = REQUIRED
    kind: Any = "int"


@dataclass(frozen=True)
class Architecture:
    name: str
    title: str  # for messages: "Llama"
    hf_types: tuple[str, ...]  # config.json's model_type
    hf_classes: tuple[str, ...]  # the classes read; the first is the one written
    gguf: str | None  # general.architecture
    fixed: dict[str, Any]
    fields: tuple[Field, ...]
    top: tuple[tuple[str, ...], ...]  # (attnkit, then each of formats): weights.py
    layer: tuple[tuple[str, ...], ...]  # the same inside each layer
    free: frozenset[str] = frozenset()
    formats: tuple[str, ...] = ("hf", "gguf")  # the files the rows name tensors of
    family: str = "decoder-only"  # the attnkit model: its serialization.FAMILIES name
    decoder_layer: tuple[tuple[str, ...], ...] = ()  # a translator's decoder layers
    hf_fixed: dict[str, Any] = field(default_factory=dict)
    hf_ignored: tuple[str, ...] = ()  # keys that do not change the function
    hf_window: dict[str, Any] = field(default_factory=dict)  # written beside sliding_window
    our_layer: str = "decoder.layers.{i}."
    hf_layer: str = "model.layers.{i}."
    hf_prefix: str = "model."  # optional in a file (LlamaModel has none; BertModel neither)
    hf_unused: str = ""  # a regex of the tensors a file may hold that are not weights
    hf_renames: tuple[tuple[str, str], ...] = ()  # older names of tensors (a regex, a name)
    optional: dict[str, str] = field(default_factory=dict)  # tensors -> the feature they need
    position_offset: bool = False  # positions count from pad_id + 1 (RoBERTa)
    gguf_fixed: dict[str, Any] = field(default_factory=dict)  # what a GGUF file implies
    gguf_lacks: frozenset[str] = frozenset()  # free features llama.cpp's graph lacks
    tied: bool = False  # tie_word_embeddings' default
    table: str = "embeddings.tokens.weight"  # the token table, and its copies when tied:
    ties: tuple[str, ...] = ("lm_head.weight",)
    pad_is_eos: bool = True  # a file with no pad id pads with EOS (else 0)
    rope_theta: float = 10000.0


# --------------------------------------------------------------------------------------------
# The config, both formats
# --------------------------------------------------------------------------------------------


def _read(source: HFConfig, key: str, f: Field, values: dict[str, Any]) -> Any:
    default = f.default(values) if callable(f.default) else f.default
    if isinstance(f.kind, dict):
        return source.get_choice(key, f.kind, default)
    read = {"int": source.get_int, "positive": source.get_positive, "dropout": source.get_dropout,
            "bool": source.get_bool}  # fmt: skip
    return read[f.kind](key, default)


def _read_fields(source: HFConfig, arch: Architecture, fmt: str, values: dict, prefix: str = ""):
    """Every field ``arch`` keeps in format ``fmt`` into ``values``; two keys of one field must
    agree (GPT-2's n_ctx and n_positions), but for dropout rates, which only training reads:
    the first is taken, and every one is written."""
    keys: dict[str, str] = {}
    for f in arch.fields:
        key = getattr(f, fmt)
        if key is None:
            continue
        value = _read(source, prefix + key, f, values)
        if isinstance(f.ours, tuple):  # one key, several fields
            values.update(zip(f.ours, value, strict=True))
            continue
        if f.ours in keys and f.kind == "dropout":
            continue
        if f.ours in keys and value != values[f.ours]:
            raise source.error(
                f"{prefix}{key}={value!r} differs from {keys[f.ours]}={values[f.ours]!r}: "
                f"attnkit has one {f.ours}"
            )
        values[f.ours], keys[f.ours] = value, prefix + key


def _value(cfg: ModelConfig, name: str | tuple[str, ...]) -> Any:
    """A field as a file holds it: the head width and KV heads resolved."""
    if isinstance(name, tuple):
        return tuple(_value(cfg, n) for n in name)
    return {"head_dim": cfg.d_head, "n_kv_heads": cfg.kv_heads}.get(name, getattr(cfg, name))


def _free(arch: Architecture) -> frozenset[str]:
    """The features a model of ``arch`` may set as it likes: its free ones and its fields."""
    fields = [name for f in arch.fields for name in (f.ours if isinstance(f.ours, tuple) else
                                                     (f.ours,))]  # fmt: skip
    return arch.free | frozenset(fields)


def _config(arch: Architecture, source: HFConfig, values: dict[str, Any], extra: dict):
    """The ModelConfig of ``values`` on top of the architecture's fixed ones; a fixed feature
    the file sets otherwise, or a value ModelConfig refuses, is the file's error."""
    d_model, heads, width = values["d_model"], values["n_heads"], values.get("head_dim")
    if width is not None and d_model % heads == 0 and width == d_model // heads:
        values["head_dim"] = None  # the usual width: no need to say it
    if values.get("rotary_dim") == (values.get("head_dim") or d_model // heads):
        values["rotary_dim"] = None
    free = _free(arch)
    for name, value in values.items():
        if name in arch.fixed and value != arch.fixed[name]:
            raise source.error(f"{name}={value!r}: attnkit's {arch.title} has {arch.fixed[name]!r}")
        if name in PLAIN and name not in free | arch.fixed.keys() and value != PLAIN[name]:
            raise source.error(
                f"{name}={value!r} is not supported for {arch.title} (attnkit's {arch.title} "
                f"has {PLAIN[name]!r})"
            )
    try:
        return ModelConfig(**{**arch.fixed, **values}, extra={"source": arch.name, **extra})
    except ValueError as error:
        raise source.error(str(error)) from None


def _ids(get: Callable[[str], Any], vocab: int, arch: Architecture) -> dict[str, int | None]:
    """bos_id, eos_id, pad_id (None where absent or outside the vocabulary; no pad: EOS or 0)."""
    found = {}
    for role in ("bos", "eos", "pad"):
        value = get(role)
        value = value[0] if isinstance(value, list) and value else value
        valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab
        found[f"{role}_id"] = value if valid else None
    if found["pad_id"] is None:
        found["pad_id"] = found["eos_id"] if arch.pad_is_eos and found["eos_id"] is not None else 0
    return found


def config_from_hf(arch: Architecture, hf: HFConfig, names=()) -> ModelConfig:
    """A ModelConfig from a ``config.json`` of ``arch`` (every key checked); ``names``: the
    file's tensors, whose presence says whether a model has its optional parts (a pooler)."""
    for key, value in arch.hf_fixed.items():
        hf.expect(key, *(value if isinstance(value, tuple) else (value,)))
    hf.ignore(*arch.hf_ignored)
    values: dict[str, Any] = {}
    _read_fields(hf, arch, "hf", values)
    if arch.fixed.get("position") == "rope":
        values.update(_rope_from_hf(hf, arch, values))
    values.update(_window_from_hf(hf))
    for role in ("bos", "eos", "pad"):
        hf.get_token_id(f"{role}_token_id", values["vocab_size"])  # types checked
    start = "decoder_start_token_id" if arch.family == "encoder-decoder" else "bos_token_id"
    ids = {"bos": start, "eos": "eos_token_id", "pad": "pad_token_id"}  # generation's start
    values.update(_ids(lambda role: hf.get(ids[role]), values["vocab_size"], arch))
    lm = arch.family in (
        "decoder-only",
        "encoder-decoder",
    )  # (an encoder has no output layer to tie)
    tie = hf.get_bool("tie_word_embeddings", values.get("tie_embeddings", arch.tied))
    if tie != values.get("tie_embeddings", tie):  # Marian: attnkit ties all three or none
        raise hf.error(f"tie_word_embeddings={tie} differs from the embeddings' sharing")
    values["tie_embeddings"] = tie if lm else False
    if arch.position_offset:  # a token at t reads row pad_id + 1 + t of the table
        values["max_len"] -= values["pad_id"] + 1
        if values["max_len"] < 1:
            table = values["max_len"] + values["pad_id"] + 1
            raise hf.error(f"max_position_embeddings={table} leaves no positions after "
                           f"pad_token_id={values['pad_id']}")  # fmt: skip
    for prefix, feature in arch.optional.items():
        rows = [row[1] for row in arch.top if row[0].startswith(prefix) and len(row) > 1]
        found = {n.removeprefix(arch.hf_prefix) for n in names}
        values[feature] = any(r.removeprefix(arch.hf_prefix) in found for r in rows)
    extra: dict[str, Any] = {}
    if arch.family == "encoder-classifier":
        extra["labels"] = _labels(hf)
    hf.check_unknown()
    if isinstance(hf.data.get("eos_token_id"), list):
        extra["eos_token_ids"] = hf.data["eos_token_id"]  # generate stops at the first only
    return _config(arch, hf, values, extra)


def _labels(hf: HFConfig) -> list[str]:
    """A classifier's class names: ``id2label`` (or ``num_labels`` classes LABEL_0 ...)."""
    id2label = hf.get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise hf.error(f"id2label must be an object, got {type(id2label).__name__}")
    count = len(id2label) if id2label else hf.get_int("num_labels", 2)
    hf.ignore("num_labels")
    if count < 2:
        raise hf.error(
            f"{count} label(s): a regression head is not supported; attnkit's "
            "EncoderClassifier needs at least 2 classes"
        )
    names = {int(k): str(v) for k, v in (id2label or {}).items()}
    return [names.get(c, f"LABEL_{c}") for c in range(count)]


def _rope_from_hf(hf: HFConfig, arch: Architecture, values: dict) -> dict[str, Any]:
    """rope_theta, rotary_dim and rope_scaling (Gemma: rope_local_theta too) from
    ``rope_parameters`` (transformers >= 5) or the older top-level keys."""
    params, scaling = hf.get("rope_parameters"), hf.get("rope_scaling")
    legacy = {k: hf.data[k] for k in ("rope_theta", "partial_rotary_factor") if k in hf}
    hf.ignore("rope_theta", "partial_rotary_factor", "rope_local_base_freq")
    if params is None:
        params = {**legacy, **(scaling or {})}
    elif scaling not in (None, params):
        raise hf.error(f"rope_scaling={scaling!r} differs from rope_parameters={params!r}")
    if not isinstance(params, dict):
        raise hf.error(f"rope_parameters must be an object, got {params!r}")
    if "full_attention" not in params and "sliding_attention" not in params:
        params = {**legacy, **params}  # transformers keeps some beside rope_parameters
    found: dict[str, Any] = {}
    if "full_attention" in params or "sliding_attention" in params:  # Gemma 3: one per kind
        kinds = {kind: params.get(kind, {}) for kind in ("full_attention", "sliding_attention")}
        found = _rope_parameters(hf, kinds["full_attention"], "full_attention", arch, values)
        local = _rope_parameters(hf, kinds["sliding_attention"], "sliding_attention", arch, {})
        found["rope_local_theta"] = local["rope_theta"]
        if local.get("rope_scaling") or found.get("rope_scaling"):
            raise hf.error("RoPE scaling per layer kind is not implemented in attnkit")
    else:
        found = _rope_parameters(hf, params, "rope_parameters", arch, values)
        if "rope_local_base_freq" in hf:  # Gemma 3 before transformers 5
            found["rope_local_theta"] = hf.get_float("rope_local_base_freq", minimum=1.0)
    return found


def _rope_parameters(hf, params, where: str, arch, values) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise hf.error(f"{where} must be an object, got {params!r}")
    rope = HFConfig(params, f"{hf.source}: {where}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    rope.ignore("type")
    theta = rope.get_float("rope_theta", arch.rope_theta, minimum=1.0)
    found: dict[str, Any] = {"rope_theta": theta}
    if values:
        width = values.get("head_dim") or values["d_model"] // values["n_heads"]
        factor = rope.get_float("partial_rotary_factor", 1.0)
        found["rotary_dim"] = int(factor * width)
    if kind in _HF_SCALINGS:
        found["rope_scaling"] = {"rope_type": kind}
        for name in _HF_SCALINGS[kind]:
            found["rope_scaling"][name] = rope.get_positive(name)
    elif kind != "default":
        raise rope.error(
            f"rope_type={kind!r}: this RoPE scaling is not implemented in attnkit (it "
            f"implements {sorted(_HF_SCALINGS)}; docs/MODELS.md)"
        )
    rope.check_unknown()
    return found


def _layer_types(every: int, n: int) -> list[str]:
    """``layer_types`` of ``n`` layers: every ``every``-th full, the rest on the window."""
    return ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
            for i in range(n)]  # fmt: skip


def _window_from_hf(hf: HFConfig) -> dict[str, Any]:
    """attention, window and global_every from ``sliding_window``, ``use_sliding_window``
    (Qwen), ``layer_types`` and the older ``sliding_window_pattern``: every layer full, every
    layer on the window, or every k-th layer full and the rest on the window (Gemma 3)."""
    window, types = hf.get("sliding_window"), hf.get("layer_types")
    if types is None and hf.get("sliding_window_pattern") is not None:  # Gemma 3, older
        types = _layer_types(hf.get_int("sliding_window_pattern"), hf.get_int("num_hidden_layers"))
    hf.ignore("sliding_window_pattern", "_sliding_window_pattern")
    use = hf.get("use_sliding_window")  # Qwen: windows only from layer max_window_layers on
    below = hf.get_int("max_window_layers", 0, minimum=0) if use else 0
    if types is None and below:
        n = hf.get_int("num_hidden_layers")
        types = ["full_attention"] * min(below, n) + ["sliding_attention"] * (n - below)
    hf.ignore("max_window_layers")
    if types is None:  # every layer alike
        if window is None or use is False:
            return {}
        return {"attention": "window", "window": hf.get_int("sliding_window")}
    if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"}:
        raise hf.error(f"layer_types={types!r}: attnkit knows full_attention and "
                       "sliding_attention layers")  # fmt: skip
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    if len(full) == len(types):
        return {}
    k = full[0] + 1 if full else 0  # every k-th layer full (0: none)
    if types != _layer_types(k, len(types)):
        raise hf.error(
            f"layer_types {types} do not repeat every {k} layers (k - 1 sliding, then one "
            "full), as attnkit's global_every needs"
        )
    found = {"attention": "window", "window": hf.get_int("sliding_window")}
    return {**found, "global_every": k} if k else found


def config_to_hf(arch: Architecture, cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as ``arch``'s transformers class reads it."""
    config: dict[str, Any] = {"model_type": arch.hf_types[0], "architectures": [arch.hf_classes[0]]}
    for f in arch.fields:
        if f.hf is not None:
            value = _value(cfg, f.ours)
            if isinstance(f.kind, dict):
                value = next(k for k, v in f.kind.items() if v == value)
            config[f.hf] = value
    config.update({k: (v[0] if isinstance(v, tuple) else v) for k, v in arch.hf_fixed.items()})
    if cfg.position == "rope":
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
        if cfg.rotary_dim is not None:
            rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.d_head
        if cfg.rope_local_theta is not None:
            local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
            rope = {"full_attention": rope, "sliding_attention": local}
        config["rope_parameters"] = rope
    if cfg.attention == "window":
        config.update(arch.hf_window, sliding_window=cfg.window)
        if cfg.global_every:
            config["layer_types"] = _layer_types(cfg.global_every, cfg.n_layers)
    if arch.position_offset:
        config["max_position_embeddings"] = cfg.max_len + cfg.pad_id + 1
    if arch.family in ("decoder-only", "encoder-decoder"):
        config["tie_word_embeddings"] = cfg.tie_embeddings
    if arch.family == "encoder-decoder":
        config["decoder_start_token_id"] = cfg.bos_id
    config.update(
        pad_token_id=cfg.pad_id,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
    )
    return config


def config_from_gguf(
    arch: Architecture, metadata: dict[str, Any], source: str, *, vocab: int | None,
    tied: bool, rope_factors: list[float] | None = None,
) -> ModelConfig:  # fmt: skip
    """A ModelConfig from a GGUF file's ``<arch>.*`` metadata (every key checked), the
    tokenizer's special ids, whether the file has an output layer (``tied``) and its
    ``rope_freqs`` (``rope_factors``)."""
    a = arch.gguf
    keys = {k: v for k, v in metadata.items() if k.startswith(f"{a}.")}
    md = HFConfig(keys, f"{source} (GGUF metadata)")
    values: dict[str, Any] = {"vocab_size": md.get_int(f"{a}.vocab_size", vocab or REQUIRED)}
    _read_fields(md, arch, "gguf", values, prefix=f"{a}.")
    width = values.get("head_dim") or values["d_model"] // values["n_heads"]
    if arch.fixed.get("position") == "rope":
        values["rope_theta"] = md.get_float(f"{a}.rope.freq_base", arch.rope_theta, minimum=1.0)
        values["rotary_dim"] = md.get_int(f"{a}.rope.dimension_count", width)
        kind = md.get(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            factor = md.get_positive(f"{a}.rope.scaling.factor")
            values["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif kind != "none":
            raise md.error(
                f"{a}.rope.scaling.type={kind!r}: this RoPE scaling is not implemented in "
                "attnkit (it implements 'linear' and rope_freqs; docs/MODELS.md)"
            )
        if rope_factors is not None:
            values["rope_scaling"] = {"rope_type": "frequencies", "factors": rope_factors}
        md.ignore(f"{a}.rope.scaling.factor", f"{a}.rope.scaling.original_context_length")
        md.ignore(f"{a}.rope.scaling.finetuned")
    window = md.get_int(f"{a}.attention.sliding_window", 0, minimum=0)
    if window:
        values.update(attention="window", window=window)
    experts = md.get_int(f"{a}.expert_count", 0, minimum=0)
    if experts:
        raise md.error(f"{a}.expert_count={experts}: mixture-of-experts files are not supported")
    md.ignore(f"{a}.expert_used_count")
    md.check_unknown()
    values.update(arch.gguf_fixed)
    values.update(_ids(lambda role: metadata.get(f"tokenizer.ggml.{GGUF_IDS[role]}"),
                       values["vocab_size"], arch))  # fmt: skip
    values["tie_embeddings"] = tied
    return _config(arch, md, values, {"file": source.rsplit("/", 1)[-1]})


def gguf_metadata(arch: Architecture, cfg: ModelConfig) -> dict[str, int | float | str]:
    """The ``<arch>.*`` keys of ``cfg`` (counts as ints, the rest as floats), as llama.cpp's
    converter writes them."""
    a = arch.gguf
    found: dict[str, int | float | str] = {f"{a}.vocab_size": cfg.vocab_size}
    for f in arch.fields:
        if f.gguf is not None and f.ours not in arch.gguf_fixed:
            value = _value(cfg, f.ours)
            found[f"{a}.{f.gguf}"] = value if f.kind == "int" else float(value)
    if cfg.position == "rope":
        found[f"{a}.rope.freq_base"] = float(cfg.rope_theta)
        found[f"{a}.rope.dimension_count"] = cfg.rotary_dim or cfg.d_head
        if (cfg.rope_scaling or {}).get("rope_type") == "linear":
            found[f"{a}.rope.scaling.type"] = "linear"
            found[f"{a}.rope.scaling.factor"] = float(cfg.rope_scaling["factor"])
    if cfg.attention == "window" or "window" in arch.free - arch.gguf_lacks:
        found[f"{a}.attention.sliding_window"] = cfg.window or 0
    return found


def refusal(arch: Architecture, cfg: ModelConfig, where: str) -> tuple[str, Any, str] | None:
    """(field, value, what ``arch`` needs) for the first feature of ``cfg`` that ``arch``
    cannot hold in ``where`` ("hf" or "gguf"); None when it holds them all."""
    free = _free(arch) - (arch.gguf_lacks if where == "gguf" else frozenset())
    plain = [(k, v) for k, v in PLAIN.items() if k not in arch.fixed]
    for name, value in [*arch.fixed.items(), *plain]:  # the fixed ones first
        if name not in free and getattr(cfg, name) != value:
            return name, getattr(cfg, name), f"{arch.title} needs {value!r}"
    if cfg.kv_heads != cfg.n_heads and "n_kv_heads" not in free:
        return "n_kv_heads", cfg.n_kv_heads, f"{arch.title} has no grouped-query attention"
    if cfg.d_head * cfg.n_heads != cfg.d_model and "head_dim" not in free:
        return "head_dim", cfg.head_dim, f"{arch.title}'s heads are d_model / n_heads wide"
    for f in arch.fields:  # a value the file's key has no name for
        if (
            isinstance(f.kind, dict)
            and getattr(f, where)
            and _value(cfg, f.ours) not in (f.kind.values())
        ):
            name = f.ours[0] if isinstance(f.ours, tuple) else f.ours
            takes = sorted({v[0] if isinstance(v, tuple) else v for v in f.kind.values()})
            return name, getattr(cfg, name), f"{arch.title} takes {takes}"
    if where == "gguf":  # what a GGUF file of it cannot say otherwise
        for name, value in arch.gguf_fixed.items():  # (GPT-2's GELU: gguf_export warns)
            if name in arch.free and getattr(cfg, name) != value:
                return name, getattr(cfg, name), f"{arch.title}'s GGUF files mean {value!r}"
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "frequencies" and where == "hf":
        return "rope_scaling", "frequencies", "a config.json names a rope_type, not factors"
    return None
