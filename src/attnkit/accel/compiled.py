"""The cached decoding step through ``torch.compile``, with the weights frozen into it.

``compiled_step(step, device)`` is ``torch.compile(step, dynamic=True)`` (dynamic shapes, so
the growing cache does not recompile), made once per process and device type. On a CPU the
weights become constants of the compiled step (Inductor's *freezing*), which lets Inductor pack
each weight matrix for its own C++ matrix kernel and keep that kernel where it measures faster
than torch's (``max_autotune``). The first call for a model compiles (a C++ compiler is
needed; bench/history/ gives the time it took); later calls reuse it.
``accel.prepare(model, "decoding", compile=True)`` gives the model both, as its
``decoding_steps`` (:func:`compiled_steps`), which ``generate`` runs. Autotuning builds and
times several kernels for each product: on an empty Inductor cache lm-small's first compile
took 81 s with it and 47.5 s without (bench/history/). ``ATTNKIT_AUTOTUNE=0`` (or ``with
autotuning(False):``) compiles without it, with torch's GEMM.

Because the compiled step holds its own packed copy of the weights, :func:`frozen_weights`
checks the weights on every call: if any parameter or buffer was changed since the step was
compiled (trained, loaded, replaced, moved), it drops the compiled code
(``torch.compiler.reset()``, which also drops other ``torch.compile`` caches of the process) and
compiles again. A change made through ``tensor.data`` bypasses the version counter this check
reads; call ``torch.compiler.reset()`` after one. Each model (and each kind of input: with or
without a padding mask) gets compiled code of its own, and Dynamo keeps at most
``torch._dynamo.config.recompile_limit`` versions of a step: past that the steps run eagerly.
"""

from __future__ import annotations

import itertools
import shutil
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from attnkit.accel import native
from attnkit.accel.packed import register_operator
from attnkit.accel.switch import Switch
from attnkit.generation import DecodingSteps, lm_step, seq2seq_step

__all__ = ["autotuning", "compiled_step", "compiled_steps", "frozen_weights"]

_COMPILED: dict[tuple[Callable, str, bool], Callable] = {}
# autotuning(False) holds the lever off inside a with block (ATTNKIT_AUTOTUNE=0: off)
autotuning = _autotune = Switch("ATTNKIT_AUTOTUNE")


def _guard_filter(entries) -> list[bool]:
    """Which of Dynamo's per-call checks to keep: none on the attributes of torch.nn's own
    modules (Linear, LayerNorm, ...), which never change during generation; every other one,
    and the identity check of each weight that is a compiled constant (another model, or a
    replaced weight, gets its own compiled code)."""
    return [
        entry.guard_type == "ID_MATCH"
        or not entry.orig_guard.source.is_unspecialized_builtin_nn_module()
        for entry in entries
    ]


def compiled_step(step: Callable, device: torch.device) -> Callable:
    """``torch.compile(step, dynamic=True)``, made once per process, device type and
    autotuning setting (Dynamo keeps the compiled code per model and per kind of input, so
    later ``generate`` calls reuse it)."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise RuntimeError(
            "compile=True: torch.compile on a CPU needs a C++ compiler (g++, c++ or clang++), "
            "and none is on PATH; install one (apt-get install g++) or leave compile off"
        )
    if device.type == "cpu" and native.library() is not None:
        register_operator()  # packed layers (GGUF weights) stay one call each
    key = (step, device.type, _autotune.on)
    if key not in _COMPILED:
        options = {"guard_filter_fn": _guard_filter}
        if device.type == "cpu":
            options["freezing"] = True  # the weights as constants (see frozen_weights)
        if device.type == "cpu" and _autotune.on:
            # packed for Inductor's C++ matrix kernel where autotuning measures it faster than
            # torch's GEMM (ATen)
            options |= {
                "max_autotune": True,
                "max_autotune_gemm_backends": "CPP,ATEN",
                "autotune_num_choices_displayed": 0,  # no timing tables on stderr
                "max_autotune_report_choices_stats": False,
            }
        _COMPILED[key] = torch.compile(step, dynamic=True, options=options)
    return _COMPILED[key]


def compiled_steps(device: torch.device) -> DecodingSteps:
    """The cached decoding steps compiled for ``device``, for a model's ``decoding_steps``: on
    a CPU each ``generate`` call runs inside :func:`frozen_weights`."""
    session = frozen_weights if device.type == "cpu" else nullcontext
    lm, seq2seq = compiled_step(lm_step, device), compiled_step(seq2seq_step, device)
    return DecodingSteps(lm, seq2seq, session)


# The weights each model's compiled steps were made with (see _weights_state).
_COMPILED_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_state(model) -> tuple:
    """What identifies a model's current weights: each parameter's and buffer's identity,
    version counter (every in-place change bumps it), dtype, device, shape and strides. Not
    its storage."""
    return tuple(
        (id(t), t._version, t.dtype, t.device, t.shape, t.stride())
        for t in itertools.chain(model.parameters(), model.buffers())
    )


@contextmanager
def frozen_weights(model):
    """Compile the steps of this block with the weights as constants (a CPU's compiled steps).

    Dynamo reads Inductor's ``freezing`` flag while it traces (to make the weights graph
    constants), so the flag is set for the whole block, not only in the compile options. If
    the model's weights changed since its steps were compiled, the stale code is dropped first.
    """
    state = _weights_state(model)
    if _COMPILED_WEIGHTS.get(model, state) != state:
        torch.compiler.reset()  # Dynamo's caches, every model's compiled steps among them
        _COMPILED_WEIGHTS.clear()
    _COMPILED_WEIGHTS[model] = state
    with torch._inductor.config.patch(freezing=True), warnings.catch_warnings():
        # Inductor's autotuner calls a storage API that torch itself deprecates.
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        yield
