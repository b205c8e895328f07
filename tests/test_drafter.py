"""Drafter semantics and strict loading."""

import json

from mlx_spec.drafter import DFLASH1, Drafter, DrafterArgs, block_mask, build_target_layer_ids
from mlx_spec.errors import CheckpointError, IncompatiblePair
from mlx_spec.loading import check_pair, load_drafter, save_drafter
from mlx_spec.target import Target

import mlx.core as mx
import numpy as np
import pytest
from helpers import drafter_config, tiny_drafter, tiny_model


@pytest.fixture(scope="module")
def model_cfg():
    return tiny_model("qwen3")


def _identity_v2(v2: Drafter) -> None:
    for layer in v2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            k = mx.zeros(conv.base_kernel.shape)
            k[:, 0] = 1.0
            conv.base_kernel = k
            conv.kernel_projection.weight = mx.zeros(conv.kernel_projection.weight.shape)
    sel = v2.candidate_selector
    sel.successor_codebook.weight = mx.zeros(sel.successor_codebook.weight.shape)


def test_identity_dflash2_equals_dflash1(model_cfg):
    model, cfg = model_cfg
    target, v2, _ = tiny_drafter(model, cfg, v2=True, layers=2)
    _, v1, _ = tiny_drafter(model, cfg, v2=False, layers=2)
    _identity_v2(v2)
    # copy the shared backbone so only the DFlash 2 additions differ
    from mlx.utils import tree_flatten

    v1.load_weights(
        [(k, v) for k, v in tree_flatten(v2.parameters()) if "conv" not in k and "candidate_selector" not in k]
    )
    feats = target(mx.array([[3, 9, 27, 81, 5, 15]]), target.make_cache()).hidden
    anchor = mx.array(7)
    for B in (2, 4, 8):
        p1 = v1.propose(anchor, feats, v1.make_cache(), B)
        p2 = v2.propose(anchor, feats, v2.make_cache(), B)
        assert p1.tokens.tolist() == p2.tokens.tolist()
        h1 = v1.hidden(mx.array([[7] + [127] * (B - 1)]), feats, v1.make_cache())
        h2 = v2.hidden(mx.array([[7] + [127] * (B - 1)]), feats, v2.make_cache())
        assert mx.allclose(h1, h2, atol=1e-5)
    # with a non-zero successor codebook the selector may change the path: the test has power
    v2.candidate_selector.successor_codebook.weight = (
        mx.random.normal(v2.candidate_selector.successor_codebook.weight.shape) * 10
    )
    v2.candidate_selector.predecessor_codebook.weight = (
        mx.random.normal(v2.candidate_selector.predecessor_codebook.weight.shape) * 10
    )
    changed = any(
        v1.propose(mx.array(a), feats, v1.make_cache(), 8).tokens.tolist()
        != v2.propose(mx.array(a), feats, v2.make_cache(), 8).tokens.tolist()
        for a in range(10)
    )
    assert changed


def test_block_mask_matches_definition():
    for causal in (False, True):
        for window in (None, 4, 7):
            for n_ctx, L in ((0, 4), (3, 5), (6, 8)):
                m = block_mask(n_ctx, 20, L, causal, window)
                q = np.arange(L)[:, None] + 20
                k = np.concatenate([np.arange(20 - n_ctx, 20), 20 + np.arange(L)])[None]
                want = np.ones((L, n_ctx + L), bool)
                if causal:
                    want &= k <= q
                if window:
                    want &= (q - k) < window
                got = np.ones_like(want) if m is None else np.array(m)
                assert (got == want).all(), (causal, window, n_ctx, L)


def test_default_tap_layers():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(48, 8) == [1, 7, 14, 20, 26, 32, 39, 45]
    assert build_target_layer_ids(30, 1) == [15]


def test_roundtrip_official_layout(tmp_path, model_cfg):
    model, cfg = model_cfg
    target, d, dcfg = tiny_drafter(model, cfg, v2=True)
    save_drafter(d, tmp_path, dcfg)
    names = set(mx.load(str(tmp_path / "model.safetensors")))
    assert "candidate_selector.successor_codebook" in names  # official: no ".weight" suffix
    loaded, _ = load_drafter(tmp_path)
    loaded.bind(target.embed, target.head)
    feats = target(mx.array([[1, 2, 3]]), target.make_cache()).hidden
    a = d.propose(mx.array(4), feats, d.make_cache(), 6).tokens
    b = loaded.propose(mx.array(4), feats, loaded.make_cache(), 6).tokens
    assert a.tolist() == b.tolist()


def _write(path, weights, config):
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def saved(tmp_path, model_cfg):
    model, cfg = model_cfg
    _, d, dcfg = tiny_drafter(model, cfg, v2=True)
    save_drafter(d, tmp_path / "ok", dcfg)
    return dict(mx.load(str(tmp_path / "ok" / "model.safetensors"))), dcfg


def test_strict_extra_tensor(tmp_path, saved):
    w, c = saved
    _write(tmp_path / "x", {**w, "layers.0.bogus.weight": mx.zeros((2,))}, c)
    with pytest.raises(CheckpointError, match="unused tensors.*layers.0.bogus.weight"):
        load_drafter(tmp_path / "x")


def test_strict_missing_tensor(tmp_path, saved):
    w, c = saved
    w = {k: v for k, v in w.items() if k != "layers.0.mlp.up_proj.weight"}
    _write(tmp_path / "x", w, c)
    with pytest.raises(CheckpointError, match="missing.*layers.0.mlp.up_proj.weight"):
        load_drafter(tmp_path / "x")


def test_strict_wrong_shape(tmp_path, saved):
    w, c = saved
    w["fc.weight"] = mx.zeros((3, 3))
    _write(tmp_path / "x", w, c)
    with pytest.raises(CheckpointError, match=r"shape mismatch.*fc.weight"):
        load_drafter(tmp_path / "x")


def test_dflash2_file_never_loads_as_dflash1(tmp_path, saved):
    w, c = saved
    c = {**c, "architectures": [DFLASH1]}
    _write(tmp_path / "x", w, c)
    with pytest.raises(CheckpointError, match="DFlash 2 tensors.*refusing"):
        load_drafter(tmp_path / "x")
    n_extra = sum(1 for k in w if "conv" in k or "candidate_selector" in k)
    assert n_extra == 4 * 1 + 3  # 2 conv modules x 2 tensors per layer (1 layer) + 3 selector


def test_not_a_drafter_and_bad_config(tmp_path, saved):
    w, c = saved
    _write(tmp_path / "x", w, {**c, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        load_drafter(tmp_path / "x")
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(tmp_path / "y")


def test_mismatched_target_is_refused(model_cfg):
    model, cfg = model_cfg
    target = Target(model, [0, 2])
    for change, culprit in (
        ({"hidden_size": 32}, "hidden_size"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_target_layers": 36}, "36-layer target"),
    ):
        dcfg = drafter_config(cfg)
        dcfg.update(change)
        d = Drafter(DrafterArgs.from_config(dcfg))
        with pytest.raises(IncompatiblePair, match=culprit):
            check_pair(target, d)
    dcfg = drafter_config(cfg, taps=(0, 9))
    with pytest.raises(IncompatiblePair, match=r"target_layer_ids \[9\]"):
        check_pair(target, Drafter(DrafterArgs.from_config(dcfg)))
