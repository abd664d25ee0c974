"""A Llama-family decoder stack with packed weights, run in C: every new token in one call per
chunk, the same arithmetic whatever shares the call.

Eager PyTorch runs a Llama layer's one-token step as about 66 tensor operations (two RMSNorms,
RoPE, the cache, attention, SwiGLU, residual adds), each a few microseconds of dispatch, around
five products through :class:`~attnkit.accel.PackedLinear`; for SmolLM2-135M's 30 layers that
is more time than the products themselves (``bench/gguf_profile.py``). :class:`PackedStack` runs
the same arithmetic for every layer and the final norm in one call into ``llama_step.c``
(``packed_llama_forward``: one parallel region, the products by the same kernels as
``PackedLinear``, on its float32 or integer path as the layer's products are set)::

    h = RMSNorm_1(x);  q, k, v = h W_in;  q, k = RoPE(q, k, position);  cache[t] = k, v
    x = x + softmax(q K^T / sqrt(d_head) + mask) V W_out
    x = x + (SiLU(RMSNorm_2(x) W_gate) * (RMSNorm_2(x) W_up)) W_down

and the differences of Gemma 3, Qwen and Phi-3 where the config names them: q and k
RMS-normalised per head before RoPE (``qk_norm``), a norm on each sublayer's output before its
residual add (``sandwich_norms``), GeGLU with tanh's GELU, heads wider than
``d_model / n_heads``, sliding-window layers whose ``RollingKVCache`` ring the C call writes and
reads, biases on q, k and v (``qkv_bias``), and RoPE over part of each head (``rotary_dim``).

**One answer per token.** A call takes B sequences and T new tokens of each: a prompt runs in
chunks of ``MAX_ROWS`` tokens, a decoding step is T = 1, a server's batch is B rows. A token's
hidden state is computed by the same operations in the same order whatever else is in the call
(``llama_step.c``), so it does not depend on how the prompt was split, on whether a prompt
cache gave its prefix, or on the other requests in a batch: bit for bit, on the float path and
on the integer path; and on the integer path, the same bits on every kernel variant.

**A module swap.** ``accel.prepare(model, "decoding")`` replaces the model's ``Decoder`` by a
:class:`PackedStack` over the same layers (:func:`packed_stack`), where :func:`why_not` finds
nothing against it. Its ``forward`` takes what the C call can run (evaluation mode, no
gradient, float32 on the CPU, no attention weights asked for, at most ``MAX_ROWS`` sequences,
caches that are the layers' own kinds) and hands anything else to ``Decoder.forward``, whose
eager steps can follow C steps on the same caches. The embedding lookup and the output layer
stay in PyTorch (a row's lookup and a packed product do not depend on the other rows either).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor, nn

from attnkit.accel import native
from attnkit.accel.packed import (
    KIND_CODES,
    MAX_ROWS,
    TILE_CODES,
    LlamaCache,
    LlamaLayer,
    PackedLinear,
    check_tile_layout,
    tiles_changed,
)
from attnkit.accel.swap import rebuilt, swap_modules
from attnkit.accel.switch import Switch
from attnkit.caches import KVCache, RollingKVCache
from attnkit.layers import DecoderLayer
from attnkit.stacks import Decoder

__all__ = ["PackedStack", "packed_stack", "packed_steps", "why_not"]

_EPS = torch.finfo(torch.float32).eps  # RMSNorm's epsilon where the norm names none
_ACTIVATIONS = {"swiglu": 0, "geglu": 1}  # the FFN's gate, by llama_step.c's code
# packed_steps(False) holds the lever off inside a with block (ATTNKIT_PACKED_STEP=0: off)
packed_steps = _switch = Switch("ATTNKIT_PACKED_STEP")


def why_not(model: nn.Module) -> str | None:
    """Why :class:`PackedStack` cannot run ``model``'s decoder (a few words), or None when it
    can."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not isinstance(getattr(model, "decoder", None), Decoder):
        return "not a decoder-only language model"
    if not hasattr(model, "lm_head"):
        return "not a decoder-only language model"
    wanted = dict(norm="pre", norm_type="rmsnorm", position="rope", bias=False, n_experts=0)
    # (bias: on every product; qkv_bias, on W_in alone, the C step adds)
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
        if any(p.bias is not None for p in products[1:]):
            return "a layer's products other than W_in have biases"
        if not any(isinstance(p, PackedLinear) for p in products):
            return "a layer has no packed products"
        if layer.parts().cross_attention is not None:
            return "the layers have cross-attention"
    floats = [t for block in model.decoder.layers for t in _floats(block)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in floats):
        return "the norms and RoPE are not float32 on the CPU"
    if native.library() is None:
        return "no native kernels (see attnkit info)"
    return None


def packed_stack(model: nn.Module) -> nn.Module:
    """Swap ``model``'s decoder stack for a :class:`PackedStack` over the same layers (where
    :func:`why_not` finds nothing against it and the lever is on); returns the model."""
    if not _switch.on or why_not(model) is not None:
        return model
    return swap_modules(
        model, lambda m: PackedStack.of(m) if m is model.decoder and type(m) is Decoder else None
    )


def _products(block: DecoderLayer) -> tuple[nn.Module, ...]:
    """A DecoderLayer's products in llama_step.c's order: in_proj, out_proj, gate, up, down
    (read through the layer's ``parts()``)."""
    attention, ffn = block.parts().attention, block.parts().ffn
    return attention.in_proj, attention.out_proj, ffn.gate, ffn.up, ffn.down


def _floats(block: DecoderLayer) -> list[Tensor]:
    """A DecoderLayer's float tensors that llama_step.c reads: norm gains (QK-norms and
    sandwich norms where there are any), RoPE's frequencies."""
    parts = block.parts()
    attention = parts.attention
    norms = [attention.q_norm, attention.k_norm, parts.attention_out_norm, parts.ffn_out_norm]
    found = [parts.attention_norm.weight, parts.ffn_norm.weight, attention.rope.inv_freq]
    found += [] if attention.in_proj.bias is None else [attention.in_proj.bias]
    return found + [n.weight for n in norms if n is not None]


def _address(module: nn.Module | None) -> int | None:
    return None if module is None else module.weight.data_ptr()


def _eps(norm: nn.Module) -> float:
    return norm.eps if norm.eps is not None else _EPS


def _weights(product: nn.Module) -> Tensor | None:
    """What the C call reads of a product: a packed one's tiles (integer path) or blocks, a
    float32 linear layer's weight storage; None for anything else."""
    if isinstance(product, PackedLinear):
        return product.tiles if product.integer else product.blocks
    if type(product) is nn.Linear:
        w = product.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2:
            if w.is_contiguous():
                return w
            if w.t().is_contiguous():  # laid out for decoding: (in, out) rows
                return w.t()
    return None


def _code(product: nn.Module) -> int:
    if isinstance(product, PackedLinear):
        if not product.integer:
            return KIND_CODES[product.kind]
        check_tile_layout(product)
        return TILE_CODES[product.kind]
    return native.kinds()["FLOAT_ROWS" if product.weight.is_contiguous() else "FLOAT_COLUMNS"]


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
        window=_window(block),
        in_bias=None if attention.in_proj.bias is None else attention.in_proj.bias.data_ptr(),
        rotary_dim=attention.rope.dim,
    )


def _window(block: DecoderLayer) -> int:
    """A layer's attention window, 0 for full attention."""
    attention = block.parts().attention
    return attention.window if attention.attention == "window" else 0


class PackedStack(Decoder):
    """A :class:`~attnkit.stacks.Decoder` whose forward runs in C where it can (see the module
    docstring); built by :meth:`of` over an existing stack's layers (nothing is copied)."""

    @classmethod
    def of(cls, decoder: Decoder) -> PackedStack:
        stack = rebuilt(cls, decoder)
        stack._windows = [_window(block) for block in decoder.layers]  # for the caches' check
        stack._described = None  # (what it was made under, the C layers, the tensors behind)
        stack._caches = None  # (the cache tensors' addresses, their C descriptions)
        return stack

    def layers_in_c(self) -> ctypes.Array:
        """The layers' C descriptions, made again whenever a packed product took or left the
        integer path (``tiles_changed``) or other kernels are in use (whose tiles' layout is
        checked then). They hold raw addresses: the tensors behind them are kept alive with
        them. (A float32 product's weight replaced after the swap is not seen: the old one is
        kept and read.)"""
        made_under = (tiles_changed(), native.library())
        if self._described is None or self._described[0] != made_under:
            blocks = list(self.layers)
            described = (LlamaLayer * len(blocks))(*[_layer(b, self.cfg) for b in blocks])
            held = [_weights(p) for b in blocks for p in _products(b)]
            held += [t for block in blocks for t in _floats(block)]
            self._described = made_under, described, held
        return self._described[1]

    def _takes(self, x, memory, self_mask, cache, return_attention, rows) -> bool:
        if not _switch.on or self.training or torch.is_grad_enabled() or return_attention:
            return False
        if memory is not None or rows is not None or x.dim() != 3 or x.device.type != "cpu":
            return False
        if x.dtype != torch.float32 or not 1 <= x.shape[0] <= MAX_ROWS or native.library() is None:
            return False
        keys = (0 if cache is None else cache.length) + x.shape[1]
        if self_mask is not None and not (
            self_mask.dtype == torch.bool and self_mask.shape == (x.shape[0], 1, 1, keys)
        ):
            return False  # only a key padding mask, one row per sequence
        if cache is None:
            return True
        if cache.cross_attn is not None or len(cache.self_attn) != len(self.layers):
            return False
        for window, kv in zip(self._windows, cache.self_attn, strict=True):
            kind = RollingKVCache if window else KVCache
            if type(kv) is not kind or kv.k.dtype != torch.float32 or kv.k.device.type != "cpu":
                return False
            if kv.k.shape[0] != x.shape[0] or not all(
                t.is_contiguous() for t in (kv.k, kv.v, kv.positions)
            ):
                return False
            if window and (kv.window != window or not kv.valid.is_contiguous()):
                return False
            if not window and kv.length + x.shape[1] > kv.max_len:
                return False
        return True

    def forward(
        self,
        x,
        memory=None,
        *,
        self_mask=None,
        memory_mask=None,
        positions=None,
        cache=None,
        return_attention=False,
        rows=None,
        memory_rows=None,
    ):
        if not self._takes(x, memory, self_mask, cache, return_attention, rows):
            return super().forward(
                x, memory, self_mask=self_mask, memory_mask=memory_mask, positions=positions,
                cache=cache, return_attention=return_attention, rows=rows,
                memory_rows=memory_rows,
            )  # fmt: skip
        b, n, _ = x.shape
        if cache is None:  # the keys and values of this call alone
            cache = self.new_cache(b, n, dtype=x.dtype)
        past = cache.length
        if positions is None:
            positions = torch.arange(past, past + n)
        positions = positions.expand(b, n).contiguous()  # (B, N)
        valid = None if self_mask is None else self_mask.reshape(b, past + n).to(torch.uint8)
        layers, table = self.layers_in_c(), self.cache_table(cache.self_attn)
        out = x.contiguous().clone()
        chunk = max(1, MAX_ROWS // b)  # tokens per sequence and call
        for start in range(0, n, chunk):
            t = min(chunk, n - start)
            part = out[:, start : start + t].contiguous()  # (B, t, D): a view when B = 1
            for entry, kv in zip(table, cache.self_attn, strict=True):
                entry.length = kv.length
            mask = None if valid is None else valid[:, : past + start + t].contiguous()
            where = positions[:, start : start + t].contiguous()
            status = native.library().packed_llama_forward(
                layers, table, len(table), self.norm.weight.data_ptr(), _eps(self.norm),
                part.data_ptr(), b, t, where.data_ptr(),
                None if mask is None else mask.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if status != 0:  # cannot happen for what _takes() let through
                raise RuntimeError(f"packed_llama_forward failed ({status})")
            if b > 1:
                out[:, start : start + t] = part
            for kv in cache.self_attn:
                kv.written(t)  # the C call wrote these keys and values (a ring: its flags)
        nothing = [None] * len(self.layers)
        return out, nothing, list(nothing)

    def cache_table(self, caches) -> ctypes.Array:
        """The caches' C descriptions (``LlamaCache``, one per layer), made once per set of cache
        tensors (a generation's) and kept: only the lengths change between calls."""
        fields = [
            {
                "k": kv.k.data_ptr(),
                "v": kv.v.data_ptr(),
                "positions": kv.positions.data_ptr(),
                "valid": kv.valid.data_ptr() if isinstance(kv, RollingKVCache) else None,
                "slots": kv.window if isinstance(kv, RollingKVCache) else kv.max_len,
            }
            for kv in caches
        ]
        key = [tuple(f.values()) for f in fields]  # every field but the length
        if self._caches is None or self._caches[0] != key:
            entries = [LlamaCache(**f, length=0) for f in fields]  # lengths: set per call
            self._caches = key, (LlamaCache * len(entries))(*entries)
        return self._caches[1]
