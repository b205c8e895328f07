"""`mlx_spec verify`: identical on correct float32 pairs; injected bugs are mismatches; a
near tie that only the batched verify form breaks the other way is numeric."""

import dataclasses
import json

from mlx_spec import batch, verify
from mlx_spec.cli import main
from mlx_spec.decode import plain_steps
from mlx_spec.loading import load_pair
from mlx_spec.prompts import Prompt
from mlx_spec.sampling import accept_greedy

import mlx.core as mx
import pytest
from helpers import VOCAB, ScriptedDrafter, save_tiny_pair

PROMPTS = [Prompt("p1", "user", "hello there"), Prompt("p2", "user", "2+2=")]
N = 20


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), v2=True)


@pytest.fixture(scope="module")
def pair(dirs):
    return load_pair(str(dirs[0]), str(dirs[1]))


def _plain(pair, ids, n=N):
    return [
        t for s in plain_steps(pair.model, ids, max_tokens=n, eos_ids=pair.tokenizer.eos_token_ids) for t in s.tokens
    ]


def test_identical_on_a_correct_pair(pair):
    seen = []
    report = verify.check(pair, PROMPTS, (2, 5), N, progress=seen.append)
    assert report.ok and report.count(verify.IDENTICAL) == 4 and len(seen) == 4
    assert report.summary() == "4 identical, 0 numeric, 0 mismatch"
    for r in report.results:
        assert r.divergence is None and r.plain_sha256 == r.spec_sha256
        assert r.plain_text_sha256 == r.spec_text_sha256 and r.cycles > 0
    d = report.as_dict()
    assert d["summary"] == {"identical": 4, "numeric": 0, "mismatch": 0} and d["ok"]
    json.dumps(d)


def test_identical_with_partial_acceptance(pair):
    """A drafter right for 2 positions per block: acceptance, rollback of the rest, bonus."""
    ids = PROMPTS[0].encode(pair.tokenizer)
    full = ids + _plain(pair, ids)
    scripted = dataclasses.replace(pair, drafter=ScriptedDrafter(full, VOCAB, right=2))
    report = verify.check(scripted, [ids], (4, 8), N)
    assert report.summary() == "2 identical, 0 numeric, 0 mismatch"
    assert all(r.accepted > 0 for r in report.results)


def _accepts_one_extra(drafts, choice):
    a, _ = accept_greedy(drafts, choice)
    if a < len(drafts):
        a += 1
    return a, choice[a]


def test_wrong_accept_rule_is_a_mismatch(pair, monkeypatch):
    monkeypatch.setattr(batch, "accept_greedy", _accepts_one_extra)  # fault injection
    report = verify.check(pair, PROMPTS[:1], (4,), N)
    (r,) = report.results
    assert not report.ok and r.verdict == verify.MISMATCH
    assert "accept-rule" in r.divergence.reason and r.block2.startswith("mismatch")
    assert r.divergence.spec_token != r.divergence.plain_token


class SloppyRollback:
    """A target that keeps one rejected position too many on every rollback."""

    def __init__(self, target):
        self.t = target

    def make_cache(self):
        return self.t.make_cache()

    def __call__(self, ids, cache, **kw):
        return self.t(ids, cache, **kw)

    def rollback(self, cache, n_verified, n_keep):
        self.t.rollback(cache, n_verified, min(n_verified, n_keep + 1))


def test_rollback_bug_is_a_mismatch(pair):
    broken = dataclasses.replace(pair, target=SloppyRollback(pair.target))
    report = verify.check(broken, PROMPTS[:1], (4,), N)
    (r,) = report.results
    assert r.verdict == verify.MISMATCH and "rollback" in r.divergence.reason
    assert r.divergence.flip > r.divergence.tolerance


class BatchedNudge:
    """Verify passes (several tokens at once) round token ``b`` up by ``delta``: a stand-in for
    kernels that round differently from single-token decoding."""

    def __init__(self, target, b, delta):
        self.t, self.b, self.delta = target, b, delta

    def make_cache(self):
        return self.t.make_cache()

    def rollback(self, *a):
        return self.t.rollback(*a)

    def __call__(self, ids, cache, **kw):
        out = self.t(ids, cache, **kw)
        if ids.shape[1] > 1 and not kw.get("last_only"):
            nudge = (mx.arange(out.logits.shape[-1]) == self.b) * self.delta
            out = out._replace(logits=out.logits + nudge)
        return out


def test_synthetic_near_tie_is_numeric(dirs):
    pair = load_pair(str(dirs[0]), str(dirs[1]))  # its head gets edited
    ids = PROMPTS[0].encode(pair.tokenizer)
    ref = _plain(pair, ids)
    b = VOCAB - 2
    assert b not in ref
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i] and ref[i] < b)
    a = ref[k]
    # token b gets a copy of a's head row: an exact tie that plain argmax resolves to a (lower id)
    w = pair.model.lm_head.weight
    pair.model.lm_head.weight = mx.where((mx.arange(VOCAB) == b)[:, None], w[a], w)
    assert _plain(pair, ids) == ref
    nudged = dataclasses.replace(pair, target=BatchedNudge(pair.target, b, 1e-5))
    report = verify.check(nudged, [ids], (4,), N)
    (r,) = report.results
    d = r.divergence
    assert r.verdict == verify.NUMERIC and report.ok, d
    assert (d.index, d.plain_token, d.spec_token) == (k, a, b)
    assert d.flip == pytest.approx(1e-5, rel=0.2) and d.flip <= d.tolerance
    assert d.single_gap == 0.0 and r.block2.startswith("numeric")
    # the same nudge, far above rounding, is a mismatch
    big = dataclasses.replace(pair, target=BatchedNudge(pair.target, b, 0.5))
    assert verify.check(big, [ids], (4,), N).results[0].verdict == verify.MISMATCH


def test_classify_synthetic_rows():
    single = mx.array([0.0, 5.0, 5.0 - 1e-6, 1.0])
    batched = mx.array([0.0, 5.0 - 1e-6, 5.0, 1.0])
    assert verify.classify(single, batched, 1, 2).verdict == verify.NUMERIC
    far = verify.classify(mx.array([0.0, 5.0, 3.0, 1.0]), mx.array([0.0, 3.0, 5.0, 1.0]), 1, 2)
    assert far.verdict == verify.MISMATCH and far.flip == pytest.approx(2.0)
    bug = verify.classify(single, single, 1, 3)  # committed token 3, its own row prefers 1
    assert bug.verdict == verify.MISMATCH and "accept-rule" in bug.reason
    # the same 0.5 gap is rounding in bfloat16 logits of size 30, not in float32
    row_s, row_b = mx.array([30.0, 29.5, 0.0]), mx.array([29.5, 30.0, 0.0])
    assert verify.classify(row_s, row_b, 0, 1, "bfloat16").verdict == verify.NUMERIC
    assert verify.classify(row_s, row_b, 0, 1, "float32").verdict == verify.MISMATCH
    assert verify.tolerance("bfloat16", 32.0) == pytest.approx(1.0)
    assert verify.tolerance("float32", 0.5) == pytest.approx(64 * 2.0**-23)


def test_engine_call(dirs):
    from mlx_spec.engine import Engine
    from mlx_spec.generation import engine_info
    from mlx_spec.session import Session

    def loader():
        p = load_pair(str(dirs[0]), str(dirs[1]))
        return Session.of(p, engine_info(p, 4, "flag"))

    with Engine(loader) as e:
        e.wait_ready(60)
        report = e.call(lambda p: verify.check(p, ["hi"], (3,), 12)).result(timeout=120)
    assert report.ok and report.results[0].verdict == verify.IDENTICAL


def test_cli(dirs, tmp_path, capsys, monkeypatch):
    t, d = dirs
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"id": "a", "prompt": "hello"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    argv = [
        "verify",
        "--target",
        str(t),
        "--drafter",
        str(d),
        "--prompts",
        str(f),
        "--block-sizes",
        "2,4",
        "--max-tokens",
        "12",
    ]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"] == {"identical": 4, "numeric": 0, "mismatch": 0}
    assert [r["prompt"] for r in out["results"]] == ["a", "a", "line-2", "line-2"]
    monkeypatch.setattr(batch, "accept_greedy", _accepts_one_extra)
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert "mismatch" in text and text.strip().endswith("0 identical, 0 numeric, 4 mismatch")
    assert main(["verify", "--target", str(t), "--no-draft"]) == 1  # BadRequest: needs a drafter
