"""One layering for the package, enforced: every import (at module level or inside a function)
points down this order or stays inside its own package, never up and never in a circle.

docs/ARCHITECTURE.md draws the same order. Modules of one rank do not import each other (so
``explain`` never imports ``training``), except inside one package (``training.trainer`` may
import ``training.tasks``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

ORDER = [
    {"checks", "files", "tables"},  # foundations: no attnkit imports
    {"config", "position", "masks", "varlen", "data"},
    {"caches"},  # what attention remembers between steps
    {"backends"},  # full / window / linear attention behind one signature
    {"attention"},  # scaled_dot_product_attention, MultiHeadAttention
    {"layers"},  # FFN, MoE, norms, EncoderLayer, DecoderLayer, LMHead
    {"stacks", "serialization"},  # embeddings + stacks; the save format and family registry
    {"sampling"},  # the distribution a sampled token is drawn from
    {"speculative"},  # drafting and checking several tokens per call (generate's, serve's)
    {"generation"},  # decoding algorithms, written against the models' small interface
    {"models"},  # the three families
    {"accel"},  # speed levers, applied from above by the caller: nothing below imports them
    {"explain"},  # explanations: pictures, traces, head scores (the trainer records some)
    {"interop", "training"},  # foreign formats in and out; training
    {"serve"},  # the HTTP server, its engine and its page
    {"__init__"},  # the package's public face: import attnkit as ak
    {"cli"},  # the attnkit command
    {"train"},  # python -m attnkit.train (torchrun's entry point)
    {"__main__"},  # python -m attnkit
]
RANK = {name: rank for rank, names in enumerate(ORDER) for name in names}


def unit(module: str) -> str:
    """attnkit.training.trainer -> training (the unit the order ranks)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every attnkit module that ``source`` imports, anywhere in the file."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # "from attnkit import checks" imports the module attnkit.checks
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n == "attnkit" or n.startswith("attnkit."))
    return found - {module}


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    files = sorted((root / "attnkit").rglob("*.py"))
    known = {module_name(f, root) for f in files}
    return {
        module_name(f, root): imports_of(
            f.read_text(encoding="utf-8"), module_name(f, root), f.name == "__init__.py", known
        )
        for f in files
    }


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the order, imports between peers of one rank, and cycles."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = unit(module), unit(target)
            if a == b:
                continue
            if a not in RANK or b not in RANK:
                wrong.append(f"{module} -> {target}: {a if a not in RANK else b} is not in ORDER")
            elif RANK[b] >= RANK[a]:
                kind = "a peer" if RANK[b] == RANK[a] else "a higher layer"
                wrong.append(f"{module} -> {target}: imports {kind}")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                wrong.append("cycle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [node])
    return wrong


def test_every_import_follows_the_layering():
    graph = import_graph()
    assert len(graph) > 40 and "attnkit.models" in graph
    wrong = violations(graph)
    assert not wrong, "imports against docs/ARCHITECTURE.md's layering:\n  " + "\n  ".join(wrong)


def test_the_check_catches_a_back_import_and_a_cycle(tmp_path):
    """The check itself can fail: a function-level import of a higher layer, and a cycle
    inside one package, are both reported."""
    pkg = tmp_path / "attnkit"
    (pkg / "training").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("import torch\n")
    (pkg / "attention.py").write_text(
        "def f():\n    from attnkit.models import DecoderLM\n    return DecoderLM\n"
    )
    (pkg / "interop.py").write_text("from attnkit.training import trainer\n")
    (pkg / "training" / "__init__.py").write_text("")
    (pkg / "training" / "trainer.py").write_text("from . import tasks\n")
    (pkg / "training" / "tasks.py").write_text("from attnkit.training.trainer import x\n")
    wrong = violations(import_graph(tmp_path))
    assert "attnkit.attention -> attnkit.models: imports a higher layer" in wrong
    assert "attnkit.interop -> attnkit.training.trainer: imports a peer" in wrong
    cycles = [w for w in wrong if w.startswith("cycle: ")]
    assert len(cycles) == 1 and {"attnkit.training.tasks", "attnkit.training.trainer"} <= set(
        cycles[0].removeprefix("cycle: ").split(" -> ")
    )
    assert violations({"attnkit.models": {"attnkit.layers"}, "attnkit.layers": set()}) == []


def test_importing_attnkit_loads_no_foreign_format_reader_and_no_slow_library():
    # Every attnkit command and every torchrun worker starts by importing attnkit.cli.
    # matplotlib (0.8 s) and Dynamo (torch._dynamo, 2 s) load only where a command uses them:
    # with them, `attnkit --help` took 5.4 s, without them 2.7 s (torch itself takes 2.2).
    import subprocess
    import sys

    code = (
        "import sys, attnkit; print(sorted(sys.modules)); "
        "import attnkit.cli; print(sorted(sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    package, cli = done.stdout.splitlines()
    for reader in ("gguf", "hf", "gpt2", "llama", "bert", "tokenizer", "embeddings"):
        assert f"'attnkit.interop.{reader}'" not in package
    assert "'attnkit.training" not in package and "'attnkit.explain" not in package
    assert "'attnkit.cli'" in cli
    for slow in ("matplotlib", "torch._dynamo", "transformers"):
        assert f"'{slow}'" not in cli, slow


def test_the_model_code_asks_about_the_compiler_in_one_place():
    """Outside ``accel`` (the levers), only ``checks.tracing()`` asks whether torch.compile is
    tracing; the model files call it."""
    asking = sorted(
        str(path.relative_to(SRC))
        for path in (SRC / "attnkit").rglob("*.py")
        if "is_compiling" in path.read_text(encoding="utf-8")
        and "accel" not in path.relative_to(SRC).parts
    )
    assert asking == ["attnkit/checks.py"], asking


def test_import_attnkit_loads_no_speed_lever():
    # accel sits above the models: the package, its models and generate run without it.
    import subprocess
    import sys

    code = "import sys, attnkit; print(sorted(m for m in sys.modules if 'attnkit.accel' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_benchmarks_use_attnkits_public_names_and_import_no_circle():
    # A benchmark measures what users run: no attnkit name that starts with "_", and no two
    # bench files that import each other (directly or around a circle).
    bench = SRC.parent / "bench"
    local = {f.stem for f in bench.glob("*.py")}
    graph, private = {}, []
    for f in sorted(bench.glob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        graph[f.stem] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module in local:
                    graph[f.stem].add(node.module)
                if node.module.startswith("attnkit"):
                    private += [f"{f.name}: {a.name}" for a in node.names if a.name[0] == "_"]
            elif isinstance(node, ast.Import):
                graph[f.stem] |= {a.name for a in node.names if a.name in local}
    assert not private, private
    assert not [w for w in violations(graph) if w.startswith("cycle")]
