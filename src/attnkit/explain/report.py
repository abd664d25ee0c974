"""An interactive attention report: ONE self-contained HTML file that works offline.

``render_attention_html(sections, path)`` writes a page where you choose an attention (encoder
self-attention, decoder self-attention, cross-attention, ...), a layer and a head (or the mean
of the heads), and see its weight matrix drawn on a canvas: row i is query token i, column j
key token j, and the colour is the weight ``softmax(q_i k_j^T / sqrt(d_k))``. Hovering a row
highlights it and lists its weights as numbers (the 20 largest, for rows past 64 keys). Below,
the model view draws every layer x head small, as bertviz's does; a click opens one. The
selection is kept in the address (``report.html#section=0&layer=1&head=2``, ``head=mean``), so
a view can be shared as a link. PNG pictures can be shown below, linked by relative path.

Long inputs stay light: past 250,000 weights a section stores one byte per weight (scaled by
each matrix's largest), and past 32 Mi weights only the mean of the heads, so a 2,048-token
text through a 6-layer model opens in a few seconds (the browser test measures it).

Offline and safe by construction:

- all CSS and JavaScript are inline; nothing is fetched (no CDN), and a Content-Security-Policy
  forbids scripts, styles and connections from anywhere else;
- tokens are data, never markup: the weights and tokens travel as JSON in a
  ``<script type="application/json">`` block, with ``<``, ``>`` and ``&`` written as ``\\u003c``
  ``\\u003e`` ``\\u0026`` so no token can close the block; the page reads it with
  ``JSON.parse`` and puts tokens on the page only through ``textContent`` (never
  ``innerHTML``); the title, notes and captions are HTML-escaped;
- the file is written to a temporary name and renamed, so it is never half-written.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.explain._attentions import select_example
from attnkit.explain._checks import as_array, check_positive_int, check_tokens
from attnkit.files import atomic_write_text

__all__ = ["attention_sections", "render_attention_html", "rollout_sections"]

PathLike = str | os.PathLike[str]

_SECTION_KEYS = {"name", "query_tokens", "key_tokens", "weights", "description"}
# Weights kept as JSON numbers up to FLOAT_LIMIT per section; above, as one byte each (base64),
# and above BYTE_LIMIT as the mean of the heads, one byte each (2,048 tokens x 6 layers fits).
FLOAT_LIMIT = 250_000
BYTE_LIMIT = 32 * 2**20
_WEIGHTS_SHAPE = (
    "(L, H, N, M) = (layers, heads, queries, keys) (one layer (H, N, M): weights[None])"
)


# --------------------------------------------------------------------------------------------
# From a model's attentions to report sections
# --------------------------------------------------------------------------------------------


def _stacks(attentions, tokens, src_tokens, tgt_tokens, index: int, owner: str):
    """Example ``index`` of each attention stack: (key, layers, query tokens, key tokens), with
    key None for a list of attentions, else "encoder", "decoder" or "cross"."""
    example = select_example(attentions, index, owner)
    if isinstance(example, list):
        if tokens is None:
            raise ValueError(f"{owner}: tokens are required for a list of attentions")
        return [(None, example, tokens, tokens)]
    ends = {
        "encoder": (src_tokens, src_tokens),
        "decoder": (tgt_tokens, tgt_tokens),
        "cross": (tgt_tokens, src_tokens),
    }
    stacks = []
    for key, layers in example.items():
        queries, keys = ends[key]
        if queries is None or keys is None:
            raise ValueError(
                f"{owner}: attentions[{key!r}] needs "
                + ("src_tokens" if key == "encoder" else "tgt_tokens")
                + ("" if key != "cross" else " and src_tokens")
            )
        stacks.append((key, layers, queries, keys))
    return stacks


def attention_sections(
    attentions,
    tokens: Sequence[str] | None = None,
    *,
    src_tokens: Sequence[str] | None = None,
    tgt_tokens: Sequence[str] | None = None,
    index: int = 0,
) -> list[dict[str, Any]]:
    """Report sections from a model's ``return_attention=True`` output, for batch element ``index``.

    - a list of (B, H, N, M) tensors (encoder-only or decoder-only models) with ``tokens``: one
      section "self-attention";
    - the encoder-decoder dict ``{"encoder", "decoder", "cross"}`` with ``src_tokens`` and
      ``tgt_tokens``: "encoder self-attention" (src x src), "decoder self-attention"
      (tgt x tgt) and "cross-attention" (tgt queries x src keys).
    """
    names = {
        None: "self-attention",
        "encoder": "encoder self-attention",
        "decoder": "decoder self-attention",
        "cross": "cross-attention",
    }
    stacks = _stacks(attentions, tokens, src_tokens, tgt_tokens, index, "attention_sections")
    return [
        {"name": names[key], "query_tokens": queries, "key_tokens": keys, "weights": layers}
        for key, layers, queries, keys in stacks
    ]


def rollout_sections(
    attentions,
    tokens: Sequence[str] | None = None,
    *,
    src_tokens: Sequence[str] | None = None,
    tgt_tokens: Sequence[str] | None = None,
    index: int = 0,
) -> list[dict[str, Any]]:
    """Report sections of attention rollout (:mod:`attnkit.explain.rollout`), taking the same
    arguments as :func:`attention_sections`: for each self-attention stack, "layer" l shows
    the rollout through layers 0..l (one matrix: heads averaged, the residual counted)."""
    from attnkit.explain.rollout import rollout_by_layer

    stacks = _stacks(attentions, tokens, src_tokens, tgt_tokens, index, "rollout_sections")
    sections = []
    for key, layers, queries, _ in stacks:
        if key == "cross":  # rollout follows one stack's residual stream
            continue
        rolled = rollout_by_layer([w[None] for w in layers])[:, 0]  # (L, N, N)
        sections.append(
            {
                "name": "attention rollout" if key is None else f"{key} rollout",
                "query_tokens": queries,
                "weights": rolled[:, None],  # (L, 1, N, N)
                "description": "layer l: the rollout through layers 0..l (heads averaged, "
                "residual counted): row i = the share of each input token in position i",
            }
        )
    return sections


# --------------------------------------------------------------------------------------------
# Checking and packing the data
# --------------------------------------------------------------------------------------------


def _pack_section(section, number: int, decimals: int) -> dict[str, Any]:
    """One section as plain JSON data: tokens, shape and the weights flattened, rounded."""
    owner = "render_attention_html"
    where = f"sections[{number}]"
    if not isinstance(section, Mapping):
        raise TypeError(f"{owner}: {where} must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - _SECTION_KEYS)
    missing = sorted({"name", "query_tokens", "weights"} - set(section))
    if unknown or missing:
        problem = f"unknown keys {unknown}" if unknown else f"no keys {missing}"
        raise ValueError(
            f"{owner}: {where} has {problem}; expected name, query_tokens, weights "
            f"(L, H, N, M), and optionally key_tokens, description"
        )
    name = section["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{owner}: {where}['name'] must be a non-empty string, got {name!r}")
    description = section.get("description", "")
    if not isinstance(description, str):
        raise TypeError(f"{owner}: {where}['description'] must be a string")
    weights = as_array(section["weights"], owner, f"{where}['weights']", 4, _WEIGHTS_SHAPE)
    layers, heads, n, m = weights.shape
    if min(weights.shape) == 0:
        raise ValueError(f"{owner}: {where}['weights'] is empty, shape {weights.shape}")
    queries = check_tokens(
        section["query_tokens"],
        owner,
        f"{where}['query_tokens']",
        n,
        f"weights of shape {weights.shape} has N={n} query rows",
    )
    keys = section.get("key_tokens")
    keys = check_tokens(
        queries if keys is None else keys,
        owner,
        f"{where}['key_tokens']",
        m,
        f"weights of shape {weights.shape} has M={m} key columns",
    )
    packed = {
        "name": name,
        "description": description,
        "query_tokens": queries,
        "key_tokens": keys,
        "shape": [layers, heads, n, m],
    }
    if weights.size <= FLOAT_LIMIT:  # short inputs: every weight as a number
        packed["weights"] = [round(float(w), decimals) for w in weights.reshape(-1)]
        return packed
    if weights.size > BYTE_LIMIT:  # long inputs: the mean of the heads only
        weights = weights.mean(axis=1, keepdims=True)
        packed["shape"][1] = 1
        packed["heads_averaged"] = True
        if weights.size > BYTE_LIMIT:
            raise ValueError(
                f"{owner}: {where} is too large for one page even with its heads averaged: "
                f"{layers} layers x {n} x {m} weights (at most {BYTE_LIMIT:,}); "
                f"pass fewer layers (weights[:k]) or a shorter text"
            )
    # one byte per weight, scaled by each (layer, head) matrix's largest: weight ~ byte/255*s
    scales = weights.reshape(weights.shape[0] * weights.shape[1], -1).max(axis=1)
    scaled = weights / np.maximum(scales, 1e-30).reshape((*weights.shape[:2], 1, 1))
    data = np.rint(np.clip(scaled, 0.0, 1.0) * 255).astype(np.uint8)
    packed.update(
        encoding="u8",
        scales=[float(x) for x in scales],
        data=base64.b64encode(data.tobytes()).decode("ascii"),
    )
    return packed


def _json_for_script(data: Any) -> str:
    """JSON that is safe inside <script type="application/json">: no '<', '>' or '&' at all.

    Those three only occur inside JSON strings (tokens), where ``\\u003c`` etc. mean the same
    characters; so ``</script>`` and ``<!--`` cannot appear, whatever the tokens are.
    """
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escape)
    return text


def _image_href(image: PathLike, report_dir: Path) -> str:
    """A relative URL for a picture beside the report; anything that would fetch is refused."""
    text = os.fspath(image)
    if not isinstance(text, str) or not text:
        raise ValueError(f"render_attention_html: images: expected a file path, got {image!r}")
    scheme = urllib.parse.urlsplit(text).scheme
    if (scheme and not re.fullmatch(r"[A-Za-z]", scheme)) or text.startswith("//"):
        raise ValueError(
            f"render_attention_html: images: {text!r} is a URL; the report is offline, so "
            f"give the path of a file, relative to the report or absolute"
        )
    path = Path(text)
    if path.is_absolute():
        path = Path(os.path.relpath(path, report_dir.resolve()))
    return urllib.parse.quote(path.as_posix(), safe="/")


def _images(images, report_dir: Path) -> list[tuple[str, str]]:
    """``images`` as (href, caption) pairs: each a path, or a (path, caption) pair."""
    pairs = []
    for number, item in enumerate(images):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str):
            image, caption = item
        elif isinstance(item, str | os.PathLike):
            image, caption = item, Path(os.fspath(item)).name
        else:
            raise TypeError(
                f"render_attention_html: images[{number}] must be a path or a (path, caption) "
                f"pair, got {item!r}"
            )
        pairs.append((_image_href(image, report_dir), caption))
    return pairs


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------

_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src 'self' data: file:; base-uri 'none'; form-action 'none'"
)


def _asset(name: str) -> str:
    """A file of the report's own (its CSS and JavaScript), shipped as package data."""
    return (Path(__file__).parent / "assets" / name).read_text(encoding="utf-8")


_CSS = _asset("report.css")

# The viewer. Tokens reach the page only through textContent and new Option(text, value).
_JS = _asset("report.js")


def _page(title: str, packed: list[dict], images: list[tuple[str, str]], notes, texts=()) -> str:
    """The whole HTML document as a string."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{e(_CSP)}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="generator" content="attnkit">',
        f"<title>{e(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>{e(title)}</h1>",
    ]
    if notes:
        parts.append('<div class="notes">')
        parts.extend(f"<p>{e(note)}</p>" for note in notes)
        parts.append("</div>")
    parts.extend(f'<pre class="output">{e(text)}</pre>' for text in texts)
    if packed:
        numbers = "checked " if max(s["shape"][3] for s in packed) <= 20 else ""
        parts += [
            '<section id="attention-viewer">',
            "<noscript><p>The attention grid needs JavaScript; the pictures below do not.</p>"
            "</noscript>",
            '<div class="controls">',
            '<label>attention <select id="section-select"></select></label>',
            '<label>layer <select id="layer-select"></select></label>',
            '<label>head <select id="head-select"></select></label>',
            f'<label><input type="checkbox" id="show-numbers" {numbers}/> numbers</label>',
            "</div>",
            '<p id="section-info"></p>',
            '<div class="viewer">',
            '<div class="grid-wrap"><div class="canvas-wrap">',
            '<canvas id="attention-grid" tabindex="0" width="0" height="0"></canvas>',
            '<canvas id="grid-overlay" width="0" height="0"></canvas></div>',
            '<p class="legend" id="grid-legend"></p></div>',
            '<aside id="row-details"></aside>',
            "</div>",
            "</section>",
            '<section id="model-view"><h2>Model view: every layer and head</h2>',
            '<p class="legend">Each picture is one layer\'s head (rows: queries, columns: '
            "keys); click one to open it above.</p>",
            '<div id="model-grid"></div></section>',
        ]
    if images:
        parts.append('<section id="pictures"><h2>Pictures</h2>')
        for href, caption in images:
            parts.append(
                f'<figure><a href="{e(href)}"><img src="{e(href)}" alt="{e(caption)}" '
                f'loading="lazy"></a><figcaption>{e(caption)}</figcaption></figure>'
            )
        parts.append("</section>")
    if packed:
        data = _json_for_script({"sections": packed})
        parts.append(f'<script type="application/json" id="attnkit-data">{data}</script>')
        parts.append(f"<script>{_JS}</script>")
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def render_attention_html(
    sections: Sequence[Mapping[str, Any]],
    path: PathLike,
    *,
    title: str = "attnkit: attention",
    images: Sequence[PathLike | tuple[PathLike, str]] = (),
    notes: Sequence[str] = (),
    decimals: int = 4,
    texts: Sequence[str] = (),
) -> Path:
    """Write the interactive attention report to ``path`` (one offline HTML file); return it.

    Args:
        sections: one dict per attention to show, e.g.
            ``{"name": "cross-attention", "query_tokens": tgt, "key_tokens": src,
            "weights": w}``, with ``w`` of shape (L, H, N, M) (a tensor, an array, nested lists,
            or a list of L tensors (H, N, M)); ``key_tokens`` defaults to ``query_tokens``
            (self-attention); an optional ``"description"`` is shown under the selectors.
            :func:`attention_sections` builds these from a model's attentions. May be empty
            when the report only shows pictures.
        path: the HTML file to write.
        title: the page title (plain text).
        images: PNG pictures to show and link below the viewer: paths relative to the report's
            directory (or absolute paths, made relative), each optionally a
            ``(path, caption)`` pair. URLs are refused: the report is offline.
        notes: paragraphs of plain text shown under the title.
        texts: blocks of preformatted plain text (a command's printed tables) shown under the
            notes.
        decimals: weights are rounded to this many decimals in the file.
    """
    owner = "render_attention_html"
    if isinstance(sections, Mapping) or not isinstance(sections, Sequence):
        raise TypeError(f"{owner}: sections must be a list of dicts, got {type(sections).__name__}")
    if not isinstance(title, str):
        raise TypeError(f"{owner}: title must be a string, got {type(title).__name__}")
    if isinstance(notes, str) or not all(isinstance(n, str) for n in notes):
        raise TypeError(f"{owner}: notes must be a list of strings, got {notes!r}")
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"{owner}: texts must be a list of strings, got {texts!r}")
    if isinstance(images, str | os.PathLike):
        raise TypeError(f"{owner}: images must be a list of paths, got a single {images!r}")
    check_positive_int(owner, "decimals", decimals)
    if not sections and not images and not texts:
        raise ValueError(f"{owner}: nothing to show: sections and images are both empty")
    packed = [_pack_section(section, i, decimals) for i, section in enumerate(sections)]
    report_dir = Path(path).parent
    page = _page(title, packed, _images(images, report_dir), list(notes), list(texts))
    return atomic_write_text(path, page, owner)
