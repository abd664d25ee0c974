"""lm-eval, a client nobody here wrote, scores a multiple-choice task through ``attnkit serve``:
its ``local-completions`` backend with the server's own tokenizer (``/tokenizer_info`` and
``/tokenize``, as vLLM offers them) asks for each choice's log-likelihood by ``echo`` +
``logprobs``. Every one must equal attnkit's own forward over the same tokens, and so must the
accuracy. The task is 50 questions written for this test (``tests/data/lm_eval``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.interop import load_tokenizer_for
from servers import serving

pytestmark = pytest.mark.needs("smollm2")

DATA = Path(__file__).parent / "data" / "lm_eval" / "attnkit_mc.jsonl"

TASK = """task: attnkit_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def pairs(sample) -> list[tuple[str, str]]:
    """The (context, continuation) of each choice of an lm-eval sample."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):
        arguments = [(a["arg_0"], a["arg_1"]) for a in arguments.values()]
    return [tuple(a) for a in arguments]


def test_lm_eval_scores_each_choice_as_attnkit_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # datasets' cache, kept out of ~
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "attnkit_mc.yaml").write_text(TASK.format(data=DATA))
    with serving(tmp_path / "serve.log") as url:  # the default path
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=smollm2,base_url={url}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=8,max_retries=1,batch_size=8",
            tasks=["attnkit_mc"],
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
        )
    samples = results["samples"]["attnkit_mc"]
    assert len(samples) == 50

    model = ak.accel.prepare(ak.from_pretrained("smollm2", dequantize=False), "decoding").model
    tokenizer = load_tokenizer_for("smollm2")

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    @torch.no_grad()
    def loglikelihood(context: str, continuation: str) -> float:
        # as lm-eval splits a pair: trailing spaces of the context go to the continuation,
        # and the continuation's tokens are the whole text's after the context's
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, n = encode(context + continuation), len(encode(context))
        hidden, _ = model.hidden_states(torch.tensor([whole]))  # (1, N, D)
        logits = model.lm_head(hidden[0, n - 1 : -1]).float()  # the continuation's predictions
        logprobs = torch.log_softmax(logits, -1)
        return float(logprobs[torch.arange(len(whole) - n), torch.tensor(whole[n:])].sum())

    correct, worst = 0, 0.0
    for sample in samples:
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        ours = [loglikelihood(c, x) for c, x in pairs(sample)]
        worst = max(worst, max(abs(a - b) for a, b in zip(theirs, ours, strict=True)))
        correct += max(range(len(ours)), key=ours.__getitem__) == int(sample["target"])
    accuracy = results["results"]["attnkit_mc"]["acc,none"]
    print(
        f"lm-eval attnkit_mc: accuracy {accuracy:.3f} through the server, {correct / 50:.3f} by "
        f"attnkit's own forward; largest log-likelihood difference {worst:.2e}"
    )
    assert worst < 1e-3, worst
    assert accuracy == pytest.approx(correct / len(samples))
    assert accuracy > 0.5  # a real model, read right: well above chance (0.25)
