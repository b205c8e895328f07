"""`mlx_spec train`: data shards, anchors and masks, losses, identity init, checkpoints."""

import json
from dataclasses import replace

from mlx_spec.drafter import DFLASH1, Drafter, DrafterArgs
from mlx_spec.loading import load_drafter, load_target_model
from mlx_spec.target import Target
from mlx_spec.train.data import DataConfig, Dataset, build_dataset, export_tokens, featurize_tokens
from mlx_spec.train.prompts import builtin_prompts
from mlx_spec.train.trainer import (
    RECIPE_FIELDS,
    Recipe,
    TrainConfig,
    block_attention_mask,
    block_hidden,
    build_drafter,
    drafter_config,
    load_checkpoint,
    loss_fn,
    loss_weights,
    make_batch,
    make_optimizer,
    sample_anchors,
    save_checkpoint,
    to_mx,
    train,
    train_step,
)

import mlx.core as mx
import numpy as np
import pytest
from helpers import save_tiny_pair
from mlx.utils import tree_flatten

TAPS = [0, 2]
MASK = 127


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tdir, _ = save_tiny_pair(root)
    model, tok = load_target_model(str(tdir))
    target = Target(model, TAPS)
    prompts = builtin_prompts(10, seed=0)
    build_dataset(target, tok, prompts[:8], root / "data", DataConfig(max_tokens=24, batch_size=4, top_k=4))
    (root / "data" / "eval_prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p.text[:16]}) for p in prompts[8:])
    )
    return root, tdir, model, tok, target


def _cfg(root, tdir, **kw):
    """A TrainConfig; keyword arguments that name a Recipe field go to its recipe."""
    base = dict(
        data=str(root / "data"),
        out=str(root / "run"),
        target=str(tdir),
        layers=1,
        intermediate_size=64,
        selector_rank=16,
        selector_top_k=8,
        mask_token_id=MASK,
        steps=4,
        seqs_per_step=2,
        anchors=6,
        checkpoint_every=2,
        eval_prompts=0,
        lr=3e-3,
    )
    base.update(kw)
    recipe = Recipe(**{k: base.pop(k) for k in list(base) if k in RECIPE_FIELDS})
    return TrainConfig(**base, recipe=recipe)


def _drafter(target, cfg, seed=0):
    mx.random.seed(seed)
    d = build_drafter(drafter_config(target.args, cfg, TAPS, MASK), target)
    mx.eval(d.parameters())
    return d


def test_data_shards_resume_and_tokens_roundtrip(env, tmp_path):
    root, tdir, model, tok, target = env
    data = Dataset.load(root / "data")
    assert len(data) == 8
    for toks, p, f in zip(data.tokens, data.prompt_lens, data.features):
        full = target(mx.array(toks)[None], target.make_cache()).hidden[0]
        assert np.abs(np.array(full[:-1]) - f[:-1].astype(np.float32)).max() < 5e-2
        assert len(toks) > p
    # A rerun skips every done prompt; featurizing the exported ids gives the same features.
    before = sorted((root / "data" / "shards").iterdir())
    build_dataset(
        target, tok, builtin_prompts(10, seed=0)[:8], root / "data", DataConfig(max_tokens=24, batch_size=4, top_k=4)
    )
    assert sorted((root / "data" / "shards").iterdir()) == before
    export_tokens(root / "data", tmp_path / "tokens.npz")
    featurize_tokens(target, tmp_path / "tokens.npz", tmp_path / "re", top_k=4)
    re = Dataset.load(tmp_path / "re")
    by_id = dict(zip(re.ids, range(len(re))))
    for i, sid in enumerate(data.ids):
        j = by_id[sid]
        assert (re.tokens[j] == data.tokens[i]).all()
        assert np.abs(re.features[j].astype(np.float32) - data.features[i].astype(np.float32)).max() < 5e-2


def test_anchors_and_mask():
    rng = np.random.default_rng(0)
    a = sample_anchors(10, 30, 8, rng)
    assert len(a) == 8 and (np.diff(a) > 0).all() and a.min() >= 10 and a.max() <= 28
    assert list(sample_anchors(10, 13, 8, rng)) == [10, 11]
    m = block_attention_mask(np.array([3, 7]), S=9, B=4, causal=False)[:, 0]
    assert m.shape == (2, 4, 13)
    assert m[0, :, :3].all() and not m[0, :, 3:9].any() and m[0, :, 9:].all()
    assert m[1, :, :7].all() and not m[1, :, 7:9].any()
    c = block_attention_mask(np.array([3]), S=9, B=4, causal=True)[0, 0, :, 9:]
    assert (c == np.tril(np.ones((4, 4), bool))).all()


def test_decay_weights():
    w = loss_weights(8, 4.0)
    assert w.shape == (7,) and w[0] == 1.0
    assert np.allclose(w[1:] / w[:-1], np.exp(-1 / 4.0))


@pytest.mark.parametrize("causal", [False, True])
def test_training_forward_equals_inference_and_blocks_are_isolated(env, causal):
    """Each training block == the drafter's own inference pass over the context before its anchor."""
    root, tdir, model, tok, target = env
    cfg = _cfg(root, tdir, attention="causal" if causal else "bidirectional").recipe
    d = _drafter(target, cfg)
    # Random (non-identity) conv and selector weights so DFlash 2 paths are exercised.
    mx.random.seed(3)
    for layer in d.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.random.normal(conv.base_kernel.shape)
            conv.kernel_projection.weight = 0.1 * mx.random.normal(conv.kernel_projection.weight.shape)
    data = Dataset.load(root / "data")
    batch = make_batch(data, np.random.default_rng(1), cfg, MASK)
    b = to_mx(batch, cfg)
    h = block_hidden(d, b["features"], b["blocks"], b["anchors"], b["seq"], b["mask"])
    for n in range(len(batch.anchors)):
        a, s = int(batch.anchors[n]), int(batch.seq[n])
        ctx = b["features"][s : s + 1, :a]
        ref = d.hidden(b["blocks"][n : n + 1], ctx, d.make_cache())[0]
        assert mx.abs(h[n] - ref).max().item() < 1e-4, n
    # Changing the anchor's own features, later context, or another block changes nothing.
    n = len(batch.anchors) // 2
    a, s = int(batch.anchors[n]), int(batch.seq[n])
    feats = np.array(batch.features)
    feats[s, a:] += 5.0
    blocks = np.array(batch.blocks)
    others = np.arange(len(blocks)) != n
    blocks[others, 0] = (blocks[others, 0] + 1) % 100
    h2 = block_hidden(d, mx.array(feats), mx.array(blocks), b["anchors"], b["seq"], b["mask"])
    assert mx.abs(h2[n] - h[n]).max().item() < 1e-5
    assert mx.abs(h2 - h).max().item() > 1e-3


def test_loss_reduction_matches_brute_force(env):
    root, tdir, model, tok, target = env
    cfg = _cfg(root, tdir, no_selector=True).recipe
    d = _drafter(target, cfg)
    batch = make_batch(Dataset.load(root / "data"), np.random.default_rng(2), cfg, MASK)
    b = to_mx(batch, cfg)
    loss, (ce, sel, wsum, _) = loss_fn(d, b, cfg)
    logits = np.array(d.logits(block_hidden(d, b["features"], b["blocks"], b["anchors"], b["seq"], b["mask"])[:, 1:]))
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    per = lse - np.take_along_axis(logits, batch.labels[..., None], -1)[..., 0]
    expect = (batch.weights * per).sum() / batch.weights.sum()
    assert abs(loss.item() - expect) < 1e-4 and sel.item() == 0.0
    assert abs(wsum.item() - batch.weights.sum()) < 1e-5
    # Weights follow the decay, zero past the sequence end.
    full = batch.weights[batch.weights[:, -1] > 0][0]
    assert np.allclose(full, loss_weights(cfg.block_size, cfg.decay))
    # KL over the target's top-K is >= 0 and the selector adds a positive K-way CE.
    kl, _ = loss_fn(d, b, replace(cfg, loss="kl"))
    assert kl.item() > 0
    _, (_, sel2, _, _) = loss_fn(d, b, replace(cfg, no_selector=False))
    assert sel2.item() > 0


def test_identity_init_equals_dflash1_backbone(env):
    root, tdir, model, tok, target = env
    cfg = _cfg(root, tdir).recipe
    d2 = _drafter(target, cfg)
    c1 = drafter_config(target.args, replace(cfg, no_conv=True, no_selector=True), TAPS, MASK)
    assert c1["architectures"] == [DFLASH1]
    d1 = Drafter(DrafterArgs.from_config(c1)).bind(target.embed, target.head)
    backbone = [(k, v) for k, v in tree_flatten(d2.parameters()) if "conv" not in k and "candidate_selector" not in k]
    d1.load_weights(backbone, strict=True)
    block = mx.array([[5] + [MASK] * 7])
    feats = mx.random.normal((1, 9, 2 * 64))
    h1 = d1.hidden(block, feats, d1.make_cache())
    h2 = d2.hidden(block, feats, d2.make_cache())
    assert mx.abs(h1 - h2).max().item() < 1e-5
    p1 = d1.propose(mx.array(5), feats, d1.make_cache(), 8)
    p2 = d2.propose(mx.array(5), feats, d2.make_cache(), 8)
    assert p1.tokens.tolist() == p2.tokens.tolist()


def test_training_lowers_loss(env):
    root, tdir, model, tok, target = env
    cfg = _cfg(root, tdir).recipe
    d = _drafter(target, cfg)
    opt = make_optimizer(cfg, 30)
    b = to_mx(make_batch(Dataset.load(root / "data"), np.random.default_rng(0), cfg, MASK), cfg)
    first = loss_fn(d, b, cfg)[0].item()
    for _ in range(15):
        train_step(d, opt, b, cfg)
    assert loss_fn(d, b, cfg)[0].item() < 0.8 * first


def test_checkpoint_resume_is_exact(env, tmp_path):
    root, tdir, model, tok, target = env
    cfg = _cfg(root, tdir, out=str(tmp_path / "run"), steps=5).recipe
    data = Dataset.load(root / "data")

    def fresh():
        return _drafter(target, cfg), make_optimizer(cfg, 5), np.random.default_rng(0)

    def step(d, opt, rng):
        return train_step(d, opt, to_mx(make_batch(data, rng, cfg, MASK), cfg), cfg)[0].item()

    d, opt, rng = fresh()
    for _ in range(2):
        step(d, opt, rng)
    config = drafter_config(target.args, cfg, TAPS, MASK)
    save_checkpoint(tmp_path / "run", d, config, opt, {"step": 2, "rng": rng.bit_generator.state})
    want = step(d, opt, rng)
    d2, opt2, rng2 = fresh()
    st = load_checkpoint(tmp_path / "run", d2, opt2)
    rng2.bit_generator.state = st["rng"]
    assert step(d2, opt2, rng2) == want
    for (k, a), (_, b) in zip(tree_flatten(d.parameters()), tree_flatten(d2.parameters())):
        assert mx.array_equal(a, b), k


def test_train_end_to_end_loads_strictly(env, tmp_path):
    root, tdir, model, tok, target = env
    cfg = _cfg(
        root,
        tdir,
        out=str(tmp_path / "run"),
        steps=4,
        eval_prompts=1,
        eval_max_tokens=8,
        export=str(tmp_path / "export"),
    )
    out = train(cfg)
    assert out["step"] == 4 and out["evals"][0]["tau"] >= 1.0
    assert (tmp_path / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    d, config = load_drafter(tmp_path / "export")
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert set(config["dflash_config"]) >= {
        "mask_token_id",
        "target_layer_ids",
        "block_size",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    }
    st = mx.load(str(tmp_path / "export" / "model.safetensors"))
    assert all(v.dtype == mx.float16 for v in st.values())
    assert "candidate_selector.successor_codebook" in st and not any("embed" in k or "lm_head" in k for k in st)
    # Resume continues to a larger step count.
    out2 = train(replace(cfg, steps=6, resume=True))
    assert out2["step"] == 6
    # `train eval` measures the exported drafter by block size and prompt kind.
    import subprocess
    import sys

    pf = tmp_path / "held.jsonl"
    pf.write_text('{"id": "code-1", "prompt": "def f"}\n{"id": "prose-1", "prompt": "the sea"}\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_spec",
            "train",
            "eval",
            "--target",
            str(tdir),
            "--drafter",
            str(tmp_path / "export"),
            "--prompts",
            str(pf),
            "--blocks",
            "2,4",
            "--max-tokens",
            "6",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    ev = json.loads(r.stdout)
    assert [row["block"] for row in ev["rows"]] == [2, 4] and ev["prompts"] == 2
    assert all(row["tau"] >= 1.0 and set(row["tau_by_kind"]) == {"code", "prose"} for row in ev["rows"])


def test_draft_vocab_with_every_id_equals_full_softmax(env):
    from mlx_spec.train.trainer import base_vocab, head_weight, step_vocab

    root, tdir, model, tok, target = env
    cfg = _cfg(root, tdir, draft_vocab=16, vocab_negatives=4).recipe
    d = _drafter(target, cfg)
    data = Dataset.load(root / "data")
    rng = np.random.default_rng(0)
    nb = make_batch(data, rng, cfg, MASK)
    v = step_vocab(nb, base_vocab(data, 16), 128, 4, rng)
    assert np.isin(nb.labels[nb.weights > 0], v).all() and len(v) < 128
    for loss in ("ce", "kl"):
        c = replace(cfg, loss=loss)
        full = loss_fn(d, to_mx(nb, c), c)[0].item()
        every = loss_fn(d, to_mx(nb, c, np.arange(128, dtype=np.int32), head_weight(target)), c)[0].item()
        assert abs(full - every) < 1e-4
        part = loss_fn(d, to_mx(nb, c, v, head_weight(target)), c)[0].item()
        assert part <= full + 1e-5  # fewer competitors, lower (or equal) loss


def test_wide_prompts_are_distinct_and_exclude(tmp_path):
    from collections import Counter

    from mlx_spec.train.prompts import wide_prompts

    narrow = builtin_prompts(1500, seed=0)
    assert len({p.text for p in narrow}) < 1300  # the narrow mix repeats itself (why "wide" exists)
    used = {p.text for p in narrow}
    wide = wide_prompts(1500, seed=1, exclude=used)
    assert len({p.text for p in wide}) == 1500 and not used & {p.text for p in wide}
    kinds = Counter(p.kind for p in wide)
    assert kinds["code"] == 600 and kinds["prose"] > 400 and sum(kinds.values()) == 1500
    assert [p.text for p in wide_prompts(50, seed=1)] == [p.text for p in wide_prompts(50, seed=1)]
    # deterministic across processes too: no object addresses in signatures
    from mlx_spec.train.prompts import stdlib_functions, stdlib_methods

    assert not [s for _, s, _ in stdlib_functions() + stdlib_methods() if "0x" in s]


def test_held_out_prompts_are_never_trained_on():
    from mlx_spec.train.prompts import split_held_out

    allp = builtin_prompts(1516, seed=0)  # the shipped drafter's first data: it repeats itself
    assert {p.text for p in allp[:1500]} & {p.text for p in allp[1500:]}  # the leak this closes
    train, held = split_held_out(allp, 1500)
    assert held == allp[1500:] and not {p.text for p in train} & {p.text for p in held}
    assert len({p.text for p in train}) == len(train) < 1500


def test_several_data_dirs_train_together(env, tmp_path):
    from mlx_spec.train.data import load_datasets

    root, tdir, model, tok, target = env
    build_dataset(
        target,
        tok,
        builtin_prompts(12, seed=3)[:4],
        tmp_path / "more",
        DataConfig(max_tokens=16, batch_size=4, top_k=4),
    )
    both, taps = load_datasets(f"{root / 'data'},{tmp_path / 'more'}")
    assert len(both) == 12 and taps == TAPS and sum(x.startswith("1:") for x in both.ids) == 4
    # a run resumes with a grown data set
    cfg = _cfg(root, tdir, out=str(tmp_path / "run"), steps=2, checkpoint_every=2)
    train(cfg)
    train(
        _cfg(
            root,
            tdir,
            out=str(tmp_path / "run"),
            steps=4,
            checkpoint_every=2,
            resume=True,
            data=f"{root / 'data'},{tmp_path / 'more'}",
        )
    )
    assert json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["step"] == 4
    other = Target(model, [1, 3])
    build_dataset(
        other,
        tok,
        builtin_prompts(12, seed=3)[:4],
        tmp_path / "taps13",
        DataConfig(max_tokens=8, batch_size=4, top_k=4),
    )
    from mlx_spec.errors import BadRequest

    with pytest.raises(BadRequest, match="cannot be mixed"):
        load_datasets([root / "data", tmp_path / "taps13"])


def test_eval_prompts_that_were_trained_on_are_dropped(env, tmp_path):
    from mlx_spec.train.trainer import drop_trained, eval_prompts

    root, tdir, model, tok, target = env
    trained = builtin_prompts(10, seed=0)[:8]
    f = tmp_path / "held.jsonl"
    f.write_text(
        json.dumps({"id": "code-a", "prompt": trained[3].text})
        + "\n"
        + json.dumps({"id": "prose-b", "prompt": "a prompt nobody trained on"})
        + "\n"
    )
    prompts = eval_prompts(f, 10)
    assert [p.id for p in prompts] == ["code-a", "prose-b"]
    keep, dropped = drop_trained(prompts, Dataset.load(root / "data"), tok)
    assert [p.id for p in keep] == ["prose-b"] and [p.id for p in dropped] == ["code-a"]
    assert len(eval_prompts(root / "data", 10)) == 2  # a data dir means its eval_prompts.jsonl


def test_draft_vocab_training_ships_its_vocabulary(env, tmp_path):
    from mlx_spec.loading import load_pair
    from mlx_spec.train.trainer import base_vocab, export_checkpoint

    root, tdir, model, tok, target = env
    train(_cfg(root, tdir, out=str(tmp_path / "run"), steps=2, checkpoint_every=2, draft_vocab=16, vocab_negatives=4))
    want = base_vocab(Dataset.load(root / "data"), 16).tolist()
    assert json.loads((tmp_path / "run" / "ckpt" / "draft_vocab.json").read_text())["ids"] == want
    export_checkpoint(tmp_path / "run", tmp_path / "export")
    pair = load_pair(str(tdir), str(tmp_path / "export"))
    assert pair.drafter.vocab.ids.tolist() == want
    # a run trained over the full vocabulary ships none
    train(_cfg(root, tdir, out=str(tmp_path / "full"), steps=2, checkpoint_every=2))
    assert not (tmp_path / "full" / "ckpt" / "draft_vocab.json").exists()


def test_train_resumes_from_a_literal_older_train_config(env, tmp_path):
    """A train_config.json as the older TrainConfig wrote it (recipe fields flat, evals 4 x 96),
    literally: `train --resume` accepts it (compared field by field) and refuses a recipe change
    by its name."""
    from mlx_spec.errors import BadRequest

    root, tdir, *_ = env
    out = tmp_path / "run"
    cfg = _cfg(root, tdir, out=str(out), steps=2, checkpoint_every=2)
    train(cfg)
    old = {
        "data": cfg.data,
        "out": str(out),
        "target": str(tdir),
        "resume": False,
        "init": None,
        "init_target_layers": False,
        "layers": 1,
        "intermediate_size": 64,
        "block_size": 8,
        "no_conv": False,
        "no_selector": False,
        "selector_rank": 16,
        "selector_top_k": 8,
        "mask_token_id": MASK,
        "loss": "ce",
        "attention": "bidirectional",
        "corruption": "full",
        "gamma": None,
        "selector_weight": 1.0,
        "draft_vocab": 0,
        "vocab_negatives": 1024,
        "steps": 2,
        "seqs_per_step": 2,
        "anchors": 6,
        "lr": 3e-3,
        "warmup": 0.04,
        "weight_decay": 0.01,
        "clip": 1.0,
        "seed": 0,
        "checkpoint_every": 2,
        "checkpoint_minutes": None,
        "eval_prompts": 4,
        "eval_max_tokens": 96,
        "eval_file": None,
        "export": None,
    }
    (out / "train_config.json").write_text(json.dumps(old))
    with pytest.raises(BadRequest, match=r"recipe\.lr"):
        train(replace(cfg, resume=True, steps=4, recipe=replace(cfg.recipe, lr=1e-3)))
    (out / "train_config.json").write_text(json.dumps(old))
    assert train(replace(cfg, resume=True, steps=4))["step"] == 4
    assert "recipe" in json.loads((out / "train_config.json").read_text())  # rewritten in the current layout
