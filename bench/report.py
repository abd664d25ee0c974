"""The results tables of docs/PERFORMANCE.md, one per CPU, written from the benchmarks' JSON.

Each benchmark writes its figures with the CPU, the commit, the date and its command
(``common.save_results``, under ``runs/bench/``). ``--record FILE ...`` keeps such files in
``bench/results/<cpu>/<bench>.json`` (the latest run of each benchmark on each CPU); the
tables are then rewritten between the markers of docs/PERFORMANCE.md from every file kept
there. Ratios are attnkit over the reference (above 1: attnkit faster), each measured in one
process with every candidate under the same settings.

    python bench/report.py --record runs/bench/training.json runs/bench/generation.json
    python bench/report.py              # rewrite the tables from bench/results/
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from common import RESULTS

PAGE = Path(__file__).parents[1] / "docs" / "PERFORMANCE.md"
BEGIN = "<!-- results: written by bench/report.py; do not edit by hand -->"
END = "<!-- results: end -->"


def cpu_key(cpu: dict) -> str:
    """A folder name for a CPU: its model name, family and model."""
    name = re.sub(r"\(R\)|\(TM\)|Processor|CPU|@.*", "", cpu["model_name"])
    name = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
    return f"{name}-f{cpu['family']}-m{cpu['model']}"


def record(paths: list[Path]) -> None:
    for path in paths:
        data = json.loads(path.read_text())
        if not {"bench", "cpu", "figures"} <= data.keys():
            sys.exit(f"{path}: not a benchmark record (no bench, cpu and figures)")
        target = RESULTS / cpu_key(data["cpu"]) / f"{data['bench']}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        print(f"kept {path} as {target.relative_to(RESULTS.parent)}")


# beside the ratios that have a target, the ones a reader looks for first
ALSO_SHOWN = ("lm-small bf16: attnkit / HF GPT-2", "lm-small bf16: attnkit compiled / HF GPT-2",
              "mt-small fp32: attnkit / HF BART")  # fmt: skip


def shown(name: str, figures: dict) -> bool:
    """A benchmark with targets shows the ratios that have one (and ``ALSO_SHOWN``); one
    without targets shows every ratio. Its JSON keeps them all."""
    targets = figures.get("targets")
    return not targets or name in targets or name in ALSO_SHOWN


def tables() -> str:
    """Markdown: per CPU, every ratio of every benchmark kept for it."""
    by_cpu: dict[str, list[dict]] = {}
    for path in sorted(RESULTS.glob("*/*.json")):
        data = json.loads(path.read_text())
        by_cpu.setdefault(path.parent.name, []).append(data)
    if not by_cpu:
        return "No results recorded yet: run a benchmark, then `python bench/report.py --record`."
    out = []
    for records in by_cpu.values():
        cpu = records[0]["cpu"]
        out += [
            f"### {cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), "
            f"{records[0].get('threads', '?')} threads",
            "",
            "| ratio | value | median round (quartiles) | target | benchmark |",
            "| --- | --- | --- | --- | --- |",
        ]
        for data in records:
            figures = data["figures"]
            spreads, targets = figures.get("spreads", {}), figures.get("targets", {})
            for name, value in figures.get("ratios", {}).items():
                if not shown(name, figures):
                    continue
                pct = "MFU" in name or "share" in name
                text = f"{value:.1%}" if pct else f"{value:.3f}x"
                spread = spreads.get(name)
                rounds = f"{spread[1]:.3f} ({spread[0]:.2f}-{spread[2]:.2f})" if spread else ""
                goal = targets.get(name)
                goal = "" if goal is None else (f"{goal:.0%}" if pct else f"{goal:.2f}x")
                out.append(f"| {name} | {text} | {rounds} | {goal} | {data['bench']} |")
        out += ["", "Measured by:", ""]
        for data in records:
            out.append(
                f"- `{data['command']}` on {data['date']} at commit `{data['commit']}` "
                f"(torch {data.get('torch', '?')})"
            )
        out.append("")
    return "\n".join(out).rstrip()


def write_page() -> None:
    text = PAGE.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        sys.exit(f"{PAGE}: the results markers are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n\n{tables()}\n\n{END}{tail}", encoding="utf-8")
    print(f"wrote the results tables of {PAGE.relative_to(PAGE.parents[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--record", nargs="+", type=Path, metavar="FILE",
        help="benchmark JSON files to keep in bench/results/ before the tables are rewritten",
    )  # fmt: skip
    args = parser.parse_args()
    if args.record:
        record(args.record)
    write_page()


if __name__ == "__main__":
    main()
