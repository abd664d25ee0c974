"""Which input tokens an output depends on, by gradients: Captum's integrated gradients and
input x gradient over the input embeddings.

For an output f (a class logit, or the log-probability of a translation's word) and the
embedded input x (what enters the encoder stack: token + position embeddings):

- **input x gradient**: ``x * df/dx``;
- **integrated gradients** (Sundararajan et al., 2017): ``(x - x') * mean over a in [0, 1] of
  df/dx at x' + a (x - x')``, with the baseline x' the embedding of a text of padding tokens
  of the same length. Its scores add up to ``f(x) - f(x')`` (completeness).

Each token's score is the sum over the embedding dimensions: positive pushed the output up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.explain._checks import check_positive_int

__all__ = ["METHODS", "attribute_classifier", "attribute_next_token", "attribute_translation"]

METHODS = ("integrated_gradients", "input_x_gradient")


def _check(owner: str, model, cls: type, kind: str, method: str, steps: int) -> None:
    """The arguments every attribution takes: the model's class, the method and its steps."""
    if not isinstance(model, cls):
        raise TypeError(
            f"{owner}: model must be an attnkit.{cls.__name__}{kind}, got {type(model).__name__}"
        )
    if method not in METHODS:
        raise ValueError(f"{owner}: method must be one of {list(METHODS)}, got {method!r}")
    check_positive_int(owner, "steps", steps)


def _target(owner: str, target, limit: int, what: str, predicted):
    """``target`` checked to be ``what`` in [0, limit); None: ``predicted()`` (each row's)."""
    if target is None:
        with torch.no_grad():
            return predicted()
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < limit:
        raise ValueError(f"{owner}: target must be {what} in [0, {limit}), got {target!r}")
    return target


def _ids(owner: str, name: str, ids) -> Tensor:
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] == 0:
        got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{owner}: {name} must be a non-empty (B, N) tensor of ids, got {got}")
    return ids


def _attribute(forward, layer, ids, baseline, target, method, steps, extra):
    from captum.attr import LayerGradientXActivation, LayerIntegratedGradients

    if method == "integrated_gradients":
        explainer = LayerIntegratedGradients(forward, layer)
        scores = explainer.attribute(
            ids,
            baselines=baseline,
            target=target,
            additional_forward_args=extra,
            n_steps=steps,
            attribute_to_layer_input=True,
        )
    else:
        explainer = LayerGradientXActivation(forward, layer)
        scores = explainer.attribute(
            ids, target=target, additional_forward_args=extra, attribute_to_layer_input=True
        )
    if isinstance(scores, tuple):
        scores = scores[0]
    return scores.sum(-1).detach()  # (B, N): summed over the embedding dimensions


def attribute_classifier(
    model,
    ids: Tensor,
    *,
    target: int | None = None,
    method: str = "integrated_gradients",
    steps: int = 50,
) -> Tensor:
    """Each input token's share in a class logit of an :class:`attnkit.EncoderClassifier`:
    ``(B, N)``. ``target``: the class (default: the predicted class of each row). ``steps``:
    integration steps of integrated gradients."""
    from attnkit.models import EncoderClassifier

    owner = "attribute_classifier"
    _check(owner, model, EncoderClassifier, "", method, steps)
    ids = _ids(owner, "ids", ids)
    classes = model.classifier.out_features
    target = _target(owner, target, classes, "a class", lambda: model(ids).argmax(-1))
    baseline = torch.full_like(ids, model.cfg.pad_id)
    return _attribute(model, model.encoder.encoder, ids, baseline, target, method, steps, None)


def attribute_next_token(
    model,
    ids: Tensor,
    *,
    target: int | None = None,
    method: str = "integrated_gradients",
    steps: int = 50,
) -> Tensor:
    """Each input token's share in the log-probability of the next token after ``ids``, for an
    :class:`attnkit.DecoderLM`: ``(B, N)``. ``target``: that token's id (default: the model's
    top prediction for each row)."""
    from attnkit.models import DecoderLM

    owner = "attribute_next_token"
    _check(owner, model, DecoderLM, " (decoder-only)", method, steps)
    ids = _ids(owner, "ids", ids)
    vocab = model.cfg.vocab_size
    target = _target(owner, target, vocab, "a token id", lambda: model(ids)[:, -1].argmax(-1))

    def next_logprobs(x):  # (B, V): log p(next token)
        return model(x)[:, -1].log_softmax(-1)

    baseline = torch.full_like(ids, model.cfg.pad_id)
    return _attribute(next_logprobs, model.decoder, ids, baseline, target, method, steps, None)


def attribute_translation(
    model,
    src_ids: Tensor,
    tgt_ids: Tensor,
    *,
    method: str = "integrated_gradients",
    steps: int = 50,
) -> Tensor:
    """Each source token's share in each word of a translation, for an
    :class:`attnkit.Transformer`: ``(B, T - 1, S)``, row t for the log-probability of
    ``tgt_ids[:, t + 1]`` given the source and ``tgt_ids[:, :t + 1]`` (``tgt_ids`` starts with
    BOS, as the decoder reads it). Read it beside the cross-attention of the same words."""
    from attnkit.models import Transformer

    owner = "attribute_translation"
    _check(owner, model, Transformer, " (encoder-decoder)", method, steps)
    src_ids = _ids(owner, "src_ids", src_ids)
    tgt_ids = _ids(owner, "tgt_ids", tgt_ids)
    if tgt_ids.shape[1] < 2:
        raise ValueError(
            f"{owner}: tgt_ids must hold BOS and at least one word, got {tgt_ids.shape[1]} token"
        )
    if src_ids.shape[0] != tgt_ids.shape[0]:
        raise ValueError(
            f"{owner}: src_ids and tgt_ids must have the same batch size, got "
            f"{src_ids.shape[0]} and {tgt_ids.shape[0]}"
        )

    def word_logprobs(src, tgt_in, tgt_out):  # (B, T - 1): log p(each next word)
        logp = model(src, tgt_in).log_softmax(-1)
        return logp.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)

    baseline = torch.full_like(src_ids, model.cfg.pad_id)
    extra = (tgt_ids[:, :-1], tgt_ids[:, 1:])
    rows = [
        _attribute(word_logprobs, model.encoder, src_ids, baseline, t, method, steps, extra)
        for t in range(tgt_ids.shape[1] - 1)
    ]
    return torch.stack(rows, dim=1)  # (B, T - 1, S)
