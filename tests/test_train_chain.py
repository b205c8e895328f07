"""`train mtp` / `train eagle`: the trainer's forward is the inference forward, and a short run on
a tiny target lowers the loss and writes a head its loader reads back."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, tiny_model
from test_chain import reference

from mlx_spec.eagle import load_eagle
from mlx_spec.mtp import load_mtp
from mlx_spec.sampling import SamplingConfig
from mlx_spec.target import Target
from mlx_spec.train.chain import (
    ChainTrainConfig,
    build_head,
    loss_fn,
    target_features,
    train_chain,
)


def _setup(kind):
    model, cfg = tiny_model("llama")
    target = Target(model, (), final_hidden=kind == "mtp")
    head, _hcfg = build_head(kind, target, cfg, seed=2)
    if kind == "eagle":
        head.bind(target)
        target = Target(model, head.taps)
    mx.eval(head.parameters())
    return target, head, cfg


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_the_trainers_forward_equals_the_inference_forward(kind):
    """Step j of the training-time test at row t is pass j of the chain anchored j - 1 rows
    earlier, fed the committed tokens: the cached ``propose`` (pass 1) and the no-cache
    recompute of the chain (every pass) give the same distribution."""
    target, head, _ = _setup(kind)
    seq = [3, 17, 5, 40, 9, 77, 12, 8, 60, 2, 31, 99, 14, 6]
    ids = mx.array([seq])
    feats = target_features(target, head, ids)
    steps = []
    loss_fn(head, feats, ids, mx.ones((1, len(seq) - 2)), ttt=3, decay=1.0, capture=steps)
    cfg = SamplingConfig(temperature=1.0)
    for t in (4, 9):
        cache = head.make_cache()
        head.add_context(feats[:, : t + 1], ids[0, : t + 1], cache)
        prop = head.propose(ids[0, t + 1], 1, cache, sampling=cfg, key=mx.random.key(0))
        want = mx.softmax(steps[0][0, t].astype(mx.float32))
        np.testing.assert_allclose(np.array(prop.q[0]), np.array(want), atol=1e-5)
        for j in (1, 2):
            a = t - j  # the chain's anchor row
            _, logits = reference(head, feats[:, : a + 1], seq[: a + 1], seq[a + 1], j + 1,
                                  feed=seq[a + 2 : a + 3 + j])
            np.testing.assert_allclose(np.array(steps[j][0, t]), np.array(logits[j]), atol=1e-4)


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_a_short_run_lowers_the_loss_and_writes_a_loadable_head(tmp_path, kind):
    model, cfg = tiny_model("llama")
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(12):  # a learnable pattern: the sequence counts up by 3
        s = int(rng.integers(VOCAB))
        seqs.append((s + 3 * np.arange(40)) % VOCAB)
    np.savez(tmp_path / "tokens.npz", tokens=np.concatenate(seqs).astype(np.int32),
             offsets=np.arange(13) * 40, prompt_lens=np.full(12, 4, np.int32), ids=np.arange(12))
    c = ChainTrainConfig(kind=kind, tokens=str(tmp_path / "tokens.npz"), out=str(tmp_path / "run"), steps=30,
                         batch_size=4, seq_len=32, lr=3e-3, ttt=2, held_out=2, checkpoint_every=30, eval_every=30)
    target = Target(model, (), final_hidden=kind == "mtp")
    summary = train_chain(c, target, cfg, log=lambda _: None)
    import json
    log = json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["log"]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]
    assert log[-1]["held_out_acc"][0] > 0.5
    if kind == "mtp":
        head = load_mtp(summary["head"], Target(model, (), final_hidden=True))
    else:
        head, _ = load_eagle(summary["head"])
    assert head.pass_count == 0
