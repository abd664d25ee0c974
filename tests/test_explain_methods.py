"""attnkit.explain's methods beyond the heatmap, each against a computation we did not write or a
direct one written here from the paper:

- attention rollout and flow: the paper's equations written out, a linear program for the
  maximum flow (scipy), and the authors' own algorithm (samiraabnar/attention_flow: their graph
  layout and Edmonds-Karp) on their example sentence through the shipped MiniLM;
- the logit lens: Hugging Face GPT-2's and Llama's ``hidden_states`` through the final norm and
  head;
- head ablation and activation patching: TransformerLens on the same GPT-2 directory, and
  weight surgery (zeroed W^O columns, a moved bias) on encoder, decoder and encoder-decoder;
- attribution: Captum's integrated gradients add up to f(x) - f(baseline), input x gradient
  equals a direct autograd computation.
"""

import numpy as np
import pytest
import torch
import transformers

import attnkit as ak
from attnkit.explain.attribution import (
    attribute_classifier,
    attribute_next_token,
    attribute_translation,
)
from attnkit.explain.interventions import ablate_heads, patch_heads, patch_residual
from attnkit.explain.lens import logit_lens
from attnkit.explain.rollout import attention_flow, attention_rollout


def _random_attentions(layers=3, batch=2, heads=2, n=5, seed=0, causal=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        scores = torch.randn(batch, heads, n, n, generator=g) * 2
        if causal:
            scores = scores.masked_fill(~ak.causal_mask(n), float("-inf"))
        out.append(scores.softmax(-1))
    return out


# --------------------------------------------------------------------------------------------
# rollout and flow
# --------------------------------------------------------------------------------------------


def _paper_rollout(attentions, residual):
    """Abnar & Zuidema, eq. (1)-(2), one example at a time, in plain loops."""
    result = []
    for b in range(attentions[0].shape[0]):
        joint = None
        for a in attentions:
            m = a[b].double().mean(0).numpy()
            if residual:
                m = 0.5 * m + 0.5 * np.eye(len(m))
                m = m / m.sum(-1, keepdims=True)
            joint = m if joint is None else m @ joint
        result.append(joint)
    return np.stack(result)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_rollout_is_the_papers_product_of_layers(residual, causal):
    attentions = _random_attentions(causal=causal)
    rollout = attention_rollout(attentions, residual=residual)
    assert rollout.shape == (2, 5, 5)
    np.testing.assert_allclose(rollout.double().numpy(), _paper_rollout(attentions, residual), 1e-6)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 5))  # shares of the inputs
    if causal:  # the future cannot reach the past through any number of layers
        assert (rollout[:, ~ak.causal_mask(5)] == 0).all()


def _lp_max_flow(mats, top, source):
    """Maximum flow from node (L, top) to (0, source) as a linear program (scipy's HiGHS):
    one variable per edge, conservation at every inner node, capacities as bounds."""
    from scipy.optimize import linprog

    n_layers, n, _ = mats.shape
    edges = [
        ((layer, i), (layer - 1, j), mats[layer - 1, i, j])
        for layer in range(1, n_layers + 1)
        for i in range(n)
        for j in range(n)
    ]
    nodes = [(layer, i) for layer in range(n_layers + 1) for i in range(n)]
    inner = [v for v in nodes if v not in ((n_layers, top), (0, source))]
    a_eq = np.zeros((len(inner), len(edges)))
    for e, (u, v, _) in enumerate(edges):
        if u in inner:
            a_eq[inner.index(u), e] -= 1
        if v in inner:
            a_eq[inner.index(v), e] += 1
    objective = np.array([-1.0 if u == (n_layers, top) else 0.0 for u, _, _ in edges])
    bounds = [(0, c) for _, _, c in edges]
    result = linprog(objective, A_eq=a_eq, b_eq=np.zeros(len(inner)), bounds=bounds)
    assert result.success
    return -result.fun


def test_flow_is_the_maximum_flow_of_a_linear_program():
    from attnkit.explain.rollout import layer_matrices

    attentions = _random_attentions(layers=2, batch=1, n=4, seed=3)
    flow = attention_flow(attentions).double().numpy()[0]
    mats = layer_matrices(attentions)[:, 0]
    raw = np.array([[_lp_max_flow(mats, i, j) for j in range(4)] for i in range(4)])
    np.testing.assert_allclose(flow, raw / raw.sum(-1, keepdims=True), atol=1e-6)


def test_flow_of_one_layer_is_that_layers_attention():
    attentions = _random_attentions(layers=1)
    torch.testing.assert_close(attention_flow(attentions), attention_rollout(attentions))


def _authors_flow(res_att_mat):
    """The authors' algorithm, as their attention_graph_util.py builds it (read, not copied):
    nodes numbered layer * length + position, an edge from each node of layer i to each node of
    layer i - 1 with the capacity of the residual-augmented weight, Edmonds-Karp from every top
    node to every input node, each row normalised."""
    import networkx as nx

    n_layers, length, _ = res_att_mat.shape
    size = (n_layers + 1) * length
    adjacency = np.zeros((size, size))
    for i in range(1, n_layers + 1):
        for k_from in range(length):
            for k_to in range(length):
                adjacency[i * length + k_from, (i - 1) * length + k_to] = res_att_mat[i - 1][
                    k_from
                ][k_to]
    graph = nx.from_numpy_array(adjacency, create_using=nx.DiGraph(), edge_attr="capacity")
    top = np.zeros((length, length))
    for k in range(length):
        u = n_layers * length + k
        for v in range(length):
            top[k, v] = nx.maximum_flow_value(
                graph, u, v, flow_func=nx.algorithms.flow.edmonds_karp
            )
        top[k] /= top[k].sum()
    return top


@pytest.mark.needs("minilm")
def test_rollout_and_flow_match_the_authors_code_on_their_example():
    from attnkit.interop import load_tokenizer_for
    from test_interop_minilm import PATH

    model = ak.from_pretrained(PATH).eval()
    tokenizer = load_tokenizer_for(PATH)
    sentence = "The author talked to Sara about [MASK] book"  # their bert_example notebook
    ids = torch.tensor([tokenizer.encode(sentence)])
    with torch.no_grad():
        _, attentions = model(ids, return_attention=True)
    mean = torch.stack(attentions)[:, 0].double().mean(1).numpy()  # (L, N, N), heads averaged
    res = mean + np.eye(mean.shape[-1])[None]  # their notebook: A + I, rows renormalised
    res = res / res.sum(-1)[..., None]
    joint = res[0]  # their compute_joint_attention, with the residual already added
    for layer in res[1:]:
        joint = layer.dot(joint)
    np.testing.assert_allclose(attention_rollout(attentions)[0].double(), joint, atol=1e-6)
    np.testing.assert_allclose(attention_flow(attentions)[0].double(), _authors_flow(res), 1e-5)


def test_rollout_and_flow_refuse_bad_input_in_one_line():
    with pytest.raises(TypeError, match="one \\(B, H, N, N\\) tensor per layer"):
        attention_rollout(torch.rand(1, 2, 3, 3))
    with pytest.raises(ValueError, match=r"attentions\[0\] must be a \(B, H, N, N\) tensor"):
        attention_rollout([torch.rand(2, 3, 4)])
    with pytest.raises(ValueError, match=r"attentions\[1\] has shape"):
        attention_flow([torch.rand(1, 2, 3, 3), torch.rand(1, 2, 4, 4)])
    with pytest.raises(ValueError, match="of self-attention weights"):
        attention_rollout([torch.rand(1, 2, 3, 5)])  # cross-attention is not square
    with pytest.raises(ValueError, match="non-negative"):
        attention_rollout([torch.full((1, 1, 2, 2), float("nan"))])


# --------------------------------------------------------------------------------------------
# the logit lens
# --------------------------------------------------------------------------------------------


def _randomize(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(std=0.2 if p.dim() > 1 else 0.05)
            if ("norm" in name.lower() or "ln" in name) and name.endswith("weight"):
                p.add_(1.0)
    return model.eval()


def _gpt2_dir(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=97, n_embd=48, n_layer=3, n_head=4, n_positions=40, attn_implementation="eager"
    )
    ref = _randomize(transformers.GPT2LMHeadModel(config))
    ref.save_pretrained(tmp_path / "gpt2")
    return ref, str(tmp_path / "gpt2")


def _hf_llama_dir(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    ref = _randomize(transformers.LlamaForCausalLM(config))
    ref.save_pretrained(tmp_path / "llama")
    return ref, str(tmp_path / "llama")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logit_lens_reads_hugging_faces_hidden_states(tmp_path, family):
    ref, path = _gpt2_dir(tmp_path) if family == "gpt2" else _hf_llama_dir(tmp_path)
    ours = ak.from_pretrained(path).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    final_norm = ref.transformer.ln_f if family == "gpt2" else ref.model.norm
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
        hidden = out.hidden_states  # L + 1; Hugging Face's last one is after the final norm
        expected = [ref.lm_head(final_norm(h)).log_softmax(-1) for h in hidden[:-1]]
        expected.append(ref.lm_head(hidden[-1]).log_softmax(-1))
        lens = logit_lens(ours, ids)
        own = ours(ids).log_softmax(-1)
    assert lens.shape == (4, 2, 7, ours.cfg.vocab_size)
    torch.testing.assert_close(lens, torch.stack(expected), atol=1e-4, rtol=1e-4)
    assert torch.equal(lens[-1], own)  # the last entry is the model's own prediction


def test_logit_lens_refuses_a_model_without_an_lm_head():
    model = ak.EncoderModel(ak.ModelConfig.preset("tiny", vocab_size=30))
    with pytest.raises(TypeError, match=r"decoder-only language model .* got EncoderModel"):
        logit_lens(model, torch.tensor([[1, 2]]))


# --------------------------------------------------------------------------------------------
# head ablation and activation patching
# --------------------------------------------------------------------------------------------

CLEAN = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
CORRUPTED = torch.tensor([[5, 6, 7, 8, 30, 10, 11]])  # one word changed ("tired" -> "wide")


def _metric(token=3):
    return lambda logits: logits.log_softmax(-1)[0, -1, token]


def test_patching_and_ablation_match_transformer_lens_on_gpt2(tmp_path):
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    _, path = _gpt2_dir(tmp_path)
    ours = ak.from_pretrained(path).eval()
    bridge = TransformerBridge.boot_transformers(path, device="cpu")
    metric = _metric()
    _, clean_cache = bridge.run_with_cache(CLEAN)
    expected = {
        "heads": patching.get_act_patch_attn_head_out_all_pos(
            bridge, CORRUPTED, clean_cache, metric
        ),
        "resid_pre": patching.get_act_patch_resid_pre(bridge, CORRUPTED, clean_cache, metric),
    }
    got = {
        "heads": patch_heads(ours, lambda m: m(CLEAN), lambda m: m(CORRUPTED), metric),
        "resid_pre": patch_residual(ours, lambda m: m(CLEAN), lambda m: m(CORRUPTED), metric),
    }
    for key in expected:
        assert got[key].shape == expected[key].shape, key
        torch.testing.assert_close(got[key], expected[key].double(), atol=1e-4, rtol=0)
        gap = (got[key] - expected[key].double()).abs().max().item()
        print(f"\npatching {key} against TransformerLens: largest difference {gap:.1e}")
    # zero ablation: TransformerLens's hook_z (the heads before W^O) set to zero
    with torch.no_grad():
        clean = float(metric(bridge(CLEAN)))
        theirs = torch.zeros(3, 4, dtype=torch.float64)
        for layer in range(3):
            for head in range(4):

                def zero(z, hook, head=head):
                    z[:, :, head] = 0
                    return z

                logits = bridge.run_with_hooks(
                    CLEAN, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero)]
                )
                theirs[layer, head] = float(metric(logits)) - clean
    ablated = ablate_heads(ours, lambda m: m(CLEAN), metric)
    torch.testing.assert_close(ablated, theirs, atol=1e-4, rtol=0)


def _tiny(family, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=40, n_layers=2, n_heads=4, **overrides)
    model = {
        "encoder": lambda: ak.EncoderClassifier(cfg, num_classes=3),
        "decoder": lambda: ak.DecoderLM(cfg),
        "encoder-decoder": lambda: ak.Transformer(cfg),
    }[family]()
    return _randomize(model, seed)


def _runs(family):
    tgt = torch.tensor([[1, 12, 13, 14]])
    if family == "encoder":
        return (lambda m: m(CLEAN)), (lambda m: m(CORRUPTED)), (lambda out: out[0, 1])
    if family == "decoder":
        return (lambda m: m(CLEAN)), (lambda m: m(CORRUPTED)), _metric()
    return (lambda m: m(CLEAN, tgt)), (lambda m: m(CORRUPTED, tgt)), _metric()


SITES = [("encoder", "encoder", "self"), ("decoder", "decoder", "self")]
SITES += [("encoder-decoder", s, a) for s, a in [("encoder", "self"), ("decoder", "cross")]]


@pytest.mark.parametrize(("family", "stack", "attention"), SITES)
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablation_equals_weight_surgery(family, stack, attention, mode):
    """Zeroing head h is zeroing its columns of W^O; its mean is those columns times the mean,
    moved into W^O's bias. Both computed on a copy of the model, with no hooks."""
    import copy

    model = _tiny(family)
    run, _, metric = _runs(family)
    deltas = ablate_heads(model, run, metric, mode=mode, stack=stack, attention=attention)
    assert deltas.shape == (2, 4)
    with torch.no_grad():
        clean = float(metric(run(model)))
    layers = [m for m in model.modules() if isinstance(m, ak.stacks.Encoder | ak.stacks.Decoder)]
    index = 0 if stack == "encoder" else -1
    for layer in range(2):
        for head in range(4):
            surgery = copy.deepcopy(model)
            stack_module = [
                m for m in surgery.modules() if isinstance(m, ak.stacks.Encoder | ak.stacks.Decoder)
            ][index]
            attn = getattr(stack_module.layers[layer], f"{attention}_attn")
            cols = slice(head * attn.d_head, (head + 1) * attn.d_head)
            with torch.no_grad():
                if mode == "mean":
                    inputs = []
                    original = getattr(layers[index].layers[layer], f"{attention}_attn")
                    hook = original.out_proj.register_forward_pre_hook(
                        lambda mod, args, inputs=inputs: inputs.append(args[0])
                    )
                    run(model)
                    hook.remove()
                    mean = inputs[0][..., cols].flatten(0, -2).mean(0)
                    attn.out_proj.bias += attn.out_proj.weight[:, cols] @ mean
                attn.out_proj.weight[:, cols] = 0
                expected = float(metric(run(surgery))) - clean
            assert abs(deltas[layer, head].item() - expected) < 1e-5, (layer, head)


@pytest.mark.parametrize("family", ["encoder", "decoder", "encoder-decoder"])
def test_patching_the_changed_token_at_the_bottom_restores_the_clean_run(family):
    model = _tiny(family)
    clean, corrupted, metric = _runs(family)
    with torch.no_grad():
        clean_value, corrupted_value = float(metric(clean(model))), float(metric(corrupted(model)))
    stack = "encoder" if family != "decoder" else "decoder"
    grid = patch_residual(model, clean, corrupted, metric, stack=stack)
    assert grid.shape == (2, 7)
    assert abs(grid[0, 4] - clean_value) < 1e-5  # the only changed input, patched: clean
    assert abs(grid[0, 0] - corrupted_value) < 1e-5  # an unchanged one: nothing changes
    same = patch_heads(model, clean, clean, metric, stack=stack)
    torch.testing.assert_close(same, torch.full((2, 4), clean_value, dtype=torch.float64))


def test_interventions_refuse_bad_input_in_one_line():
    model = _tiny("decoder")
    run, other, metric = _runs("decoder")
    with pytest.raises(ValueError, match="mode must be 'zero' or 'mean', got 'max'"):
        ablate_heads(model, run, metric, mode="max")
    with pytest.raises(ValueError, match=r"stack must be one of \['decoder'\], got 'encoder'"):
        ablate_heads(model, run, metric, stack="encoder")
    with pytest.raises(ValueError, match="attention='cross', but this stack has no such"):
        patch_heads(model, run, other, metric, attention="cross")
    with pytest.raises(ValueError, match="metric must return a scalar"):
        ablate_heads(model, run, lambda logits: logits)
    with pytest.raises(ValueError, match=r"same shape .* same number of tokens"):
        patch_residual(model, run, lambda m: m(CLEAN[:, :5]), metric)
    with pytest.raises(TypeError, match="run must be a callable"):
        ablate_heads(model, CLEAN, metric)
    with pytest.raises(TypeError, match="attnkit model with an encoder or decoder stack"):
        ablate_heads(torch.nn.Linear(2, 2), run, metric)


# --------------------------------------------------------------------------------------------
# attribution (Captum)
# --------------------------------------------------------------------------------------------


def midpoint_integrated_gradients(model, stack, ids, target, steps=300):
    """Integrated gradients at the input of ``stack`` (a token's share: the sum over its width of
    (x - x') times the mean gradient on the straight line from x' to x), by the midpoint rule
    with autograd here: x' is the stack's input for a text of padding tokens."""
    seen = {}
    handle = stack.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    with torch.no_grad():
        model(ids)
        x = seen["x"].detach()
        model(torch.full_like(ids, model.cfg.pad_id))
        base = seen["x"].detach()
    handle.remove()
    total = torch.zeros_like(x)
    for k in range(steps):
        point = (base + (k + 0.5) / steps * (x - base)).requires_grad_()
        handle = stack.register_forward_pre_hook(lambda m, args, p=point: (p, *args[1:]))
        (grad,) = torch.autograd.grad(model(ids)[0, target], point)
        handle.remove()
        total += grad
    return ((x - base) * total / steps).sum(-1)


def test_integrated_gradients_add_up_to_the_change_from_the_baseline():
    """Captum's attributions token by token against the integral computed here, and their sum
    against f(x) - f(baseline) (completeness)."""
    classifier = _tiny("encoder")
    scores = attribute_classifier(classifier, CLEAN, target=1, steps=100)
    assert scores.shape == (1, 7)
    own = midpoint_integrated_gradients(classifier, classifier.encoder.encoder, CLEAN, 1)
    torch.testing.assert_close(scores, own, atol=2e-3, rtol=1e-2)
    assert scores.abs().max() > 10 * 2e-3  # shares large enough for the comparison to mean much
    with torch.no_grad():
        change = classifier(CLEAN)[0, 1] - classifier(torch.zeros_like(CLEAN))[0, 1]
    assert abs(scores.sum().item() - change.item()) < 1e-3 * max(1.0, abs(change.item()))

    translator = _tiny("encoder-decoder")
    tgt = torch.tensor([[1, 12, 13, 14]])
    rows = attribute_translation(translator, CLEAN, tgt, steps=100)
    assert rows.shape == (1, 3, 7)

    def word_logprobs(src):
        logp = translator(src, tgt[:, :-1]).log_softmax(-1)
        return logp.gather(-1, tgt[:, 1:, None])[..., 0]

    with torch.no_grad():
        change = word_logprobs(CLEAN) - word_logprobs(torch.zeros_like(CLEAN))
    torch.testing.assert_close(rows.sum(-1), change, atol=2e-3, rtol=1e-2)

    decoder = _tiny("decoder")
    scores = attribute_next_token(decoder, CLEAN, target=3, steps=100)
    with torch.no_grad():
        logp = [decoder(x)[0, -1].log_softmax(-1)[3] for x in (CLEAN, torch.zeros_like(CLEAN))]
    assert abs(scores.sum().item() - (logp[0] - logp[1]).item()) < 2e-3


def test_input_x_gradient_is_the_embedding_times_its_gradient():
    classifier = _tiny("encoder")
    captured = {}

    def leaf(module, args):  # the embedded input, made a leaf that keeps its gradient
        x = args[0].detach().requires_grad_()
        captured["x"] = x
        return (x, *args[1:])

    handle = classifier.encoder.encoder.register_forward_pre_hook(leaf)
    logit = classifier(CLEAN)[0, 2]
    handle.remove()
    (grad,) = torch.autograd.grad(logit, captured["x"])
    expected = (captured["x"] * grad).sum(-1).detach()
    got = attribute_classifier(classifier, CLEAN, target=2, method="input_x_gradient")
    torch.testing.assert_close(got, expected)


def test_attribution_refuses_bad_input_in_one_line():
    classifier = _tiny("encoder")
    with pytest.raises(ValueError, match=r"target must be a class in \[0, 3\), got 7"):
        attribute_classifier(classifier, CLEAN, target=7)
    with pytest.raises(ValueError, match="method must be one of"):
        attribute_classifier(classifier, CLEAN, method="saliency")
    with pytest.raises(ValueError, match="ids must be a non-empty"):
        attribute_classifier(classifier, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(TypeError, match=r"must be an attnkit\.Transformer"):
        attribute_translation(classifier, CLEAN, CLEAN)


def test_rollout_refuses_layers_that_gave_no_weights():
    with pytest.raises(ValueError, match=r"attentions\[0\] is None: the model gave no weights"):
        attention_rollout([None, None])  # what a layer gives when its weights were not asked for


# --------------------------------------------------------------------------------------------
# attnkit explain rollout|flow|lens|heads|patch|attribute
# --------------------------------------------------------------------------------------------

SNAKE = "我 用 毒 毒 毒 蛇"


def _cli(argv, capsys):
    from attnkit.cli import main

    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _options(text: str) -> set[str]:
    import re

    return set(re.findall(r"^  (--[a-z-]+)", text, flags=re.MULTILINE))


def test_each_explain_method_help_lists_only_its_own_options(capsys):
    """`attnkit explain METHOD --help` shows the options METHOD reads, and no other method's."""
    own = {
        "": {"--model", "--preset", "--seed", "--layer", "--head", "--query", "--dims",
             "--scores", "--tokens", "--d-k", "--causal"},
        "scaling": {"--seed", "--png", "--svg"},
        "complexity": {"--budget", "--threads", "--png", "--svg"},
        "circuits": {"--repeat", "--seed", "--json", "--png", "--svg", "--html"},
        "lens": {"--model", "--preset", "--seed", "--family", "--query", "--answer", "--png",
                 "--svg", "--html"},
        "heads": {"--model", "--preset", "--seed", "--family", "--answer", "--versus",
                  "--label", "--mode", "--target", "--stack", "--png", "--svg", "--html"},
        "attribute": {"--model", "--preset", "--seed", "--family", "--answer", "--versus",
                      "--label", "--method", "--steps", "--target", "--stack", "--png", "--svg",
                      "--html"},
    }  # fmt: skip
    for method, options in own.items():
        with pytest.raises(SystemExit):
            _cli(["explain", *filter(None, [method]), "--help"], capsys)
        out = capsys.readouterr().out
        assert _options(out) == options, method
        assert f"usage: attnkit explain {method}".rstrip() in out


def test_explain_rollout_and_flow_print_the_views_and_draw_png_and_svg(capsys, tmp_path):
    png, svg = tmp_path / "flow.png", tmp_path / "flow.svg"
    argv = ["explain", "flow", SNAKE, "--query", "蛇", "--png", str(png), "--svg", str(svg)]
    status, out, _ = _cli(argv, capsys)
    assert status == 0
    assert "raw (top layer)" in out and "rollout" in out and "flow" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("我", "用", "毒", "蛇"))]
    assert len(rows) == 6 and abs(sum(float(r[2]) for r in rows) - 1) < 0.01  # rollout sums to 1
    assert png.read_bytes().startswith(b"\x89PNG")
    assert b"<svg" in svg.read_bytes()[:400]
    status, out, _ = _cli(["explain", "rollout", SNAKE], capsys)  # no --query: the matrix
    assert status == 0 and len([line for line in out.splitlines() if line.startswith("毒")]) == 3


def test_explain_lens_heads_patch_and_attribute_on_every_family(capsys, tmp_path):
    status, out, _ = _cli(["explain", "lens", SNAKE, "--answer", "蛇"], capsys)
    assert status == 0 and "embeddings" in out and "layer 2" in out and "rank" in out
    status, out, _ = _cli(["explain", "heads", SNAKE, "--mode", "mean"], capsys)
    assert status == 0 and "layer 1" in out and "the heads that matter most" in out
    argv = ["explain", "patch", SNAKE, "--corrupted", "我 用 蛇 毒 毒 蛇", "--answer", "蛇"]
    status, out, _ = _cli([*argv, "--svg", str(tmp_path / "patch.svg")], capsys)
    assert status == 0 and "share of the clean metric restored" in out
    assert (tmp_path / "patch.svg").exists() and (tmp_path / "patch-heads.svg").exists()
    status, out, _ = _cli(["explain", "attribute", SNAKE, "--family", "classifier"], capsys)
    assert status == 0 and "class" in out and out.count("\n  ") >= 6
    argv = ["explain", "attribute", "ich bin hier", "--target", "i am here"]
    status, out, _ = _cli([*argv, "--family", "encoder-decoder", "--steps", "8"], capsys)
    assert status == 0 and "cross-attention" in out
    argv = ["explain", "heads", "ich bin hier", "--target", "i am here"]
    status, out, _ = _cli([*argv, "--family", "encoder-decoder"], capsys)
    assert status == 0 and "cross-attention" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "rollout", "   "], "TEXT is empty"),
        (["explain", "lens"], "required: TEXT"),
        (["explain", "lens", SNAKE, "--family", "encoder"], "needs a decoder-only model"),
        (["explain", "rollout", SNAKE, "--query", "龙"], "--query: '龙' is not one of"),
        (["explain", "patch", SNAKE], "give --corrupted TEXT"),
        (["explain", "patch", SNAKE, "--corrupted", "我 用 蛇"], "as many tokens as TEXT (6)"),
        (["explain", "heads", SNAKE, "--answer", "龙"], "--answer: '龙' is not a word"),
        (["explain", "heads", SNAKE, "--family", "encoder"], "an output to measure"),
        (["explain", "heads", SNAKE, "--family", "classifier", "--label", "5"], "--label"),
        (["explain", "attribute", SNAKE, "--steps", "0"], "--steps: must be a positive"),
        (["explain", "attribute", "a b", "--family", "encoder-decoder"], "needs --target"),
        (["explain", "rollout", SNAKE, "--png", "x.jpg"], "must end in .png"),
        (["explain", "rollout", SNAKE, "--png", "a.png", "--html", "r.txt"], "end in .html"),
        (["explain", "scaling", SNAKE], "unrecognized arguments"),
    ],
)
def test_explain_methods_refuse_bad_input_in_one_line(capsys, argv, message):
    status, out, err = _cli(argv, capsys)
    assert status == 2, out
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_explain_html_puts_the_tables_pictures_attention_and_rollout_in_one_page(tmp_path, capsys):
    import json
    import re

    html = tmp_path / "report" / "lens.html"
    status, out, _ = _cli(["explain", "lens", SNAKE, "--html", str(html)], capsys)
    assert status == 0 and f"wrote {html}" in out
    page = html.read_text(encoding="utf-8")
    assert '<pre class="output">' in page and "embeddings" in page  # the printed table
    assert '<img src="lens.png"' in page and (html.parent / "lens.png").exists()
    block = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', page)
    sections = json.loads(block.group(1))["sections"]
    assert [s["name"] for s in sections] == ["self-attention", "attention rollout"]
    rollout = torch.tensor(sections[1]["weights"]).reshape(sections[1]["shape"])
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", vocab_size=512))  # the command's model
    assert rollout.shape == (model.cfg.n_layers, 1, 6, 6)
    torch.testing.assert_close(
        rollout.sum(-1), torch.ones(model.cfg.n_layers, 1, 6), atol=1e-3, rtol=0
    )
