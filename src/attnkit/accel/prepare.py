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
- decoding: a Llama model with packed GGUF weights runs its decoder stack in C (a module
  swap); its packed products take the integer path (int8 activations), by a rule: on every CPU
  with the native kernels, whose variants all give that path the same bits, so the same file
  gives the same answers on any x86 machine (``exact=True``, ``--exact`` or ``ATTNKIT_INT8=0``:
  the float32 path); the linear weights are laid out for one-row products once;
  ``compile=True`` gives the model compiled decoding steps (``accel.compiled_steps``).

No lever that changes a model's arithmetic is chosen by timing it: each is on or off by a rule
that reads the CPU, the model and the switches, and says so in its reason.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from torch import nn

from attnkit.accel import decoding, native, packed_step  # noqa: F401 (their switches)
from attnkit.accel.attention import tiles_available, use_attention_kernel
from attnkit.accel.compiled import compiled_steps
from attnkit.accel.decoding import lay_out_for_decoding
from attnkit.accel.lm_loss import fuse_lm_loss
from attnkit.accel.onednn import (
    describe_choice,
    onednn_choice,
    onednn_linear_available,
    use_onednn_products,
)
from attnkit.accel.packed import PackedLinear, int8_path, use_integer_products
from attnkit.accel.packed_step import packed_stack
from attnkit.accel.switch import Switch, read_environment, switch
from attnkit.accel.unpadded import unpad_stacks
from attnkit.layers import LMHead, MoEFeedForward

__all__ = ["JOBS", "Lever", "Prepared", "levers", "prepare", "ready_for_decoding"]

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
    unpad = switch("ATTNKIT_UNPAD")
    why = unpad.why_off if not unpad.on else "a mixture of experts counts padding" if moe else ""
    levers.append(Lever("unpadded", unpad.on and not moe, why))
    attention = _kernel_lever("attention-kernel", "ATTNKIT_ATTENTION_KERNEL")
    tiles = switch("ATTNKIT_ATTENTION_TILES")
    on = tiles.on and attention.on and tiles_available()
    why = "bf16 attention" if on else "no AMX tiles here"
    if not tiles.on or not attention.on:
        why = tiles.why_off if not tiles.on else f"the attention kernel is off: {attention.why}"
    levers += [attention, Lever("amx-tiles", on, why)]
    if not onednn_linear_available():
        levers.append(Lever("onednn-fp32", False, "torch has no oneDNN linear"))
    else:
        choice = onednn_choice()
        levers.append(Lever("onednn-fp32", bool(choice["on"]), describe_choice()))
    glibc, keeping = platform.libc_ver()[0] == "glibc", switch("ATTNKIT_KEEP_MEMORY")
    why = "glibc" if glibc and keeping.on else keeping.why_off if glibc else "no glibc"
    levers.append(Lever("keep-memory", glibc and bool(keeping.on), why))
    return levers


# 0: the float32 path, 1 or unset: the integer path (the rule)
integer_products = Switch("ATTNKIT_INT8")
INT8_RULE = "the integer path wherever the kernels are built: the same bits on every variant"


def _integer_lever(model: nn.Module | None, exact: bool = False) -> Lever:
    """int8-products: whether packed products take the integer path, and why."""
    if exact:
        return Lever("int8-products", False, "exact: float32 activations, as asked")
    if not integer_products.on:
        return Lever("int8-products", False, f"{integer_products.why_off}: float32 activations")
    path = int8_path()
    if path is None:
        return Lever("int8-products", False, "no native kernels (see attnkit info)")
    if model is not None and not any(isinstance(m, PackedLinear) for m in model.modules()):
        return Lever("int8-products", False, "no packed weights")
    return Lever("int8-products", True, f"{path}; rule: {INT8_RULE}")


def _decoding_levers(
    model: nn.Module | None, exact: bool = False, compile: bool = False
) -> list[Lever]:
    layout = switch("ATTNKIT_DECODING_LAYOUT")
    packed = _kernel_lever(
        "packed-step",
        "ATTNKIT_PACKED_STEP",
        f"packed Llama-family decoders, {native.variant()} kernels",
    )
    if packed.on and model is not None:
        why = packed_step.why_not(model)
        packed = Lever("packed-step", why is None, packed.why if why is None else why)
    return [
        packed,
        _integer_lever(model, exact),
        Lever("decoding-layout", layout.on, "once, in place" if layout.on else layout.why_off),
        Lever("compiled-step", compile, "as asked" if compile else "compile=True asks for it"),
    ]


def levers(job: str) -> list[Lever]:
    """The levers :func:`prepare` would turn on for ``job`` here, with no model in hand."""
    if job not in JOBS:
        raise ValueError(f"levers: job must be one of {JOBS}, got {job!r}")
    read_environment()
    return _training_levers(None) if job == "training" else _decoding_levers(None)


def prepare(model: nn.Module, job: str, *, exact: bool = False, compile: bool = False) -> Prepared:
    """Ready ``model`` for ``job`` (``"training"`` or ``"decoding"``) and report every lever.

    For training, the model's LM heads get the fused loss, its stacks the unpadded forward and
    its linear layers oneDNN's products where the rule takes them (module swaps, in place),
    and its attention layers choose the C kernel for their fused path.
    For decoding, packed products take the integer path by the rule of the module docstring
    (``exact=True`` keeps them on the float32 path; ``ATTNKIT_INT8=0`` too), the linear weights
    are laid out for one-row products once, in place (so that ``generate`` need not do it per
    call), and a Llama model with packed weights gets its decoder stack in C (``PackedStack``:
    the prompt in chunks and every step, each token's arithmetic the same whatever shares its
    call); ``compile=True`` gives it compiled decoding steps (``model.decoding_steps``, run by
    ``generate``). Returns the model (as changed) and the levers; nothing changes the model's
    answers except the integer path, which its lever reports.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare: model must be an nn.Module, got {type(model).__name__}")
    if job not in JOBS:
        raise ValueError(f"prepare: job must be one of {JOBS}, got {job!r}")
    read_environment()  # the switches' environment variables, read here (and in levers)
    if job == "decoding":
        found = _decoding_levers(model, exact, compile)
        on = {lever.name: lever.on for lever in found}
        model = use_integer_products(model, bool(on["int8-products"]))
        if on["decoding-layout"]:
            lay_out_for_decoding(model)
        if on["packed-step"]:
            model = packed_stack(model)
        if compile:
            device = next(model.parameters()).device
            model.decoding_steps = compiled_steps(device)
        for module in model.modules():
            if isinstance(module, PackedLinear):
                module.prepared = True
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


def ready_for_decoding(model: nn.Module) -> nn.Module:
    """``model`` prepared for decoding (:func:`prepare`) where it keeps packed weights, which are
    never trained: what ``from_pretrained`` returns; ``prepare(model, "decoding", exact=True)``
    then puts the products back on the float32 path. Any other model as it is."""
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return prepare(model, "decoding").model
    return model
