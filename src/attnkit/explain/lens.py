"""The logit lens (nostalgebraist, 2020): what a decoder-only model would predict if it stopped
after each layer.

The residual stream x_l after the embeddings (l = 0) and after each of the L layers is read
through the model's own final norm and LM head:

    lens_l = log_softmax(LMHead(FinalNorm(x_l)))      l = 0 .. L

so lens_L is the model's own log-probabilities, and earlier entries show when the answer forms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.explain.sites import capture_outputs

__all__ = ["logit_lens"]


def logit_lens(model, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Log-probabilities of the next token read from the residual stream: ``(L + 1, B, N, V)``.

    ``model``: an :class:`attnkit.DecoderLM`; ``ids`` (B, N) token ids (and an optional
    ``attention_mask`` as for the model's forward). Entry 0 reads the embeddings, entry l the
    output of layer l, each through the final norm (Pre-LN models have one; Post-LN models end
    in a norm already) and the LM head; entry L equals ``log_softmax(model(ids))``.
    """
    from attnkit.models import DecoderLM

    if not isinstance(model, DecoderLM):
        raise TypeError(
            f"logit_lens: model must be a decoder-only language model (attnkit.DecoderLM), "
            f"got {type(model).__name__}"
        )
    layers = list(model.decoder.layers)
    with torch.no_grad(), capture_outputs([model.embeddings, *layers]) as streams:
        logits = model(ids, attention_mask)
        norm = model.decoder.norm
        lens = [
            torch.log_softmax(model.lm_head(norm(x) if norm is not None else x), dim=-1)
            for x in streams[:-1]
        ]
    lens.append(torch.log_softmax(logits, dim=-1))
    return torch.stack(lens)  # (L + 1, B, N, V)
