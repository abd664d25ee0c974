"""A decoding step of a Llama-family model with packed weights, one C call for all layers.

Eager PyTorch runs a Llama layer's one-token step as about 66 tensor operations (two RMSNorms,
RoPE, the cache, attention, SwiGLU, residual adds), each a few microseconds of dispatch, around
five products through :class:`~attnkit.accel.PackedLinear`; for SmolLM2-135M's 30 layers that
is more time than the products themselves (``bench/gguf_profile.py``). :class:`PackedDecoder`
runs the same arithmetic for every layer in one call into ``packed.c`` (``packed_llama_step``:
one parallel region for the whole stack, the products by the same kernel as ``PackedLinear``,
on its float32 or integer path as the layer's products are set)::

    h = RMSNorm_1(x);  q, k, v = h W_in;  q, k = RoPE(q, k, position);  cache[t] = k, v
    x = x + softmax(q K^T / sqrt(d_head) + mask) V W_out
    x = x + (SiLU(RMSNorm_2(x) W_gate) * (RMSNorm_2(x) W_up)) W_down

and Gemma 3's differences where the config names them: q and k RMS-normalised per head before
RoPE (``qk_norm``), a norm on each sublayer's output before its residual add
(``sandwich_norms``), GeGLU with tanh's GELU, heads wider than ``d_model / n_heads``, and
sliding-window layers whose ``RollingKVCache`` ring the C call writes and reads.

The embedding lookup, the final norm and the output layer stay in PyTorch. The model is not
changed: the decoder reads its weights, norms and KV caches as they are, and writes this step's
keys and values into the same caches, so eager and C steps can follow each other. Only what it
can run exactly is taken (:func:`why_not` says why not otherwise): a ``DecoderLM``-like model
whose layers are Pre-LN, RMSNorm, RoPE, full or window attention, SwiGLU or GeGLU, without
biases, each product packed or a float32 linear layer (Gemma's Q6_K ones), in evaluation mode,
in float32 on the CPU, one new token per row, at most ``MAX_ROWS`` rows, with the compiled
kernel. The logits equal the eager packed step's up to
float32 rounding order (``tests/test_packed_step.py``).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor, nn

from attnkit.accel.packed import (
    _KIND_CODES,
    MAX_ROWS,
    TILE_CODES,
    LlamaCache,
    LlamaLayer,
    PackedLinear,
    packed_kernel,
)
from attnkit.accel.switch import Switch
from attnkit.caches import KVCache, RollingKVCache
from attnkit.layers import DecoderLayer
from attnkit.position import positions_from_mask

__all__ = ["PackedDecoder", "packed_decoder", "packed_steps", "why_not"]

_EPS = torch.finfo(torch.float32).eps  # RMSNorm's epsilon where the norm names none
_ACTIVATIONS = {"swiglu": 0, "geglu": 1}  # the FFN's gate, by packed_llama_step's code
_switch = Switch("ATTNKIT_PACKED_STEP")


def packed_steps(enabled: bool):
    """Turn :func:`packed_decoder` on or off inside a ``with`` block (benchmarks and tests
    compare both). The default is on; ``ATTNKIT_PACKED_STEP=0`` turns it off."""
    return _switch(enabled)


def why_not(model: nn.Module) -> str | None:
    """Why :class:`PackedDecoder` cannot run ``model``'s steps (a few words), or None when it
    can (``generate`` puts the model in evaluation mode first)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "decoder") or not hasattr(model, "lm_head"):
        return "not a decoder-only language model"
    wanted = dict(norm="pre", norm_type="rmsnorm", position="rope", bias=False, n_experts=0)
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            return f"cfg.{name} is {getattr(cfg, name)!r}, the C step needs {value!r}"
    if cfg.attention not in ("full", "window"):
        return f"cfg.attention is {cfg.attention!r}, the C step needs 'full' or 'window'"
    if cfg.activation not in _ACTIVATIONS:
        return f"cfg.activation is {cfg.activation!r}, the C step needs 'swiglu' or 'geglu'"
    if cfg.activation == "geglu" and cfg.gelu_approximation != "tanh":
        return "GeGLU with exact GELU: the C step computes GELU with tanh"
    for layer in model.decoder.layers:
        products = _products(layer)
        if not all(_weights(p) is not None for p in products):
            return "a layer's products are neither packed nor float32 linear layers"
        if not any(isinstance(p, PackedLinear) for p in products):
            return "a layer has no packed products"
        if layer.parts().cross_attention is not None:
            return "the layers have cross-attention"
    if packed_kernel() is None:
        return "no native kernels (see attnkit info)"
    return None


def packed_decoder(model: nn.Module) -> PackedDecoder | None:
    """A :class:`PackedDecoder` for ``model``, or None where it cannot run its steps (or the
    lever is off)."""
    if not _switch.on or why_not(model) is not None or model.training:
        return None
    return PackedDecoder(model)


def _products(block: DecoderLayer) -> tuple[nn.Module, ...]:
    """A DecoderLayer's products in packed_llama_step's order: in_proj, out_proj, gate, up, down
    (read through the layer's ``parts()``)."""
    attention, ffn = block.parts().attention, block.parts().ffn
    return attention.in_proj, attention.out_proj, ffn.gate, ffn.up, ffn.down


def _floats(block: DecoderLayer) -> list[Tensor]:
    """A DecoderLayer's float tensors that packed_llama_step reads: norm gains (QK-norms and
    sandwich norms where there are any), RoPE's frequencies."""
    parts = block.parts()
    attention = parts.attention
    norms = [attention.q_norm, attention.k_norm, parts.attention_out_norm, parts.ffn_out_norm]
    found = [parts.attention_norm.weight, parts.ffn_norm.weight, attention.rope.inv_freq]
    return found + [n.weight for n in norms if n is not None]


def _address(module: nn.Module | None) -> int | None:
    return None if module is None else module.weight.data_ptr()


def _eps(norm: nn.Module) -> float:
    return norm.eps if norm.eps is not None else _EPS


def _layer(block: DecoderLayer, cfg) -> LlamaLayer:
    """The C description of one DecoderLayer: sizes, norm gains and weights."""
    parts, products = block.parts(), _products(block)
    attention, ffn = parts.attention, parts.ffn
    return LlamaLayer(
        d_model=cfg.d_model,
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        d_head=attention.d_head,
        d_ff=ffn.up.out_features,
        eps=_eps(parts.attention_norm),
        scale=1.0 / math.sqrt(attention.d_head),
        norm1=parts.attention_norm.weight.data_ptr(),
        norm2=parts.ffn_norm.weight.data_ptr(),
        inv_freq=attention.rope.inv_freq.data_ptr(),
        kind=(ctypes.c_int * 5)(*[_code(p) for p in products]),
        weight=(ctypes.c_void_p * 5)(*[_weights(p).data_ptr() for p in products]),
        q_norm=_address(attention.q_norm),
        k_norm=_address(attention.k_norm),
        qk_eps=_eps(attention.q_norm) if attention.q_norm is not None else 0.0,
        attn_out_norm=_address(parts.attention_out_norm),
        ffn_out_norm=_address(parts.ffn_out_norm),
        activation=_ACTIVATIONS[ffn.activation],
        window=attention.window if attention.attention == "window" else 0,
    )


def _weights(product: nn.Module) -> Tensor | None:
    """What the C step reads of a product: a packed one's tiles (integer path) or blocks, a
    float32 linear layer's weight storage; None for anything else."""
    if isinstance(product, PackedLinear):
        return product.blocks if product.tiles is None else product.tiles
    if type(product) is nn.Linear and product.bias is None:
        w = product.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2:
            if w.is_contiguous():
                return w
            if w.t().is_contiguous():  # laid out for decoding: (in, out) rows
                return w.t()
    return None


def _code(product: nn.Module) -> int:
    if isinstance(product, PackedLinear):
        return _KIND_CODES[product.kind] if product.tiles is None else TILE_CODES[product.kind]
    return 16 if product.weight.is_contiguous() else 17  # float32 (N, K), or (K, N)


class PackedDecoder:
    """Runs ``model``'s cached one-token steps through ``packed_llama_step``.

    ``step(model, tokens, mask, cache)`` has the signature and result of the eager step
    (logits (B, V) for tokens (B, 1) after ``cache.length`` cached positions; ``mask`` (B,
    length + 1) True on real tokens, or None) and falls back to ``eager`` for a call it cannot
    take (a prompt, more than ``MAX_ROWS`` rows, a cache that is not a plain float32 KVCache,
    or for a window layer a RollingKVCache of its window).
    Build it after the weights are final: it keeps their addresses."""

    def __init__(self, model: nn.Module) -> None:
        reason = "the model is in training mode" if model.training else why_not(model)
        if reason is not None:
            raise ValueError(f"PackedDecoder: cannot run this model's steps: {reason}")
        blocks = model.decoder.layers
        floats = [t for block in blocks for t in _floats(block)]
        if any(
            t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
            for t in floats
        ):
            raise ValueError("PackedDecoder: the norms and RoPE must be float32 on the CPU")
        self.model = model
        self.layers = (LlamaLayer * len(blocks))(*[_layer(block, model.cfg) for block in blocks])
        self._caches: tuple[tuple, ctypes.Array] | None = None  # the last cache's C view
        # The C descriptions hold raw addresses: keep the tensors behind them alive, so that a
        # weight replaced on the model later leaves this decoder with the old values, never
        # with freed memory.
        self._held = floats + [_weights(p) for block in blocks for p in _products(block)]

    def accepts(self, tokens: Tensor, cache, mask: Tensor | None = None) -> bool:
        """Whether :meth:`step` runs this call in C (else it falls back)."""
        caches = getattr(cache, "self_attn", None)
        if (
            tokens.dim() != 2
            or tokens.shape[1] != 1
            or not 1 <= tokens.shape[0] <= MAX_ROWS
            or caches is None
            or getattr(cache, "cross_attn", None) is not None
            or len(caches) != len(self.layers)
            or caches[0].length < 1
        ):
            return False
        rows = tokens.shape[0]
        for layer, c in zip(self.layers, caches, strict=True):
            if not (
                c.k.dtype == torch.float32
                and c.k.is_contiguous()
                and c.v.is_contiguous()
                and c.positions.is_contiguous()
                and c.k.device.type == "cpu"
                and c.k.shape[0] == rows
            ):
                return False
            if layer.window:  # a ring of the last `window` positions, this token real
                if not (
                    type(c) is RollingKVCache
                    and c.window == layer.window
                    and c.valid.is_contiguous()
                    and (mask is None or bool(mask[:, -1].all()))
                ):
                    return False
            elif type(c) is not KVCache or not c.length < c.max_len:
                return False
        return True

    def step(self, model, tokens: Tensor, mask: Tensor | None, cache, eager) -> Tensor:
        if model is not self.model or not self.accepts(tokens, cache, mask):
            return eager(model, tokens, mask, cache)
        caches, past = cache.self_attn, cache.length
        b = tokens.shape[0]
        if mask is None:
            positions = torch.full((b,), past, dtype=torch.long)
            valid = None
        else:
            positions = positions_from_mask(mask)[:, past].contiguous()  # (B,)
            valid = None if bool(mask.all()) else mask.contiguous()  # (B, past + 1) bool
        x = model.embeddings(tokens, positions[:, None]).reshape(b, -1).float().contiguous()
        table = self.cache_table(caches)
        for entry, kv in zip(table, caches, strict=True):
            entry.length = kv.length
        status = packed_kernel().packed_llama_step(
            self.layers, table, len(table), x.data_ptr(), b, positions.data_ptr(),
            None if valid is None else valid.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:  # cannot happen for what accepts() let through
            raise RuntimeError(f"packed_llama_step failed ({status})")
        for layer, kv in zip(self.layers, caches, strict=True):
            if layer.window:
                kv.length += 1  # the C call set the ring's flag for this step's slot
            else:
                kv.written(1)  # the C call wrote this step's key and value into the cache
        x = model.decoder.norm(x)
        return model.lm_head(x)  # (B, V)

    def cache_table(self, caches) -> ctypes.Array:
        """The caches' C descriptions (``LlamaCache``, one per layer), built once per set of
        cache tensors (a generation's) and kept: only the lengths change between steps."""
        fields = [
            {
                "k": kv.k.data_ptr(),
                "v": kv.v.data_ptr(),
                "positions": kv.positions.data_ptr(),
                "valid": kv.valid.data_ptr() if layer.window else None,
                "slots": kv.window if layer.window else kv.max_len,
            }
            for layer, kv in zip(self.layers, caches, strict=True)
        ]
        key = [tuple(f.values()) for f in fields]  # every field but the length
        if self._caches is None or self._caches[0] != key:
            entries = [LlamaCache(**f, length=0) for f in fields]  # lengths: set by step()
            self._caches = key, (LlamaCache * len(entries))(*entries)
        return self._caches[1]
