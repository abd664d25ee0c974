"""One call that readies a model for its job, and says what it turned on and why anything is off.

::

    report = accel.prepare(model, "training")   # the trainer calls it
    print(report.line())    # levers: fused-loss on, unpadded on, attention-kernel on (amx), ...

``levers(job)`` answers the same question without a model (``attnkit info`` prints it for both
jobs). Each :class:`Lever` is one speed lever of this package: its name, whether it is on, and
why (the switch or environment variable that turned it off, the kernel that is missing, the
CPU feature that is absent). The levers themselves live in their own modules; this one only
chooses and reports:

- training: the fused LM-head loss, the unpadded stacks and oneDNN's float32 products change
  the model (module swaps), and its attention layers choose the C kernel; glibc's kept memory
  acts on the process (``training.config.step_context``); compiled layers are the recipe's
  ``train.compile``;
- decoding: a Llama model with packed GGUF weights steps in C; its packed products take the
  integer path (int8 activations) where it measures faster on the model's own layers; the
  linear weights are laid out for one-row products once; ``generate(compile=True)`` compiles
  the step.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from torch import nn

from attnkit.accel import decoding, native, packed_step  # noqa: F401 (their switches)
from attnkit.accel.attention import tiles_available, use_attention_kernel
from attnkit.accel.decoding import lay_out_for_decoding
from attnkit.accel.lm_loss import fuse_lm_loss
from attnkit.accel.measured import machine_key, remembered
from attnkit.accel.onednn import (
    describe_choice,
    onednn_choice,
    onednn_linear_available,
    use_onednn_products,
)
from attnkit.accel.packed import PackedLinear, int8_path, time_paths, use_integer_products
from attnkit.accel.switch import switch
from attnkit.accel.unpadded import unpad_stacks
from attnkit.layers import LMHead, MoEFeedForward

__all__ = ["JOBS", "Lever", "Prepared", "levers", "prepare"]

JOBS = ("training", "decoding")


@dataclass(frozen=True)
class Lever:
    """One speed lever: ``name``, whether it is ``on``, and ``why`` (a few words)."""

    name: str
    on: bool
    why: str = ""

    def __str__(self) -> str:
        return f"{self.name} {'on' if self.on else 'off'}" + (f" ({self.why})" if self.why else "")


@dataclass
class Prepared:
    """What :func:`prepare` did: the model (the same object, changed in place where a lever
    swaps modules) and every lever with its state."""

    model: nn.Module
    job: str
    levers: list[Lever] = field(default_factory=list)

    def line(self) -> str:
        """The levers in one line, for a run's header."""
        return "levers: " + ", ".join(str(lever) for lever in self.levers)


def _kernel_lever(name: str, env: str, what: str = "") -> Lever:
    """A lever that needs the native kernels: on when they loaded and its switch is on."""
    if not switch(env).on:
        return Lever(name, False, switch(env).why_off)
    if native.library() is None:
        return Lever(name, False, "no native kernels (see attnkit info)")
    return Lever(name, True, what or f"{native.variant()} kernels")


def _training_levers(model: nn.Module | None) -> list[Lever]:
    modules = [] if model is None else list(model.modules())
    has_head = model is None or any(isinstance(m, LMHead) for m in modules)
    moe = any(isinstance(m, MoEFeedForward) for m in modules)
    levers = []
    if not has_head:
        levers.append(Lever("fused-loss", False, "no LM head"))
    else:
        kernel = _kernel_lever("fused-loss", "ATTNKIT_LOSS_KERNEL")
        why = "rows in C" if kernel.on else f"rows in torch: {kernel.why}"
        levers.append(Lever("fused-loss", True, why))
    if not switch("ATTNKIT_UNPAD").on:
        levers.append(Lever("unpadded", False, switch("ATTNKIT_UNPAD").why_off))
    elif moe:
        levers.append(Lever("unpadded", False, "a mixture of experts counts padded tokens"))
    else:
        levers.append(Lever("unpadded", True))
    levers.append(_kernel_lever("attention-kernel", "ATTNKIT_ATTENTION_KERNEL"))
    if not switch("ATTNKIT_ATTENTION_TILES").on:
        levers.append(Lever("amx-tiles", False, switch("ATTNKIT_ATTENTION_TILES").why_off))
    else:
        tiles = switch("ATTNKIT_ATTENTION_KERNEL").on and tiles_available()
        why = "bf16 attention" if tiles else "no AMX tiles here"
        if not tiles and native.library() is None:
            why = "no native kernels (see attnkit info)"
        elif not tiles and not switch("ATTNKIT_ATTENTION_KERNEL").on:
            why = "the attention kernel is off"
        levers.append(Lever("amx-tiles", tiles, why))
    if not onednn_linear_available():
        levers.append(Lever("onednn-fp32", False, "torch has no oneDNN linear"))
    else:
        choice = onednn_choice()
        levers.append(Lever("onednn-fp32", bool(choice["on"]), describe_choice()))
    kept = platform.libc_ver()[0] == "glibc" and os.environ.get("ATTNKIT_KEEP_MEMORY") != "0"
    why = "glibc" if kept else ("ATTNKIT_KEEP_MEMORY=0" if platform.libc_ver()[0] else "no glibc")
    levers.append(Lever("keep-memory", kept, why))
    return levers


_INT8 = "ATTNKIT_INT8"  # 0: the float32 path, 1: the integer path, unset: measured


def _integer_lever(model: nn.Module | None) -> Lever:
    """int8-products: whether packed products take the integer path, and why."""
    forced = os.environ.get(_INT8)
    if forced == "0":
        return Lever("int8-products", False, f"{_INT8}=0")
    path = int8_path()
    if path is None:
        return Lever("int8-products", False, "no native kernels (see attnkit info)")
    if model is None:
        why = f"{_INT8}=1" if forced == "1" else "where it measures faster on the model"
        return Lever("int8-products", True, f"{path}; {why}")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        return Lever("int8-products", False, "no packed weights")
    if forced == "1":
        return Lever("int8-products", True, f"{path}; {_INT8}=1")
    layer = max(packed, key=lambda m: m.blocks.numel())
    shape = f"{layer.kind} {layer.out_features} x {layer.in_features}"
    key = f"{machine_key()}, {native.variant()} kernels, {shape}"
    times = remembered("int8", key, lambda: time_paths(layer))  # every process agrees
    if times["int8"] == float("inf"):
        return Lever("int8-products", False, f"{path}; {shape}: its rows make no whole tiles")
    faster = times["int8"] < 0.97 * times["float32"]
    ms = {name: f"{times[name] * 1e3:.3f} ms" for name in ("int8", "float32")}
    why = f"{path}; one row x {layer.out_features}: int8 {ms['int8']}, float32 {ms['float32']}"
    return Lever("int8-products", faster, why)


def _decoding_levers(model: nn.Module | None) -> list[Lever]:
    layout = switch("ATTNKIT_DECODING_LAYOUT")
    packed = _kernel_lever(
        "packed-step", "ATTNKIT_PACKED_STEP", f"GGUF Llama and Gemma 3, {native.variant()} kernels"
    )
    if packed.on and model is not None:
        why = packed_step.why_not(model)
        packed = Lever("packed-step", why is None, packed.why if why is None else why)
    return [
        packed,
        _integer_lever(model),
        Lever("decoding-layout", layout.on, "once, in place" if layout.on else layout.why_off),
        Lever("compiled-step", False, "generate(compile=True) asks for it"),
    ]


def levers(job: str) -> list[Lever]:
    """The levers :func:`prepare` would turn on for ``job`` here, with no model in hand."""
    if job not in JOBS:
        raise ValueError(f"levers: job must be one of {JOBS}, got {job!r}")
    return _training_levers(None) if job == "training" else _decoding_levers(None)


def prepare(model: nn.Module, job: str) -> Prepared:
    """Ready ``model`` for ``job`` (``"training"`` or ``"decoding"``) and report every lever.

    For training, the model's LM heads get the fused loss, its stacks the unpadded forward and
    its linear layers oneDNN's products where they measured faster (module swaps, in place),
    and its attention layers choose the C kernel for their fused path.
    For decoding, packed products take the integer path where it measured faster on the
    model's largest packed layer (measured once per machine and layer shape, and kept:
    :mod:`attnkit.accel.measured`; ``ATTNKIT_INT8=0`` or ``1`` forces a path), the linear weights
    are laid out for one-row products once, in place (so that ``generate`` need not do it per
    call), and the packed C step is reported as it will run for this model (``generate`` builds
    it per call).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare: model must be an nn.Module, got {type(model).__name__}")
    if job not in JOBS:
        raise ValueError(f"prepare: job must be one of {JOBS}, got {job!r}")
    if job == "decoding":
        found = _decoding_levers(model)
        on = {lever.name: lever.on for lever in found}
        use_integer_products(model, bool(on["int8-products"]))
        if on["decoding-layout"]:
            lay_out_for_decoding(model)
        return Prepared(model, job, found)
    found = _training_levers(model)
    on = {lever.name: lever.on for lever in found}
    if on["fused-loss"]:
        model = fuse_lm_loss(model)
    if on["unpadded"]:
        model = unpad_stacks(model)
    model = use_onednn_products(model, on["onednn-fp32"])
    use_attention_kernel(model, on["attention-kernel"])
    return Prepared(model, job, found)
