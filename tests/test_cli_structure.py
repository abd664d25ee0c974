"""The command line as one pattern: every command is a module of ``attnkit.cli`` with
``register(subparsers)`` and ``run(args)``, ``parser.py`` loops over one list of them, and no
module imports another's private (underscore) names."""

import ast
from pathlib import Path

from attnkit.cli import build_parser
from attnkit.cli.parser import COMMANDS

CLI = Path(__file__).resolve().parents[1] / "src" / "attnkit" / "cli"


def test_every_command_module_registers_itself_and_runs():
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices
    assert len(choices) == len(COMMANDS) == 18
    for module in COMMANDS:
        assert callable(module.register) and callable(module.run), module.__name__
        assert module.__name__.startswith("attnkit.cli.")
    for name, sub in choices.items():
        handler = sub.get_default("handler")
        assert handler.__name__ == "run", name
        assert handler.__module__ in {m.__name__ for m in COMMANDS}, name


def test_no_private_name_crosses_modules():
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnkit.cli"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
