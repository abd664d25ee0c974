"""A training step whose Transformer layers run through ``torch.compile``.

``with compiled_layers(model):`` swaps every ``EncoderLayer`` and ``DecoderLayer`` of the model
for a :class:`CompiledLayer` (``torch.compile(layer)``, made once per layer and kept) for the
duration of the block (the trainer wraps the training forward in it: ``train.compile = true``,
``attnkit train --compile``); outside the block the plain layers are back in their places, so
evaluation, sampling and checkpoints never see compiled code. Inductor fuses the elementwise
work of a layer (norms, the activation, residual adds, dropout, the casts of bf16 autocast)
into a few loops, forward and backward. The matrix products stay in oneDNN (where
:func:`attnkit.accel.use_onednn_products` swapped them in, as the registered operator
``torch.ops.attnkit.onednn_mm``) and attention in attnkit's C kernel (for models that
:func:`attnkit.accel.use_attention_kernel` set, as ``torch.ops.attnkit.attention``) or torch's
fused one. A mixture of experts routes tokens by their values (``nonzero``), so it runs eagerly
between the compiled parts of its layer (an :class:`EagerExperts` in the block). The unpadded
stacks (``accel.unpad_stacks``) keep skipping a padded batch's padding: their layers take the
real rows, (1, T, D), and attention over those packed rows runs eagerly between the layer's
compiled parts (a graph break: an :class:`EagerRowsAttention` in the block), where attnkit's
kernel takes them as they lie. T changes from batch to batch, so it is marked dynamic: one
compile serves every batch. (Before, the stacks ran the padded batch inside the block, and
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
from attnkit.accel.swap import rebuilt, swap_modules
from attnkit.attention import MultiHeadAttention
from attnkit.layers import DecoderLayer, EncoderLayer, MoEFeedForward

__all__ = [
    "CompiledLayer",
    "EagerExperts",
    "EagerRowsAttention",
    "compiled_layers",
    "transformer_layers",
]

# What each module is swapped for inside the block, made at its first compiled step and kept
# (the same modules each time: Dynamo's guards hold, nothing compiles again).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


class CompiledLayer(nn.Module):
    """A Transformer layer through ``torch.compile(layer)``. An unpadded stack
    (``accel.unpad_stacks``) hands its layers x (1, T, D) (and memory (1, T_src, D)), T the
    batch's real tokens, which changes from batch to batch: their row count is marked dynamic,
    so that one graph serves any T (Dynamo would compile for the first T and again,
    shape-generic, at the second)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.compiled = torch.compile(layer)  # holds the layer itself as compiled._orig_mod

    def forward(self, x, *args, **kwargs):
        if kwargs.get("rows") is not None:
            for rows in (x, args[0] if args else kwargs.get("memory")):
                if isinstance(rows, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(rows, 1)
        return self.compiled(x, *args, **kwargs)


# torch.compiler.disable, as torch's own modules write it: torch.compiler.disable imports Dynamo
# at once (2 s for every process that imports attnkit), torch._disable_dynamo at the first call
@torch._disable_dynamo
def _eager_rows(forward, x, *args, **kwargs):
    out = forward(x, *args, **kwargs)  # (1, T, D)
    torch._dynamo.maybe_mark_dynamic(out, 1)
    return out


class EagerRowsAttention(MultiHeadAttention):
    """A MultiHeadAttention whose calls with packed rows (``rows=``) run eagerly: inside a
    compiled layer, attention over packed rows runs between the layer's compiled parts (a
    graph break), where the kernel takes the rows as they lie (the kernel's packed form does
    not take traced rows: ``takes_packed``). The output's row count is marked dynamic, as the
    layer's input is (:class:`CompiledLayer`). Other calls are traced as usual."""

    def forward(self, x, *args, **kwargs):
        if kwargs.get("rows") is not None:
            return _eager_rows(super().forward, x, *args, **kwargs)
        return super().forward(x, *args, **kwargs)


class EagerExperts(MoEFeedForward):
    """A mixture of experts that runs eagerly inside a compiled layer: it routes each token by
    data (``nonzero``)."""

    @torch._disable_dynamo
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def _swapped(module: nn.Module) -> nn.Module | None:
    """What ``module`` runs as inside the block (None: itself), the same object each time; a
    subclass swap reads the module's current state (its mode, its settings) again."""
    if isinstance(module, EncoderLayer | DecoderLayer):
        if module not in _COMPILED:
            _COMPILED[module] = CompiledLayer(module)
        return _COMPILED[module]
    cls = {MultiHeadAttention: EagerRowsAttention, MoEFeedForward: EagerExperts}.get(type(module))
    if cls is None:
        return None
    made = _COMPILED.get(module)
    if made is None:
        made = _COMPILED[module] = rebuilt(cls, module)
    else:  # the same object as before, over the module's state as it is now
        made.__dict__.update(rebuilt(cls, module).__dict__)
    return made


@contextmanager
def compiled_layers(model: nn.Module, enabled: bool = True):
    """Inside the block, each Transformer layer of ``model`` runs compiled (module swaps: see
    the module docstring); ``enabled=False`` changes nothing."""
    layers = transformer_layers(model) if enabled else []
    if not layers:
        yield
        return
    register_operator()  # oneDNN products and attention stay one call each in the graphs
    register_attention()
    originals: dict[int, nn.Module] = {}  # id(what runs in the block) -> the module it was

    def swap(module: nn.Module) -> nn.Module | None:
        new = _swapped(module)
        if new is not None:
            originals[id(new)] = module
        return new

    swap_modules(model, swap)
    try:
        # The partitioner may recompute views in the backward. Without that, a ReLU whose
        # output is saved as a (tokens, d_ff) view for the next product's gradient also saved
        # the mask out <= 0 as a bool tensor, and Inductor's CPU code writes and reads bool
        # tensors element by element: an mt-small step went from 1.19x the eager step's time
        # to 0.94x (bench/history/).
        import torch._functorch.config as functorch_config

        with functorch_config.patch(recompute_views=True):
            yield
    finally:
        swap_modules(model, lambda m: originals.get(id(m)))
