"""Where fine-tuned review classifiers go wrong, on the validation split of reviews-zh.

    python bench/reviews_errors.py CHECKPOINT [CHECKPOINT ...] [--split validation]

For each checkpoint (a model directory that ``attnkit train`` wrote, e.g.
``runs/reviews-zh-e5/checkpoint``): its accuracy, and its accuracy on the reviews that were cut to
the recipe's block size against those that fit whole. With two checkpoints or more, also the
accuracy of the mean of their probabilities (an ensemble), and how many reviews they all get
wrong. The README's reviews-zh-e5 section quotes these for the lr 5e-5 and 1e-4 runs.
Accuracy, not speed: tune on validation only, never on test.
"""

from __future__ import annotations

import argparse

import torch

import attnkit as ak
from attnkit.interop import load_tokenizer_for
from attnkit.training.classification import classify
from attnkit.training.recipes import load_examples, load_recipe

BATCH = 64


def probabilities(path: str, texts: list[str], max_len: int) -> torch.Tensor:
    """(len(texts), classes) of the checkpoint at ``path``, shortest texts batched together."""
    model, tokenizer = ak.from_pretrained(path), load_tokenizer_for(path)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    probs = torch.empty(len(texts), model.classifier.out_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for start in range(0, len(order), BATCH):
            chosen = order[start : start + BATCH]
            probs[chosen] = classify(model, tokenizer, [texts[i] for i in chosen], max_len=max_len)
    return probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT")
    parser.add_argument("--split", choices=("validation", "test"), default="validation")
    parser.add_argument("--recipe", default="examples/reviews-zh-e5.toml")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    examples = load_examples(recipe.data)[args.split]
    texts, labels = [t for t, _ in examples], torch.tensor([y for _, y in examples])
    max_len = recipe.data.block_size
    tokenizer = load_tokenizer_for(args.checkpoints[0])
    lengths = torch.tensor([len(tokenizer.encode(t)) for t in texts])
    cut = lengths > max_len
    print(f"reviews-zh {args.split}: {len(texts)} reviews, {int(cut.sum())} longer than {max_len}")
    every, wrong = [], torch.ones(len(texts), dtype=torch.bool)
    for path in args.checkpoints:
        probs = probabilities(path, texts, max_len)
        right = probs.argmax(-1) == labels
        every.append(probs)
        wrong &= ~right
        print(
            f"{path}: accuracy {right.float().mean():.4f}; cut reviews "
            f"{right[cut].float().mean():.4f}, whole ones {right[~cut].float().mean():.4f}"
        )
    if len(every) > 1:
        mean = torch.stack(every).mean(0)
        accuracy = (mean.argmax(-1) == labels).float().mean()
        print(f"mean of the {len(every)} models' probabilities: accuracy {accuracy:.4f}")
        print(f"reviews every model gets wrong: {int(wrong.sum())}")


if __name__ == "__main__":
    main()
