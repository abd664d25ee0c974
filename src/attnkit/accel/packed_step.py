"""A decoding step of a Llama-architecture model with packed weights, one C call per layer.

Eager PyTorch runs a Llama layer's one-token step as about 66 tensor operations (two RMSNorms,
RoPE, the cache, attention, SwiGLU, residual adds), each a few microseconds of dispatch, around
five products through :class:`~attnkit.accel.PackedLinear`; for SmolLM2-135M's 30 layers that
is more time than the products themselves (``bench/gguf_profile.py``). :class:`PackedDecoder`
runs the same arithmetic per layer as one call into ``packed.c`` (``packed_llama_step``: one
parallel region, the products by the same kernel as ``PackedLinear``, on its float32 or
integer path as the layer's products are set)::

    h = RMSNorm_1(x);  q, k, v = h W_in;  q, k = RoPE(q, k, position);  cache[t] = k, v
    x = x + softmax(q K^T / sqrt(d_head) + mask) V W_out
    x = x + (SiLU(RMSNorm_2(x) W_gate) * (RMSNorm_2(x) W_up)) W_down

The embedding lookup, the final norm and the output layer stay in PyTorch. The model is not
changed: the decoder reads its weights, norms and KV caches as they are, and writes this step's
keys and values into the same caches, so eager and C steps can follow each other. Only what it
can run exactly is taken (:func:`packed_decoder` says why not otherwise): a ``DecoderLM``-like
model whose layers are Pre-LN, RMSNorm, RoPE, full attention, SwiGLU, without biases, every
product packed, in evaluation mode, in float32 on the CPU, one new token per row, at most
``MAX_ROWS`` rows, with the compiled kernel. The logits equal the eager packed step's up to
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
    LlamaLayer,
    PackedLinear,
    packed_kernel,
)
from attnkit.accel.switch import Switch
from attnkit.caches import KVCache
from attnkit.layers import DecoderLayer
from attnkit.position import positions_from_mask

__all__ = ["PackedDecoder", "packed_decoder", "packed_steps", "why_not"]

_EPS = torch.finfo(torch.float32).eps  # RMSNorm's epsilon where the norm names none
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
    wanted = dict(norm="pre", norm_type="rmsnorm", position="rope", activation="swiglu")
    wanted.update(attention="full", bias=False, n_experts=0, head_dim=None, qk_norm=False)
    wanted.update(sandwich_norms=False)
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            return f"cfg.{name} is {getattr(cfg, name)!r}, the C step needs {value!r}"
    for layer in model.decoder.layers:
        products = _products(layer)
        if not all(isinstance(p, PackedLinear) and p.bias is None for p in products):
            return "a layer's products are not all packed"
        if len({p.integer for p in products}) > 1:
            return "a layer's products mix the integer and float32 paths"
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
    """A DecoderLayer's float tensors that packed_llama_step reads: norm gains, RoPE's
    frequencies."""
    parts = block.parts()
    return [parts.attention_norm.weight, parts.ffn_norm.weight, parts.attention.rope.inv_freq]


def _layer(block: DecoderLayer, cfg) -> LlamaLayer:
    """The C description of one DecoderLayer: sizes, norm gains and packed weights."""
    parts, products = block.parts(), _products(block)
    attention, ffn = parts.attention, parts.ffn
    norm1, norm2, inv_freq = (t.data_ptr() for t in _floats(block))
    return LlamaLayer(
        d_model=cfg.d_model,
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        d_head=attention.d_head,
        d_ff=ffn.gate.out_features,
        eps=parts.attention_norm.eps if parts.attention_norm.eps is not None else _EPS,
        scale=1.0 / math.sqrt(attention.d_head),
        norm1=norm1,
        norm2=norm2,
        inv_freq=inv_freq,
        kind=(ctypes.c_int * 5)(*[_code(p) for p in products]),
        weight=(ctypes.c_void_p * 5)(*[_weights(p).data_ptr() for p in products]),
        integer=int(products[0].integer),
    )


def _weights(product: PackedLinear) -> Tensor:
    """What the C step reads of a packed product: its tiles on the integer path, else its
    blocks."""
    return product.blocks if product.tiles is None else product.tiles


def _code(product: PackedLinear) -> int:
    return _KIND_CODES[product.kind] if product.tiles is None else TILE_CODES[product.kind]


class PackedDecoder:
    """Runs ``model``'s cached one-token steps through ``packed_llama_step``.

    ``step(model, tokens, mask, cache)`` has the signature and result of the eager step
    (logits (B, V) for tokens (B, 1) after ``cache.length`` cached positions; ``mask`` (B,
    length + 1) True on real tokens, or None) and falls back to ``eager`` for a call it cannot
    take (a prompt, more than ``MAX_ROWS`` rows, a cache that is not a plain float32 KVCache).
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
        self.layers = [_layer(block, model.cfg) for block in blocks]
        # The C descriptions hold raw addresses: keep the tensors behind them alive, so that a
        # weight replaced on the model later leaves this decoder with the old values, never
        # with freed memory.
        self._held = floats + [_weights(p) for block in blocks for p in _products(block)]

    def accepts(self, tokens: Tensor, cache) -> bool:
        """Whether :meth:`step` runs this call in C (else it falls back)."""
        caches = getattr(cache, "self_attn", None)
        return (
            tokens.dim() == 2
            and tokens.shape[1] == 1
            and 1 <= tokens.shape[0] <= MAX_ROWS
            and caches is not None
            and getattr(cache, "cross_attn", None) is None
            and len(caches) == len(self.layers)
            and all(
                type(c) is KVCache
                and c.k.dtype == torch.float32
                and c.k.is_contiguous()
                and c.v.is_contiguous()
                and c.positions.is_contiguous()
                and c.k.device.type == "cpu"
                and c.k.shape[0] == tokens.shape[0]
                for c in caches
            )
            and 0 < caches[0].length < caches[0].max_len
        )

    def step(self, model, tokens: Tensor, mask: Tensor | None, cache, eager) -> Tensor:
        if model is not self.model or not self.accepts(tokens, cache):
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
        kernel, threads = packed_kernel().packed_llama_step, torch.get_num_threads()
        valid_at = None if valid is None else valid.data_ptr()
        for layer, kv in zip(self.layers, caches, strict=True):
            status = kernel(
                ctypes.byref(layer), x.data_ptr(), b, positions.data_ptr(), valid_at,
                kv.k.data_ptr(), kv.v.data_ptr(), kv.positions.data_ptr(), past, kv.max_len,
                threads,
            )  # fmt: skip
            if status != 0:  # cannot happen for what accepts() let through
                raise RuntimeError(f"packed_llama_step failed ({status})")
            kv.written(1)  # the C call wrote this step's key and value into the cache
        x = model.decoder.norm(x)
        return model.lm_head(x)  # (B, V)
