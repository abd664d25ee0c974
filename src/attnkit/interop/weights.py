"""An architecture's tensors in both directions: the rows ``(attnkit, Hugging Face, GGUF)`` of
its description (:mod:`attnkit.interop.architectures`) as :class:`Link` s, and what reads them.

A row's names may end in ``[part]``, a block of a fused tensor's rows (q, k, v, gate, up: q, k
and v stacked in attnkit's ``in_proj``; Phi-3's ``qkv_proj`` and ``gate_up_proj``), and in
``~transform``: ``T`` (stored transposed: GPT-2's Conv1D), ``+1`` (stored as ``w - 1``: Gemma's
norms in Hugging Face's files), ``rope`` (llama.cpp's order of Llama's q / k rows: each head's
RoPE halves interleaved), ``offset`` (RoBERTa's position table, whose first ``pad_id + 1`` rows
no token reads), ``cols`` / ``rows`` (Marian's model dimension, reordered by
:func:`marian_permutation`: the columns of what reads the residual stream, the rows of what
writes it)::

    build        a file's tensors  -> the attnkit model, every tensor used, every shape checked
    weights_to   a model's state   -> a file's tensors
    plan         GGUF tensors      -> the rows of each attnkit weight (for packed layers)
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit.config import ModelConfig
from attnkit.interop.architecture import Architecture
from attnkit.interop.checkpoint import Tensors
from attnkit.models import EncoderClassifier
from attnkit.serialization import FAMILIES, build_empty

__all__ = [
    "Link", "build", "links", "marian_permutation", "permute", "plan", "unpermute", "weights_to"
]  # fmt: skip

PARTS = ("q", "k", "v", "gate", "up")  # the row blocks of fused tensors, in their order


@dataclass(frozen=True)
class Link:
    """One block of rows that attnkit and a file both hold: ``ours`` (``our_part`` of it, or
    all) is ``theirs`` (``their_part``, or all) after ``transform`` (see the module)."""

    ours: str
    our_part: str | None
    theirs: str
    their_part: str | None
    transform: str


_NAME = re.compile(r"([^\[~]+)(?:\[(\w+)\])?(?:~(T|\+1|rope|offset|cols|rows))?")


def links(arch: Architecture, fmt: str, cfg: ModelConfig) -> list[Link]:
    """Every link of ``arch`` in format ``fmt`` (one of its formats) for ``cfg``'s layers, the
    token table's tied copies left out (the output layer; Marian's target table), a feature's
    tensors where ``cfg`` has it (the pooler: ``Architecture.optional``)."""
    column = 1 + arch.formats.index(fmt)
    stack = (arch.our_layer, {"hf": arch.hf_layer, "gguf": "blk.{i}.", "e5": "l{i}."}[fmt])
    rows = [(row, "", "") for row in arch.top]
    rows += [(row, *(p.format(i=i) for p in stack)) for i in range(cfg.n_layers)
             for row in arch.layer]  # fmt: skip
    rows += [(row, f"decoder.layers.{i}.", f"model.decoder.layers.{i}.")
             for i in range(cfg.n_layers) for row in arch.decoder_layer]  # fmt: skip
    absent = tuple(p for p, feature in arch.optional.items() if not getattr(cfg, feature))
    found = []
    for row, mine, prefix in rows:
        ours, theirs = row[0], row[column] if len(row) > column else ""
        if not theirs or (cfg.tie_embeddings and ours in arch.ties):
            continue
        if absent and ours.removeprefix("encoder.").startswith(absent):
            continue
        our_name, our_part, _ = _NAME.fullmatch(ours).groups()
        their_name, their_part, transform = _NAME.fullmatch(theirs).groups()
        link = Link(mine + our_name, our_part, prefix + their_name, their_part, transform or "")
        found.append(link)
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


def permute(weight: Tensor, heads: int, inverse: bool = False) -> Tensor:
    """Hugging Face's q / k rows -> llama.cpp's (the converter's ``permute``): each head's
    (2, d_head / 2) RoPE halves -> (d_head / 2, 2) pairs; ``inverse``: back."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"permute: {rows} rows do not split into {heads} heads of pairs")
    blocks = (rows // heads // 2, 2) if inverse else (2, rows // heads // 2)
    return weight.reshape(heads, *blocks, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute(weight: Tensor, heads: int) -> Tensor:
    """llama.cpp's q / k rows -> Hugging Face's: the inverse of :func:`permute`."""
    return permute(weight, heads, inverse=True)


def marian_permutation(d_model: int) -> Tensor:
    """Marian's dimension m holds attnkit's dimension ``perm[m]``: the even dimensions (its
    sinusoids' sines) first, then the odd ones (cosines)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _heads(cfg: ModelConfig, link: Link) -> int:
    return cfg.n_heads if link.our_part == "q" else cfg.kv_heads


# transform -> (file -> attnkit, attnkit -> file), each of (tensor, link, cfg)
_TRANSFORMS = {
    "": (lambda t, link, cfg: t, lambda t, link, cfg: t),
    "T": (lambda t, link, cfg: t.t(), lambda t, link, cfg: t.t()),
    "+1": (lambda t, link, cfg: t + 1, lambda t, link, cfg: t - 1),
    "offset": (  # rows no token reads: zeros
        lambda t, link, cfg: t[cfg.pad_id + 1 :],
        lambda t, link, cfg: torch.cat([t.new_zeros(cfg.pad_id + 1, t.shape[1]), t]),
    ),
    "rope": (
        lambda t, link, cfg: unpermute(t, _heads(cfg, link)),
        lambda t, link, cfg: permute(t, _heads(cfg, link)),
    ),
    "cols": (
        lambda t, link, cfg: t[:, marian_permutation(cfg.d_model).argsort()],
        lambda t, link, cfg: t[:, marian_permutation(cfg.d_model)],
    ),
    "rows": (
        lambda t, link, cfg: t[marian_permutation(cfg.d_model).argsort()],
        lambda t, link, cfg: t[marian_permutation(cfg.d_model)],
    ),
}


def _model(arch: Architecture, cfg: ModelConfig) -> nn.Module:
    """The attnkit model of ``arch``'s family, built on the meta device (every weight is
    loaded next)."""
    if arch.family == "encoder-classifier":
        labels = cfg.extra.get("labels")
        return build_empty(
            lambda: EncoderClassifier(cfg, len(labels), pooling="cls", labels=labels)
        )
    return build_empty(lambda: FAMILIES[arch.family](cfg))


def _hf_name(name: str, names: set[str], arch: Architecture) -> str:
    """A file's tensor name as the description spells it: with or without the optional
    prefix (LlamaModel has no "model.", BertForMaskedLM has "bert."), an old name renamed."""
    for old, new in arch.hf_renames:
        name = re.sub(old, new, name)
    prefix = arch.hf_prefix
    if name not in names and prefix + name in names:
        return prefix + name
    if name not in names and name.startswith(prefix) and name[len(prefix) :] in names:
        return name[len(prefix) :]
    return name


def build(
    arch: Architecture, fmt: str, cfg: ModelConfig, tensors: Tensors, *,
    assign: bool = False, placeholders: frozenset[str] = frozenset(),
) -> nn.Module:  # fmt: skip
    """The attnkit model of ``cfg`` holding ``tensors`` (named as format ``fmt`` names
    them). Every tensor must be used, with the shape the config gives it. ``placeholders``:
    attnkit weights to leave unfilled (packed layers replace them next; their file tensors are
    not read). ``assign``: the tensors become the parameters (no copy)."""
    model = _model(arch, cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = links(arch, fmt, cfg)
    if fmt == "hf":
        names = {link.theirs for link in found}
        unused = arch.hf_unused + ("|lm_head\\.weight" if cfg.tie_embeddings else "")
        tensors.discard(lambda n: not re.fullmatch(unused, n))
        tensors = tensors.rename(lambda n: _hf_name(n, names, arch))
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
        rows += cfg.pad_id + 1 if group[0].transform == "offset" else 0
        shape = (rows, *ours[1:])
        if group[0].transform == "T":
            shape = shape[::-1]
        tensor = _TRANSFORMS[group[0].transform][0](tensors.take(theirs, shape), group[0], cfg)
        for link, piece in zip(group, _split(tensor, parts, cfg), strict=True):
            pieces[link.ours, link.our_part] = piece
    state = {}
    for ours, group in _grouped(found, "ours").items():
        if ours in placeholders:
            state[ours] = torch.empty(expected[ours])  # never written: packed layers next
        else:
            parts = [pieces[ours, link.our_part] for link in group]
            state[ours] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if cfg.tie_embeddings:  # the token table's copies
        state.update(dict.fromkeys(arch.ties, state[arch.table]))
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
        out[theirs] = _TRANSFORMS[group[0].transform][1](tensor, group[0], cfg).contiguous()
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
