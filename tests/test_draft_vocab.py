"""A reduced draft vocabulary (draft_vocab.json): a cheaper draft head, the same output."""

import json

from mlx_spec.decode import spec_steps
from mlx_spec.drafter import DraftVocab
from mlx_spec.errors import CheckpointError
from mlx_spec.sampling import SamplingConfig
from mlx_spec.target import Target

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import VOCAB, greedy_reference, save_tiny_pair, tiny_drafter, tiny_model

PROMPT = [1, 5, 9, 17, 33, 2, 8]
N = 30


def _vocab(target, ids):
    ids = mx.array(np.asarray(ids, np.int32))
    return DraftVocab(ids, target.head_rows(ids))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bits", [None, 4])
def test_head_rows_equal_the_heads_columns(tied, bits):
    import importlib

    from helpers import TARGET_CONFIGS

    cfg = dict(TARGET_CONFIGS["qwen3"], tie_word_embeddings=tied)
    mod = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    target = Target(model, [0])
    ids = mx.array([0, 3, 7, 64, 100, 127], mx.int32)
    h = mx.random.normal((2, 5, cfg["hidden_size"]))
    want = target.head(h)[..., ids]
    got = target.head_rows(ids)(h)
    assert got.shape == (2, 5, 6)
    assert mx.allclose(got, want, atol=1e-4).item()


@pytest.fixture(scope="module")
def pair():
    model, cfg = tiny_model("qwen3")
    return model, cfg, greedy_reference(model, PROMPT, N)


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_the_whole_vocabulary_as_draft_vocab_changes_nothing(pair, v2):
    model, cfg, ref = pair
    target, drafter, _ = tiny_drafter(model, cfg, v2=v2, layers=2)
    full = list(spec_steps(target, drafter, PROMPT, block_size=4, max_tokens=N))
    drafter.bind(target.embed, target.head, _vocab(target, range(VOCAB)))
    same = list(spec_steps(target, drafter, PROMPT, block_size=4, max_tokens=N))
    assert [s.tokens for s in same] == [s.tokens for s in full]
    assert [s.accepted for s in same] == [s.accepted for s in full]


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_a_reduced_vocab_drafts_inside_it_and_stays_lossless(pair, v2):
    model, cfg, ref = pair
    target, drafter, _ = tiny_drafter(model, cfg, v2=v2, layers=2)
    sub = sorted(set(ref[::2]) | set(range(0, VOCAB, 5)))  # some of the answer, not all of it
    drafter.bind(target.embed, target.head, _vocab(target, sub))
    for B in (2, 4, 8):
        steps = list(spec_steps(target, drafter, PROMPT, block_size=B, max_tokens=N))
        assert [t for s in steps for t in s.tokens] == ref, B
    cache = drafter.make_cache()
    feats = target(mx.array([PROMPT]), target.make_cache()).hidden
    drafts = drafter.propose(mx.array(ref[0]), feats, cache, 8).tokens.tolist()
    assert len(drafts) == 7 and set(drafts) <= set(sub)
    # sampled: drafts inside the vocabulary, q the realized distribution over target ids (0 outside)
    for n in (None, 64):
        c = drafter.make_cache()
        drafter.add_context(feats, c)
        h = drafter.hidden(mx.array([[ref[0]] + [VOCAB - 1] * 3]), None, c)[0, 1:]
        toks, q = drafter.sample(
            h, drafter.logits(h), mx.array(ref[0]), SamplingConfig(0.9, top_p=0.95), mx.random.key(3), n
        )
        q, toks = np.array(q), np.array(toks)
        assert q.shape[-1] == VOCAB and np.allclose(q.sum(-1), 1, atol=1e-5)
        outside = np.setdiff1d(np.arange(VOCAB), sub)
        assert (q[..., outside] == 0).all() and np.isin(toks, sub).all()
        flat_q, flat_t = q.reshape(-1, VOCAB), toks.reshape(-1)
        assert (flat_q[np.arange(len(flat_t)), flat_t] > 0).all()


def test_draft_vocab_file_is_used_reported_counted_and_checked(tmp_path):
    from mlx_spec import memory
    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair, write_draft_vocab
    from mlx_spec.quantize import QuantChoice

    tdir, ddir = save_tiny_pair(tmp_path)
    assert load_pair(str(tdir), str(ddir)).drafter.vocab is None  # no file: the full head
    write_draft_vocab(ddir, [5, 3, 9, 64, 3], "test")
    p = load_pair(str(tdir), str(ddir))
    assert p.drafter.vocab.ids.tolist() == [3, 5, 9, 64]
    info = engine_info(p, 4, "flag")
    assert info.draft_vocab == 4 and "draft vocabulary 4 ids" in info.describe()
    assert load_pair(str(tdir), str(ddir), draft_vocab="full").drafter.vocab is None
    quant = QuantChoice(None, None, 64, False, "")
    rows = {i.name: i.bytes for i in memory.plan_for(str(tdir), str(ddir), quant, context=256, metal=False).items}
    assert rows["draft head rows"] == 4 * 64 * 4  # 4 float32 rows of the 64-wide head
    full = memory.plan_for(str(tdir), str(ddir), quant, context=256, metal=False, draft_vocab="full")
    assert "draft head rows" not in {i.name for i in full.items}
    f = ddir / "draft_vocab.json"
    for body, why in [
        ("{not json", "unreadable"),
        (json.dumps({"ids": [3, 2]}), "sorted"),
        (json.dumps({"ids": [1, VOCAB]}), "outside the vocabulary"),
        (json.dumps({"ids": []}), "non-empty"),
        (json.dumps({"idz": [1]}), "unreadable"),
    ]:
        f.write_text(body)
        with pytest.raises(CheckpointError, match=why) as e:
            load_pair(str(tdir), str(ddir))
        assert "draft_vocab.json" in str(e.value)
