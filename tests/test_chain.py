"""Chain drafters (MTP heads, EAGLE-3): strict loading in each published layout, and the chain
itself against a step-by-step reference that recomputes everything without a cache."""

import json

from mlx_spec.chain import ChainDrafter
from mlx_spec.eagle import Eagle3, Eagle3Args, eagle_config, load_eagle
from mlx_spec.errors import CheckpointError, IncompatiblePair, UnsupportedModel
from mlx_spec.mtp import load_mtp
from mlx_spec.sampling import SamplingConfig, target_probs
from mlx_spec.target import Target

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, make_eagle, tiny_model, write_mtp_checkpoint
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model
from test_hybrid import build

PROMPT = [1, 5, 9, 17, 33, 2, 8, 40, 77, 3]


def prefill(target: Target, ids):
    cache = target.make_cache()
    out = target(mx.array([ids]), cache)
    return cache, out


def feats_of(drafter, out):
    return out.final if drafter.final_hidden else out.hidden


def reference(head, feats, ids, anchor, k, feed=None):
    """Chain of k passes recomputed from scratch each pass (no cache). ``feed``: the tokens to
    feed after each pass (the proposal's, at T > 0); else the argmax. Returns (tokens, logits)."""
    h = head.fuse(feats)
    seq_ids = list(ids[1:]) + [int(anchor)]
    toks, logits = [], []
    for j in range(k):
        out, lg = head.step(h, mx.array([seq_ids]), [None] * head.n_layers, "causal")
        row = lg[0, -1]
        tok = int(feed[j]) if feed is not None else int(mx.argmax(row))
        if feed is None and head.draft_ids is not None:
            tok = int(head.draft_ids[tok])
        logits.append(row)
        toks.append(tok)
        h = mx.concatenate([h, out[:, -1:]], axis=1)
        seq_ids.append(tok)
    return toks, mx.stack(logits)


MTP_KINDS = [("qwen3", False), ("qwen3_next", True), ("qwen3_5", False), ("qwen3_5_moe", False)]


@pytest.fixture(scope="module", params=MTP_KINDS, ids=[k for k, _ in MTP_KINDS])
def mtp_pair(request, tmp_path_factory):
    kind, per_expert = request.param
    root, model, _ = write_mtp_checkpoint(tmp_path_factory.mktemp(kind), kind, per_expert)
    target = Target(model, (), final_hidden=True)
    return root, target, load_mtp(root, target)


EAGLE_CASES = [("eagle", False), ("eagle", True), ("speculators", False), ("speculators", True)]


@pytest.fixture(scope="module", params=EAGLE_CASES, ids=[f"{a}-{'d2t' if b else 'full'}" for a, b in EAGLE_CASES])
def eagle_pair(request, tmp_path_factory):
    layout, reduced = request.param
    root = tmp_path_factory.mktemp(f"eagle-{layout}")
    model, _ = make_eagle(root, layout, reduced)
    d, _ = load_eagle(root)
    d.bind(Target(model, ()))
    return root, Target(model, d.taps), d


def _check_chain(target, head, k=4):
    cache_t, out = prefill(target, PROMPT)
    anchor = int(mx.argmax(out.logits[0, -1]))
    cache = head.make_cache()
    head.add_context(feats_of(head, out), mx.array(PROMPT), cache)
    prop = head.propose(mx.array(anchor), k, cache)
    ref, _ = reference(head, feats_of(head, out)[0:1], PROMPT, anchor, k)
    assert prop.tokens.tolist() == ref
    return cache_t, out, cache, anchor, prop


def test_mtp_propose_equals_a_step_by_step_recompute(mtp_pair):
    _, target, head = mtp_pair
    assert isinstance(head, ChainDrafter)
    _check_chain(target, head)
    assert head.pass_count >= 4


def test_eagle_propose_equals_a_step_by_step_recompute(eagle_pair):
    _, target, d = eagle_pair
    _, _, _, _, prop = _check_chain(target, d)
    if d.draft_ids is not None:
        allowed = set(d.draft_ids.tolist())
        assert set(prop.tokens.tolist()) <= allowed


def _rollback_equals_fresh(target, head, accepted: int, k: int = 4):
    cache_t, _, cache, anchor, prop = _check_chain(target, head, k)
    drafts = prop.tokens.tolist()
    block = [anchor] + drafts
    vout = target(mx.array([block]), cache_t, record=True)
    bonus = int(mx.argmax(vout.logits[0, accepted]))
    target.rollback(cache_t, len(block), accepted + 1)
    head.rollback(cache)
    f = feats_of(head, vout)[:, : accepted + 1]
    head.add_context(f, mx.array(block[: accepted + 1]), cache)
    got = head.propose(mx.array(bonus), k, cache)
    # a fresh cache fed every committed row at once
    committed = PROMPT + block[: accepted + 1]
    _, full = prefill(target, committed)
    fresh = head.make_cache()
    head.add_context(feats_of(head, full), mx.array(committed), fresh)
    want = head.propose(mx.array(bonus), k, fresh)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert cache.offset == fresh.offset


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_mtp_rollback_then_propose_equals_a_fresh_cache(mtp_pair, accepted):
    _, target, head = mtp_pair
    _rollback_equals_fresh(target, head, accepted)


@pytest.mark.parametrize("accepted", [0, 3])
def test_eagle_rollback_then_propose_equals_a_fresh_cache(eagle_pair, accepted):
    _, target, d = eagle_pair
    _rollback_equals_fresh(target, d, accepted)


def _check_probs(target, head):
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    _, out = prefill(target, PROMPT)
    anchor = int(mx.argmax(out.logits[0, -1]))
    cache = head.make_cache()
    head.add_context(feats_of(head, out), mx.array(PROMPT), cache)
    prop = head.propose(mx.array(anchor), 3, cache, sampling=cfg, key=mx.random.key(7))
    assert prop.q.shape == (3, VOCAB)
    np.testing.assert_allclose(np.array(prop.q.sum(axis=-1)), 1.0, atol=1e-5)
    _, logits = reference(head, feats_of(head, out), PROMPT, anchor, 3, feed=prop.tokens.tolist())
    want = target_probs(logits, cfg)
    if head.draft_ids is not None:
        want = mx.zeros((3, VOCAB)).at[:, head.draft_ids].add(want)
        assert float(prop.q[:, [i for i in range(VOCAB) if i not in set(head.draft_ids.tolist())]].sum()) == 0
    np.testing.assert_allclose(np.array(prop.q), np.array(want), atol=2e-5)
    for j, t in enumerate(prop.tokens.tolist()):
        assert float(prop.q[j, t]) > 0


def test_mtp_proposal_probabilities_match_its_logits(mtp_pair):
    _, target, head = mtp_pair
    _check_probs(target, head)


def test_eagle_proposal_probabilities_match_its_logits(eagle_pair):
    _, target, d = eagle_pair
    _check_probs(target, d)


# -- strict loading --------------------------------------------------------------------------


def _edit_mtp(root, fn):
    f = root / "model-mtp.safetensors"
    w = dict(mx.load(str(f)))
    fn(w)
    mx.save_safetensors(str(f), w)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_mtp_loading_names_a_missing_extra_or_misshapen_tensor(tmp_path, kind):
    root, model, _ = write_mtp_checkpoint(tmp_path, kind, per_expert=kind == "qwen3_next")
    target = Target(model, (), final_hidden=True)
    load_mtp(root, target)
    _edit_mtp(root, lambda w: w.pop("mtp.pre_fc_norm_hidden.weight"))
    with pytest.raises(CheckpointError, match=r"missing from the file: mtp\.pre_fc_norm_hidden\.weight"):
        load_mtp(root, target)
    _edit_mtp(
        root,
        lambda w: w.update(
            {"mtp.pre_fc_norm_hidden.weight": mx.ones((64,)), "mtp.layers.0.surplus.weight": mx.ones((4,))}
        ),
    )
    with pytest.raises(CheckpointError, match=r"unused tensors in the file: mtp\.layers\.0\.surplus\.weight"):
        load_mtp(root, target)
    _edit_mtp(root, lambda w: (w.pop("mtp.layers.0.surplus.weight"), w.update({"mtp.fc.weight": mx.ones((64, 64))})))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight file \(64, 64\) vs model \(64, 128\)"):
        load_mtp(root, target)


def test_a_stripped_conversion_is_refused_for_mtp_with_the_way_out(tmp_path):
    model, cfg = build("qwen3_next")
    save_model(tmp_path, model)
    save_config(dict(cfg), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="has no mtp.* tensors: this conversion stripped") as e:
        load_mtp(tmp_path, Target(model, (), final_hidden=True), hint="Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert "Qwen/Qwen3-Next-80B-A3B-Instruct" in str(e.value)


def test_mtp_is_refused_for_a_target_without_the_final_hidden(tmp_path):
    root, model, _ = write_mtp_checkpoint(tmp_path, "qwen3")
    with pytest.raises(UnsupportedModel, match="final_hidden"):
        load_mtp(root, Target(model, ()))


def test_deepseek_mtp_layout_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}))
    model, _ = tiny_model("qwen3")
    with pytest.raises(UnsupportedModel, match="deepseek_v3.*eh_proj"):
        load_mtp(tmp_path, Target(model, (), final_hidden=True))


def test_original_form_norms_are_shifted_like_mlx_lm_shifts_the_target(tmp_path):
    """A Qwen3-Next checkpoint in its original form (per-expert target tensors) stores norms as
    weight - 1; the MTP norms get mlx-lm's +1, a converted one does not."""
    root, model, head = write_mtp_checkpoint(tmp_path, "qwen3_next")
    target = Target(model, (), final_hidden=True)
    plain = load_mtp(root, target)
    np.testing.assert_allclose(np.array(plain.norm.weight), np.array(head.norm.weight))
    mx.save_safetensors(
        str(root / "extra.safetensors"), {"model.layers.0.mlp.experts.0.up_proj.weight": mx.zeros((2, 2))}
    )
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"mtp.fc.weight": "model-mtp.safetensors"}})
    )
    shifted = load_mtp(root, target)
    np.testing.assert_allclose(np.array(shifted.norm.weight), np.array(head.norm.weight) + 1, atol=1e-6)


def _edit_eagle(root, fn):
    f = root / "model.safetensors"
    w = dict(mx.load(str(f)))
    fn(w)
    mx.save_safetensors(str(f), w)


@pytest.mark.parametrize("layout,layer", [("eagle", "midlayer"), ("speculators", "layers.0")])
def test_eagle_loading_names_a_missing_extra_or_misshapen_tensor(tmp_path, layout, layer):
    make_eagle(tmp_path, layout, reduced=True)
    load_eagle(tmp_path)
    _edit_eagle(tmp_path, lambda w: w.pop(f"{layer}.hidden_norm.weight"))
    with pytest.raises(CheckpointError, match=rf"missing from the file: {layer}\.hidden_norm\.weight"):
        load_eagle(tmp_path)
    _edit_eagle(
        tmp_path, lambda w: w.update({f"{layer}.hidden_norm.weight": mx.ones((64,)), f"{layer}.bogus": mx.ones((3,))})
    )
    with pytest.raises(CheckpointError, match=rf"unused tensors in the file: {layer}\.bogus"):
        load_eagle(tmp_path)
    _edit_eagle(
        tmp_path, lambda w: (w.pop(f"{layer}.bogus"), w.update({f"{layer}.self_attn.q_proj.weight": mx.ones((64, 64))}))
    )
    with pytest.raises(
        CheckpointError, match=rf"{layer}\.self_attn\.q_proj\.weight file \(64, 64\) vs model \(64, 128\)"
    ):
        load_eagle(tmp_path)


def test_eagle_reduced_vocabulary_without_d2t_is_refused(tmp_path):
    make_eagle(tmp_path, "eagle", reduced=True)
    _edit_eagle(tmp_path, lambda w: (w.pop("d2t"), w.pop("t2d")))
    with pytest.raises(CheckpointError, match="no d2t"):
        load_eagle(tmp_path)


def test_eagle_d2t_that_disagrees_with_t2d_is_refused(tmp_path):
    make_eagle(tmp_path, "speculators", reduced=True)

    def flip(w):
        t2d = np.array(w["t2d"])
        t2d[np.argmax(~t2d)] = True
        w["t2d"] = mx.array(t2d)

    _edit_eagle(tmp_path, flip)
    with pytest.raises(CheckpointError, match="t2d does not mark exactly"):
        load_eagle(tmp_path)


def test_the_two_eagle_layouts_draft_the_same_tokens(tmp_path):
    model, _ = make_eagle(tmp_path / "a", "eagle", reduced=True, seed=9)
    make_eagle(tmp_path / "b", "speculators", reduced=True, seed=9)
    a, _ = load_eagle(tmp_path / "a")
    b, _ = load_eagle(tmp_path / "b")
    b.midlayer.norm_before_residual = False  # the same weights; only the default differs
    out = []
    for d in (a, b):
        d.bind(Target(model, ()))
        _, _, _, _, prop = _check_chain(Target(model, d.taps), d)
        out.append(prop.tokens.tolist())
    assert out[0] == out[1]


def test_eagle_default_taps_are_low_middle_high_layer_inputs(tmp_path):
    model, tcfg = tiny_model("llama")
    cfg = eagle_config(tcfg, intermediate_size=96)
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    d = Eagle3(Eagle3Args.from_config(cfg)).bind(Target(model, ()))
    N = tcfg["num_hidden_layers"]
    assert d.taps == (2 - 1, N // 2 - 1, N - 3 - 1)


def test_eagle_that_does_not_fit_the_target_is_refused(tmp_path):
    model, tcfg = tiny_model("llama")
    cfg = eagle_config(
        dict(tcfg, hidden_size=32, num_attention_heads=2, head_dim=16), intermediate_size=96, layer_ids=(1, 2, 9)
    )
    with pytest.raises(IncompatiblePair, match=r"width 32.*layer ids \[9\] out of range"):
        Eagle3(Eagle3Args.from_config(cfg)).bind(Target(model, ()))


def test_mtp_pass_is_fc_over_embedding_then_hidden_one_layer_and_norm(mtp_pair):
    """The published order, written out: fc(concat(norm_e(embed(next token)), norm_h(hidden)))."""
    _, target, head = mtp_pair
    _, out = prefill(target, PROMPT)
    h, ids = out.final[:, :-1], mx.array([PROMPT[1:]])
    e = mx.fast.rms_norm(target.embed(ids), head.pre_fc_norm_embedding.weight, head.pre_fc_norm_embedding.eps)
    hh = mx.fast.rms_norm(h, head.pre_fc_norm_hidden.weight, head.pre_fc_norm_hidden.eps)
    x = mx.concatenate([e, hh], axis=-1) @ head.fc.weight.T
    x = head.layers[0](x, "causal", None)
    want = target.head(mx.fast.rms_norm(x, head.norm.weight, head.norm.eps))
    from mlx_spec.chain import draft_logits

    np.testing.assert_allclose(np.array(draft_logits(head, out.final, mx.array(PROMPT))), np.array(want), atol=1e-4)


def test_eagle_pass_reads_the_embedding_then_the_fused_taps(eagle_pair):
    _, target, d = eagle_pair
    _, out = prefill(target, PROMPT)
    L = d.midlayer
    h = out.hidden[:, :-1] @ d.fc.weight.T
    emb = target.embed(mx.array([PROMPT[1:]]))
    hn = mx.fast.rms_norm(h, L.hidden_norm.weight, L.hidden_norm.eps)
    residual = hn if d.args.norm_before_residual else h
    x = mx.concatenate([mx.fast.rms_norm(emb, L.input_layernorm.weight, L.input_layernorm.eps), hn], axis=-1)
    h = residual + L.self_attn(x, "causal", None)
    h = h + L.mlp(L.post_attention_layernorm(h))
    want = mx.fast.rms_norm(h, d.norm.weight, d.norm.eps) @ d.lm_head.weight.T
    from mlx_spec.chain import draft_logits

    np.testing.assert_allclose(np.array(draft_logits(d, out.hidden, mx.array(PROMPT))), np.array(want), atol=1e-4)


def test_an_mtp_head_is_quantized_like_a_quantized_target(tmp_path):
    from mlx import nn

    root, model, _ = write_mtp_checkpoint(tmp_path, "qwen3")
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    head = load_mtp(root, Target(model, (), final_hidden=True))
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 4 and head.fc.group_size == 64
    assert isinstance(head.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_a_stored_quantized_mtp_head_loads_as_it_is(tmp_path):
    from mlx import nn

    root, model, head = write_mtp_checkpoint(tmp_path, "qwen3")
    nn.quantize(head, group_size=64, bits=8)
    mx.save_safetensors(
        str(root / "model-mtp.safetensors"), {"mtp." + k: v for k, v in tree_flatten(head.parameters())}
    )
    cfg = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(dict(cfg, quantization={"group_size": 64, "bits": 8})))
    got = load_mtp(root, Target(model, (), final_hidden=True))
    assert isinstance(got.fc, nn.QuantizedLinear) and got.fc.bits == 8
    np.testing.assert_array_equal(np.array(got.fc.weight), np.array(head.fc.weight))


def chain_greedy(target, drafter, prompt, n: int, k: int):
    """A minimal greedy speculative loop over the chain interface (propose, verify, accept,
    roll back both sides): what the decode loop runs with a chain drafter."""
    from mlx_spec.sampling import accept_greedy

    cache_t = target.make_cache()
    out = target(mx.array([prompt]), cache_t)
    cache = drafter.make_cache()
    drafter.add_context(feats_of(drafter, out), mx.array(prompt), cache)
    tokens = [int(mx.argmax(out.logits[0, -1]))]
    while len(tokens) < n:
        anchor = tokens[-1]
        drafts = drafter.propose(mx.array(anchor), k, cache).tokens.tolist()
        block = [anchor] + drafts
        vout = target(mx.array([block]), cache_t, record=True)
        a, bonus = accept_greedy(drafts, mx.argmax(vout.logits[0], axis=-1).tolist())
        target.rollback(cache_t, len(block), a + 1)
        drafter.rollback(cache)
        drafter.add_context(feats_of(drafter, vout)[:, : a + 1], mx.array(block[: a + 1]), cache)
        tokens += drafts[:a] + [bonus]
    return tokens[:n]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_greedy_chain_decoding_with_an_mtp_head_equals_plain_decoding(tmp_path, kind):
    from mlx_spec.chain_loading import load_chain

    from helpers import greedy_reference

    root, model, _ = write_mtp_checkpoint(tmp_path, kind, per_expert=kind == "qwen3_next")
    target, head = load_chain("mtp", model, root)
    assert chain_greedy(target, head, PROMPT, 24, 3) == greedy_reference(model, PROMPT, 24)


def test_greedy_chain_decoding_with_an_eagle_drafter_equals_plain_decoding(tmp_path):
    from mlx_spec.chain_loading import load_chain

    from helpers import greedy_reference

    model, _ = make_eagle(tmp_path, "speculators", reduced=True)
    target, d = load_chain("eagle", model, drafter=tmp_path)
    assert d.taps == (0, 1, 2)
    assert chain_greedy(target, d, PROMPT, 24, 4) == greedy_reference(model, PROMPT, 24)
