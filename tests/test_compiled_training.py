"""Compiled training steps (``train.compile``, ``accel.compiled_layers``): the same losses and
gradients as eager steps in every family and attention variant, an exact resume, DDP on 2
processes following 1 process, and clear refusals."""

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit import accel
from attnkit.accel import compiled_training
from attnkit.cli import main
from attnkit.training import TrainConfig
from test_distributed import SHAKESPEARE, torchrun, train_losses, weights
from test_distributed import tiny as distributed_tiny

# torch.compile on a CPU needs a C++ compiler: make test installs g++, and without one every
# test here fails in one line naming the install command (never a skip)
pytestmark = pytest.mark.needs("g++")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread throughout, as the 2-process run below has: Dynamo compiles again when the
    thread count changes, and Inductor's cache on disk then serves those processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The layers' shapes and options are the ones the trainer runs below (micro-batches of 3 x 16),
# so that one compiled layer serves both tests: every compile costs CI 10-20 s on a cold cache.
LM_LAYERS = dict(
    d_model=32,
    n_heads=2,
    n_kv_heads=1,  # grouped-query attention
    d_ff=64,
    position="rope",
    activation="swiglu",
    norm_type="rmsnorm",
    attention="window",
    window=4,
)
SMALL = dict(vocab_size=64, n_layers=2, max_len=32, dropout=0.0)


def _batch(cfg, b=3, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (b, n), generator=g)
    mask = torch.arange(n) < torch.tensor([[n], [n - 3], [n - 5]])[:b]  # right padding
    return ids.masked_fill(~mask, 0), mask


def _lm_loss(model, cfg):
    ids, _ = _batch(cfg, n=17)
    return model.loss(ids[:, :-1], ids[:, 1:], ignore_index=0)


def _mt_loss(model, cfg):
    src, src_mask = _batch(cfg, seed=1)
    tgt, tgt_mask = _batch(cfg, seed=2)
    tgt_in = ak.shift_right(tgt, cfg.bos_id)
    return model.loss(src, tgt_in, tgt, src_mask, tgt_mask, ignore_index=0)


def _cls_loss(model, cfg):
    ids, mask = _batch(cfg, seed=3)
    return F.cross_entropy(model(ids, mask), torch.tensor([0, 1, 2]))


# The paper's Post-LN layers with ALiBi, for the translator and the classifier alike (their
# encoder layers are the same, compiled once).
POST_LN = dict(d_model=32, n_heads=4, d_ff=64, norm="post", position="alibi", activation="relu")
FAMILIES = {
    # decoder-only: Pre-LN, RoPE, grouped-query, sliding-window attention, SwiGLU, RMSNorm
    "decoder-only LM": (lambda cfg: ak.DecoderLM(cfg), LM_LAYERS, _lm_loss),
    # encoder-decoder: padding masks on both sides, cross-attention
    "translator": (lambda cfg: ak.Transformer(cfg), POST_LN, _mt_loss),
    # encoder-only: a classifier over padded sentences
    "classifier": (lambda cfg: ak.EncoderClassifier(cfg, 3), POST_LN, _cls_loss),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_layers_give_the_eager_loss_and_gradients(family):
    build, changes, loss_of = FAMILIES[family]
    cfg = ak.ModelConfig(**SMALL, **changes)
    torch.manual_seed(0)
    model = accel.prepare(build(cfg), "training").model
    layers = compiled_training.transformer_layers(model)
    assert len(layers) == cfg.n_layers * (2 if family == "translator" else 1)

    saved = []  # what the compiled step keeps for its backward

    def keep(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    def step(compiled):
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            with accel.compiled_layers(model, compiled):
                loss = loss_of(model, cfg)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_loss, eager_grads = step(False)
    saved.clear()
    compiled_loss, compiled_grads = step(True)
    assert compiled_training._COMPILED.get(layers[0]) is not None  # it did go through Dynamo
    # ReLU's backward reads its saved output, not a saved bool mask (Inductor's CPU code
    # handles bool tensors element by element; accel.compiled_layers lets views recompute)
    masks = [shape for dtype, shape in saved if dtype == torch.bool and shape[-1] == cfg.d_ff]
    assert not masks, f"{family}: bool masks saved for the backward: {masks}"
    assert compiled_training.transformer_layers(model) == layers  # the plain layers are back
    assert torch.allclose(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        scale = float(grad.abs().max()) + 1e-8
        gap = float((compiled_grads[name] - grad).abs().max())
        assert gap <= 1e-4 * scale, f"{family}: {name} differs by {gap:.2e} (max {scale:.2e})"


def tiny(steps, **changes):
    """test_distributed's small run with LM_LAYERS' layers and micro-batches of 3 rows of 16
    tokens, as the tests above compile them."""
    layers = {f"model.{key}": value for key, value in LM_LAYERS.items()}
    micro = {"train.batch_size": 6, "train.accumulate": 2}
    return distributed_tiny(steps, **{**layers, **micro, **changes})


def _train(run, *args):
    threads = torch.get_num_threads()
    try:
        assert main(["train", SHAKESPEARE, "--out", str(run), "--quiet", *args]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.needs("shakespeare")
def test_compiled_runs_follow_eager_resume_exactly_and_ddp_follows_one_process(tmp_path, capsys):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    _train(eager, *tiny(6))
    _train(compiled, "--compile", *tiny(6))
    one, other = train_losses(eager), train_losses(compiled)
    assert sorted(one) == sorted(other) == list(range(1, 7))
    assert max(abs(one[s] - other[s]) for s in one) < 1e-5
    assert other[6] < other[1]

    # 3 steps, a stop, a resume to 6: bit for bit the 6 straight steps
    resumed = tmp_path / "resumed"
    _train(resumed, "--compile", *tiny(6), "--set", "train.steps=3")
    _train(resumed, "--resume", "--set", "train.compile=true", *tiny(6))
    a, b = weights(compiled), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(resumed) == other

    # the same run compiled on 2 processes (DDP through torchrun; 3 rows each, one micro-batch)
    ddp = tmp_path / "ddp"
    micro = tiny(6, **{"train.accumulate": 1})
    done = torchrun(SHAKESPEARE, "--out", str(ddp), "--compile", *micro, timeout=300)
    assert "2 processes (ddp)" in done.stdout and "compiled layers" in done.stdout
    assert "compiled the layers: step 1 took" in done.stdout
    two = train_losses(ddp)
    assert max(abs(two[s] - other[s]) for s in other) < 1e-5


def test_the_layers_are_compiled_only_inside_the_block_and_experts_stay_eager():
    # Module swaps for the block: each layer runs as a CompiledLayer (torch.compile(layer)),
    # the same one each time; its experts route eagerly; after the block, the plain modules.
    cfg = ak.ModelConfig(**SMALL, **{**LM_LAYERS, "n_experts": 2})
    model = ak.DecoderLM(cfg)
    layers = compiled_training.transformer_layers(model)
    experts = [layer.ffn for layer in layers]
    before = dict(model.state_dict())
    for _ in range(2):
        with accel.compiled_layers(model):
            held = list(model.decoder.layers)
            assert [type(m) for m in held] == [compiled_training.CompiledLayer] * len(layers)
            assert [m.compiled._orig_mod for m in held] == layers
            assert held == [compiled_training._COMPILED[layer] for layer in layers]
            # routing by data (nonzero) runs eagerly between the compiled parts of a layer
            assert all(type(layer.ffn) is compiled_training.EagerExperts for layer in layers)
            assert [layer.ffn.experts for layer in layers] == [moe.experts for moe in experts]
        assert list(model.decoder.layers) == layers
        assert [layer.ffn for layer in layers] == experts
        assert dict(model.state_dict()).keys() == before.keys()
    with accel.compiled_layers(model, False):
        assert list(model.decoder.layers) == layers


def test_compile_refusals(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"train.compile must be true or false, got .yes."):
        TrainConfig(compile="yes")
    with pytest.raises(ValueError, match="strategy='fsdp'"):
        accel.check_compiler(sharded=True)
    monkeypatch.setattr(compiled_training.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        accel.check_compiler()
