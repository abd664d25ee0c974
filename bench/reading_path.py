"""How much code a reader walks from ids to logits: a DecoderLM (lm-small, full attention) runs
one eager forward under ``sys.settrace``; per attnkit file, its length, the lines of the
functions that ran (definition to end, what a reader follows), and the distinct lines executed.

    python bench/reading_path.py            (PYTHONPATH=OTHER/src for another checkout)
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import sys

import torch

import attnkit as ak


def trace_forward() -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """(first lines of the functions entered, lines executed), per attnkit file."""
    root = os.path.dirname(ak.__file__)
    cfg = ak.ModelConfig.preset("lm-small")
    torch.manual_seed(0)
    model = ak.DecoderLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    entered, executed = collections.defaultdict(set), collections.defaultdict(set)

    def local(frame, event, arg):
        if event == "line":
            executed[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root):
            return None
        if event == "call":
            entered[frame.f_code.co_filename].add(frame.f_code.co_firstlineno)
        return local

    with torch.no_grad():
        model(ids)  # warm: first-call set-up is not the path
        sys.settrace(tracer)
        try:
            model(ids)
        finally:
            sys.settrace(None)
    return entered, executed


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    entered, executed = trace_forward()
    root = os.path.dirname(ak.__file__)
    print(f"{'file':28s} {'lines':>6s} {'functions run':>14s} {'lines executed':>15s}")
    totals = [0, 0, 0]
    for path in sorted(set(entered) | set(executed)):
        source = open(path, encoding="utf-8").read()
        spans = 0
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if {node.lineno, first} & entered[path]:
                    spans += node.end_lineno - first + 1
        row = [source.count("\n"), spans, len(executed[path])]
        totals = [a + b for a, b in zip(totals, row, strict=True)]
        print(f"{os.path.relpath(path, root):28s} {row[0]:6d} {row[1]:14d} {row[2]:15d}")
    print(f"{'total':28s} {totals[0]:6d} {totals[1]:14d} {totals[2]:15d}")


if __name__ == "__main__":
    main()
