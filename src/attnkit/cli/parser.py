"""The argument parser of every command: argument parsing only; each command runs in its own
module of this package."""

from __future__ import annotations

import argparse

import attnkit
from attnkit.cli import (
    average,
    chat,
    classify,
    demo,
    embed,
    evaluate,
    explain,
    export,
    generate,
    info,
    models,
    perplexity,
    quantize,
    serve,
    train,
    translate,
    tune_length_penalty,
    viz,
)
from attnkit.cli.common import Parser

# every command, in the order `attnkit --help` lists them; each module has register() and run()
COMMANDS = (
    explain, demo, viz, models, info, generate, perplexity, embed, quantize,
    train, evaluate, translate, average, tune_length_penalty, classify, export, serve, chat,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="attnkit",
        description="attnkit: the Transformer, whole and open to inspection.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(commands)
    return parser
