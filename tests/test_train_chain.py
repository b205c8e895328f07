"""`train mtp` / `train eagle`: the trainer's forward is the inference forward, and a short run on
a tiny target lowers the loss and writes a head its loader reads back."""

import json
import struct

from mlx_spec.eagle import load_eagle
from mlx_spec.errors import BadRequest
from mlx_spec.loading import MODELS_DIR
from mlx_spec.mtp import load_mtp
from mlx_spec.sampling import SamplingConfig
from mlx_spec.target import Target
from mlx_spec.train import chain
from mlx_spec.train.chain import (
    ChainTrainConfig,
    FeatureStore,
    Tokens,
    build_features,
    build_head,
    chain_counts,
    eagle_taps,
    loss_fn,
    make_batch,
    span_features,
    target_features,
    train_chain,
)

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, tiny_model
from mlx_lm.models import llama
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


@pytest.mark.parametrize(
    "kind,draft_vocab,softmax_vocab,store",
    [("mtp", 0, 0, False), ("mtp", 0, 48, True), ("eagle", 0, 0, False), ("eagle", 64, 0, True)],
)
def test_a_short_run_lowers_the_loss_and_writes_a_loadable_head(tmp_path, kind, draft_vocab, softmax_vocab, store):
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
    if store:
        full = Target(model, eagle_taps(cfg["num_hidden_layers"]), final_hidden=True)
        build_features(full, [str(tmp_path / "tokens.npz")], tmp_path / "feats", log=lambda _: None)
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
        softmax_vocab=softmax_vocab,
        vocab_negatives=8,
        features=str(tmp_path / "feats") if store else None,
    )
    target = Target(model, (), final_hidden=kind == "mtp")
    summary = train_chain(c, target, cfg, log=lambda _: None)

    log = json.loads((tmp_path / "run" / "ckpt" / "state.json").read_text())["log"]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]
    assert log[-1]["held_out"]["acc"][0] > 0.5
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
    with pytest.raises(BadRequest, match="no checkpoint"):
        train_chain(
            ChainTrainConfig(steps=8, resume=True, **dict(base, out=str(tmp_path / "none"))),
            Target(model, ()),
            cfg,
            log=lambda _: None,
        )


def _token_file(path, seqs, prompt_len, names):
    np.savez(
        path,
        tokens=np.concatenate(seqs).astype(np.uint16),
        offsets=np.cumsum([0] + [len(q) for q in seqs]),
        prompt_lens=np.full(len(seqs), prompt_len, np.int32),
        ids=np.array(names),
    )
    return str(path)


def _two_files(tmp_path, n=6):
    rng = np.random.default_rng(5)
    files, all_seqs = [], []
    for f in "ab":
        seqs = [rng.integers(0, VOCAB, size=int(rng.integers(20, 40))) for _ in range(n)]
        files.append(_token_file(tmp_path / f"{f}.npz", seqs, 5, [f"{f}{i}" for i in range(n)]))
        all_seqs.append(seqs)
    return files, all_seqs


def test_several_token_files_train_together_and_held_out_prompts_leave_the_training_set(tmp_path):
    (a, b), (sa, sb) = _two_files(tmp_path)
    # the held-out file: the target's responses to two prompts that are also in a and b
    held = [np.concatenate([sa[1][:5], [7, 8, 9, 10]]), np.concatenate([sb[4][:5], [1, 2, 3, 4]])]
    ev = _token_file(tmp_path / "heldout.npz", held, 5, ["h0", "h1"])
    data = Tokens(f"{a},{b}", eval_path=ev)
    assert data.dropped == ["a1", "b4"]
    assert [s.id for s in data.train] == [f"a{i}" for i in (0, 2, 3, 4, 5)] + [f"b{i}" for i in (0, 1, 2, 3, 5)]
    assert [s.id for s in data.test] == ["h0", "h1"] and [s.file for s in data.test] == [2, 2]
    for s in data.train:  # each sequence is its file's tokens at its offset
        want = (sa if s.file == 0 else sb)[int(s.id[1:])]
        np.testing.assert_array_equal(s.tokens, want)
        with np.load((a, b)[s.file]) as z:
            np.testing.assert_array_equal(z["tokens"][s.start : s.start + len(s.tokens)], want)
    plain = Tokens([a, b], held_out=3)  # without a held-out file: the last sequences of the last file
    assert [s.id for s in plain.test] == ["b3", "b4", "b5"] and len(plain.train) == 9
    model, cfg = tiny_model("llama")
    c = ChainTrainConfig(
        kind="mtp", tokens=f"{a},{b}", eval_tokens=ev, out=str(tmp_path / "run"), steps=2, batch_size=2, seq_len=16
    )
    summary = train_chain(c, Target(model, (), final_hidden=True), cfg, log=lambda _: None)
    assert summary["steps"] == 2 and summary["last"]["held_out"]["acc"]
    with pytest.raises(BadRequest, match="give one"):
        ChainTrainConfig(kind="mtp", tokens=a, eval_tokens=ev, held_out=4, out=str(tmp_path / "x"))


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_the_feature_store_gives_the_loss_the_target_recomputes(tmp_path, kind):
    """Windows that start inside a sequence read features computed over the whole sequence
    before them, from the store or from the target, to float16 rounding."""
    (a, b), _ = _two_files(tmp_path)
    model, cfg = tiny_model("llama")
    full = Target(model, eagle_taps(cfg["num_hidden_layers"]), final_hidden=True)
    build_features(full, [a, b], tmp_path / "feats", log=lambda _: None)
    data = Tokens(f"{a},{b}", held_out=2)
    target, head, _ = _setup(kind)
    store = FeatureStore(tmp_path / "feats", data.files, final=kind == "mtp", taps=head.taps)
    ids, mask, spans = make_batch(data.train, np.random.default_rng(3), 6, 16)
    assert any(sp.start > 0 for sp in spans) and {sp.seq.file for sp in spans} == {0, 1}
    stored = span_features(spans, 16, store=store)
    recomputed = span_features(spans, 16, target=target, head=head)
    np.testing.assert_allclose(np.array(stored), np.array(recomputed), rtol=2e-3, atol=2e-3)
    l1, a1 = loss_fn(head, stored, ids, mask, ttt=2, decay=0.8)
    l2, a2 = loss_fn(head, recomputed, ids, mask, ttt=2, decay=0.8)
    assert abs(float(l1) - float(l2)) < 1e-3 * float(l2)
    with pytest.raises(BadRequest, match="no features"):
        FeatureStore(tmp_path / "elsewhere", data.files, final=True)


def test_the_restricted_softmax_is_the_full_heads_logits_at_those_ids():
    target, head, _ = _setup("mtp")
    seq = [3, 17, 5, 40, 9, 77, 12, 8, 60, 2, 31, 99, 14, 6]
    ids = mx.array([seq])
    feats = target_features(target, head, ids)
    mask = mx.ones((1, len(seq) - 2))
    vocab = np.union1d(np.arange(0, VOCAB, 3), seq[2:]).astype(np.int32)
    full, sub = [], []
    loss_full, _ = loss_fn(head, feats, ids, mask, ttt=2, decay=0.5, capture=full)
    loss_sub, _ = loss_fn(
        head,
        feats,
        ids,
        mask,
        ttt=2,
        decay=0.5,
        capture=sub,
        softmax=(mx.array(vocab), target.head_rows(mx.array(vocab))),
    )
    want = 0.0
    for j in range(2):
        np.testing.assert_allclose(np.array(sub[j]), np.array(full[j])[..., vocab], rtol=1e-5, atol=1e-5)
        lg = np.array(full[j][0, :-1])
        restricted = lg[:, vocab]
        lse = np.log(np.exp(restricted - restricted.max(-1, keepdims=True)).sum(-1)) + restricted.max(-1)
        ce = lse - lg[np.arange(len(seq) - 2), seq[2:]]
        want += 0.5**j * ce[j:].mean()
    assert abs(float(loss_sub) - want / 1.5) < 1e-4
    assert float(loss_sub) < float(loss_full)  # fewer rows in the normalizer


def test_chain_acceptance_counts_an_anchor_only_while_every_earlier_depth_was_right():
    hits = [np.array([[1, 1, 0, 1, 1]]), np.array([[0, 0, 1, 1, 1]]), np.array([[0, 0, 1, 0, 1]])]
    mask = np.array([[1, 1, 1, 1, 0]])
    # anchors 0 and 1 have three response rows; both get depth 1 right, anchor 0 misses depth 2
    # (step 1, row 1) and is not counted at depth 3 though step 2 is right at its row 2
    counts, anchors = chain_counts(hits, mask)
    assert anchors == 2 and counts.tolist() == [2, 1, 0]


def test_an_interrupted_feature_build_resumes_to_the_same_store(tmp_path):
    (a, _), _ = _two_files(tmp_path)
    model, cfg = tiny_model("llama")
    full = Target(model, eagle_taps(cfg["num_hidden_layers"]), final_hidden=True)
    build_features(full, [a], tmp_path / "whole", batch_size=2, log=lambda _: None)

    def stop_after_first_flush(msg):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_features(full, [a], tmp_path / "cut", batch_size=2, flush_every=2, log=stop_after_first_flush)
    data = Tokens(a, held_out=1)
    with pytest.raises(BadRequest, match="incomplete"):
        FeatureStore(tmp_path / "cut", data.files, final=True)
    said = []
    build_features(full, [a], tmp_path / "cut", batch_size=2, flush_every=2, log=said.append)
    assert said[0].startswith(f"features: {a}: 4/6")  # continued after the first two
    for name in ("final.npy", "taps.npy"):
        (d,) = (tmp_path / "whole").iterdir()
        # the same rows; a resumed batch may pair sequences of another length (one float16 ulp)
        np.testing.assert_allclose(
            np.load(d / name), np.load(tmp_path / "cut" / d.name / name), rtol=2**-10, atol=2**-14
        )
    FeatureStore(tmp_path / "cut", data.files, final=False, taps=eagle_taps(cfg["num_hidden_layers"]))


def test_a_run_reads_a_store_still_being_built_and_recomputes_the_rest(tmp_path):
    (a, _), (sa, _) = _two_files(tmp_path)
    ev = _token_file(tmp_path / "heldout.npz", [np.arange(3, 30) % VOCAB], 5, ["h0"])
    model, cfg = tiny_model("llama")
    full = Target(model, eagle_taps(cfg["num_hidden_layers"]), final_hidden=True)
    build_features(full, [ev], tmp_path / "feats", log=lambda _: None)

    def stop(msg):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a third of the file stored
        build_features(full, [a], tmp_path / "feats", batch_size=2, flush_every=2, log=stop)
    data = Tokens(a, eval_path=ev)
    store = FeatureStore(tmp_path / "feats", data.files, final=True, partial=True)
    ready = [s.index for s in data.train if store.ready(s)]
    (d,) = [p for p in (tmp_path / "feats").iterdir() if p.name.startswith("a-")]
    assert sorted(ready) == sorted(np.load(d / "order.npy")[:2].tolist())  # the first block of a seeded order
    with pytest.raises(BadRequest, match="incomplete"):
        FeatureStore(tmp_path / "feats", data.files, final=True)
    c = ChainTrainConfig(
        kind="mtp", tokens=a, eval_tokens=ev, features=str(tmp_path / "feats"), grow=True,
        out=str(tmp_path / "run"), steps=3, batch_size=2, seq_len=16, eval_every=100,
    )  # fmt: skip
    said = []
    train_chain(c, Target(model, (), final_hidden=True), cfg, log=said.append)
    rows = [json.loads(m) for m in said if m.startswith("{")]
    assert [r["stored"] for r in rows] == [2, 2, 2]  # of the 6: the target recomputes the other 4
    # a stored sequence's window reads the store; an unstored one is recomputed, to the same
    # features (the store is float16)
    target = Target(model, (), final_hidden=True)
    head, _ = chain.build_head("mtp", target, cfg, 0, None)
    kept = next(s for s in data.train if store.ready(s))
    other = next(s for s in data.train if not store.ready(s))
    spans = [chain.Span(kept, 2, 12), chain.Span(other, 1, 12)]
    mixed = span_features(spans, 16, store=store, target=target, head=head)
    recomputed = span_features(spans, 16, target=target, head=head)
    np.testing.assert_allclose(np.array(mixed), np.array(recomputed), rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(np.array(mixed[0, :12]), store.window(kept, 2, 12).astype(np.float32))
    with pytest.raises(BadRequest, match="no features of sequence"):
        span_features(spans, 16, store=store)
    with pytest.raises(BadRequest, match="give --features"):
        ChainTrainConfig(kind="mtp", tokens=a, out=str(tmp_path / "x"), grow=True)


# The embedded target's architecture (SmolLM2-135M-Instruct's config.json): built lazily, so no
# weight is materialized, to check the shipped heads fit it.
EMBEDDED = dict(
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def _float_dtypes(path):
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {v["dtype"] for k, v in header.items() if k not in ("__metadata__", "d2t", "t2d")}


def test_the_shipped_heads_load_strictly_against_the_embedded_target():
    model = llama.Model(llama.ModelArgs.from_dict(EMBEDDED))
    eagle_dir, mtp_dir = MODELS_DIR / "smollm2-135m-eagle3", MODELS_DIR / "smollm2-135m-mtp"
    d, cfg = load_eagle(eagle_dir)
    d.bind(Target(model, ()))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and d.args.layout == "eagle"
    assert d.taps == (1, 14, 26) and d.draft_ids.shape == (8192,)  # EAGLE layer ids 2, 15, 27
    head = load_mtp(mtp_dir, Target(model, (), final_hidden=True))
    assert head.kind == "mtp" and head.vocab_size == 49152
    for folder in (eagle_dir, mtp_dir):
        (weights,) = folder.glob("*.safetensors")
        assert _float_dtypes(weights) == {"F16"} and weights.stat().st_size < 40 << 20
        assert (folder / "README.md").is_file()


def test_a_feature_build_advances_its_files_together(tmp_path):
    """What is stored at any point is a fair sample of all the files (for --grow)."""
    (a, b), _ = _two_files(tmp_path)
    model, cfg = tiny_model("llama")
    full = Target(model, eagle_taps(cfg["num_hidden_layers"]), final_hidden=True)
    said = []

    def stop_after_three_blocks(msg):
        said.append(msg)
        if len(said) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_features(full, [a, b], tmp_path / "feats", batch_size=2, flush_every=2, log=stop_after_three_blocks)
    assert [m.split(" sequences")[0] for m in said] == [
        f"features: {a}: 2/6",
        f"features: {b}: 2/6",
        f"features: {a}: 4/6",
    ]


@pytest.mark.slow
def test_the_shipped_heads_draft_the_real_targets_held_out_responses():
    """The shipped heads on the real embedded target, through the inference path (add_context,
    propose, rollback): 3-deep greedy chains along held-out responses the target wrote."""
    from mlx_spec.default_target import DEFAULT_TARGET_ID
    from mlx_spec.loading import load_target_model

    model, _ = load_target_model(DEFAULT_TARGET_ID)
    data = Tokens(
        str(MODELS_DIR / "smollm2-135m-dflash2" / "data" / "tokens-v2.npz"),
        eval_path=str(MODELS_DIR / "smollm2-135m-dflash2" / "data" / "eval_tokens.npz"),
    )
    d, _ = load_eagle(MODELS_DIR / "smollm2-135m-eagle3")
    d.bind(Target(model, ()))
    mtp_target = Target(model, (), final_hidden=True)
    heads = [(Target(model, d.taps), d), (mtp_target, load_mtp(MODELS_DIR / "smollm2-135m-mtp", mtp_target))]
    for target, head in heads:
        first = []
        for s in data.test[:4]:
            feats = target_features(target, head, mx.array(s.tokens[None]))
            cache = head.make_cache()
            P = s.prompt_len
            head.add_context(feats[:, :P], mx.array(s.tokens[:P]), cache)
            for t in range(P, len(s.tokens) - 4):  # anchor t: the committed token at t, drafts t + 1..
                prop = head.propose(mx.array(int(s.tokens[t])), 3, cache)
                first.append(int(prop.tokens[0]) == int(s.tokens[t + 1]))
                head.rollback(cache)
                head.add_context(feats[:, t : t + 1], mx.array(s.tokens[t : t + 1]), cache)
        assert np.mean(first) > 0.3, (head.kind, np.mean(first))
