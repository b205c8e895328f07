"""`train mtp` / `train eagle`: the trainer's forward is the inference forward, and a short run on
a tiny target lowers the loss and writes a head its loader reads back."""

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

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, tiny_model
from test_chain import reference


def _setup(kind, draft_ids=None):
    model, cfg = tiny_model("llama")
    target = Target(model, (), final_hidden=kind == "mtp")
    head, _ = build_head(kind, target, cfg, seed=2, draft_ids=draft_ids)
    if kind == "eagle":
        head.bind(target)
        target = Target(model, head.taps)
    mx.eval(head.parameters())
    return target, head, cfg


@pytest.mark.parametrize("kind,reduced", [("mtp", False), ("eagle", False), ("eagle", True)])
def test_the_trainers_forward_equals_the_inference_forward(kind, reduced):
    """Step j of the training-time test at row t is pass j of the chain anchored j - 1 rows
    earlier, fed the committed tokens: the cached ``propose`` (pass 1) and the no-cache
    recompute of the chain (every pass) give the same distribution."""
    target, head, _ = _setup(kind, np.arange(0, VOCAB, 2) if reduced else None)
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
        if reduced:
            want = mx.zeros((VOCAB,)).at[head.draft_ids].add(want)
        np.testing.assert_allclose(np.array(prop.q[0]), np.array(want), atol=1e-5)
        for j in (1, 2):
            a = t - j  # the chain's anchor row
            _, logits = reference(head, feats[:, : a + 1], seq[: a + 1], seq[a + 1], j + 1, feed=seq[a + 2 : a + 3 + j])
            np.testing.assert_allclose(np.array(steps[j][0, t]), np.array(logits[j]), atol=1e-4)


@pytest.mark.parametrize("kind,draft_vocab", [("mtp", 0), ("eagle", 0), ("eagle", 64)])
def test_a_short_run_lowers_the_loss_and_writes_a_loadable_head(tmp_path, kind, draft_vocab):
    model, cfg = tiny_model("llama")
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(12):  # a learnable pattern: the sequence counts up by 3
        s = int(rng.integers(VOCAB))
        seqs.append((s + 3 * np.arange(40)) % VOCAB)
    np.savez(
        tmp_path / "tokens.npz",
        tokens=np.concatenate(seqs).astype(np.int32),
        offsets=np.arange(13) * 40,
        prompt_lens=np.full(12, 4, np.int32),
        ids=np.arange(12),
    )
    c = ChainTrainConfig(
        kind=kind,
        tokens=str(tmp_path / "tokens.npz"),
        out=str(tmp_path / "run"),
        steps=30,
        batch_size=4,
        seq_len=32,
        lr=3e-3,
        ttt=2,
        held_out=2,
        checkpoint_every=30,
        eval_every=30,
        draft_vocab=draft_vocab,
    )
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
        if draft_vocab:  # the draft vocabulary is the response tokens' most frequent, mapped back by d2t
            ids = np.concatenate([s[4:] for s in seqs[:-2]])
            want = np.sort(np.argsort(-np.bincount(ids, minlength=VOCAB), kind="stable")[:draft_vocab])
            np.testing.assert_array_equal(np.array(head.draft_ids), want)
    # the written head, loaded as inference loads it, drafts the held-out sequence's next tokens
    t_view = Target(model, (), final_hidden=True) if kind == "mtp" else Target(model, head.bind(Target(model, ())).taps)
    if kind == "mtp":
        head = load_mtp(summary["head"], t_view)
    seq = seqs[-1].tolist()
    feats = target_features(t_view, head, mx.array([seq]))
    hits = 0
    for t in range(4, 30):
        cache = head.make_cache()
        head.add_context(feats[:, : t + 1], mx.array(seq[: t + 1]), cache)
        hits += int(head.propose(mx.array(int(seq[t + 1])), 1, cache).tokens[0]) == int(seq[t + 2])
    assert hits / 26 > 0.5
    assert head.pass_count == 26


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    import json

    model, cfg = tiny_model("llama")
    seqs = [(s + 3 * np.arange(40)) % VOCAB for s in range(8)]
    np.savez(
        tmp_path / "tokens.npz",
        tokens=np.concatenate(seqs).astype(np.int32),
        offsets=np.arange(9) * 40,
        prompt_lens=np.full(8, 4, np.int32),
        ids=np.arange(8),
    )
    base = {
        "kind": "eagle",
        "tokens": str(tmp_path / "tokens.npz"),
        "out": str(tmp_path / "run"),
        "batch_size": 2,
        "seq_len": 24,
        "ttt": 2,
        "held_out": 2,
        "checkpoint_every": 4,
        "eval_every": 100,
        "draft_vocab": 32,
    }
    train_chain(ChainTrainConfig(steps=4, **base), Target(model, ()), cfg, log=lambda _: None)
    first = (tmp_path / "run" / "head" / "model.safetensors").read_bytes()
    first_log = json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["log"]
    train_chain(ChainTrainConfig(steps=8, resume=True, **base), Target(model, ()), cfg, log=lambda _: None)
    log = json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["log"]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert log[:4] == first_log  # continued, not restarted
    assert (tmp_path / "run" / "head" / "model.safetensors").read_bytes() != first
    from mlx_spec.errors import BadRequest

    with pytest.raises(BadRequest, match="no checkpoint"):
        train_chain(
            ChainTrainConfig(steps=8, resume=True, **dict(base, out=str(tmp_path / "none"))),
            Target(model, ()),
            cfg,
            log=lambda _: None,
        )
