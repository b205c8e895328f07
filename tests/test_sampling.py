"""Sampling at T > 0 is lossless in distribution; the target-side rule is mlx-lm's.

The distribution tests draw tens of thousands of speculative blocks in one MLX graph: the real
drafters' proposal code (``Drafter.sample``) on a tiny target with a 16-token vocabulary, the
target's exact conditionals from one batched forward, and ``speculative_sample``. The joint law of
the first two committed tokens is compared with plain sampling (chi-square, fixed seeds).
"""

import importlib
import math

from mlx_spec.decode import spec_steps
from mlx_spec.drafter import ContextCache, DrafterArgs, Proposal
from mlx_spec.sampling import (
    SamplingConfig,
    accept_greedy,
    accept_sampled,
    filtered_logprobs,
    point_mass,
    sample_probs,
    speculative_sample,
    target_probs,
)
from mlx_spec.target import Target

import mlx.core as mx
import numpy as np
import pytest
from helpers import TARGET_CONFIGS, VOCAB, greedy_reference, save_tiny_pair, tiny_drafter, tiny_model

V = 16
N = 40_000
PROMPT, ANCHOR = [1, 5, 9], 3


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x): regularized upper incomplete gamma Q(df/2, x/2) (no scipy here)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if term < total * 1e-15:
                break
        return max(0.0, 1.0 - front * total)
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)  # continued fraction for Q(a, x) (Lentz)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return front * h


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expecting < 5 are pooled into one."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    stat = (((obs_c - exp_c) ** 2)[keep] / exp_c[keep]).sum()
    return chi2_sf(stat, int(keep.sum()) - 1)


def two_sample_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity test for two equal-size samples (cells with < 10 in all pooled)."""
    big = (a + b) >= 10
    a_c = np.append(a[big], a[~big].sum())
    b_c = np.append(b[big], b[~big].sum())
    keep = (a_c + b_c) > 0
    stat = (((a_c - b_c) ** 2)[keep] / (a_c + b_c)[keep]).sum()
    return chi2_sf(stat, int(keep.sum()) - 1)


def test_chi2_sf_known_values():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(124.342113, 100) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(100.0, 100) == pytest.approx(0.481191, abs=1e-5)


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == (3, 7)
    assert accept_greedy([4, 9, 6], [4, 5, 6, 7]) == (1, 5)
    assert accept_greedy([1], [4, 5]) == (0, 4)
    assert accept_greedy([], [8]) == (0, 8)


@pytest.mark.parametrize(
    "temp,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.8, 0.5, 7), (1.0, 0.05, 0)]
)
def test_target_rule_is_mlx_lm_sampler(temp, top_p, top_k):
    """Same kept set and probabilities as mlx-lm's make_sampler chain (top-p, then top-k, then T)."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    mx.random.seed(3)
    logits = mx.random.normal((6, 40)) * 3
    cfg = SamplingConfig(temp, top_p, top_k)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = lp
    if top_p < 1:
        ref = apply_top_p(ref, top_p)
    if top_k:
        ref = apply_top_k(ref, top_k)
    ours = filtered_logprobs(logits, cfg)
    assert (mx.isinf(ours) == mx.isinf(ref)).all().item()
    assert mx.allclose(target_probs(logits, cfg), mx.softmax(ref / temp, axis=-1), atol=1e-6).item()
    kept = (~mx.isinf(ours)).sum(axis=-1)
    assert (kept >= 1).all().item() and (top_k == 0 or (kept <= top_k).all().item())


def test_sample_probs_never_draws_zero_probability():
    p = mx.array([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]])
    draws = np.array(sample_probs(p, mx.random.key(0), n=5000))
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0}


def test_speculative_sample_exact_toy():
    """Toy p/q with a known answer: one draft, q puts all mass on a token p dislikes."""
    p = mx.array([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # (1, 2, 3)
    q = mx.array([[[0.0, 0.0, 1.0]]])
    drafts = mx.array([[2]])
    n = 200_000
    a, tok = speculative_sample(
        mx.broadcast_to(p, (n, 2, 3)), mx.broadcast_to(q, (n, 1, 3)), mx.broadcast_to(drafts, (n, 1)), mx.random.key(1)
    )
    a, tok = np.array(a), np.array(tok)
    assert abs(a.mean() - 0.2) < 0.005  # accept prob = p(2)/q(2)
    first = np.where(a == 1, 2, tok)  # the first committed token
    assert np.allclose(np.bincount(first, minlength=3) / n, [0.5, 0.3, 0.2], atol=0.005)
    assert np.allclose(np.bincount(tok[a == 1], minlength=3) / (a == 1).sum(), [0.1, 0.1, 0.8], atol=0.01)


# ---------------------------------------------------------------------------------------------
# Distribution of the first two committed tokens: speculative (real drafter proposals) vs plain.


@pytest.fixture(scope="module")
def small_vocab():
    cfg = dict(TARGET_CONFIGS["qwen3"], vocab_size=V)
    mod = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 2
    model.lm_head.weight = model.lm_head.weight * 2
    mx.eval(model.parameters())
    # target logits after [prompt, anchor], after [.., a] and after [.., a, b], for every a, b
    ids = mx.array([PROMPT + [ANCHOR, a, b] for a in range(V) for b in range(V)])
    logits = model(ids).astype(mx.float32)  # (V*V, 6, V)
    tables = (logits[0, 3], logits[::V, 4], logits[:, 5].reshape(V, V, V))
    drafters = {}
    for v2 in (False, True):
        target, drafter, _ = tiny_drafter(model, cfg, v2=v2, seed=5)
        feats = target(mx.array([PROMPT]), target.make_cache()).hidden
        block = mx.array([[ANCHOR, V - 1, V - 1]])
        h = drafter.hidden(block, feats, drafter.make_cache())[0, 1:]  # (2, H)
        drafters["dflash2" if v2 else "dflash1"] = (drafter, h, drafter.logits(h))
    return tables, drafters


def _two_tokens(tables, drafters, kind, cfg, n_drafts, key, residual=True, speculate=True):
    p0, p1, p2 = (target_probs(t, cfg) for t in tables)  # (V,), (V, V), (V, V, V)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    if not speculate:
        y1 = sample_probs(mx.broadcast_to(p0, (N, V)), k1)
        return y1, sample_probs(p1[y1], k2)
    drafter, h, unary = drafters[kind]
    drafts, q = drafter.sample(h[:n_drafts], unary[:n_drafts], mx.array(ANCHOR), cfg, k1, n=N)
    d1 = drafts[:, 0]
    rows = [mx.broadcast_to(p0, (N, V)), p1[d1]]
    if n_drafts == 2:
        rows.append(p2[d1, drafts[:, 1]])
    a, tok = speculative_sample(mx.stack(rows, axis=1), q, drafts, k2, residual=residual)
    after = sample_probs(p1[tok], k3)  # a rejection at the first draft: the next block samples
    y1 = mx.where(a == 0, tok, d1)
    y2 = mx.where(a == 0, after, tok if n_drafts == 1 else mx.where(a == 1, tok, drafts[:, 1]))
    return y1, y2


def _counts(y1, y2):
    return np.bincount(np.array(y1 * V + y2), minlength=V * V)


def _exact(tables, cfg):
    p0, p1, _ = (np.array(target_probs(t, cfg)) for t in tables)
    return (p0[:, None] * p1).reshape(-1)


CONFIGS = [SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9, top_k=6)]


@pytest.mark.parametrize("kind", ["dflash1", "dflash2"])
@pytest.mark.parametrize("n_drafts", [1, 2])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["T1", "T0.8-p0.9-k6"])
def test_speculative_sampling_matches_plain(small_vocab, kind, n_drafts, cfg):
    tables, drafters = small_vocab
    seed = 11 * n_drafts + (kind == "dflash2") + 100 * CONFIGS.index(cfg)
    spec = _counts(*_two_tokens(tables, drafters, kind, cfg, n_drafts, mx.random.key(seed)))
    plain = _counts(*_two_tokens(tables, drafters, kind, cfg, n_drafts, mx.random.key(seed + 7), speculate=False))
    exact = _exact(tables, cfg)
    assert spec.sum() == N
    assert (spec[exact == 0] == 0).all()  # nothing outside the target's top-p/top-k support
    assert two_sample_pvalue(spec, plain) > 0.01
    assert gof_pvalue(spec, exact) > 0.001  # against the exact law too (8 configurations)


def _two_tokens_mixed(tables, drafters, kind, cfg, key):
    """Blocks of two drafts from two sources, chosen per block by a rule that does not look at
    any draw (as the drafting policy chooses before a cycle): every third block a lookup draft
    (a deterministic proposal, q = point mass; a different copy per block), else the drafter's
    sampled draft with its q."""
    p0, p1, p2 = (target_probs(t, cfg) for t in tables)
    k1, k2, k3 = mx.random.split(key, 3)
    drafter, h, unary = drafters[kind]
    dd, dq = drafter.sample(h[:2], unary[:2], mx.array(ANCHOR), cfg, k1, n=N)
    i = mx.arange(N)
    looked = mx.stack([(i * 7) % V, (i * 3 + 1) % V], axis=1).astype(dd.dtype)  # the copies
    use = (i % 3 == 0)[:, None]
    drafts = mx.where(use, looked, dd)
    q = mx.where(use[..., None], point_mass(looked.reshape(-1), V).reshape(N, 2, V), dq)
    d1 = drafts[:, 0]
    rows = mx.stack([mx.broadcast_to(p0, (N, V)), p1[d1], p2[d1, drafts[:, 1]]], axis=1)
    a, tok = speculative_sample(rows, q, drafts, k2)
    after = sample_probs(p1[tok], k3)
    y1 = mx.where(a == 0, tok, d1)
    y2 = mx.where(a == 0, after, mx.where(a == 1, tok, drafts[:, 1]))
    return y1, y2


@pytest.mark.parametrize("kind", ["dflash1", "dflash2"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["T1", "T0.8-p0.9-k6"])
def test_lookup_and_drafter_proposals_mixed_match_plain(small_vocab, kind, cfg):
    tables, drafters = small_vocab
    seed = 300 + (kind == "dflash2") + 10 * CONFIGS.index(cfg)
    spec = _counts(*_two_tokens_mixed(tables, drafters, kind, cfg, mx.random.key(seed)))
    plain = _counts(*_two_tokens(tables, drafters, kind, cfg, 2, mx.random.key(seed + 7), speculate=False))
    exact = _exact(tables, cfg)
    assert (spec[exact == 0] == 0).all()
    assert two_sample_pvalue(spec, plain) > 0.01
    assert gof_pvalue(spec, exact) > 0.001


def test_accept_sampled_takes_a_point_mass_proposal():
    """q None at T > 0 is a deterministic proposal: accepted with probability p(d)."""
    logits = mx.log(mx.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    cfg = SamplingConfig(1.0)
    got = [accept_sampled(logits, Proposal(mx.array([2], mx.int32), None), cfg, mx.random.key(s)) for s in range(3000)]
    acc = np.array([a for a, _ in got])
    assert abs(acc.mean() - 0.2) < 0.03
    rejected = np.array([t for a, t in got if a == 0])
    assert (rejected != 2).all()  # the correction never re-proposes the rejected token
    assert abs((rejected == 0).mean() - 0.5 / 0.8) < 0.04


@pytest.mark.parametrize("kind", ["dflash1", "dflash2"])
def test_dropping_the_residual_is_detected(small_vocab, kind):
    """Power: the same test fails when rejected positions resample from p instead of max(p-q, 0)."""
    tables, drafters = small_vocab
    cfg = CONFIGS[0]
    key = mx.random.key(5)
    broken = _counts(*_two_tokens(tables, drafters, kind, cfg, 2, key, residual=False))
    plain = _counts(*_two_tokens(tables, drafters, kind, cfg, 2, mx.random.key(6), speculate=False))
    assert two_sample_pvalue(broken, plain) < 0.01
    assert gof_pvalue(broken, _exact(tables, cfg)) < 0.01


def test_proposal_q_is_the_realized_distribution(small_vocab):
    """Drafts follow the q the drafter reports (DFlash 2: sparse over K candidates, and the second
    row depends on the first pick)."""
    _, drafters = small_vocab
    cfg = SamplingConfig(1.0)
    for kind, (drafter, h, unary) in drafters.items():
        drafts, q = drafter.sample(h, unary, mx.array(ANCHOR), cfg, mx.random.key(2), n=N)
        d, qn = np.array(drafts), np.array(q)
        assert np.allclose(qn.sum(-1), 1, atol=1e-5)
        assert (qn[np.arange(N), 0, d[:, 0]] > 0).all() and (qn[np.arange(N), 1, d[:, 1]] > 0).all()
        if kind == "dflash2":
            assert ((qn > 0).sum(-1) <= drafter.args.selector_top_k).all()
        assert gof_pvalue(np.bincount(d[:, 0], minlength=V), qn[0, 0]) > 0.01
        for first in np.unique(d[:, 0]):
            rows = d[:, 0] == first
            if rows.sum() >= 2000:  # the second row given the first pick
                assert np.allclose(qn[rows, 1], qn[rows, 1][0])
                assert gof_pvalue(np.bincount(d[rows, 1], minlength=V), qn[rows, 1][0]) > 0.01


# ---------------------------------------------------------------------------------------------
# The decode loop at T > 0.

SHORT = [1, 5, 9, 17, 33, 2, 8]


@pytest.fixture(scope="module")
def tiny():
    model, cfg = tiny_model("qwen3")
    return model, cfg, greedy_reference(model, SHORT, 24)


def _run(target, drafter, B, sampling, n=24):
    return [
        t for s in spec_steps(target, drafter, SHORT, block_size=B, max_tokens=n, sampling=sampling) for t in s.tokens
    ]


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_seed_reproducible(tiny, v2):
    model, cfg, _ = tiny
    target, drafter, _ = tiny_drafter(model, cfg, v2=v2)
    runs = {s: _run(target, drafter, 4, SamplingConfig(1.0, seed=s)) for s in (1, 2, 3)}
    assert _run(target, drafter, 4, SamplingConfig(1.0, seed=1)) == runs[1]
    assert len({tuple(r) for r in runs.values()}) > 1


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_top_k_1_sampling_is_greedy(tiny, v2):
    """With top_k=1 the target is deterministic: every draft but its argmax is rejected and the
    residual must put all mass on the argmax, so sampling reproduces greedy decoding."""
    model, cfg, ref = tiny
    target, drafter, _ = tiny_drafter(model, cfg, v2=v2)
    for B in (2, 5):
        assert _run(target, drafter, B, SamplingConfig(1.0, top_k=1, seed=0)) == ref


class DistributionOracle:
    """Drafts by sampling the target itself (no cache), so q == p and every draft is accepted
    unless the loop pairs a draft with the wrong verify row."""

    def __init__(self, model, prompt, cfg):
        self.model, self.history, self.cfg, self.last = model, list(prompt), cfg, []
        self.args = DrafterArgs(
            hidden_size=1,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            intermediate_size=1,
            vocab_size=VOCAB,
            num_target_layers=1,
            target_layer_ids=[0],
            mask_token_id=0,
        )

    def make_cache(self):
        return [ContextCache()]

    def add_context(self, features, cache):
        cache[0].offset += features.shape[1]

    def propose(self, anchor, features, cache, block_size, sampling=0.0, key=None):
        kept = features.shape[1] - 1 if cache[0].offset else 0  # drafts accepted last cycle
        cache[0].offset += features.shape[1]
        self.history += self.last[:kept] + [anchor.item()]
        seq, toks, qs = list(self.history), [], []
        for k in mx.random.split(key, block_size - 1):
            q = target_probs(self.model(mx.array([seq]))[0, -1], self.cfg)
            t = sample_probs(q, k).item()
            seq.append(t)
            toks.append(t)
            qs.append(q)
        self.last = toks
        return Proposal(mx.array(toks, mx.int32), mx.stack(qs))


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, seed=4), SamplingConfig(0.7, top_p=0.8, seed=9)])
def test_rows_are_aligned_with_drafts(tiny, cfg):
    model, _, _ = tiny
    target = Target(model, [0])
    oracle = DistributionOracle(model, SHORT, cfg)
    steps = list(spec_steps(target, oracle, SHORT, block_size=4, max_tokens=20, sampling=cfg))
    cycles = [s for s in steps[1:] if s.drafted]
    assert cycles and all(s.accepted == s.drafted for s in cycles)


def test_accept_sampled_without_drafts_samples_the_target():
    logits = mx.array([[0.0, 5.0, -9.0]])
    cfg = SamplingConfig(1.0, top_k=1)
    assert accept_sampled(logits, None, cfg, mx.random.key(0)) == (0, 1)
    empty = Proposal(mx.zeros((0,), mx.int32), mx.zeros((0, 3)))
    assert accept_sampled(logits, empty, cfg, mx.random.key(0)) == (0, 1)


def test_generate_cli_same_seed_same_text(tmp_path, capsys):
    import json

    from mlx_spec.cli import main

    t, d = save_tiny_pair(tmp_path)
    texts = {}
    for name, extra in (("spec", ["--drafter", str(d), "--block-size", "4"]), ("plain", ["--no-draft"])):
        for seed in ("5", "5", "6"):
            argv = [
                "generate",
                "--target",
                str(t),
                *extra,
                "--prompt",
                "hello",
                "--max-tokens",
                "24",
                "--temperature",
                "1.0",
                "--seed",
                seed,
                "--json",
            ]
            assert main(argv) == 0
            texts.setdefault(name, []).append(json.loads(capsys.readouterr().out)["text"])
    for name, (a, b, c) in texts.items():
        assert a == b, name
        assert a != c, name  # a different seed gives another sample (true for these seeds)


def test_next_token_draws_as_accept_sampled_does_with_no_drafts():
    """A plain step's token drawn in the graph (batching's pipelined steps) is the draw that
    ``accept_sampled`` makes for a block with no drafts, key for key."""
    from mlx_spec.sampling import accept_sampled, next_token

    logits = mx.random.normal((3, 50), key=mx.random.key(1))
    cfg = SamplingConfig(1.0)
    got = [int(next_token(logits, cfg, mx.random.key(k)).item()) for k in range(12)]
    assert got == [accept_sampled(logits, None, cfg, mx.random.key(k))[1] for k in range(12)]
    assert len(set(got)) > 3  # (the draws do depend on the key)
    assert int(next_token(logits, SamplingConfig(), None).item()) == int(mx.argmax(logits[-1]).item())
