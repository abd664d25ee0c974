"""A training step whose Transformer layers run through ``torch.compile``.

``with compiled_layers(model):`` gives every ``EncoderLayer`` and ``DecoderLayer`` of the model
a compiled ``forward`` for the duration of the block (the trainer wraps the training forward in
it: ``train.compile = true``, ``attnkit train --compile``); outside the block the layers are the
plain modules again, so evaluation, sampling and checkpoints never see compiled code. Inductor
fuses the elementwise work of a layer (norms, the activation, residual adds, dropout, the casts
of bf16 autocast) into a few loops, forward and backward. The matrix products stay in oneDNN
(where :func:`attnkit.accel.use_onednn_products` swapped them in, as the registered operator
``torch.ops.attnkit.onednn_mm``) and attention in attnkit's C kernel (for layers that
:func:`attnkit.accel.use_attention_kernel` set, as ``torch.ops.attnkit.attention``) or torch's
fused one. A mixture of experts routes tokens by their values (``nonzero``), so it runs eagerly
between the compiled parts of its layer. The unpadded stacks (``accel.unpad_stacks``) keep
skipping a padded batch's padding: their layers take the real rows, (1, T, D), and attention
over those packed rows runs eagerly between the layer's compiled parts (a graph break), where
attnkit's kernel takes them as they lie. T changes from batch to batch, so it is marked dynamic:
one compile serves every batch. (Before, the stacks ran the padded batch inside the block, and
mt-small's compiled step took the padded stacks' time, 1.14x the eager unpadded one:
bench/history/.)

Why layers and not the whole model: every layer of a stack runs the same code, so Dynamo
traces one layer, and the compiled code serves all of them (the weights are its inputs, not
constants): 24-32 s to compile lm-small or mt-small on a 2-core CPU instead of minutes. The
embeddings and the fused LM-head loss (:mod:`attnkit.accel.lm_loss`) stay eager.

The compiled code is made once per layer and kept (a new input shape may compile once more:
Dynamo then makes it shape-generic). Inductor caches what it builds on disk
(``TORCHINDUCTOR_CACHE_DIR``; by default under the system's temporary directory), so a second
process compiles from the cache (5-8 s). Whether it pays depends on the processor:
bench/history/ measures it (on a 2-core Zen 4 it did not).
"""

from __future__ import annotations

import shutil
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from attnkit.accel.attention import register_operator as register_attention
from attnkit.accel.onednn import register_operator
from attnkit.attention import MultiHeadAttention
from attnkit.layers import DecoderLayer, EncoderLayer, MoEFeedForward

__all__ = ["compiled_layers", "transformer_layers"]

# Each layer's compiled forward, made at its first compiled step.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Each attention layer's forward that runs packed rows eagerly (_eager_over_rows).
_EAGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The ``EncoderLayer`` / ``DecoderLayer`` modules of ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, EncoderLayer | DecoderLayer)]


def check_compiler(enabled: bool = True, *, sharded: bool = False) -> None:
    """Raise a one-line error when compiled layers (``enabled``) cannot train here: no C++
    compiler for Inductor's CPU code, or a sharded (FSDP2) run, whose gathering of the shards
    runs around each layer and is not compiled with it."""
    if not enabled:
        return
    if sharded:
        raise ValueError(
            "train.compile=true does not run under strategy='fsdp'; use strategy='ddp' or "
            "leave compile off"
        )
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise RuntimeError(
            "train.compile: torch.compile on a CPU needs a C++ compiler (g++, c++ or clang++), "
            "and none is on PATH; install one (apt-get install g++) or leave compile off"
        )


def _rows_any_length(compiled):
    """``compiled`` called with the packed rows' count marked dynamic: an unpadded stack
    (``accel.unpad_stacks``) hands its layers x (1, T, D) (and memory (1, T_src, D)), T the
    batch's real tokens, which changes from batch to batch; one graph for any T, where Dynamo
    would compile for the first T and again, shape-generic, at the second."""

    def forward(x, *args, **kwargs):
        if kwargs.get("rows") is not None:
            for rows in (x, args[0] if args else kwargs.get("memory")):
                if isinstance(rows, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(rows, 1)
        return compiled(x, *args, **kwargs)

    return forward


def _eager_over_rows(attention: MultiHeadAttention):
    """``attention.forward``, which runs eagerly when called with packed rows (``rows=``):
    inside a compiled layer, attention over packed rows runs between the layer's compiled parts
    (a graph break), where the kernel takes the rows as they lie (the kernel's packed form does
    not take traced rows: ``takes_packed``). The output's row count is marked dynamic, as the
    layer's input is (:func:`_rows_any_length`), so that the rest of the layer compiles once
    for any number of rows. Other calls are traced as usual."""
    plain = attention.forward

    # torch.compiler.disable, as torch's own modules write it: torch.compiler.disable imports
    # Dynamo at once (2 s for every process that imports attnkit), torch._disable_dynamo at
    # the first call
    @torch._disable_dynamo
    def eager(x, *args, **kwargs):
        out = plain(x, *args, **kwargs)  # (1, T, D)
        torch._dynamo.maybe_mark_dynamic(out, 1)
        return out

    def forward(x, *args, **kwargs):
        if kwargs.get("rows") is not None:
            return eager(x, *args, **kwargs)
        return plain(x, *args, **kwargs)

    return forward


@contextmanager
def compiled_layers(model: nn.Module, enabled: bool = True):
    """Inside the block, each Transformer layer of ``model`` runs a compiled ``forward``
    (see the module docstring); ``enabled=False`` changes nothing."""
    layers = transformer_layers(model) if enabled else []
    if layers:  # oneDNN products and attention stay one call each in the compiled graphs
        register_operator()
        register_attention()
    # A mixture of experts routes each token by data (nonzero): it runs eagerly between
    # the compiled parts of its layer.
    experts = [m for m in model.modules() if isinstance(m, MoEFeedForward)] if layers else []
    for module in experts:
        module.forward = torch.compiler.disable(module.forward)
    attentions = [m for layer in layers for m in layer.modules()
                  if isinstance(m, MultiHeadAttention)]  # fmt: skip
    for module in attentions:  # the same function each time: Dynamo's guards hold
        if module not in _EAGER:
            _EAGER[module] = _eager_over_rows(module)
        module.forward = _EAGER[module]
    for layer in layers:
        compiled = _COMPILED.get(layer)
        if compiled is None:
            compiled = _COMPILED[layer] = _rows_any_length(torch.compile(layer.forward))
        layer.forward = compiled  # an instance attribute: nn.Module.__call__ calls it
    try:
        # The partitioner may recompute views in the backward. Without that, a ReLU whose
        # output is saved as a (tokens, d_ff) view for the next product's gradient also saved
        # the mask out <= 0 as a bool tensor, and Inductor's CPU code writes and reads bool
        # tensors element by element: an mt-small step went from 1.19x the eager step's time
        # to 0.94x (bench/history/).
        import torch._functorch.config as functorch_config

        with functorch_config.patch(recompute_views=bool(layers)):
            yield
    finally:
        for module in layers + experts + attentions:
            del module.forward  # the class's forward again
