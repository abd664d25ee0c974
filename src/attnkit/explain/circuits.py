"""Circuits: what each head does, read from its attention and from its weights.

Two kinds of evidence (Elhage et al., "A Mathematical Framework for Transformer Circuits",
2021; Olsson et al., "In-context Learning and Induction Heads", 2022):

- **Detector scores** (TransformerLens' ``head_detector`` definitions). For a head's attention
  A (N, N) over a sequence and a pattern P of the positions a kind of head attends to, the score
  is sum(A * P) / sum(A): the share of the head's attention that falls where the pattern says,
  over the rows (queries) where P marks a position, so that a perfect head scores 1
  (TransformerLens sums over every row: on a repeated sequence its best induction score is about
  one half).
  *previous-token*: P[i, i-1] = 1. *duplicate-token*: P[i, j] = 1 for an earlier j holding the
  same token. *induction*: P[i, j] = 1 for j just after an earlier copy of token i (the head
  looks at what followed the last time, to predict it again). Induction is measured on a random
  token sequence repeated twice, where only an induction head can predict the second copy; its
  per-token loss on the second copy is reported beside it.
- **Weight scores.** A head's OV circuit W_E W_V W_O W_U (vocab x vocab) maps the token it
  attends to onto the logits it raises; a *copying* head raises the token it reads, so the
  matrix's eigenvalues are mostly positive. The copying score is sum(Re(lambda)) /
  sum(|lambda|) over its eigenvalues, in [-1, 1], computed on the (d_head x d_head) matrix
  W_O W_U W_E W_V, which has the same non-zero eigenvalues. *Composition* (K, Q or V) between a
  head of an earlier layer and one of a later layer is ||W_OV^1 W^2|| / (||W_OV^1|| ||W^2||)
  (Frobenius norms), where W^2 is the later head's W_Q W_K^T (Q), its transpose (K) or its W_OV
  (V): how much of what the first head writes the second reads into its query, key or value.

Shapes follow TransformerLens' row-vector convention (x W): W_Q, W_K, W_V are (H, d_model,
d_head) per layer and W_O (H, d_head, d_model); a grouped-query model's key and value heads are
repeated for the query heads that share them. Layer norms, biases and rotary positions are left
out, as TransformerLens leaves them out of these scores.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.explain.streaming import BLOCK, attention_patterns, self_attentions, stream_attention

__all__ = [
    "DETECTORS",
    "circuit_scores",
    "composition_scores",
    "detection_pattern",
    "detector_scores",
    "formation",
    "head_weights",
    "in_context_score",
    "ov_copying_scores",
    "repeated_tokens",
    "streamed_detector_scores",
    "watch_heads",
    "weight_shares",
]

DETECTORS = ("previous-token", "duplicate-token", "induction")


def detection_pattern(name: str, ids: Tensor, rows: range | None = None) -> Tensor:
    """The 0/1 pattern of the positions a ``name`` head attends to over tokens ``ids`` (N,),
    lower-triangular (TransformerLens' ``get_*_detection_pattern``): (N, N), or the query rows
    ``rows`` of it, (len(rows), N)."""
    n = ids.shape[-1]
    i = torch.arange(n)[:, None] if rows is None else torch.tensor(rows)[:, None]
    j = torch.arange(n)[None, :]
    if name == "previous-token":
        return (j == i - 1).float()
    same = ((ids[i] == ids[None, :]) & (j < i)).float()  # an earlier copy of the token
    if name == "duplicate-token":
        return same
    if name == "induction":  # the position just after an earlier copy
        return torch.cat([torch.zeros(len(i), 1), same[:, :-1]], dim=1)
    raise ValueError(f"detection_pattern: name must be one of {list(DETECTORS)}, got {name!r}")


def _terms(weights: Tensor, pattern: Tensor, marked: bool) -> tuple[Tensor, Tensor]:
    """sum(A * P) and sum(A) over the rows of ``weights`` (..., b, N) and ``pattern`` (b, N)
    (with ``marked``, only the rows where the pattern marks a position), in float64. The
    pattern is read where it is non-zero: a few positions a row, not N."""
    rows, columns = pattern.nonzero(as_tuple=True)
    inside = (weights[..., rows, columns].double() * pattern[rows, columns].double()).sum(-1)
    kept = pattern.sum(-1) > 0 if marked else slice(None)
    return inside, weights[..., kept, :].sum((-2, -1), dtype=torch.float64)


def detector_scores(attentions: list[Tensor], pattern: Tensor, *, marked: bool = True) -> Tensor:
    """sum(A * P) / sum(A) for every head: ``attentions`` one (H, N, N) tensor per layer,
    ``pattern`` (N, N); returns (L, H). With ``marked`` (the default) only the rows where the
    pattern marks a position count, so that a perfect head scores 1 (the first copy of a
    repeated sequence gives an induction head nothing to find); ``marked=False`` is
    TransformerLens' score over every row."""
    inside, total = _terms(torch.stack(attentions), pattern, marked)  # (L, H) twice
    return inside / total


def streamed_detector_scores(
    model: nn.Module, ids: Tensor, names=DETECTORS, *, block: int = BLOCK
) -> dict[str, Tensor]:
    """:func:`detector_scores` of every read head over a text ``ids`` (1, N) of any length,
    for each of ``names``: the attention is read a block of queries at a time
    (:func:`~attnkit.explain.streaming.stream_attention`), its pattern built for the same rows."""
    layers = len(self_attentions(model))
    sums: dict[str, list] = {name: [0.0] * layers for name in names}
    counts: dict[str, list] = {name: [0.0] * layers for name in names}

    def add(layer: int, start: int, weights: Tensor) -> None:
        rows = range(start, start + weights.shape[1])
        for name in names:
            inside, total = _terms(weights, detection_pattern(name, ids[0], rows), True)
            sums[name][layer] = sums[name][layer] + inside
            counts[name][layer] = counts[name][layer] + total

    stream_attention(model, ids, add, block=block)
    return {name: torch.stack(sums[name]) / torch.stack(counts[name]) for name in names}


def weight_shares(weights: Tensor, ids: Tensor) -> dict[str, float]:
    """Where one head's attention ``weights`` (N, N) over a sequence written twice, ``ids``
    (N,), goes on the second copy's rows, on average: the share on each detector's positions,
    and on the first token (where a head with nothing to do parks its weight)."""
    rows = detection_pattern("induction", ids).sum(-1) > 0
    a = weights[rows].double()
    shares = {
        name: float((a * detection_pattern(name, ids)[rows]).sum(-1).mean()) for name in DETECTORS
    }
    shares["first token"] = float(a[:, 0].mean())
    return shares


def repeated_tokens(vocab_size: int, half: int, *, seed: int = 0, first: int | None = None):
    """A random sequence of ``half`` tokens repeated twice, (1, 2 * half) (after ``first``, a
    BOS, when given): the input induction heads are measured on."""
    if half < 2:
        raise ValueError(f"repeated_tokens: half must be at least 2, got {half}")
    generator = torch.Generator().manual_seed(seed)
    low = 100 if vocab_size > 1000 else 0  # a large vocabulary's lowest ids: special tokens
    tokens = torch.randint(low, vocab_size, (half,), generator=generator)
    ids = torch.cat([tokens, tokens])
    if first is not None:
        ids = torch.cat([torch.tensor([first]), ids])
    return ids[None]


def _float_weight(layer: nn.Module) -> Tensor:
    weight = getattr(layer, "weight", None)
    if isinstance(weight, Tensor) and weight.is_floating_point():
        return weight.detach().double()
    return layer.dequantized().double()  # a packed layer


def head_weights(attention: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W_Q, W_K, W_V, W_O) of one attention module, (H, d_model, d_head) thrice and (H,
    d_head, d_model), in float64, key and value heads repeated over their query groups."""
    h, kv, dh = attention.n_heads, attention.n_kv_heads, attention.d_head
    w = _float_weight(attention.in_proj)  # (rows, d_model): q, then k, then v
    q, k, v = w.split([h * dh, kv * dh, kv * dh])

    def heads(rows: Tensor, count: int) -> Tensor:  # (count * dh, D) -> (H, D, dh)
        per = rows.reshape(count, dh, -1).transpose(1, 2)
        return per.repeat_interleave(h // count, dim=0)

    w_o = _float_weight(attention.out_proj).T.reshape(h, dh, -1)  # (H, dh, D)
    return heads(q, h), heads(k, kv), heads(v, kv), w_o


def ov_copying_scores(model: nn.Module) -> Tensor | None:
    """Each head's copying score, (L, H); None for a model without an unembedding (an
    encoder)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return None
    embeddings = getattr(model, "embeddings", None) or model.tgt_embeddings  # a translator's
    w_e = _float_weight(embeddings.tokens)  # (V, D)
    unembed_embed = _float_weight(head).T @ w_e  # W_U W_E (D, D), once: V is the long side
    scores = []
    for attention in self_attentions(model):
        _, _, w_v, w_o = head_weights(attention)
        small = w_o @ unembed_embed @ w_v  # (H, dh, dh): W_O W_U W_E W_V
        eigenvalues = torch.linalg.eigvals(small)
        scores.append(eigenvalues.real.sum(-1) / eigenvalues.abs().sum(-1))
    return torch.stack(scores)


def composition_scores(model: nn.Module) -> dict[str, Tensor]:
    """{"Q", "K", "V"}: (L, H, L, H) tensors, entry [l1, h1, l2, h2] the composition of head h1
    of layer l1 into head h2 of a later layer l2 (zero where l2 <= l1). Each matrix is kept as
    its two (d_model, d_head) factors, A B^T, so that a norm costs d_head^3, not d_model^3:
    ||A_1 B_1^T A_2 B_2^T||^2 = tr(A_1^T A_1 M G M^T) with M = B_1^T A_2 and G = B_2^T B_2."""
    weights = [head_weights(a) for a in self_attentions(model)]
    w_q, w_k, w_v = (torch.stack([w[i] for w in weights]) for i in range(3))  # (L, H, D, dh)
    w_o = torch.stack([w[3] for w in weights]).transpose(-2, -1)  # (L, H, D, dh): W_O^T
    layers = w_q.shape[0]

    def gram(a: Tensor) -> Tensor:
        return a.transpose(-2, -1) @ a  # (..., dh, dh)

    def norm(a: Tensor, b: Tensor) -> Tensor:  # ||a b^T||
        return (gram(a) * gram(b)).sum((-2, -1)).sqrt()

    left_a, left_b = w_v, w_o  # W_OV = W_V W_O
    out = {}
    for mode, (right_a, right_b) in {"Q": (w_q, w_k), "K": (w_k, w_q), "V": (w_v, w_o)}.items():
        scores = torch.zeros(layers, w_q.shape[1], layers, w_q.shape[1], dtype=torch.float64)
        right_norm, grams = norm(right_a, right_b), gram(right_b)  # (L, H), (L, H, dh, dh)
        for first in range(layers - 1):
            m = torch.einsum("ide,ljdf->iljef", left_b[first], right_a[first + 1 :])
            g = gram(left_a[first])[:, None, None]  # (H1, 1, 1, dh, dh)
            inner = (g * (m @ grams[first + 1 :] @ m.transpose(-2, -1))).sum((-2, -1)).sqrt()
            scale = norm(left_a[first], left_b[first])[:, None, None] * right_norm[first + 1 :]
            scores[first, :, first + 1 :] = inner / scale
        out[mode] = scores
    return out


def circuit_scores(
    model: nn.Module,
    ids: Tensor | None = None,
    *,
    half: int = 50,
    seed: int = 0,
    bos: int | None = None,
) -> dict:
    """Every head's scores: the three detector scores (previous- and duplicate-token over
    ``ids`` (1, N) when given, a text of any length read a block of queries at a time, else over
    the repeated random sequence; induction over the repeated sequence of ``half`` tokens), the
    loss per token on its second copy, the copying scores, the composition scores, and the
    strongest head of each detector with its attention over the repeated sequence ("patterns":
    name -> ((layer, head), (N, N)), the sequence in "repeated"). Tensors are (L, H), (L, H, L,
    H) for composition."""
    repeated = repeated_tokens(model.cfg.vocab_size, half, seed=seed, first=bos)
    if ids is not None and ids.shape[1] < 2:
        raise ValueError(f"circuits: the text has {ids.shape[1]} token; at least 2 needed")
    on_repeat = attention_patterns(model, repeated)
    scores = {
        name: detector_scores(on_repeat, detection_pattern(name, repeated[0])) for name in DETECTORS
    }
    if ids is not None:
        scores.update(streamed_detector_scores(model, ids, ("previous-token", "duplicate-token")))
    strongest = {name: divmod(int(t.argmax()), t.shape[1]) for name, t in scores.items()}
    out = {"detectors": scores, "copying": ov_copying_scores(model), "repeated": repeated[0]}
    out["patterns"] = {name: (at, on_repeat[at[0]][at[1]]) for name, at in strongest.items()}
    out["composition"] = composition_scores(model)
    if isinstance(getattr(model, "lm_head", None), nn.Module) and not hasattr(model, "encoder"):
        with torch.no_grad():
            logits = model(repeated).float()
        losses = nn.functional.cross_entropy(logits[0, :-1], repeated[0, 1:], reduction="none")
        second = losses[-(half - 1) :]  # the second copy, from its second token on
        out["loss"] = {"first": float(losses[: half - 1].mean()), "second": float(second.mean())}
    return out


def in_context_score(
    model: nn.Module, ids: Tensor, *, early: int = 50, late: int = 500, window: int = 16
) -> float:
    """Olsson et al.'s in-context-learning score over the texts ``ids`` (B, N): the mean loss
    of the tokens at positions ``late`` minus that at ``early`` (each a ``window`` of positions
    ending there, the positions capped to the texts' length, early to a tenth of it): how much
    more predictable text becomes with more context before it (negative)."""
    n = ids.shape[1] - 1
    late = min(late, n)
    early = max(window, min(early, n // 10))
    with torch.no_grad():
        logits = model(ids[:, :-1]).float()
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return float(losses[:, late - window : late].mean() - losses[:, early - window : early].mean())


def watch_heads(model: nn.Module, names: list[str], length: int, *, seed: int = 0) -> dict:
    """What a training run records per evaluation for ``names`` (of :data:`DETECTORS`): each
    head's score keyed by "layer.head", measured on random tokens repeated twice (at most
    ``length`` tokens in all)."""
    half = min(50, length // 2)
    repeated = repeated_tokens(model.cfg.vocab_size, half, seed=seed)
    patterns = attention_patterns(model, repeated)
    out = {}
    for name in names:
        scores = detector_scores(patterns, detection_pattern(name, repeated[0]))
        out[name] = {
            f"{i // scores.shape[1]}.{i % scores.shape[1]}": round(float(v), 4)
            for i, v in enumerate(scores.flatten())
        }
    return out


def formation(records: list[dict]) -> dict | None:
    """What a run's ``metrics.jsonl`` records (its lines, as dicts) say of its heads forming:
    the evaluation steps, the validation loss and in-context score at each, every watched
    score as a (steps, heads) tensor with the heads' names, and, for each score, the step at
    whose evaluation its best head rose the most since the one before (None: nothing
    recorded)."""
    kept = [r for r in records if r.get("split") == "validation" and "heads" in r]
    if not kept:
        return None
    names = list(kept[-1]["heads"])
    heads = list(kept[-1]["heads"][names[0]])
    scores = {n: torch.tensor([[r["heads"][n][h] for h in heads] for r in kept]) for n in names}
    steps = [r["step"] for r in kept]
    jumps = {}
    for name, table in scores.items():
        best = table.max(dim=1).values
        rise = best[1:] - best[:-1] if len(best) > 1 else torch.zeros(1)
        at = int(rise.argmax()) + 1 if len(best) > 1 else 0
        jumps[name] = {
            "step": steps[at],
            "before": float(best[at - 1] if at else best[0]),
            "after": float(best[at]),
        }
    return {
        "steps": steps,
        "loss": [r["loss"] for r in kept],
        "in_context": [r.get("in_context") for r in kept],
        "heads": heads,
        "scores": scores,
        "jumps": jumps,
    }
