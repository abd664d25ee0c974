"""Float32 matrix products through oneDNN's GEMM on the CPU.

torch sends float32 CPU matrix products to MKL, whose CPU dispatch gives non-Intel processors
slower code paths on some processors; oneDNN chooses its kernels by the instruction set alone.
How much this gains depends on the processor (bench/history/): measure it before relying on it.

``use_onednn_products(model)`` is a module swap: every ``nn.Linear`` of the model becomes a
:class:`OneDNNLinear` over the same parameters, whose products (its ``forward``, and the slices of
its rows that cross-attention applies alone, ``rows``) go through :func:`linear`: a product whose
operands are float32 CPU tensors with at least a few rows runs through oneDNN, forward, dL/dx and
dL/dW alike; everything else (other dtypes, autocast, other devices, single rows) runs as usual.
Strict float32 throughout. The oneDNN path differentiates once (no second derivatives).
``onednn_linear(False)`` (or ``ATTNKIT_ONEDNN_LINEAR=0``) turns the path off everywhere, and
``ATTNKIT_ONEDNN_LINEAR=1`` turns it on. By default a rule chooses, from the CPU alone, since the
two GEMMs round differently and a stopwatch must never choose a model's arithmetic: oneDNN on
AMD processors, whose float32 products MKL sends down slower code paths (one lm-small layer
2.0x faster with oneDNN on a Zen 5, 1.1x on a Zen 4), MKL elsewhere (the faster one on the
Intel Xeons measured: bench/history/). Every process on the same kind of CPU (a resumed run,
the ranks of a distributed one) makes the same choice; :func:`onednn_choice` says what it is
and why (:func:`describe_choice` in one line, which ``attnkit train`` prints for a float32
run).

Each product is the registered torch operator ``attnkit::onednn_mm`` with its gradients
(:func:`onednn_mm`): autograd runs its registered backward, and inside a graph that
``torch.compile`` builds for training (``accel.compiled_layers``) it stays one opaque call; an
inference graph (``accel.compiled_steps``) sees ordinary linears instead.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.accel import native
from attnkit.accel.swap import rebuilt, swap_modules
from attnkit.accel.switch import Switch

__all__ = [
    "OneDNNLinear",
    "bf16_products_fast",
    "describe_choice",
    "linear",
    "mm_t",
    "onednn_choice",
    "onednn_linear",
    "onednn_linear_available",
    "register_operator",
    "use_onednn",
    "use_onednn_products",
]

# Rows below which a product stays with torch's own GEMM: for a single row (a decoding step)
# its matrix-vector kernel beats oneDNN's per-call set-up.
_MIN_ROWS = 8
# onednn_linear(False / True) forces the lever inside a with block (ATTNKIT_ONEDNN_LINEAR=0 /
# =1 outside it; neither: None, the rule chooses, _enabled)
onednn_linear = _switch = Switch("ATTNKIT_ONEDNN_LINEAR", default=None)
# the rule: the processors whose float32 products oneDNN takes by default; known at import,
# so that a graph being compiled reads a constant
ONEDNN_VENDORS = ("AuthenticAMD",)
_RULE = native.cpu()["vendor"] in ONEDNN_VENDORS


# Known at import, so that a graph being compiled reads a constant (Dynamo does not trace
# torch.backends' functions).
_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache  # the processor's: asked before every training step
def bf16_products_fast() -> bool:
    """Whether torch runs bfloat16 matrix products on this CPU by oneDNN's bf16 kernels (an x86
    CPU with AVX-512, with or without AVX512-BF16 or AMX). Elsewhere, e.g. an AVX2-only AMD Zen
    3, ``torch.mm`` and ``F.linear`` in bf16 take a scalar fallback: on a 2-core Zen 3, 1
    GFLOP/s for 512 x 512 against float32's 100, so bf16 training is many times slower there
    than float32."""
    return _AVAILABLE and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear operator (x86 and ARM CPU builds do)."""
    return _AVAILABLE


def onednn_choice() -> dict:
    """Whether oneDNN takes float32 products outside ``onednn_linear`` blocks (``"on"``) and
    why (``"by"``: the environment variable, or the rule and this CPU's vendor)."""
    if _switch.on is not None:
        return {"on": _switch.on, "by": f"{_switch.env}={int(_switch.on)}"}
    vendor = native.cpu()["vendor"]
    return {"on": _RULE, "by": f"rule: oneDNN on AMD processors, MKL elsewhere; this is {vendor}"}


def describe_choice() -> str:
    """One line for a log: which GEMM takes float32 products here and why, e.g. "float32
    products: MKL (rule: oneDNN on AMD processors, MKL elsewhere; this is GenuineIntel)"."""
    if not onednn_linear_available():
        return "float32 products: MKL (this torch build has no oneDNN linear)"
    choice = onednn_choice()
    return f"float32 products: {'oneDNN' if choice['on'] else 'MKL'} ({choice['by']})"


def _enabled() -> bool:
    """Whether the path is on: forced by the switch, else by the rule."""
    return _RULE if _switch.on is None else _switch.on


def _mm(a: Tensor, b_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b_t.T (+ bias)`` for 2-D float32 CPU tensors, by oneDNN. ``b_t`` may be a
    transposed view (oneDNN reads either layout); ``a`` is made contiguous if it is not."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


def _gradients(ctx, x2: Tensor, weight: Tensor, grad: Tensor, mm: Callable):
    """(dL/dx2, dL/dW, dL/db) of ``x2 W^T + b``, each None unless needed, the products by
    ``mm(a, b_t, bias)`` (:func:`_mm` or its registered operator)."""
    # (T, out), dense: a broadcast gradient (that of a sum, strides 0) sends oneDNN to a
    # reference kernel a thousand times slower.
    g2 = grad.reshape(-1, grad.shape[-1]).contiguous()
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = mm(g2, weight.t(), None)  # dL/dx = g W
    if ctx.needs_input_grad[1]:
        # dL/dW = g^T x, (out, in). oneDNN wants its left operand contiguous, so transpose
        # whichever of g (T x out) and x (T x in) is the smaller copy.
        if g2.shape[1] <= x2.shape[1]:
            grad_w = mm(g2.t(), x2.t(), None)
        else:  # (x^T g)^T: copies x and the (in, out) result, not the wide g (LM head)
            grad_w = mm(x2.t(), g2.t(), None).t().contiguous()
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2.sum(0)
    return grad_x, grad_w, grad_b


def use_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether oneDNN takes this product (see the module docstring)."""
    return (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.float32)
        # A dense (out, in) or (in, out) layout only: a strided slice of a transposed weight
        # sends oneDNN to a reference kernel, far slower than torch's GEMM on the same view.
        and (weight.is_contiguous() or weight.t().is_contiguous())
        and x.dim() >= 2
        and x.numel() >= _MIN_ROWS * x.shape[-1] > 0
        and not torch.is_autocast_enabled("cpu")  # autocast casts to bf16: torch's path
        # Under torch.compile: a training graph keeps the product as the registered operator
        # (compiled layers, accel.compiled_layers); an inference graph sees an ordinary linear,
        # which Inductor's freezing packs for its own kernel (accel.compiled_steps).
        and (not torch.compiler.is_compiling() or torch.is_grad_enabled())
        and onednn_linear_available()
        and _enabled()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where :func:`use_onednn` says so (the
    operator ``attnkit::onednn_mm``, every leading axis of x a row)."""
    if not use_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    out = onednn_mm(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def mm_t(a: Tensor, b_t: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b_t.T`` for 2-D tensors, through oneDNN where :func:`linear` would use it. torch's
    own product writes into ``out`` when one is given; oneDNN's always returns a new tensor."""
    if not use_onednn(a, b_t, None):
        return a @ b_t.t() if out is None else torch.mm(a, b_t.t(), out=out)
    return onednn_mm(a, b_t, None)


@torch.library.custom_op("attnkit::onednn_mm", mutates_args=())
def onednn_mm(a: Tensor, b_t: Tensor, bias: Tensor | None) -> Tensor:
    """``a @ b_t.T (+ bias)`` by oneDNN, as a torch operator with its gradients (both
    products by oneDNN too): autograd runs its registered backward, and a graph compiled for
    training (:func:`attnkit.accel.compiled_layers`) keeps each product as one opaque call while
    Inductor fuses the work around it."""
    return _mm(a, b_t, bias)


@onednn_mm.register_fake
def _(a: Tensor, b_t: Tensor, bias: Tensor | None) -> Tensor:
    return a.new_empty(a.shape[0], b_t.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    a, b_t, bias = inputs
    ctx.save_for_backward(a, b_t)
    ctx.has_bias = bias is not None


def _backward(ctx, grad: Tensor):
    return _gradients(ctx, *ctx.saved_tensors, grad, onednn_mm)


onednn_mm.register_autograd(_backward, setup_context=_setup_context)


def register_operator() -> Callable:
    """The operator ``torch.ops.attnkit.onednn_mm`` (registered with this module)."""
    return onednn_mm


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose products go through :func:`linear` (oneDNN where
    :func:`use_onednn` says so, else ``F.linear``): built by :func:`use_onednn_products` over an
    existing layer's parameters; its state dict is the plain layer's."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def rows(self, x: Tensor, rows: slice) -> Tensor:
        """``x W[rows]^T + b[rows]``: some of the layer's output rows alone (cross-attention's
        W^Q, or W^K and W^V, from one in_proj), through the same product."""
        bias = None if self.bias is None else self.bias[rows]
        return linear(x, self.weight[rows], bias)


def use_onednn_products(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (exactly that class: quantized, packed or fused
    layers keep their own products) by a :class:`OneDNNLinear` over the same parameters;
    returns the model. Which GEMM each product takes is still decided per call (the rule, or
    ``onednn_linear(...)``/``ATTNKIT_ONEDNN_LINEAR``). ``enabled=False`` changes nothing."""
    if not enabled or not onednn_linear_available():
        return model

    def swap(module: nn.Module) -> nn.Module | None:
        return rebuilt(OneDNNLinear, module) if type(module) is nn.Linear else None

    return swap_modules(model, swap)
