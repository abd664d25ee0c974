"""One description per architecture, read in every direction.

An :class:`Architecture` says once how one family of checkpoints maps to attnkit's
:class:`~attnkit.models.DecoderLM`:

- its names: the Hugging Face ``model_type`` and classes, the GGUF ``general.architecture``;
- ``fixed``: the :class:`~attnkit.config.ModelConfig` values every model of it has (RMSNorm,
  SwiGLU, ...), and ``free``: the features a model of it may have or not (a sliding window);
- ``fields``: each a :class:`Field`, a ModelConfig field beside its ``config.json`` key and its
  GGUF metadata key, with the default a file that lacks the key means;
- ``hf_fixed``: ``config.json`` keys whose one value is what attnkit computes (read: refused at
  any other value; written: that value);
- ``top`` and ``layer``: each tensor as a row ``(attnkit, Hugging Face, GGUF)`` (see
  :func:`links`).

RoPE (``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` /
``partial_rotary_factor``; GGUF's ``rope.*`` keys and ``rope_freqs``), sliding windows
(``sliding_window``, ``layer_types``) and the special token ids are read and written here for
every architecture alike. Hugging Face import and export, GGUF import and export and the
packing plan of :mod:`attnkit.interop.gguf` all read the same description::

    config_from_hf / config_to_hf      config.json        <-> ModelConfig
    config_from_gguf / gguf_metadata   <arch>.* metadata  <-> ModelConfig
    build / weights_to                 tensors            <-> a DecoderLM's state dict
    plan                               GGUF tensors        -> the rows of each linear layer
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import REQUIRED, HFConfig
from attnkit.models import DecoderLM
from attnkit.serialization import build_empty

__all__ = [
    "Architecture",
    "Field",
    "build",
    "config_from_gguf",
    "config_from_hf",
    "config_to_hf",
    "gguf_metadata",
    "links",
    "permute",
    "plan",
    "refusal",
    "unpermute",
    "weights_to",
]

PARTS = ("q", "k", "v", "gate", "up")  # the row blocks of fused tensors, in their order
# A model's features beyond its sizes, at the values a plain decoder has: an architecture
# takes a model only where each is its own fixed value or one it declares free.
PLAIN = dict(
    attention="full", window=None, global_every=0, rope_local_theta=None, qk_norm=False,
    sandwich_norms=False, qkv_bias=False, rotary_dim=None, rope_scaling=None,
    scale_embeddings=False, embedding_norm=False, type_vocab_size=0, n_experts=0, pooler=False,
)  # fmt: skip
# rope_type in a config.json -> the numbers attnkit reads for it (config.ROPE_SCALINGS)
_HF_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class Field:
    """A ModelConfig field ``ours``, its ``config.json`` key ``hf`` and its GGUF key ``gguf``
    (after ``<arch>.``); None where a format does not hold it. ``default``: what a file that
    lacks the key means (a callable of the values read so far, or REQUIRED). ``kind``: "int",
    "positive" (a float > 0), "dropout", or a dict of the file's values to attnkit's."""

    ours: str
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
    top: tuple[tuple[str, str, str], ...]  # (attnkit, Hugging Face, GGUF)
    layer: tuple[tuple[str, str, str], ...]  # the same inside each layer
    free: frozenset[str] = frozenset()
    hf_fixed: dict[str, Any] = field(default_factory=dict)
    hf_ignored: tuple[str, ...] = ()  # keys that do not change the function
    hf_window: dict[str, Any] = field(default_factory=dict)  # written beside sliding_window
    hf_layer: str = "model.layers.{i}."
    hf_prefix: str = "model."  # optional in a file (LlamaModel has none)
    hf_buffers: tuple[str, ...] = ()  # tensors a file may hold that are not weights
    gguf_fixed: dict[str, Any] = field(default_factory=dict)  # what a GGUF file implies
    gguf_lacks: frozenset[str] = frozenset()  # free features llama.cpp's graph lacks
    tied: bool = False  # tie_word_embeddings' default
    pad_is_eos: bool = True  # a file with no pad id pads with EOS (else 0)
    rope_theta: float = 10000.0


# --------------------------------------------------------------------------------------------
# The config, both formats
# --------------------------------------------------------------------------------------------


def _read(source: HFConfig, key: str, f: Field, values: dict[str, Any]) -> Any:
    default = f.default(values) if callable(f.default) else f.default
    if isinstance(f.kind, dict):
        return source.get_choice(key, f.kind, default)
    read = {"int": source.get_int, "positive": source.get_positive, "dropout": source.get_dropout}
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
        if f.ours in keys and f.kind == "dropout":
            continue
        if f.ours in keys and value != values[f.ours]:
            raise source.error(
                f"{prefix}{key}={value!r} differs from {keys[f.ours]}={values[f.ours]!r}: "
                f"attnkit has one {f.ours}"
            )
        values[f.ours], keys[f.ours] = value, prefix + key


def _value(cfg: ModelConfig, name: str) -> Any:
    """A field as a file holds it: the head width and KV heads resolved."""
    return {"head_dim": cfg.d_head, "n_kv_heads": cfg.kv_heads}.get(name, getattr(cfg, name))


def _config(arch: Architecture, source: HFConfig, values: dict[str, Any], extra: dict):
    """The ModelConfig of ``values`` on top of the architecture's fixed ones; a fixed feature
    the file sets otherwise, or a value ModelConfig refuses, is the file's error."""
    d_model, heads, width = values["d_model"], values["n_heads"], values.get("head_dim")
    if width is not None and d_model % heads == 0 and width == d_model // heads:
        values["head_dim"] = None  # the usual width: no need to say it
    if values.get("rotary_dim") == (values.get("head_dim") or d_model // heads):
        values["rotary_dim"] = None
    for name, value in values.items():
        if name in arch.fixed and value != arch.fixed[name]:
            raise source.error(f"{name}={value!r}: attnkit's {arch.title} has {arch.fixed[name]!r}")
        if name in PLAIN and name not in arch.free | arch.fixed.keys() and value != PLAIN[name]:
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


def config_from_hf(arch: Architecture, hf: HFConfig) -> ModelConfig:
    """A ModelConfig from a ``config.json`` of ``arch`` (every key checked)."""
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
    values.update(_ids(lambda role: hf.get(f"{role}_token_id"), values["vocab_size"], arch))
    values["tie_embeddings"] = hf.get_bool("tie_word_embeddings", arch.tied)
    hf.check_unknown()
    extra = {}
    if isinstance(hf.data.get("eos_token_id"), list):
        extra["eos_token_ids"] = hf.data["eos_token_id"]  # generate stops at the first only
    return _config(arch, hf, values, extra)


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


def _window_from_hf(hf: HFConfig) -> dict[str, Any]:
    """attention, window and global_every from ``sliding_window``, ``use_sliding_window``
    (Qwen), ``layer_types`` and the older ``sliding_window_pattern``: every layer full, every
    layer on the window, or every k-th layer full and the rest on the window (Gemma 3)."""
    window, types = hf.get("sliding_window"), hf.get("layer_types")
    if types is None and hf.get("sliding_window_pattern") is not None:  # Gemma 3, older
        k = hf.get_int("sliding_window_pattern")
        types = ["full_attention" if (i + 1) % k == 0 else "sliding_attention"
                 for i in range(hf.get_int("num_hidden_layers"))]  # fmt: skip
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
    pattern = ["full_attention" if k and (i + 1) % k == 0 else "sliding_attention"
               for i in range(len(types))]  # fmt: skip
    if types != pattern:
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
        k = cfg.global_every
        if k:
            config["layer_types"] = [
                "full_attention" if (i + 1) % k == 0 else "sliding_attention"
                for i in range(cfg.n_layers)
            ]
    config.update(
        tie_word_embeddings=cfg.tie_embeddings,
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
    values.update(_ids(lambda role: metadata.get(f"tokenizer.ggml.{_GGUF_IDS[role]}"),
                       values["vocab_size"], arch))  # fmt: skip
    values["tie_embeddings"] = tied
    return _config(arch, md, values, {"file": source.rsplit("/", 1)[-1]})


_GGUF_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}


def gguf_metadata(arch: Architecture, cfg: ModelConfig) -> dict[str, int | float]:
    """The ``<arch>.*`` keys of ``cfg`` (counts as ints, the rest as floats), as llama.cpp's
    converter writes them."""
    a = arch.gguf
    found: dict[str, int | float] = {f"{a}.vocab_size": cfg.vocab_size}
    for f in arch.fields:
        if f.gguf is not None and f.ours not in arch.gguf_fixed:
            value = _value(cfg, f.ours)
            found[f"{a}.{f.gguf}"] = value if f.kind == "int" else float(value)
    if cfg.position == "rope":
        found[f"{a}.rope.freq_base"] = float(cfg.rope_theta)
        found[f"{a}.rope.dimension_count"] = cfg.rotary_dim or cfg.d_head
        if (cfg.rope_scaling or {}).get("rope_type") == "linear":
            found[f"{a}.rope.scaling.factor"] = float(cfg.rope_scaling["factor"])
    if cfg.attention == "window" or "window" in arch.free - arch.gguf_lacks:
        found[f"{a}.attention.sliding_window"] = cfg.window or 0
    return found


def refusal(arch: Architecture, cfg: ModelConfig, where: str) -> tuple[str, Any, str] | None:
    """(field, value, what ``arch`` needs) for the first feature of ``cfg`` that ``arch``
    cannot hold in ``where`` ("hf" or "gguf"); None when it holds them all."""
    free = arch.free - (arch.gguf_lacks if where == "gguf" else frozenset())
    plain = [(k, v) for k, v in PLAIN.items() if k not in arch.fixed]
    for name, value in [*arch.fixed.items(), *plain]:  # the fixed ones first
        if name not in free and getattr(cfg, name) != value:
            return name, getattr(cfg, name), f"{arch.title} needs {value!r}"
    if where == "gguf":  # what a GGUF file of it cannot say otherwise
        for name, value in arch.gguf_fixed.items():
            if name in free and getattr(cfg, name) != value:
                return name, getattr(cfg, name), f"{arch.title}'s GGUF files mean {value!r}"
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "frequencies" and where == "hf":
        return "rope_scaling", "frequencies", "a config.json names a rope_type, not factors"
    return None


# --------------------------------------------------------------------------------------------
# The tensors: links between attnkit's names and a file's
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One block of rows that attnkit and a file both hold: ``ours`` (``our_part`` of it, or
    all) is ``theirs`` (``their_part``, or all) after ``transform``: "T" (stored transposed,
    GPT-2's Conv1D), "+1" (Gemma's norms store ``w - 1``), "rope" (llama.cpp's q / k rows)."""

    ours: str
    our_part: str | None
    theirs: str
    their_part: str | None
    transform: str


_NAME = re.compile(r"([^\[~]+)(?:\[(\w+)\])?(?:~(T|\+1|rope))?")


def links(arch: Architecture, fmt: str, cfg: ModelConfig) -> list[Link]:
    """Every link of ``arch`` in format ``fmt`` ("hf" or "gguf") for ``cfg``'s layers, the
    output layer left out when it is tied. A row's names may end in ``[part]`` (a block of a
    fused tensor's rows: q, k, v, gate, up) and ``~transform``."""
    column = {"hf": 1, "gguf": 2}[fmt]
    rows = [(row, "") for row in arch.top]
    rows += [(row, str(i)) for i in range(cfg.n_layers) for row in arch.layer]
    found = []
    for row, i in rows:
        ours, theirs = row[0], row[column]
        if not theirs or (ours == "lm_head.weight" and cfg.tie_embeddings):
            continue
        our_name, our_part, _ = _NAME.fullmatch(ours).groups()
        their_name, their_part, transform = _NAME.fullmatch(theirs).groups()
        if i:
            our_name = f"decoder.layers.{i}.{our_name}"
            their_name = (arch.hf_layer if fmt == "hf" else "blk.{i}.").format(i=i) + their_name
        found.append(Link(our_name, our_part, their_name, their_part, transform or ""))
    return found


def _rows(cfg: ModelConfig, part: str) -> int:
    """How many rows the block ``part`` of a fused tensor has."""
    if part == "q":
        return cfg.n_heads * cfg.d_head
    return cfg.kv_heads * cfg.d_head if part in ("k", "v") else cfg.d_ff  # gate, up: d_ff


def _split(tensor: Tensor, parts: list[str | None], cfg: ModelConfig) -> list[Tensor]:
    if parts == [None]:
        return [tensor]
    return list(tensor.split([_rows(cfg, p) for p in parts]))


def _grouped(found: list[Link], key: str) -> dict[str, list[Link]]:
    """Links by their ``key`` tensor ("ours" or "theirs"), each list in the parts' order."""
    groups: dict[str, list[Link]] = defaultdict(list)
    for link in found:
        groups[getattr(link, key)].append(link)
    part = "our_part" if key == "ours" else "their_part"
    order = {p: i for i, p in enumerate(PARTS)}
    return {k: sorted(v, key=lambda x: order.get(getattr(x, part), 0)) for k, v in groups.items()}


def permute(weight: Tensor, heads: int) -> Tensor:
    """Hugging Face's q / k rows -> llama.cpp's: each head's two RoPE halves interleaved (the
    converter's ``permute``)."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def unpermute(weight: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`permute`: llama.cpp's q / k rows (heads, d_head / 2, 2) -> (heads,
    2, d_head / 2), the halves Hugging Face's RoPE pairs."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"unpermute: {rows} rows do not split into {heads} heads of pairs")
    pairs = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def _heads(cfg: ModelConfig, link: Link) -> int:
    return cfg.n_heads if link.our_part == "q" else cfg.kv_heads


def _from_file(tensor: Tensor, link: Link, cfg: ModelConfig) -> Tensor:
    if link.transform == "T":
        return tensor.t()
    if link.transform == "+1":
        return tensor + 1
    return unpermute(tensor, _heads(cfg, link)) if link.transform == "rope" else tensor


def _to_file(tensor: Tensor, link: Link, cfg: ModelConfig) -> Tensor:
    if link.transform == "T":
        return tensor.t()
    if link.transform == "+1":
        return tensor - 1
    return permute(tensor, _heads(cfg, link)) if link.transform == "rope" else tensor


def build(
    arch: Architecture, fmt: str, cfg: ModelConfig, tensors: Tensors, *,
    assign: bool = False, placeholders: frozenset[str] = frozenset(),
) -> DecoderLM:  # fmt: skip
    """The DecoderLM of ``cfg`` holding ``tensors`` (named as format ``fmt`` names them).
    Every tensor must be used, with the shape the config gives it. ``placeholders``: attnkit
    weights to leave unfilled (packed layers replace them next; their file tensors are not
    read). ``assign``: the tensors become the parameters (no copy)."""
    model = build_empty(lambda: DecoderLM(cfg))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = links(arch, fmt, cfg)
    if fmt == "hf":
        names = {link.theirs for link in found}
        buffers = arch.hf_buffers + (("lm_head.weight",) if cfg.tie_embeddings else ())
        tensors.discard(lambda n: not n.endswith(buffers))
        tensors = tensors.rename(lambda n: arch.hf_prefix + n if arch.hf_prefix + n in names else n)
    pieces: dict[tuple[str, str | None], Tensor] = {}
    for theirs, group in _grouped(found, "theirs").items():
        if all(link.ours in placeholders for link in group):
            tensors.discard(lambda n, skipped=theirs: n != skipped)
            continue
        ours = expected[group[0].ours]
        parts = [link.their_part for link in group]
        if parts != [None]:  # a fused tensor: its blocks' rows
            rows = sum(_rows(cfg, p) for p in parts)
        else:  # all of ours, or one block of it
            rows = _rows(cfg, group[0].our_part) if group[0].our_part else ours[0]
        shape = (rows, *ours[1:])
        if group[0].transform == "T":
            shape = shape[::-1]
        tensor = _from_file(tensors.take(theirs, shape), group[0], cfg)
        for link, piece in zip(group, _split(tensor, parts, cfg), strict=True):
            pieces[link.ours, link.our_part] = piece
    state = {}
    for ours, group in _grouped(found, "ours").items():
        if ours in placeholders:
            state[ours] = torch.empty(expected[ours])  # never written: packed layers next
        else:
            parts = [pieces[ours, link.our_part] for link in group]
            state[ours] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embeddings.tokens.weight"]
    tensors.check_all_used()
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True, assign=assign)
    return model.eval()


def weights_to(arch: Architecture, fmt: str, cfg: ModelConfig, state: dict) -> dict[str, Tensor]:
    """A DecoderLM's ``state`` dict as format ``fmt`` names and lays out its tensors."""
    found = links(arch, fmt, cfg)
    pieces = {}
    for ours, group in _grouped(found, "ours").items():
        tensor = state[ours].detach().float()
        parts = [link.our_part for link in group]
        for link, piece in zip(group, _split(tensor, parts, cfg), strict=True):
            pieces[link.ours, link.our_part] = piece
    out = {}
    for theirs, group in _grouped(found, "theirs").items():
        tensor = torch.cat([pieces[link.ours, link.our_part] for link in group])
        out[theirs] = _to_file(tensor, group[0], cfg).contiguous()
    return out


def plan(arch: Architecture, cfg: ModelConfig) -> dict[str, list[tuple[str, slice, int]]]:
    """attnkit weight -> the GGUF tensors whose rows make it, in order: (name, which of its
    rows, the heads to unpermute them by or 0). The rows of a weight are its blocks' rows, so
    a packed layer is made of the file's blocks alone."""
    found = links(arch, "gguf", cfg)
    starts: dict[tuple[str, str | None], slice] = {}
    for theirs, group in _grouped(found, "theirs").items():
        at = 0
        for link in group:
            n = _rows(cfg, link.their_part) if link.their_part else None
            starts[theirs, link.their_part] = slice(at, None if n is None else at + n)
            at += n or 0
    return {
        ours: [
            (
                link.theirs,
                starts[link.theirs, link.their_part],
                _heads(cfg, link) if link.transform == "rope" else 0,
            )
            for link in group
        ]
        for ours, group in _grouped(found, "ours").items()
    }
