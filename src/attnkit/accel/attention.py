"""Attention for training steps on the CPU by a C kernel (``attention.c``), forward and backward.

    out = softmax(q k^T * scale + mask) v            (per batch and head)

:func:`attention` is registered as the attention implementation ``"attnkit"`` of
``backends.ATTENTION``, and :func:`use_attention_kernel` (which ``accel.prepare(model,
"training")`` calls) makes a model choose it (``set_attn_implementation``). It takes the
calls whose inputs need a gradient when it can: CPU float32 or bfloat16 tensors of shape
(B, H, N, d) and (B, H, M, d), no dropout, as many key and value heads as query heads, no mask
or a boolean key-padding mask of shape (B, 1, 1, M), with or without the causal flag (a
decoder's self-attention has both, handed over unmerged). Everything else goes to torch as
usual. The kernel is called as registered torch operators
(``torch.library.custom_op``: ``attnkit::attention``, ``attnkit::packed_attention``,
``attnkit::packed_self_attention`` and their backwards), so that autograd runs their registered
gradients and a graph that ``torch.compile`` builds for training (``accel.compiled_layers``)
holds one opaque call per attention. Its variable-length form (:func:`packed_attention`,
:func:`packed_self_attention`: the real rows of a padded batch, sequence after sequence,
``attnkit.varlen``) is registered with it as its packed form, where
``MultiHeadAttention`` finds it when called with ``rows=``.

Why: at lm-small's shapes (d = 32, 256 positions) torch's CPU flash attention runs near 40
GFLOP/s in float32 and slower still in bf16, so attention became the largest cost of a bf16
step after the products. The kernel (one (batch, head) per task, register-blocked products over
float32 scratch, p recomputed from the row's log-sum-exp in the backward) is measured against
it in bench/history/. The forward saves only the output and one log-sum-exp per row, as torch's
kernel does. ``attention_kernel(False)`` or ``ATTNKIT_ATTENTION_KERNEL=0`` turns it off.

bfloat16 inputs compute in float32, except where the kernel is built for AMX tiles (an Intel
Xeon from Sapphire Rapids on) and Linux lends them (:func:`tiles_available`): there every
product runs on the tile unit, bf16 in and float32 sums, with p and ds rounded to bf16 before
the products that take them, as FlashAttention's bf16 kernels do (``attention_tiles.h``).
``attention_tiles(False)`` or ``ATTNKIT_ATTENTION_TILES=0`` keeps bf16 in float32 arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from attnkit import backends
from attnkit.accel import native
from attnkit.accel.switch import Switch
from attnkit.attention import MultiHeadAttention
from attnkit.varlen import Sequences

__all__ = [
    "FUSED_NAME", "Sequences", "attention", "attention_kernel", "attention_tiles",
    "packed_attention", "packed_self_attention", "register_operator", "takes_packed",
    "tiles_available", "use_attention_kernel",
]  # fmt: skip

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_SCRATCH = 1 << 22  # padded N x M per head (the backward keeps two): beyond, torch's kernel
# attention_kernel(False) holds the lever off inside a with block (ATTNKIT_ATTENTION_KERNEL=0: off)
attention_kernel = _switch = Switch("ATTNKIT_ATTENTION_KERNEL")
# attention_tiles(False): bf16 in float32 arithmetic inside a with block (the AMX tiles' products
# off; ATTNKIT_ATTENTION_TILES=0: off)
attention_tiles = _tiles = Switch("ATTNKIT_ATTENTION_TILES")


_View, _Shape = native.structure("View"), native.structure("Shape")  # structs.h


def tiles_available() -> bool:
    """Whether bfloat16 attention runs its products on AMX tiles here: the kernel was built with
    them (the ``amx`` variant of :mod:`attnkit.accel.native` is in use) and Linux lends them."""
    library = native.library()
    return library is not None and bool(library.attention_tiles())


def _view(t: Tensor, sequences: Sequences | None = None) -> _View:
    """A (B, H, N, d) tensor, or packed sequences' (T, H, d) rows, for the kernel."""
    if sequences is None:
        return _View(_DTYPE_CODES[t.dtype], t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))
    first = sequences.first.data_ptr()
    return _View(_DTYPE_CODES[t.dtype], t.data_ptr(), 0, t.stride(1), t.stride(0), first)


def _like_heads(t: Tensor) -> Tensor:
    """An empty (B, H, N, d) tensor laid out as (B, N, H, d), as the layers' heads are."""
    b, h, n, d = t.shape
    return t.new_empty(b, n, h, d).transpose(1, 2)


def _check(status: int, where: str) -> None:
    if status != 0:
        raise RuntimeError(f"{where}: the attention kernel failed (status {status})")


def _shape(q, k, valid, causal: bool, scale: float, queries=None, keys=None) -> _Shape:
    if queries is None:  # (B, H, N, d) and (B, H, M, d)
        b, h, n, d = q.shape
        m, lengths = k.shape[2], (None, None)
    else:  # packed (T, H, d) rows
        b, (h, d), n, m = len(queries.lengths), q.shape[1:], queries.longest, keys.longest
        lengths = (queries.lengths.data_ptr(), keys.lengths.data_ptr())
    valid = None if valid is None else valid.data_ptr()
    return _Shape(b, h, n, m, d, int(causal), scale, valid, int(_tiles.on), *lengths)


def _like(t: Tensor, packed: bool) -> Tensor:
    """An empty tensor for t's results: laid out as the heads are (``_like_heads``), or packed
    (T, H, d) rows."""
    return t.new_empty(t.shape) if packed else _like_heads(t)


def _forward(q, k, v, valid, causal: bool, scale: float, queries=None, keys=None):
    """(out, lse): out laid out as the heads are (or packed as q), lse (B, H, N) float32."""
    shape = _shape(q, k, valid, causal, scale, queries, keys)
    out = _like(q, queries is not None)
    if queries is None:
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    else:  # (B, H, longest): rows past a shorter sequence's end hold +inf, as rows with no key
        lse = q.new_full((shape.batch, shape.heads, shape.n), float("inf"), dtype=torch.float32)
    with record_function("attnkit::attention_forward"):  # named in torch.profiler's tables
        status = native.library().attention_forward(
            shape, _view(q, queries), _view(k, keys), _view(v, keys), _view(out, queries),
            lse.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "attention_forward")
    return out, lse


def _backward(q, k, v, out, lse, grad, valid, causal: bool, scale: float, queries=None,
              keys=None, into=None):  # fmt: skip
    """(dL/dq, dL/dk, dL/dv) from the output's gradient (written into ``into``'s three tensors
    where given)."""
    grad = grad.to(q.dtype)
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    shape = _shape(q, k, valid, causal, scale, queries, keys)
    packed = queries is not None
    dq, dk, dv = into or (_like(q, packed), _like(k, packed), _like(v, packed))
    with record_function("attnkit::attention_backward"):
        status = native.library().attention_backward(
            shape, _view(q, queries), _view(k, keys), _view(v, keys), _view(out, queries),
            _view(grad, queries), lse.data_ptr(), _view(dq, queries), _view(dk, keys),
            _view(dv, keys), torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "attention_backward")
    return dq, dk, dv


def _tiled() -> bool:
    """Whether bfloat16 attention takes the AMX tiles (padded only)."""
    return _tiles.on and tiles_available()


def takes_packed(q: Tensor, longest: int) -> bool:
    """Whether :func:`packed_attention` can take packed q (T, H, d) rows whose sequences
    (and keys') are at most ``longest`` long: the kernel is on and built, not inside a compiled
    graph, a CPU float32 tensor, or bfloat16 where no AMX tiles would take it (the tile path
    takes padded heads only). ``q`` may also be the projection's input: under autocast the
    rows will come out in autocast's dtype, and that is the one checked."""
    dtype = q.dtype
    if torch.is_autocast_enabled(q.device.type) and dtype.is_floating_point:
        dtype = torch.get_autocast_dtype(q.device.type)
    return (
        _switch.on
        and not torch.compiler.is_compiling()
        and q.device.type == "cpu"
        and native.library() is not None
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and not _tiled()))
        and -(-longest // 4) * 4 * (-(-longest // 32) * 32) <= _MAX_SCRATCH
    )


def packed_attention(
    q: Tensor, kv: Tensor, queries: Sequences, keys: Sequences, *, causal: bool,
    scale: float | None = None,
) -> Tensor:  # fmt: skip
    """softmax(q k^T scale) v for each of B sequences packed into rows, with no padding: q
    (T, H, d) rows as ``queries`` says, keys and values ``kv`` (T_k, 2, H, d) as ``keys``
    says; ``causal``: query i of sequence b sees its keys 0 .. i + M_b - N_b. Returns
    (T, H, d); a query of a sequence with no keys gets zeros. The caller checks
    :func:`takes_packed` first."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.attnkit.packed_attention(q, kv, *queries, *keys, bool(causal), scale)[0]


def packed_self_attention(
    qkv: Tensor, sequences: Sequences, *, causal: bool, scale: float | None = None
) -> Tensor:
    """:func:`packed_attention` of a self-attention layer, from its projection's packed rows
    ``qkv`` (T, 3, H, d), q, k and v in that order. Returns (T, H, d)."""
    scale = qkv.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.attnkit.packed_self_attention(qkv, *sequences, bool(causal), scale)[0]


# The kernel as torch operators (torch.library.custom_op, with their fake tensors for
# torch.compile and their gradients): eager calls and compiled graphs both see one opaque
# operator per attention, and autograd its registered backward. Registering costs a few
# milliseconds and needs no kernel; calling one without the kernel raises.


@torch.library.custom_op("attnkit::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """(out, lse) of (B, H, N, d) heads; ``valid`` (B, M) uint8 key padding or None."""
    return _forward(q, k, v, valid, causal, scale)


@_attention_op.register_fake
def _(q, k, v, valid, causal, scale):
    return _like_heads(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def _attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad: Tensor,
    valid: Tensor | None, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _backward(q, k, v, out, lse, grad, valid, causal, scale)


@_attention_backward_op.register_fake
def _(q, k, v, out, lse, grad, valid, causal, scale):
    return _like_heads(q), _like_heads(k), _like_heads(v)


def _attention_context(ctx, inputs, output) -> None:
    q, k, v, valid, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output, valid)
    ctx.options = (causal, scale)


def _attention_gradient(ctx, grad_out, grad_lse):
    q, k, v, out, lse, valid = ctx.saved_tensors
    grads = _attention_backward_op(q, k, v, out, lse, grad_out, valid, *ctx.options)
    return *grads, None, None, None


_attention_op.register_autograd(_attention_gradient, setup_context=_attention_context)


@torch.library.custom_op("attnkit::packed_attention", mutates_args=())
def _packed_op(
    q: Tensor, kv: Tensor, q_first: Tensor, q_lengths: Tensor, q_longest: int,
    k_first: Tensor, k_lengths: Tensor, k_longest: int, causal: bool, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out (T, H, d), lse) from packed q (T, H, d) and [K, V] (T_k, 2, H, d), the sequences
    given as :class:`Sequences`' fields."""
    queries = Sequences(q_first, q_lengths, q_longest)
    keys = Sequences(k_first, k_lengths, k_longest)
    return _forward(q, *kv.unbind(1), None, causal, scale, queries, keys)


@_packed_op.register_fake
def _(q, kv, q_first, q_lengths, q_longest, k_first, k_lengths, k_longest, causal, scale):
    lse = q.new_empty(q_first.shape[0], q.shape[1], q_longest, dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("attnkit::packed_attention_backward", mutates_args=())
def _packed_backward_op(
    q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, grad: Tensor, q_first: Tensor,
    q_lengths: Tensor, q_longest: int, k_first: Tensor, k_lengths: Tensor, k_longest: int,
    causal: bool, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(dq, dkv): the keys' and values' gradient as one (T_k, 2, H, d) tensor, as the
    projection's output was, so that no split has to be joined in the backward."""
    queries = Sequences(q_first, q_lengths, q_longest)
    keys = Sequences(k_first, k_lengths, k_longest)
    dq, dkv = q.new_empty(q.shape), kv.new_empty(kv.shape)
    _backward(q, *kv.unbind(1), out, lse, grad, None, causal, scale, queries, keys,
              into=(dq, *dkv.unbind(1)))  # fmt: skip
    return dq, dkv


@_packed_backward_op.register_fake
def _(q, kv, out, lse, grad, *rest):
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


def _packed_context(ctx, inputs, output) -> None:
    q, kv, *sequences, causal, scale = inputs
    ctx.save_for_backward(q, kv, *output)
    ctx.options = (*sequences, causal, scale)


def _packed_gradient(ctx, grad_out, grad_lse):
    q, kv, out, lse = ctx.saved_tensors
    dq, dkv = _packed_backward_op(q, kv, out, lse, grad_out, *ctx.options)
    return dq, dkv, *([None] * 8)


_packed_op.register_autograd(_packed_gradient, setup_context=_packed_context)


@torch.library.custom_op("attnkit::packed_self_attention", mutates_args=())
def _packed_self_op(
    qkv: Tensor, first: Tensor, lengths: Tensor, longest: int, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """(out (T, H, d), lse) of self-attention from one projection's packed rows [Q, K, V]
    (T, 3, H, d)."""
    sequences = Sequences(first, lengths, longest)
    return _forward(*qkv.unbind(1), None, causal, scale, sequences, sequences)


@_packed_self_op.register_fake
def _(qkv, first, lengths, longest, causal, scale):
    t, _, h, d = qkv.shape
    return qkv.new_empty(t, h, d), qkv.new_empty(first.shape[0], h, longest, dtype=torch.float32)


@torch.library.custom_op("attnkit::packed_self_attention_backward", mutates_args=())
def _packed_self_backward_op(
    qkv: Tensor, out: Tensor, lse: Tensor, grad: Tensor, first: Tensor, lengths: Tensor,
    longest: int, causal: bool, scale: float,
) -> Tensor:  # fmt: skip
    """dqkv, one (T, 3, H, d) tensor (see :func:`_packed_backward_op`)."""
    sequences = Sequences(first, lengths, longest)
    dqkv = qkv.new_empty(qkv.shape)
    _backward(*qkv.unbind(1), out, lse, grad, None, causal, scale, sequences, sequences,
              into=dqkv.unbind(1))  # fmt: skip
    return dqkv


@_packed_self_backward_op.register_fake
def _(qkv, *rest):
    return qkv.new_empty(qkv.shape)


def _packed_self_context(ctx, inputs, output) -> None:
    qkv, *sequences, causal, scale = inputs
    ctx.save_for_backward(qkv, *output)
    ctx.options = (*sequences, causal, scale)


def _packed_self_gradient(ctx, grad_out, grad_lse):
    qkv, out, lse = ctx.saved_tensors
    return _packed_self_backward_op(qkv, out, lse, grad_out, *ctx.options), *([None] * 5)


_packed_self_op.register_autograd(_packed_self_gradient, setup_context=_packed_self_context)


def register_operator():
    """``torch.ops.attnkit.attention`` (registered with this module), or None where the kernel
    is not built (asked eagerly, so that a graph traced after it knows)."""
    return _attention_op if _built() else None


def _key_padding(mask: Tensor | None, b: int, m: int) -> Tensor | bool | None:
    """A (B, 1, 1, M) or (B, M)-broadcastable boolean mask as (B, M) uint8 (1 = a key that may
    be attended); None for no mask; False for a mask the kernel cannot take."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
        return False
    if mask.shape[-1] != m or mask.shape[0] not in (1, b):
        return False
    return mask.reshape(-1, m).expand(b, m).to(torch.uint8).contiguous()


def _built() -> bool:
    """Whether the kernel is built and loaded; inside a graph being traced, whether it was
    when the eager calls before asked (loading is not something Dynamo traces)."""
    global _loaded
    if not torch.compiler.is_compiling():
        _loaded = native.library() is not None
    return _loaded


_loaded = False


def _takes(q, k, v, dropout_p, enable_gqa) -> bool:
    return (
        _switch.on
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and q.device.type == k.device.type == v.device.type == "cpu"
        and q.dtype in _DTYPE_CODES
        and q.dtype == k.dtype == v.dtype
        and q.dim() == k.dim() == v.dim() == 4
        and q.shape[:2] == k.shape[:2] == v.shape[:2]  # no broadcast, no grouped heads
        and k.shape == v.shape
        and k.shape[-1] == q.shape[-1]
        and min(q.shape) > 0
        and k.shape[2] > 0
        and dropout_p == 0.0
        and not enable_gqa
        and -(-q.shape[2] // 4) * 4 * (-(-k.shape[2] // 32) * 32) <= _MAX_SCRATCH
        and all(t.stride(-1) == 1 for t in (q, k, v))
        and _built()
    )


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):  # fmt: skip
    """``F.scaled_dot_product_attention`` with the same arguments, by the kernel where it
    applies (see the module docstring), else by torch; unlike torch's, it also takes a mask
    together with ``is_causal`` (both apply; the causal mask bottom-right aligned, as
    ``masks.causal_mask``)."""
    if _takes(q, k, v, dropout_p, enable_gqa):
        valid = _key_padding(attn_mask, q.shape[0], k.shape[2])
        if valid is not False:
            scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
            return _attention_op(q, k, v, valid, bool(is_causal), scale)[0]
    return backends.sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


FUSED_NAME = "attnkit"  # the kernel's name in backends.ATTENTION
backends.register_attention(
    FUSED_NAME,
    attention,
    backends.PackedAttention(takes_packed, packed_self_attention, packed_attention),
)


def use_attention_kernel(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Every attention layer of ``model`` runs its fused path by :func:`attention` (``enabled``)
    or by torch's SDPA again; returns the model. The kernel takes what it can (see the module
    docstring: a training step's CPU float32 or bf16 heads) and hands the rest to torch."""
    name = FUSED_NAME if enabled else "sdpa"
    if hasattr(model, "set_attn_implementation"):  # an attnkit model: its config records it
        return model.set_attn_implementation(name)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.attn_implementation = name
    return model
