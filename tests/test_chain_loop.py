"""Chain drafters (MTP heads, EAGLE-3) in the one decode loop: greedy output equal to plain
decoding through ``generate``, a batch drafting from four sources in one step, exact chain-cache
rollback after partial acceptance (dense and hybrid targets), the prefix cache, T > 0 in
distribution, the policy's choice of depth, refusals by name, and what the engine says ran."""

from dataclasses import replace

from mlx_spec.batch import BatchBudget, BatchDecoder, batched_steps
from mlx_spec.config import LoadConfig
from mlx_spec.decode import spec_steps
from mlx_spec.drafter import Proposal
from mlx_spec.errors import BadRequest, CheckpointError, IncompatiblePair, MlxSpecError
from mlx_spec.generation import GenConfig, Result, engine_info, generate
from mlx_spec.loading import load_pair
from mlx_spec.policy import PLAIN, Acceptance, Copy, Decision
from mlx_spec.prefix import PrefixCache
from mlx_spec.sampling import SamplingConfig

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, greedy_reference, save_chain_family

PROMPT = [1, 5, 9, 17, 33, 2, 8, 40, 77, 3, 5, 9, 17, 33]
N = 20


class Forced:
    """A draft policy that drafts ``plan[i]`` ((source, rows), cycling) every cycle: a lookup
    draft only where the lookup has a proposal (else a plain step)."""

    def __init__(self, plan, max_lookup: int = 8):
        self.plan, self.i = list(plan), 0
        self.sources = tuple(sorted({s for s, _ in self.plan if s != PLAIN}))
        self.max_lookup = max_lookup
        self.pinned, self.max_block = None, 4
        self.acceptance = {s: Acceptance(8, (1.0,) * 8) for s in ("dflash", "mtp", "eagle")}
        self.dflash = self.acceptance["dflash"]
        self.copy = Copy()
        self.steps = []

    def _next(self, ctx):
        source, rows = self.plan[self.i % len(self.plan)]
        if source == "lookup":
            rows = min(rows, len(ctx.lookup) + 1)
            if rows < 2:
                return Decision(PLAIN, 1)
        return Decision(source, rows)

    def peek(self, ctx):
        return self._next(ctx)

    def stays_plain(self, ctx):
        return self._next(ctx).source == PLAIN

    def choose(self, ctx):
        d = self._next(ctx)
        self.i += 1
        return d

    def pick(self, decision, drafts, confidence, ctx=None, *, trim=False):
        return decision

    def observe(self, step):
        self.steps.append(step)


class AllDraft(BatchBudget):
    """Every sequence drafts what it wishes (the batch's cost model out of the way)."""

    def plan(self, wants, accs, plain_runs, probes, extra_rows=0, passes=None, heads=None):
        return list(wants)


class Steered:
    """A chain drafter whose k passes run for real (its cache grows and rolls back as it
    would), but whose proposal is the known continuation for the first ``rights[i]`` drafts
    (cycling over calls) and wrong after: partial acceptance on demand."""

    def __init__(self, chain, full, rights=(0, 1, 2, 9)):
        self.chain, self.full, self.rights, self.calls = chain, list(full), list(rights), 0

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def propose(self, anchor, k, cache, *, sampling=0.0, key=None):
        self.chain.propose(anchor, k, cache, sampling=sampling, key=key)  # the real passes
        queued = sum(h.shape[1] for h in cache.queued_h)
        p = cache.committed + queued  # the anchor's position (the rows it read before it)
        right = self.rights[self.calls % len(self.rights)]
        self.calls += 1
        toks = [self.full[p + j] if j <= right else (self.full[p + j] + 1) % VOCAB for j in range(1, k + 1)]
        return Proposal(mx.array(toks, mx.int32), None)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The llama family: target + MTP head, DFlash 2, EAGLE-3 with d2t, loaded as one pair."""
    dirs = save_chain_family(tmp_path_factory.mktemp("family"))
    pair = load_pair(
        str(dirs["target"]),
        str(dirs["drafter"]),
        sources=("dflash", "lookup", "mtp", "eagle"),
        mtp=dirs["mtp"],
        eagle=dirs["eagle"],
    )
    ref = greedy_reference(pair.model, PROMPT, N)
    return dirs, pair, ref


def _gen(pair, policy, prompt=PROMPT, n=N, sampling=SamplingConfig(), prefix=None):
    info = engine_info(pair, 4, "flag", adaptive=True)
    result = Result()
    for _ in generate(pair, info, prompt, GenConfig(max_tokens=n, sampling=sampling), result, prefix, policy=policy):
        pass
    return result


@pytest.mark.parametrize("source", ["mtp", "eagle"])
def test_greedy_chain_drafts_through_generate_equal_plain_decoding(family, source):
    _, pair, ref = family
    policy = Forced([(source, 4), (source, 2), (source, 3)])
    result = _gen(pair, policy)
    assert result.tokens == ref
    used = result.stats.sources[source]
    assert used["cycles"] >= 3 and result.stats.head_passes == sum(s.head_passes for s in policy.steps)
    assert all(s.source == source and s.head_passes == s.drafted for s in policy.steps if s.drafted)


def _fresh_chain(pair, kind, ids):
    """A chain cache built in one go from the target's features of ``ids`` (what the loop's cache
    must equal after any number of cycles, rollbacks and hand-overs)."""
    from mlx_spec.target import feature_view

    head = pair.chains[kind]
    out = pair.target(mx.array([list(ids)]), pair.target.make_cache())
    feats = out.final if head.final_hidden else feature_view(pair.target.taps, head.taps)(out.hidden)
    cache = head.make_cache()
    head.add_context(feats, mx.array(list(ids)), cache)
    head.flush(cache)
    return cache


def _same_cache(got, want):
    assert got.offset == want.offset and got.committed == want.committed
    n = got.offset
    for a, b in zip(got.layers, want.layers):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            np.testing.assert_allclose(np.array(x[..., :n, :]), np.array(y[..., :n, :]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(got.pending), np.array(want.pending), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Hybrid gated-delta-net targets (qwen3_next; qwen3_5_moe, its MTP layer a MoE block), each
    with its MTP head in its own folder: kind -> (pair, greedy reference)."""
    out = {}
    for kind in ("qwen3_next", "qwen3_5_moe"):
        dirs = save_chain_family(tmp_path_factory.mktemp(kind), kind, eagle=False)
        pair = load_pair(str(dirs["target"]), None, sources=("mtp",), mtp=dirs["mtp"])
        out[kind] = pair, greedy_reference(pair.model, PROMPT, N)
    return out


def _steered_run(pair, ref, kind, rights=(0, 1, 2, 9)):
    steered = Steered(pair.chains[kind], PROMPT + ref, rights)
    kept = []
    policy = Forced([(kind, 4)])
    steps = list(
        spec_steps(
            pair.target,
            pair.drafter if "dflash" in pair.draft_sources else None,
            PROMPT,
            block_size=1,
            max_tokens=N,
            policy=policy,
            chains={**pair.chains, kind: steered},
            on_exit=kept.append,
        )
    )
    return steps, kept[0]


@pytest.mark.parametrize("case", ["mtp-dense", "eagle-dense", "mtp-qwen3_next", "mtp-qwen3_5_moe"])
def test_chain_cache_after_partial_acceptance_equals_a_fresh_one(family, hybrid, case):
    kind, where = case.split("-")
    pair, ref = (family[1], family[2]) if where == "dense" else hybrid[where]
    steps, kept = _steered_run(pair, ref, kind)
    assert [t for s in steps for t in s.tokens] == ref
    accepted = {s.accepted for s in steps if s.drafted}
    assert {0, 1, 2} <= accepted and max(accepted) == 3  # rejected, partly and wholly accepted drafts
    assert kept.tokens == tuple(PROMPT + ref[:-1])  # the caches hold every fed id
    _same_cache(kept.chains[kind], _fresh_chain(pair, kind, kept.tokens))


def test_a_batch_drafts_from_four_sources_in_one_step_and_each_reply_equals_plain(family):
    _, pair, _ = family
    prompts = [PROMPT, PROMPT[3:] + PROMPT, PROMPT[::-1] + PROMPT[:5], PROMPT * 2]
    refs = [greedy_reference(pair.model, p, N) for p in prompts]
    plans = [[("mtp", 3)], [("eagle", 4)], [("dflash", 4)], [("lookup", 6)]]
    dec = BatchDecoder(pair.target, pair.drafter, chains=pair.chains, max_batch=4, policy=AllDraft(), block_size=4)
    assert "not packed" in dec.chain_path  # said, as the drafter path is
    sids = [dec.add(p, max_tokens=N, policy=Forced(plan)) for p, plan in zip(prompts, plans)]
    got, together = {s: [] for s in sids}, []
    while len(dec):
        steps = dec.step()
        together.append({st.source for _, st in steps if st.drafted})
        for sid, st in steps:
            got[sid] += st.tokens
    assert [got[s] for s in sids] == refs
    assert {"mtp", "eagle", "dflash", "lookup"} in together  # one step, four sources


def test_the_prefix_cache_hands_chain_caches_to_the_next_turn(family):
    """A whole entry (the next turn extends it) and a partial one (a prompt that departs from
    it: taken one token shorter) both give the target's output, and the chain caches the next
    run leaves equal fresh ones."""
    _, pair, ref = family
    prefix = PrefixCache(1 << 26, min_tokens=4)
    plan = [("mtp", 3), ("eagle", 3)]
    first = _gen(pair, Forced(plan), prefix=prefix)
    assert first.tokens == ref
    for prompt in (PROMPT + ref + [7, 11], PROMPT[:9] + [60, 61, 62]):
        want = greedy_reference(pair.model, prompt, 12)
        hits = prefix.hits
        assert _gen(pair, Forced(plan), prompt, 12, prefix=prefix).tokens == want
        assert prefix.hits == hits + 1
        entry = list(prefix._entries.values())[-1]
        assert entry.tokens == tuple(prompt + want[:-1]) and set(entry.chains) == {"mtp", "eagle"}
        for kind in ("mtp", "eagle"):
            _same_cache(entry.chains[kind], _fresh_chain(pair, kind, entry.tokens))


# -- T > 0: the chain's proposal distribution, through the loop ------------------------------------

SMALL_V = 4  # every draft lands in the target's support: a wrong q would show
SAMPLED = SamplingConfig(1.0)


@pytest.fixture(scope="module")
def small():
    """A 4-token-vocabulary llama target with a DFlash drafter, an MTP head and EAGLE-3 drafters
    with and without a reduced vocabulary, in memory: (target view, drafter, chains)."""
    import importlib

    from mlx_spec.eagle import Eagle3, Eagle3Args, eagle_config
    from mlx_spec.mtp import MTPHead
    from mlx_spec.target import Target, union_taps

    from helpers import TARGET_CONFIGS, _sharpen, tiny_drafter

    cfg = dict(TARGET_CONFIGS["llama"], vocab_size=SMALL_V)
    mod = importlib.import_module("mlx_lm.models.llama")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    _, drafter, _ = tiny_drafter(model, cfg)
    eagles = {}
    for name, vd in (("eagle", 3), ("eagle-full", None)):
        mx.random.seed(5)
        e = Eagle3(
            Eagle3Args.from_config(eagle_config(cfg, intermediate_size=96, draft_vocab_size=vd, layer_ids=(1, 2, 3)))
        )
        _sharpen(e, 5)  # (twice: peaked proposals, so a wrong q is far from the right one)
        _sharpen(e, 5)
        if vd:
            e.set_d2t(np.array([0, 2, 3]) - np.arange(3))
        eagles[name] = e.bind(Target(model, ()))
    target = Target(model, union_taps(drafter.args.target_layer_ids, eagles["eagle"].taps), final_hidden=True)
    drafter.bind(target.embed, target.head)
    mx.random.seed(3)
    head = MTPHead("llama", dict(cfg, num_nextn_predict_layers=1))
    _sharpen(head, 3)  # (twice, as the EAGLE-3 drafters)
    _sharpen(head, 3)
    head.bind(target.embed, target.head)
    return target, drafter, {"mtp": head, **eagles}


def _law(target, prompt, cfg, depth=3):
    """The target's exact law of its next ``depth`` tokens under ``cfg``."""
    from mlx_spec.sampling import target_probs

    law = {}

    def walk(prefix, p):
        if len(prefix) == depth:
            law[tuple(prefix)] = p
            return
        out = target(mx.array([prompt + prefix]), target.make_cache())
        q = np.array(target_probs(out.logits[0, -1], cfg))
        for t in np.nonzero(q)[0]:
            walk(prefix + [int(t)], p * float(q[t]))

    walk([], 1.0)
    return law


class WrongQ:
    """A chain drafter that reports another distribution than the one its drafts were drawn from
    (its q shifted by one token): rejection sampling then judges them by the wrong law. What the
    distribution test must catch (a q merely dropped is a point-mass proposal: still exact)."""

    def __init__(self, chain):
        self.chain = chain

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def propose(self, anchor, k, cache, *, sampling=0.0, key=None):
        p = self.chain.propose(anchor, k, cache, sampling=sampling, key=key)
        return Proposal(p.tokens, mx.roll(p.q, 1, axis=-1))


SMALL_PROMPT = [1, 3, 2, 0, 1, 1, 3]


def _sampled_counts(small, plans, chains, rounds=4, batch=64):
    """Counts of the first three tokens of ``rounds * batch`` seeded replies, decoded ``batch``
    at a time (sequence i drafts with ``plans[i % len(plans)]``, its cycle shifted by i), and
    the target's exact law of them."""
    target, drafter, _ = small
    law = _law(target, SMALL_PROMPT, SAMPLED)
    cells = {y: i for i, y in enumerate(sorted(law))}
    counts = np.zeros(len(cells))
    dec = BatchDecoder(target, drafter, chains=chains, max_batch=batch, policy=AllDraft(), block_size=3)
    for r in range(rounds):
        jobs = []
        for i in range(batch):
            pol = Forced(plans[i % len(plans)])
            pol.i = i
            jobs.append(
                dict(prompt=SMALL_PROMPT, max_tokens=3, sampling=replace(SAMPLED, seed=r * batch + i), policy=pol)
            )
        out = {j: [] for j in range(batch)}
        for j, st in batched_steps(dec, jobs):
            out[j] += st.tokens
        for toks in out.values():
            counts[cells[tuple(toks)]] += 1
    return counts, np.array([law[y] for y in sorted(law)])


@pytest.mark.parametrize("plan", ["mtp", "eagle", "mixed"])
def test_sampled_chain_drafts_keep_the_target_distribution(small, plan):
    """MTP; EAGLE-3 over a reduced vocabulary (its q scattered back to the target's); every
    source switching per cycle, different ones in the same step (EAGLE-3 over the full one)."""
    from test_sampling import gof_pvalue

    heads = small[2]
    chains = {"mtp": heads["mtp"], "eagle": heads["eagle-full" if plan == "mixed" else "eagle"]}
    plans = [[(plan, 3)]]
    if plan == "mixed":
        plans = [[("mtp", 3), ("eagle", 2), ("dflash", 3), ("lookup", 3)], [("eagle", 3), ("mtp", 2), ("dflash", 2)]]
    counts, law = _sampled_counts(small, plans, chains)
    assert gof_pvalue(counts, law) > 0.001


def test_the_distribution_check_catches_a_chain_proposal_with_the_wrong_q(small):
    from test_sampling import gof_pvalue

    counts, law = _sampled_counts(small, [[("mtp", 3)]], {"mtp": WrongQ(small[2]["mtp"])})
    assert gof_pvalue(counts, law) < 0.001


# -- the policy: sources, depth, cost ----------------------------------------------------------------


def _policy(acc, tc, **kw):
    from mlx_spec.costs import Costs
    from mlx_spec.policy import ChainPrior, DraftPolicy

    costs = Costs(10.0, {2: 1.0, 4: 1.2, 8: 1.6}, {B: 10.0 + (B - 1) for B in (1, 2, 3, 4, 5, 8, 9)}, 64)
    return DraftPolicy(costs, 4, sources=("mtp",), chains={"mtp": ChainPrior(tuple(acc), tc, 8, True)}, **kw)


def _best_depth(pol, tc):
    """The depth with the most expected tokens per ms, by hand: E(k) / (Tt(k + 1) + k * Tc)."""
    curve = pol.acceptance["mtp"].curve()
    rate = {k: (1 + sum(curve[:k])) / (10.0 + k + k * tc) for k in range(1, 9)}
    return max(rate, key=rate.get)


@pytest.mark.parametrize(
    "acc,tc",
    [
        ((0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6), 0.5),  # a good head: deep chains
        ((0.7, 0.35, 0.1, 0.02, 0.01, 0.0, 0.0, 0.0), 0.5),  # a weak tail: short ones
        ((0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6), 3.0),  # dear head passes: shorter
    ],
)
def test_the_policy_drafts_the_chain_depth_a_scripted_acceptance_makes_best(acc, tc):
    from mlx_spec.policy import Context

    pol = _policy(acc, tc, margin=0.0)
    k = _best_depth(pol, tc)
    assert pol.choose(Context()) == Decision("mtp", k + 1)


def test_the_chain_depth_follows_what_the_reply_accepts():
    """A chain whose drafts are all accepted drafts deeper; one whose first draft is, and no
    more, drafts short (each source learns its own acceptance by position)."""
    from mlx_spec.batch import Step
    from mlx_spec.policy import Context

    depths = []
    for accepted_of in (lambda k: k, lambda k: min(k, 1)):
        pol = _policy((0.6, 0.3, 0.15, 0.07, 0.03, 0.01, 0.0, 0.0), 0.3, margin=0.0)
        first = pol.choose(Context()).length
        for _ in range(30):
            d = pol.choose(Context())
            k = d.length - 1
            a = accepted_of(k)
            pol.observe(
                Step(tuple(range(a + 1)), drafted=k, accepted=a, block_size=d.length, source="mtp", head_passes=k)
            )
        depths.append((first, pol.choose(Context()).length))
    (first, deep), (_, one) = depths
    assert deep == 9 > first  # the deepest chain (MAX_CHAIN_DEPTH)
    assert one <= 3  # one or two drafts (an untried second position is judged by the first's)


def test_a_resting_chain_source_is_probed_like_the_drafter():
    from mlx_spec.batch import Step
    from mlx_spec.policy import Context

    pol = _policy((0.02,) * 8, 3.0)  # a chain that never pays: plain steps, and probes
    ds = []
    for _ in range(40):
        d = pol.choose(Context())
        ds.append(d)
        k = d.length - 1
        pol.observe(Step((1,), drafted=k, accepted=0, block_size=d.length, source=d.source, head_passes=k))
    probes = [i for i, d in enumerate(ds) if d.source == "mtp"]
    assert ds[0].source == PLAIN and pol.rest["mtp"]
    assert probes and all(ds[i].probe and ds[i].length <= 3 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the spacing doubles while probes fail


def test_the_batch_budget_counts_a_chain_draft_s_head_passes():
    """The same wish and acceptance: a lookup draft (rows only) is taken where a chain draft,
    paying a head pass per drafted row, is not."""
    from mlx_spec.batch import Acceptance as RowAcceptance
    from mlx_spec.batch import StepCost

    class Fixed(BatchBudget):
        def __init__(self):
            super().__init__()
            self._costs = StepCost(100.0, 4.0, 4.0, 1.0, 2.0, 5.0, 40.0)

        def observe(self, *a, **k):
            pass

    good = RowAcceptance(4, (0.6, 0.4, 0.3))
    pol = Fixed()
    assert pol.plan([4, 4], [good, good], [0, 0], [8, 8], 0, [False, False], [False, True]) == [4, 1]
    free = BatchBudget()
    free._costs = StepCost(100.0, 4.0, 4.0, 1.0, 2.0, 5.0, 0.0)
    free.observe = lambda *a, **k: None
    assert free.plan([4, 4], [good, good], [0, 0], [8, 8], 0, [False, False], [False, True]) == [4, 4]


# -- refusals by name, and what the engine says ran ---------------------------------------------------


def test_a_requested_source_that_cannot_run_is_refused_by_name(family, tmp_path, monkeypatch):
    from mlx_spec import loading, session
    from mlx_spec.config import parse_draft
    from mlx_spec.default_target import DEFAULT_TARGET_ID
    from mlx_spec.eagle import Eagle3, Eagle3Args, eagle_config, save_eagle

    from helpers import TARGET_CONFIGS

    dirs = family[0]
    t, d = str(dirs["target"]), str(dirs["drafter"])
    with pytest.raises(CheckpointError, match=r"has no mtp\.\* tensors: this conversion stripped"):
        session.check(LoadConfig(target=t, drafter=d, draft="dflash,mtp"))
    with pytest.raises(BadRequest, match="--draft eagle needs an EAGLE-3 drafter: --eagle PATH"):
        session.check(LoadConfig(target=t, drafter=d, draft="dflash,eagle"))
    with pytest.raises(BadRequest, match="unknown source 'medusa'"):
        parse_draft("dflash,medusa")
    with pytest.raises(BadRequest, match="--no-adaptive drafts a fixed DFlash block"):
        LoadConfig(target=t, draft="mtp", adaptive=False)
    with pytest.raises(BadRequest, match="--mtp .* but --draft dflash does not draft with mtp"):
        session.check(LoadConfig(target=t, drafter=d, draft="dflash", mtp=str(dirs["mtp"])))
    monkeypatch.setattr(loading, "MODELS_DIR", tmp_path)  # an install without the embedded heads
    monkeypatch.setattr(session, "MODELS_DIR", tmp_path)  # (the name chain_refs reads)
    with pytest.raises(BadRequest, match="embedded default target carries no MTP head"):
        session.chain_refs(LoadConfig(target=DEFAULT_TARGET_ID, draft="mtp"))
    assert session.chain_refs(LoadConfig(target=DEFAULT_TARGET_ID, draft="auto")) == {}
    # a drafter that does not fit the target
    other = dict(TARGET_CONFIGS["llama"], hidden_size=32, num_attention_heads=2)
    save_eagle(
        Eagle3(Eagle3Args.from_config(eagle_config(other, intermediate_size=64))),
        tmp_path / "e",
        eagle_config(other, intermediate_size=64),
    )
    with pytest.raises(
        IncompatiblePair, match="EAGLE-3 drafter does not fit the target: drafter fuses target features of width 32"
    ):
        load_pair(t, None, sources=("eagle",), eagle=tmp_path / "e")
    with pytest.raises(MlxSpecError, match="--draft eagle needs an EAGLE-3 drafter"):
        load_pair(t, None, sources=("eagle",))


def test_the_engine_line_stats_and_server_block_name_the_sources(family):
    from mlx_spec.server.schemas import speculation

    _, pair, ref = family
    info = engine_info(pair, 4, "flag", adaptive=True)
    line = info.describe()
    assert "(dflash+lookup+mtp+eagle)" in line and "MTP head" in line and "EAGLE-3 drafter" in line
    assert "DFlash block <= 16, a lookup draft, an MTP chain or an EAGLE-3 chain" in line
    result = _gen(pair, Forced([("mtp", 3), ("eagle", 4), ("dflash", 3), (PLAIN, 1)]))
    assert result.tokens == ref
    st = result.stats
    trace = st.trace_text()
    assert "m3:" in trace and "e4:" in trace and "d3:" in trace and " p" in trace
    by = st.source_stats()
    assert len(by["mtp"]["acceptance_by_position"]) == 2 and len(by["eagle"]["acceptance_by_position"]) == 3
    assert st.head_passes == by["mtp"]["drafted"] + by["eagle"]["drafted"] > 0
    block = speculation(info, st.snapshot(trace=True))
    assert block["sources"] == ["dflash", "lookup", "mtp", "eagle"] and set(block["chains"]) == {"mtp", "eagle"}
    assert {"mtp", "eagle", "dflash"} <= set(block["cycles"]["sources"])
    assert block["cycles"]["head_passes"] == st.head_passes
    # a pair without DFlash: the chain drafts alone
    only = replace(pair, drafter=None, drafter_id=None, sources=("mtp", "lookup"), chain_ids={"mtp": "x"})
    one = engine_info(only, adaptive=True)
    assert one.method == "mtp" and one.speculative and "(mtp+lookup)" in one.describe()


# -- the tuner and bench --------------------------------------------------------------------------


def test_the_tuner_measures_each_chain_drafter_and_the_policy_starts_from_it(family):
    from mlx_spec.policy import MAX_CHAIN_DEPTH, PolicyFactory
    from mlx_spec.tuning import tune
    from mlx_spec.tuning.store import FORMAT, TuneResult

    _, pair, _ = family
    result = tune(pair, budget_s=4, tokens=6, candidates=[2, 3], threads=[None], probe_prompts=1, cost_rounds=(3, 3))
    assert FORMAT == 4 and result.format == FORMAT and set(result.key) >= {"mtp", "eagle"}
    for kind in ("mtp", "eagle"):
        c = result.chains[kind]
        assert c["pass_ms"] == result.costs.tc_ms[kind] > 0
        assert len(c["acceptance_by_position"]) == MAX_CHAIN_DEPTH and 1 <= c["depth"] <= MAX_CHAIN_DEPTH
    assert TuneResult.from_dict(result.as_dict()).chains == result.chains
    factory = PolicyFactory(pair, result, sources=("mtp", "eagle"))
    for kind in ("mtp", "eagle"):
        prior = factory.chains[kind]
        assert prior.measured and prior.pass_ms == result.chains[kind]["pass_ms"]
        assert list(prior.acceptance) == result.chains[kind]["acceptance_by_position"]


def _chain_only(dirs, sources=("mtp", "eagle", "lookup")):
    """The family's target with its MTP head and EAGLE-3 drafter and no DFlash drafter."""
    return load_pair(str(dirs["target"]), None, sources=sources, mtp=dirs["mtp"], eagle=dirs["eagle"])


def _small_tune(pair, budget_s, progress=None):
    from mlx_spec.tuning import tune

    # (a budget far above what 3 race rounds of the tiny models take: the race always runs, and ends on its rounds)
    kw = dict(tokens=6, threads=[None], probe_prompts=1, cost_rounds=(3, 3), max_rounds=3)
    return tune(pair, budget_s=budget_s, progress=progress, **kw)


def test_a_pair_without_a_dflash_drafter_tunes_on_first_launch_stores_reloads_and_says_so(family, tmp_path):
    """A target with an MTP head and an EAGLE-3 drafter and no DFlash drafter: the first launch
    tunes it (within its budget, with progress) and stores under the pair's key (the chain
    drafters in it, no DFlash drafter); the next launch reads the store; the engine line names
    each chain's tuned depth and where the priors came from, and the policy starts from them.
    With --no-tune: the stated default prior, said so, and nothing stored is used."""
    from mlx_spec.generation import policies
    from mlx_spec.policy import MAX_CHAIN_DEPTH
    from mlx_spec.session import choose_block, info_for
    from mlx_spec.tuning import load_result, tune_key

    pair = _chain_only(family[0])
    notes, calls = [], []

    def tune_fn(p, budget_s, progress):
        calls.append(budget_s)
        return _small_tune(p, budget_s, progress)

    cfg = LoadConfig(target=str(family[0]["target"]), draft="mtp,eagle,lookup", tune_budget_s=60)
    choice = choose_block(pair, cfg, lambda d, t, m: notes.append(m), root=tmp_path, tune_fn=tune_fn)
    assert calls == [60] and any(m.startswith("acceptance probe (MTP)") for m in notes)
    assert any("pass costs" in m for m in notes)
    stored = load_result(tune_key(pair), tmp_path)
    assert stored is not None and set(stored.key) == {"machine", "target", "mtp", "eagle"}  # (no DFlash drafter)
    assert stored.best_source in ("mtp", "eagle") and stored.acceptance_by_position == ()
    assert set(stored.costs.tc_ms) == {"mtp", "eagle"} and set(stored.costs.tt_ms) >= set(range(2, MAX_CHAIN_DEPTH + 2))
    plain = [c for c in stored.candidates if c.block == 1]
    assert plain and plain[0].measured  # raced against plain decoding
    for kind in ("mtp", "eagle"):
        c = stored.chains[kind]
        rows = [x for x in stored.candidates if x.source == kind]
        assert [x.block for x in rows] == list(range(2, MAX_CHAIN_DEPTH + 2))  # every depth, modelled
        assert c["pass_ms"] == stored.costs.tc_ms[kind] and 1 <= c["depth"] <= MAX_CHAIN_DEPTH
        assert len(c["acceptance_by_position"]) == MAX_CHAIN_DEPTH and "rounds" in c
    depths = dict(choice.depths)
    assert depths == {k: stored.chains[k]["depth"] for k in ("mtp", "eagle")}
    again = choose_block(pair, cfg, lambda d, t, m: None, root=tmp_path, tune_fn=tune_fn)
    assert calls == [60] and again == choice  # the next launch reads the store
    info = info_for(pair, choice, adaptive=True)
    line = info.describe()
    for kind, name in (("mtp", "an MTP chain"), ("eagle", "an EAGLE-3 chain")):
        assert f"{name} (prior depth {depths[kind]})" in line, line
    assert f"(chain priors: {stored.source}" in line and stored.date[:10] in line
    # the policy starts from the stored priors (the engine reads the default store: put it there)
    from mlx_spec.tuning import save_result

    save_result(stored)
    factory = policies(pair, info)
    assert factory.measured and all(factory.chains[k].measured for k in ("mtp", "eagle"))
    assert factory.chains["mtp"].pass_ms == stored.chains["mtp"]["pass_ms"]
    # --no-tune: the stated default prior, said so; the stored result is not what the policy starts from
    off = choose_block(pair, replace(cfg, tune=False), root=tmp_path, tune_fn=tune_fn)
    assert calls == [60] and off.depths == ()
    line = info_for(pair, off, adaptive=True).describe()
    assert "(chain priors: not tuned (--no-tune): the stated default prior)" in line and "prior depth" not in line
    factory = policies(pair, info_for(pair, off, adaptive=True))
    assert not factory.measured and not any(factory.chains[k].measured for k in ("mtp", "eagle"))


def test_a_chain_only_choice_goes_to_the_drafter_the_model_puts_first_and_off_names_each():
    """The chain sweep's decision, per drafter by the rule that chooses blocks, then the drafter
    whose choice scores highest; plain when none beats it by its noise."""
    from mlx_spec.tuning import Candidate
    from mlx_spec.tuning.run import ChainSweep

    sweep = ChainSweep.__new__(ChainSweep)
    sweep.chains, sweep.dflt, sweep.noise_floor = {"mtp": None, "eagle": None}, None, 0.03

    def cands(mtp, eagle):
        out = [Candidate(1, False, predicted=1.0, noise=0.0)]
        for src, xs in (("mtp", mtp), ("eagle", eagle)):
            out += [
                Candidate(k + 1, False, predicted=x, tau=1 + 0.5 * k, noise=0.0, source=src)
                for k, x in enumerate(xs, 1)
            ]
        return out

    key, why = sweep.decision(cands([1.2, 1.35, 1.3], [1.1, 1.15, 1.05]))
    assert key == (3, None, "mtp") and why.startswith("MTP first (x1.35); MTP: mtp k=2 x1.35"), why
    assert "EAGLE-3: eagle k=2 x1.15" in why
    key, why = sweep.decision(cands([1.2, 1.3, 1.25], [1.5, 1.1, 1.0]))
    assert key == (2, None, "eagle")
    key, why = sweep.decision(cands([0.9, 0.8, 0.7], [1.01, 0.9, 0.8]))
    assert key == (1, None) and why.startswith("off: no chain drafter beats plain decoding by its noise (MTP: ")
    assert "EAGLE-3: the best chain eagle k=1 x1.01 does not beat plain" in why


def test_tune_runs_for_a_chain_only_pair_and_prints_what_it_chose_per_drafter(family, tmp_path, monkeypatch, capsys):
    import json

    from mlx_spec.cli import main

    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path))
    dirs = family[0]
    argv = ["tune", "--target", str(dirs["target"]), "--draft", "mtp,lookup", "--mtp", str(dirs["mtp"])]
    assert main(argv + ["--budget", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"target {dirs['target']} | MTP {dirs['mtp']} | prompts ")
    assert lines[1].split()[:2] == ["chain", "threads"] and any(x.split()[0].lstrip("*") == "off" for x in lines[2:])
    assert any(x.lstrip("* ").startswith("mtp k=8 ") for x in lines)
    head = next(x for x in lines if x.startswith("MTP: one pass "))
    assert " ms, acceptance by position " in head and "; depth " in head and "(model x" in head
    assert "choice: " in out and "why: " in out and f"stored: {tmp_path}" in out
    assert main(argv + ["--budget", "2", "--tokens", "4", "--candidates", "2,3", "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)
    assert stored["best_source"] == "mtp" and {c["source"] for c in stored["candidates"]} == {"dflash", "mtp"}
    assert {(c["source"], c["block"]) for c in stored["candidates"]} == {("dflash", "off"), ("mtp", "2"), ("mtp", "3")}
    assert "drafter" not in stored["key"] and "mtp" in stored["key"]
    # refused by name: a block size for a pair without a DFlash drafter; a pair with nothing to tune
    gen = ["generate", "--target", str(dirs["target"]), "--draft", "mtp", "--mtp", str(dirs["mtp"]), "--prompt", "x"]
    assert main(gen + ["--block-size", "4"]) == 1
    assert "--block-size 4 pins the DFlash block, but --draft mtp loads no DFlash drafter" in capsys.readouterr().err
    assert main(["tune", "--target", str(dirs["target"]), "--draft", "lookup", "--budget", "2"]) == 1
    assert "nothing to tune: --draft lookup loads no DFlash drafter and no chain drafter" in capsys.readouterr().err


def test_bench_methods_runs_a_policy_row_per_source_set_against_both_plain_baselines(family, tmp_path, capsys):
    import json

    from mlx_spec.cli import main

    dirs = family[0]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abcabcabcabc", "kind": "code"}\n{"prompt": "hello there", "kind": "prose"}\n')
    argv = ["bench", "--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]), "--mtp", str(dirs["mtp"])]
    argv += ["--eagle", str(dirs["eagle"]), "--prompts", str(f), "--max-tokens", "10", "--repeats", "1", "--json"]
    main(argv + ["--methods", "lookup,mtp,eagle,dflash,auto"])
    out = json.loads(capsys.readouterr().out)
    rows = {r["label"]: r for r in out["rows"]}
    assert list(rows) == [
        "mlx-lm plain",
        "plain (ours)",
        "lookup per-cycle",
        "mtp per-cycle",
        "eagle per-cycle",
        "dflash per-cycle",
        "auto (every source)",
    ]
    assert all(r["diverged"] == 0 for r in out["rows"])  # greedy: every row is the target's output
    assert set(out["costs"]["tc_ms"]) == {"mtp", "eagle"}
    for kind in ("mtp", "eagle"):
        r = rows[f"{kind} per-cycle"]
        assert r["td_ms"] == round(out["costs"]["tc_ms"][kind], 2)  # Td of a chain row: its head pass
        if r["status"] == "ok":
            assert r["speedup"] > 0 and r["speedup_mlx"] > 0 and r["tau"] is not None
            assert set(r["sources"]) <= {kind} and r["ceiling"] is not None
    plain = ["bench", "--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]), "--prompts", str(f)]
    assert main(plain + ["--draft", "dflash", "--methods", "mtp"]) == 1
    assert "--methods mtp: the loaded pair cannot draft with mtp" in capsys.readouterr().err


def test_verify_checks_every_loaded_chain_drafter_against_plain_decoding(family):
    from mlx_spec.verify import IDENTICAL, check

    _, pair, _ = family
    report = check(pair, prompts=[PROMPT], block_sizes=[3], max_tokens=12)
    assert [(r.source, r.block_size) for r in report.results] == [("dflash", 3), ("mtp", 3), ("eagle", 3)]
    assert report.ok and all(r.verdict == IDENTICAL and r.cycles for r in report.results)
    assert "mtp k=2" in report.results[1].describe()


def test_the_memory_plan_counts_the_chain_drafters_asked_for(family):
    from mlx_spec.memory import batch_room
    from mlx_spec.session import plan_session

    dirs = family[0]
    t, d = str(dirs["target"]), str(dirs["drafter"])
    plain = plan_session(LoadConfig(target=t, drafter=d), enforce=False).plan
    both = plan_session(
        LoadConfig(target=t, drafter=d, draft="dflash,mtp,eagle", mtp=str(dirs["mtp"]), eagle=str(dirs["eagle"])),
        enforce=False,
    ).plan
    names = [i.name for i in both.items]
    assert {"MTP head weights", "EAGLE-3 weights"} <= set(names) and {
        "MTP head draft KV cache",
        "EAGLE-3 draft KV cache",
    } <= set(names)
    assert not {"MTP head weights", "EAGLE-3 weights"} & {i.name for i in plain.items}
    assert both.total > plain.total and batch_room(both).per_sequence > batch_room(plain).per_sequence


def test_a_batched_server_with_chain_drafters_answers_as_plain_decoding_and_says_so(family):
    """serve with every source loaded (--draft auto-like), two requests batched: each reply is
    the target's own, the speculation block names the sources and chain drafters, /health the
    chain path and /metrics the head passes."""
    import threading

    from mlx_spec.server.app import create_app
    from mlx_spec.session import Session

    import httpx
    from test_server import running_engine, serve_in_thread

    dirs, pair, _ = family

    def loader():
        p = load_pair(
            str(dirs["target"]),
            str(dirs["drafter"]),
            sources=("dflash", "lookup", "mtp", "eagle"),
            mtp=dirs["mtp"],
            eagle=dirs["eagle"],
        )
        return Session.of(p, engine_info(p, 4, "flag", adaptive=True))

    prompts = [PROMPT, PROMPT * 2]
    want = [greedy_reference(pair.model, p, 12) for p in prompts]
    with running_engine(loader, max_batch=2) as e, serve_in_thread(create_app(e, keepalive_s=0.5)) as u:
        got = [None, None]

        def ask(i):
            body = {"model": e.info.target, "prompt": prompts[i], "max_tokens": 12, "temperature": 0}
            got[i] = httpx.post(f"{u}/v1/completions", json=body, timeout=120).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        tok = pair.tokenizer
        for g, w in zip(got, want):
            assert g["choices"][0]["text"] == tok.decode([t for t in w if t not in tok.eos_token_ids])
            spec = g["speculation"]
            assert spec["sources"] == ["dflash", "lookup", "mtp", "eagle"] and set(spec["chains"]) == {"mtp", "eagle"}
            assert "head_passes" in spec["cycles"]
        health = httpx.get(f"{u}/health", timeout=30).json()
        assert health["batch_chain"] == "eagle, mtp: k head passes per drafting sequence (not packed across sequences)"
        text = httpx.get(f"{u}/metrics", timeout=30).text
        assert "mlx_spec:spec_decode_head_passes_total" in text and "batch_chain_drafters{" in text
