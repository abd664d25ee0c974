"""``attnkit export``: a model out as a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnkit.cli.common import UsageError, load_model, load_tokenizer


def register(commands) -> None:
    export = commands.add_parser(
        "export",
        help="write a model as a Hugging Face directory or a GGUF file (llama.cpp, Ollama)",
        description=(
            "Write MODEL, with its tokenizer, as a directory that another tool reads: --format "
            "hf for transformers (Llama, Qwen2, Qwen3, Phi-3, Mistral, Gemma 3, GPT-2, BERT, "
            "XLM-RoBERTa-XL or Marian: the architecture it was read from, else whichever "
            "computes the same function), --format gguf for llama.cpp, Ollama and LM Studio "
            "(decoder-only models). MODEL is anything from_pretrained reads: "
            "a training checkpoint, a fine-tuned directory, a shipped name (smollm2, gemma3, "
            "minilm, e5). A model with no counterpart in the format is refused, naming the "
            "field; nothing is written then. See docs/EXPORT.md."
        ),
        epilog=(
            "examples:\n"
            "  attnkit export runs/shakespeare-char-3min/checkpoint runs/export-hf --format hf\n"
            "  attnkit export runs/shakespeare-char-3min/checkpoint runs/export-gguf "
            "--format gguf --quant q8_0\n"
            "  attnkit export minilm runs/minilm-hf --format hf"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("model", metavar="MODEL", help="the model to export")
    export.add_argument("out", metavar="OUT", help="the directory to write (must not exist)")
    export.add_argument("--format", choices=["hf", "gguf"], default="hf", help="default: hf")
    from attnkit.interop.export import DTYPES, QUANTIZATIONS

    export.add_argument("--dtype", choices=list(DTYPES), default="f32", help="weights' type (f32)")
    export.add_argument(
        "--quant",
        choices=list(QUANTIZATIONS),
        help="GGUF only: the linear layers in llama.cpp's 8- or 4-bit blocks",
    )
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.interop.export import export
    from attnkit.serve.chat import chat_template_for

    if Path(args.out).exists():
        raise UsageError(f"OUT: {args.out} already exists; choose a new directory")
    if args.quant and args.format != "gguf":
        raise UsageError(f"--quant {args.quant}: only --format gguf holds quantized blocks")
    model = load_model(args.model, "MODEL", dequantize=True)
    tokenizer = load_tokenizer(args.model, "MODEL")
    try:
        written = export(
            model,
            args.out,
            format=args.format,
            dtype=args.dtype,
            quant=args.quant,
            tokenizer=tokenizer,
            chat_template=chat_template_for(args.model),
            card=run_card(args.model),
        )
    except ValueError as error:
        raise UsageError(f"MODEL: {error}") from None
    print(f"wrote {written}")


def run_card(model: str) -> dict:
    """What a training checkpoint recorded (its recipe, steps, last validation), for README.md."""
    path = Path(model)
    card: dict = {"name": path.parent.name if path.name == "checkpoint" else path.name}
    state = path / "trainer_state.json" if path.is_dir() else None
    if state is not None and state.is_file():
        data = json.loads(state.read_text(encoding="utf-8"))
        card["Training"] = {k: data.get(k) for k in ("step", "tokens_seen", "elapsed_s")}
        if data.get("last_validation"):
            card["Validation"] = data["last_validation"]
        if data.get("recipe"):
            card["Recipe"] = data["recipe"]
    return card
