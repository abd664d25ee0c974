"""Looking inside attention: the scaling experiment, pictures, the HTML report, bertviz export.

Everything here takes plain tensors (or nested lists) and token lists, so it works for any
model:

- :mod:`~attnkit.explain.scaling`: why scores are divided by sqrt(d_k), measured
  (``scaling_experiment``, ``format_scaling_table``, ``plot_scaling``).
- :mod:`~attnkit.explain.plots`: PNG pictures of weights, heads, masks, the sinusoidal table and
  the warm-up schedule.
- :mod:`~attnkit.explain.report`: one offline, interactive HTML page of attention weights
  (``render_attention_html``, ``attention_sections``).
- :mod:`~attnkit.explain.bertviz`: the layout bertviz's ``head_view`` / ``model_view`` expect,
  and a JSON export.
- :mod:`~attnkit.explain.fonts`: the CJK font fallback that lets Chinese tokens render.
- :mod:`~attnkit.explain.rollout`: attention rollout and attention flow (Abnar & Zuidema), how
  much each input token reaches each position at the top.
- :mod:`~attnkit.explain.lens`: the logit lens, a decoder's prediction after every layer.
- :mod:`~attnkit.explain.interventions`: head ablation and activation patching (hooks on the
  residual stream and on each head's output before W^O, see :mod:`~attnkit.explain.sites`).
- :mod:`~attnkit.explain.attribution`: integrated gradients and input x gradient (Captum).

Every file is written atomically (a temporary file, then a rename).
"""

from attnkit.explain.attribution import attribute_classifier, attribute_translation
from attnkit.explain.bertviz import bertviz_data, export_bertviz_json, to_bertviz
from attnkit.explain.fonts import MissingFontWarning, cjk_font
from attnkit.explain.interventions import ablate_heads, patch_heads, patch_residual
from attnkit.explain.lens import logit_lens
from attnkit.explain.plots import (
    plot_attention_heads,
    plot_attention_heatmap,
    plot_mask,
    plot_schedule,
    plot_sinusoidal_table,
    warmup_schedule,
)
from attnkit.explain.report import attention_sections, render_attention_html
from attnkit.explain.rollout import attention_flow, attention_rollout
from attnkit.explain.scaling import (
    ScalingRow,
    SoftmaxStats,
    format_scaling_table,
    plot_scaling,
    scaling_experiment,
)

__all__ = [
    "MissingFontWarning",
    "ScalingRow",
    "SoftmaxStats",
    "ablate_heads",
    "attention_flow",
    "attention_rollout",
    "attention_sections",
    "attribute_classifier",
    "attribute_translation",
    "bertviz_data",
    "cjk_font",
    "export_bertviz_json",
    "format_scaling_table",
    "logit_lens",
    "patch_heads",
    "patch_residual",
    "plot_attention_heads",
    "plot_attention_heatmap",
    "plot_mask",
    "plot_scaling",
    "plot_schedule",
    "plot_sinusoidal_table",
    "render_attention_html",
    "scaling_experiment",
    "to_bertviz",
    "warmup_schedule",
]
