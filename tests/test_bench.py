"""bench: ceiling/efficiency arithmetic, the engaged-mechanism check, baselines, a --json smoke."""

import json
import math

from mlx_spec.analysis import COPY_SUBSET, copy_ceiling, copy_max_draft, copy_oracle, copy_share, reach_table, scopes
from mlx_spec.baselines import ar_draft_steps, find_draft, layer_skip_draft, lookup_steps
from mlx_spec.bench import (
    Costs,
    Method,
    PromptRow,
    Run,
    Sample,
    ceiling,
    efficiency,
    engaged,
    pooled_ceiling,
    prompt_report,
    subset_speedups,
    summarize,
)
from mlx_spec.decode import Step, spec_steps
from mlx_spec.progress import Bar as ProgressBar
from mlx_spec.prompts import BUILTIN, KINDS, WORKLOADS, builtin_prompts, interleave, load_prompts
from mlx_spec.stats import Stats
from mlx_spec.target import Target

import pytest
from helpers import VOCAB, ScriptedDrafter, greedy_reference, save_tiny_pair, tiny_model

PROMPT = [1, 5, 9, 17, 33, 2, 8, 5, 9, 17]


def test_ceiling_and_efficiency():
    assert ceiling(3.0, 100.0, 20.0, 130.0) == pytest.approx(2.0)  # tau * T1 / (Td + Tt)
    assert ceiling(1.0, 100.0, 0.0, 100.0) == pytest.approx(1.0)  # plain-like cycle: no gain
    assert efficiency(1.8, 2.0) == pytest.approx(0.9)
    assert math.isnan(efficiency(1.0, math.nan)) and math.isnan(ceiling(2, 10, 0, 0))


def test_engaged():
    assert not engaged(0, 0) and not engaged(40, 0) and engaged(40, 1)
    # a per-cycle policy that stayed plain on a weak set still ran (its decisions are the mechanism)
    assert engaged(0, 0, policy=True, cycles=30) and not engaged(0, 0, policy=True, cycles=0)
    # ... but one whose sources include DFlash probes by its third cycle: no draft at all past that
    # is a broken engine (the probe path, or the drafter lost)
    assert not engaged(0, 0, policy=True, cycles=4, probes=True) and engaged(0, 0, policy=True, cycles=3, probes=True)
    assert engaged(2, 0, policy=True, cycles=30, probes=True)
    # probes the policy trimmed to the anchor (the drafter ran, nothing was verified) count too
    assert engaged(0, 0, policy=True, cycles=30, probes=True, drafter_ran=3)


def test_costs_interpolate_and_round_trip():
    c = Costs(100.0, {2: 30.0, 4: 40.0}, {1: 100.0, 4: 130.0, 8: 170.0}, 64)
    assert c.verify(6) == pytest.approx(150.0) and c.verify(12) == pytest.approx(210.0)
    assert c.draft(3) == pytest.approx(35.0) and c.draft(1) == 0.0
    assert Costs.from_dict(json.loads(json.dumps(c.as_dict()))) == c
    noisy = Costs(100.0, {2: 30.0, 4: 50.0, 6: 35.0, 8: 60.0}, {1: 100.0, 4: 150.0, 6: 120.0, 8: 160.0}, 64).smoothed()
    tt = [noisy.tt_ms[b] for b in (1, 4, 6, 8)]
    assert tt == sorted(tt) and sum(tt) == pytest.approx(530.0, abs=0.01)  # a line through the points
    assert noisy.t1_ms == 100.0


def _run(steps, seconds_per_cycle, first=0.5):
    st = Stats()
    for s in steps:
        st.add(s)
    n = len(steps) - 1
    toks = [t for s in steps for t in s.tokens]
    blocks = {}
    for s in steps[1:]:
        blocks[s.drafted + 1] = blocks.get(s.drafted + 1, 0) + 1
    return Run(toks, first + n * seconds_per_cycle, first, len(steps[0].tokens), st, blocks)


def _steps(per_cycle: list[tuple[int, int]]):
    """(drafted, accepted) per cycle -> Steps committing accepted + 1 tokens."""
    out, t = [Step((0,), prefill=True)], 1
    for d, a in per_cycle:
        out.append(Step(tuple(range(t, t + a + 1)), drafted=d, accepted=a, block_size=d + 1))
        t += a + 1
    return out


def test_summarize_speedup_ceiling_and_failed_rows():
    plain, spec, dead = Method("plain"), Method("dflash", 4), Method("dflash", 8)
    costs = Costs(100.0, {4: 20.0, 8: 30.0}, {1: 100.0, 4: 130.0, 8: 160.0}, 32)
    samples = []
    for r in range(3):
        ps = _steps([(0, 0)] * 24)  # 24 plain tokens after the first
        samples.append(Sample(plain, r, "p", "code", _run(ps, 0.1)))
        ss = _steps([(3, 2)] * 8)  # tau 3 -> 24 tokens in 8 cycles
        samples.append(Sample(spec, r, "p", "code", _run(ss, 0.15)))
        samples.append(Sample(dead, r, "p", "code", _run(_steps([(7, 0)] * 24), 0.2)))
    rows = {r.label: r for r in summarize(samples, costs)}
    p, s, d = rows["plain (ours)"], rows["dflash B=4"], rows["dflash B=8"]
    assert p.status == "ok" and p.speedup == 1.0 and p.tau is None
    assert s.status == "ok" and s.tau == 3.0 and s.acceptance == pytest.approx(2 / 3, abs=1e-3)
    assert s.acceptance_by_position == [1.0, 1.0, 0.0]
    assert s.speedup == pytest.approx(2.0)  # (24 tok / 1.2 s) / (24 tok / 2.4 s)
    assert s.ceiling == pytest.approx(3 * 100 / 150)  # tau * T1 / (Td + Tt(4))
    assert s.efficiency == pytest.approx(s.speedup / s.ceiling, abs=1e-3)
    assert d.status.startswith("failed: mechanism did not engage")
    assert d.decode_tps is None and d.speedup is None and d.ceiling is None  # never a speed
    assert Stats.merged([x.run.stats for x in samples if x.method == spec]).cycles == 24


def test_copy_share_counts_reply_tokens_in_spans_of_the_prompt():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert copy_share(prompt, [1, 2, 3, 4, 5]) == 1.0
    assert copy_share(prompt, [9, 9, 2, 3, 4, 5, 9, 9]) == pytest.approx(0.5)  # one 4-gram span
    assert copy_share(prompt, [1, 2, 3, 9, 5, 6, 7]) == 0.0  # spans shorter than 4 do not count
    assert copy_share(prompt, [5, 6, 7, 8, 1, 2, 3, 4]) == 1.0 and copy_share(prompt, []) == 0.0
    assert copy_share(prompt, [1, 2, 3, 4, 5, 6], n=6) == 1.0 and copy_share(prompt, [1, 2, 3, 4, 5], n=6) == 0.0
    # a reply counts in the "copying" totals from COPY_SUBSET on (the scripts' scopes), as in bench's table
    assert scopes(COPY_SUBSET) == ("all", "copying") and scopes(COPY_SUBSET - 0.01) == ("all",)


def test_copy_ceiling_is_an_oracle_over_the_copied_spans():
    """A fake cost curve: T1 100 ms, Tt(L) = 100 + 5 (L - 1). The oracle drafts copied tokens in
    blocks of up to 32 drafts (+ the bonus), plain steps elsewhere; the first token is the prefill's."""
    linear = Costs(100.0, {}, {1: 100.0, 33: 260.0}, 0)
    file = list(range(100, 200))
    assert copy_oracle(file, file, linear) == (99, pytest.approx(3 * 260.0))  # 3 blocks of 33
    assert copy_ceiling(file, file, linear) == pytest.approx(9900 / 780)
    assert copy_ceiling([1, 2, 3], list(range(50, 90)), linear) == 1.0  # nothing to copy: plain steps
    assert math.isnan(copy_ceiling(file, file[:1], linear))
    # 20 new tokens (19 plain steps after the prefill's), then 40 copied ones: 2 cycles of 38 drafts
    reply = list(range(20)) + file[:40]
    assert copy_oracle(file, reply, linear) == (59, pytest.approx(19 * 100 + 2 * 100 + 5 * 38))
    # a curve that jumps past 9 rows: the oracle keeps to blocks of 9 (not the longest one)
    step = Costs(100.0, {}, {1: 100.0, 9: 100.0, 10: 1000.0, 33: 1000.0}, 0)
    assert copy_oracle(file, file[:40], step) == (39, pytest.approx(500.0))
    assert copy_ceiling(file, file, linear, max_draft=8) == pytest.approx(9900 / (11 * 140))  # 11 blocks of 9
    rows = [
        PromptRow("a", "agent", 100, 100, 1.0, oracle=(99, 780.0)),
        PromptRow("b", "agent", 3, 40, 0.0, oracle=(39, 3900.0)),
        PromptRow("c", "agent", 3, 1, 0.0),
    ]
    assert pooled_ceiling(rows, 100.0) == pytest.approx(round(138 * 100 / 4680, 3))
    assert pooled_ceiling(rows[2:], 100.0) is None


def test_a_policy_rows_model_time_charges_the_draft_pass_only_where_the_drafter_ran():
    from mlx_spec.bench import model_ms

    costs = Costs(100.0, {4: 20.0, 8: 30.0}, {1: 100.0, 4: 130.0, 8: 160.0}, 32)
    blocks, drafter = {1: 2, 4: 3, 8: 1}, {4: 2}  # 2 plain steps, 3 + 1 drafted cycles, 2 of them by DFlash
    assert model_ms(Method("default", 8), blocks, costs, drafter) == pytest.approx(2 * 100 + 3 * 130 + 160 + 2 * 20)
    assert model_ms(Method("lookup-policy", 8), blocks, costs, {}) == pytest.approx(2 * 100 + 3 * 130 + 160)
    assert model_ms(Method("dflash", 4), {4: 3}, costs) == pytest.approx(3 * 150)


def test_a_fixed_block_runs_one_row_cycle_is_a_verify_pass_not_a_plain_step():
    """Without a policy, spec_steps verifies the anchor alone through the target's verify pass
    (taps recorded) when one token of room is left (L = 1: most 24-token tuner runs end so):
    model_ms books Tt(1), not T1 as Costs.step_ms(1, 1) would, and no draft pass."""
    from mlx_spec.bench import model_ms

    costs = Costs(100.0, {4: 20.0}, {1: 110.0, 4: 130.0}, 32)
    assert model_ms(Method("dflash", 4), {1: 1, 4: 3}, costs) == 110.0 + 3 * (20.0 + 130.0)
    assert costs.step_ms(1, 1) == 100.0  # (the policy loop's one-row cycle: a plain step)
    assert model_ms(Method("plain"), {1: 5}, costs) == 5 * 100.0


def test_a_switched_cycle_charges_the_draft_pass_at_the_drafters_block(monkeypatch):
    """pick() may verify the lookup's 32 drafts after the drafter ran at 8: the drafter's pass is
    charged at Td(8), not Td(33)."""
    from types import SimpleNamespace

    from mlx_spec.bench import Runner, model_ms

    runner = Runner(SimpleNamespace(tokenizer=SimpleNamespace(eos_token_ids=[])))
    steps = [
        Step((0,), prefill=True),
        Step((1,), source="plain"),
        Step(tuple(range(33)), drafted=32, accepted=32, block_size=33, source="lookup", draft_ms=5.0, draft_block=8),
        Step((1, 2), drafted=7, accepted=1, block_size=8, source="dflash", draft_ms=5.0, draft_block=8),
        Step((1, 2), drafted=3, accepted=1, block_size=4, source="lookup"),
    ]
    monkeypatch.setattr(runner, "steps", lambda method, ids, n: iter(steps))
    run = runner.run(Method("default", 8), [1], 40)
    assert run.blocks == {1: 1, 33: 1, 8: 1, 4: 1} and run.drafter_blocks == {8: 2}
    costs = Costs(100.0, {8: 30.0, 33: 90.0}, {1: 100.0, 4: 130.0, 8: 160.0, 33: 300.0}, 32)
    assert model_ms(Method("default", 8), run.blocks, costs, run.drafter_blocks) == pytest.approx(
        100 + 300 + 160 + 130 + 2 * 30
    )


def test_copy_table_shows_the_ceiling_and_each_rows_share():
    from mlx_spec.bench import Row
    from mlx_spec.commands.bench import copy_table

    rows = [Row("plain (ours)", "plain", 1), Row("default engine", "default", 8, tau=5.0)]
    prompts = [
        PromptRow(
            "agent-1",
            "agent",
            150,
            100,
            0.9,
            tau={"default engine": 5.0},
            speedup={"default engine": 3.0},
            speedup_mlx={"default engine": 3.1},
            ceiling=6.0,
            oracle=(99, 1000.0),
            of_ceiling={"default engine": 0.5},
        ),
        PromptRow("agent-5", "agent", 120, 60, 0.2, ceiling=1.1, oracle=(59, 5000.0)),
    ]
    text = copy_table(prompts, rows, {"default engine": (3.0, 3.1)}, {"agent": 2.0, "copying": 6.0})
    assert "ceiling" in text.splitlines()[1] and "default engine tau x/x-mlx %ceil" in text
    assert "5.00 3.00/3.10 50%" in text and "6.00" in text
    assert (
        "copy share >= 50%: agent-1; ceiling x6.00): default engine x3.00 / x3.10 mlx-lm (50% of the ceiling)"
    ) in text
    assert "all agent prompts: ceiling x2.00" in text


def test_two_baselines_per_kind_and_the_worst_prompt():
    """Every speedup against our plain path and against mlx-lm's; the worst single prompt."""
    mlx, plain, spec = Method("mlx-lm"), Method("plain"), Method("dflash", 4)
    assert not mlx.speculative and mlx.label == "mlx-lm plain" and plain.label == "plain (ours)"
    samples = []
    for r in range(3):
        for pid, kind, spec_s in (("c1", "code", 0.05), ("c2", "code", 0.1), ("p1", "prose", 0.2)):
            # plain: 24 tokens at 0.1 s; mlx-lm: at 0.08 s; dflash: 8 cycles (tau 3) at spec_s
            samples.append(Sample(plain, r, pid, kind, _run(_steps([(0, 0)] * 24), 0.1)))
            samples.append(Sample(mlx, r, pid, kind, _run(_steps([(0, 0)] * 24), 0.08)))
            samples.append(Sample(spec, r, pid, kind, _run(_steps([(3, 2)] * 8), spec_s)))
    rows = {r.label: r for r in summarize(samples)}
    m, p, s = rows["mlx-lm plain"], rows["plain (ours)"], rows["dflash B=4"]
    assert p.speedup == 1.0 and p.speedup_mlx == pytest.approx(0.8) and m.speedup == pytest.approx(1.25)
    assert s.speedup_by_kind == {"code": pytest.approx(24 * 0.1 / (8 * 0.075)), "prose": pytest.approx(1.5)}
    assert s.speedup_by_kind_mlx["prose"] == pytest.approx(1.2)
    assert s.tau_by_kind == {"code": 3.0, "prose": 3.0} and p.tau_by_kind == {}  # drafting rows only
    assert s.worst == ("p1", pytest.approx(1.5)) and s.worst_mlx == ("p1", pytest.approx(1.2))
    assert m.worst_mlx == (m.worst_mlx[0], 1.0)
    prompts = [("c1", "code", [0, 1, 2, 3, 4, 5]), ("c2", "code", [7]), ("p1", "prose", [9])]
    pr = {x.prompt_id: x for x in prompt_report(samples, prompts)}
    assert pr["c1"].copy_share == pytest.approx(6 / 25)  # tokens 0..5 of the reply repeat the prompt
    assert pr["c2"].copy_share == 0.0 and pr["p1"].tau["dflash B=4"] == 3.0
    assert pr["c1"].speedup["dflash B=4"] == pytest.approx(6.0) and pr["p1"].speedup_mlx["dflash B=4"] == pytest.approx(
        1.2
    )
    costs = Costs(0.1e3, {}, {1: 100.0, 33: 260.0}, 0)  # a cost curve: the copy ceiling, each row's share
    pr = {x.prompt_id: x for x in prompt_report(samples, prompts, costs=costs)}
    c1 = pr["c1"]
    assert c1.oracle == (24, pytest.approx(125.0 + 18 * 100)) and c1.ceiling == pytest.approx(2400 / 1925, abs=1e-3)
    assert c1.of_ceiling == {"dflash B=4": pytest.approx(6.0 / c1.ceiling, abs=1e-3)}  # speculative rows only
    assert pr["c2"].ceiling == 1.0
    # past the longest measured verify Tt would be extrapolated (falling here: Tt(6) 110 < Tt(4)),
    # so the oracle keeps to blocks of up to 3 drafts (copy_max_draft): Tt(4) for tokens 1-4, Tt(2)
    # for 5-6, plain steps after (not one block of 5 drafts at the extrapolated 110)
    falling = Costs(100.0, {}, {1: 100.0, 2: 150.0, 4: 130.0}, 0)
    c1 = {x.prompt_id: x for x in prompt_report(samples, prompts, costs=falling)}["c1"]
    assert copy_max_draft(falling) == 3 and c1.oracle == (24, pytest.approx(130.0 + 150.0 + 18 * 100))
    sub = subset_speedups(samples, {"c1"})
    assert sub["dflash B=4"] == (pytest.approx(6.0), pytest.approx(4.8))


def test_find_draft():
    h = [1, 2, 3, 4, 9, 1, 2, 3]
    assert find_draft(h, 3) == [4, 9, 1]  # the trigram 1 2 3 occurred before: continue it
    assert find_draft(h, 1) == [4]
    assert find_draft([5, 6, 7], 4) == [] and find_draft(h, 0) == []


@pytest.fixture(scope="module")
def tiny():
    model, cfg = tiny_model("qwen3")
    return model, cfg, greedy_reference(model, PROMPT, 30)


def test_lookup_and_ar_draft_are_lossless(tiny):
    model, cfg, ref = tiny
    for k in (1, 3, 7):
        steps = list(lookup_steps(model, PROMPT, num_draft=k, max_tokens=30))
        assert [t for s in steps for t in s.tokens] == ref
        assert all(s.drafted <= k and s.accepted <= s.drafted for s in steps)
    other, _ = tiny_model("qwen3", seed=3)
    for k in (2, 4):
        steps = list(ar_draft_steps(model, other, PROMPT, num_draft=k, max_tokens=30))
        assert [t for s in steps for t in s.tokens] == ref
    same = list(ar_draft_steps(model, model, PROMPT, num_draft=3, max_tokens=30))  # draft = target
    assert all(s.accepted == s.drafted for s in same)
    skip = layer_skip_draft(model, 2)  # the target's first 2 of 4 layers, shared weights
    assert len(skip.layers) == 2 and len(model.layers) == 4
    steps = list(ar_draft_steps(model, skip, PROMPT, num_draft=3, max_tokens=30))
    assert [t for s in steps for t in s.tokens] == ref


class _Planned:
    """A DFlash-only policy that takes its blocks from ``plan`` (1 = a plain step) and keeps what
    it is shown: the least a per-cycle policy must answer to the decode loop."""

    sources, max_lookup = ("dflash",), 0

    def __init__(self, plan, seen):
        self.plan, self.seen = list(plan), seen

    def stays_plain(self, ctx) -> bool:
        return self.plan[0] == 1

    def choose(self, ctx):
        from mlx_spec.policy import DFLASH, PLAIN, Decision

        L = self.plan.pop(0)
        return Decision(DFLASH if L > 1 else PLAIN, L)

    def pick(self, decision, drafts, confidence, ctx=None, *, trim=False):
        return decision

    def observe(self, step) -> None:
        self.seen.append(step)


def test_spec_steps_policy_sets_each_cycle(tiny):
    model, cfg, ref = tiny
    target = Target(model, [0])
    seen = []
    policy = _Planned([4, 1, 1, 6, 2, 8] * 20, seen)
    steps = list(
        spec_steps(
            target, ScriptedDrafter(PROMPT + ref, VOCAB, right=2), PROMPT, block_size=16, max_tokens=30, policy=policy
        )
    )
    assert [t for s in steps for t in s.tokens] == ref
    assert seen[0].prefill and [s.block_size for s in steps[1:5]] == [4, 1, 1, 6]
    assert steps[2].drafted == 0 and steps[4].accepted == 2


def test_prompts_builtin_and_jsonl(tmp_path):
    assert {p.kind for p in BUILTIN} == set(KINDS) and len(builtin_prompts(per_kind=1)) == len(KINDS)
    assert [p.kind for p in interleave(builtin_prompts())][:4] == ["code", "math", "prose", "agent"]
    assert {p.kind for p in builtin_prompts(WORKLOADS["chat"])} == {"code", "math", "prose"}
    agent = builtin_prompts(WORKLOADS["agent"])
    assert len(agent) >= 5 and all(p.messages for p in agent)
    assert any(len(p.messages) == 3 and p.messages[1]["role"] == "assistant" for p in agent)  # multi-turn edits
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "hi", "kind": "code"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n'
        '{"id": "math-7", "prompt": "1+1?"}\n'
    )
    ps = load_prompts(f)
    assert [p.kind for p in ps] == ["code", "user", "math"] and ps[1].messages[0]["content"] == "yo"
    f.write_text('{"nope": 1}\n')
    from mlx_spec.errors import BadRequest

    with pytest.raises(BadRequest, match="p.jsonl:1"):
        load_prompts(f)
    # the same reader serves `train data --prompts`: bare strings and "text" objects too
    f.write_text('"write a haiku"\n{"text": "sum a list", "id": "code-3"}\n')
    assert [(p.text, p.kind) for p in load_prompts(f)] == [("write a haiku", "user"), ("sum a list", "code")]
    f.write_text('{"prompt": "  "}\n')
    with pytest.raises(BadRequest, match="empty prompt"):
        load_prompts(f)


def test_bench_prompts_are_not_training_prompts():
    """The built-in bench set (agent edits included) stays out of the training mixes: no prompt
    text in common, and no agent file's lines inside a training prompt."""
    from mlx_spec.train import prompts as train

    mixes = train.builtin_prompts(1500) + train.wide_prompts(3000) + train.broad_prompts(3000)
    keys = {train.prompt_key(p) for p in mixes}
    assert not [p.id for p in BUILTIN if train.prompt_key(p) in keys]
    text = "\n".join(keys)
    for p in (p for p in BUILTIN if p.kind == "agent"):
        body = p.messages[0]["content"]
        file = body[body.index("```") :]
        assert not [ln for ln in file.splitlines() if len(ln) > 24 and ln in text], p.id


def test_progress_bar_off_a_tty_says_one_line():
    import io

    buf = io.StringIO()
    bar = ProgressBar(buf, "tuning")
    bar(1, 2, "half")
    bar(2, 2, "done")
    bar.close()
    assert buf.getvalue() == "tuning ...\ntuning: done (0:00)\n"


def test_bench_json_smoke(tmp_path, capsys, monkeypatch):
    """Not timed: the command runs every row on tiny models and reports them honestly."""
    from mlx_spec.cli import main

    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    t, d = save_tiny_pair(tmp_path)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abcabcabcabc", "kind": "code"}\n{"prompt": "hello there", "kind": "prose"}\n')
    rc = main(
        [
            "bench",
            "--target",
            str(t),
            "--drafter",
            str(d),
            "--prompts",
            str(f),
            "--max-tokens",
            "12",
            "--repeats",
            "1",
            "--block-sizes",
            "2,4",
            "--ar-draft",
            str(t),
            "--json",
            "--json-out",
            str(tmp_path / "bench.json"),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "bench.json").read_text()) == out
    labels = [r["label"] for r in out["rows"]]
    policy = (
        ["lookup per-cycle", "default engine"] if hasattr(__import__("mlx_spec.policy").policy, "PolicyFactory") else []
    )
    assert labels == [
        "mlx-lm plain",
        "plain (ours)",
        "lookup B=8",
        "ar-draft B=4",
        "dflash B=2",
        "dflash B=4",
        "dflash per-cycle",
        *policy,
    ]
    assert out["blas"] and out["costs"]["t1_ms"] > 0 and out["kinds"] == ["code", "prose"]
    for r in out["rows"]:
        if r["status"] != "ok":  # a random tiny drafter may accept nothing: then no speed at all
            assert r["status"].startswith("failed: mechanism did not engage") and r["decode_tps"] is None
        else:
            assert r["decode_tps"] > 0 and r["speedup"] > 0
    ar = out["rows"][3]
    assert ar["status"] == "ok" and ar["acceptance"] == 1.0  # the target as its own draft
    assert all(r["diverged"] == 0 for r in out["rows"])  # greedy: every method is the target's output
    assert rc == (1 if out["failed"] else 0)
    mlx, ours = out["rows"][0], out["rows"][1]  # mlx-lm's stream_generate: the same tokens as our plain path
    assert mlx["status"] == "ok" and mlx["tau"] is None and mlx["speedup_mlx"] == 1.0 and ours["speedup"] == 1.0
    assert all(r["speedup_mlx"] > 0 and r["worst"] and r["worst_mlx"] for r in out["rows"] if r["status"] == "ok")
    assert [p["prompt_id"] for p in out["per_prompt"]] == out["prompts"]
    assert all(0.0 <= p["copy_share"] <= 1.0 for p in out["per_prompt"]) and "ours" in out["blas_threads"]
    for p in out["per_prompt"]:  # the copy ceiling: the oracle's tokens * T1 / its time, never below plain
        if p["reply_tokens"] > 1:
            tokens, ms = p["oracle"]
            assert p["ceiling"] == pytest.approx(tokens * out["costs"]["t1_ms"] / ms, rel=0.05) and p["ceiling"] >= 1.0
    assert "agent_ceiling" in out
    reach = {(r["block"], r["source"]): r for r in out["reach"]}  # every measured block, DFlash to its max
    assert {(2, "dflash"), (4, "dflash"), (2, "lookup"), (4, "lookup")} <= set(reach)
    tt, td, t1 = out["costs"]["tt_ms"], out["costs"]["td_ms"], out["costs"]["t1_ms"]
    assert reach[(4, "dflash")]["break_even"] == pytest.approx((tt["4"] + td["4"]) / t1, rel=1e-3)


def test_bench_vocab_compare_rows(tmp_path, capsys, monkeypatch):
    """--vocab-compare adds full-head rows beside the reduced draft vocabulary's; both lossless."""
    from mlx_spec.cli import main
    from mlx_spec.loading import write_draft_vocab

    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    t, d = save_tiny_pair(tmp_path)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "abcabcabcabc", "kind": "code"}\n')
    base = [
        "bench",
        "--target",
        str(t),
        "--drafter",
        str(d),
        "--prompts",
        str(f),
        "--max-tokens",
        "10",
        "--repeats",
        "1",
        "--block-sizes",
        "4",
        "--lookup-block",
        "0",
        "--no-adaptive",
        "--json",
    ]
    assert main(base + ["--vocab-compare"]) != 0
    assert "full head already" in capsys.readouterr().err
    write_draft_vocab(d, range(0, 128, 2))
    main(base + ["--vocab-compare"])
    out = json.loads(capsys.readouterr().out)
    rows = {r["label"]: r for r in out["rows"]}
    assert list(rows) == ["mlx-lm plain", "plain (ours)", "dflash B=4", "dflash B=4 full-vocab"]
    assert all(r["diverged"] == 0 for r in out["rows"])
    full = rows["dflash B=4 full-vocab"]
    assert full["td_ms"] is None and full["ceiling"] is None


def test_merged_stats_add_every_counter():
    """Every field of Stats is either added up by Stats.merged or named in NOT_MERGED: a counter
    added to Stats later is summed (or consciously left out), never silently dropped."""
    from dataclasses import fields

    from mlx_spec.stats import NOT_MERGED

    a, b = Stats(), Stats()
    for i, f in enumerate(fields(Stats)):
        if f.name in NOT_MERGED:
            continue
        kind = type(getattr(a, f.name))
        if kind is int:
            setattr(a, f.name, i + 1)
            setattr(b, f.name, 100 * (i + 1))
        elif kind is list:
            setattr(a, f.name, [1 + i, 2])
            setattr(b, f.name, [10 * (i + 1)])
        elif kind is dict:
            setattr(a, f.name, {1: 2} if f.name == "block_sizes" else {"dflash": {"cycles": 1}})
            setattr(
                b,
                f.name,
                {1: 3, 4: 1} if f.name == "block_sizes" else {"dflash": {"cycles": 2}, "lookup": {"cycles": 1}},
            )
        else:
            raise AssertionError(f"Stats.{f.name}: a {kind.__name__} neither merged nor in NOT_MERGED")
    a.cached_tokens = b.cached_tokens = 7
    m = Stats.merged([a, b])
    for i, f in enumerate(fields(Stats)):
        if f.name not in NOT_MERGED and type(getattr(a, f.name)) is int:
            assert getattr(m, f.name) == 101 * (i + 1), f.name
    for i, f in enumerate(fields(Stats)):
        if f.name not in NOT_MERGED and type(getattr(a, f.name)) is list:
            assert getattr(m, f.name) == [1 + i + 10 * (i + 1), 2], f.name
    assert m.block_sizes == {1: 5, 4: 1}
    assert m.sources == {"dflash": {"cycles": 3}, "lookup": {"cycles": 1}}
    assert m.cached_tokens == 0 and m.trace == []
    assert Stats.merged([]) == Stats()


def test_merged_stats_add_the_drafter_counters():
    from mlx_spec.decode import Step

    parts = []
    for steps in (
        [Step((1, 2), drafted=3, accepted=1, block_size=4, source="dflash", draft_block=4)],
        [Step((3,), source="dflash", draft_block=4), Step((4,), source="plain")],
    ):
        st = Stats()
        for s in steps:
            st.add(s)
        parts.append(st)
    m = Stats.merged(parts)
    assert (m.cycles, m.plain_cycles, m.drafter_passes, m.trimmed) == (3, 2, 2, 1)


def test_the_reach_table_prices_every_measured_block_and_dflash_up_to_the_drafters():
    from mlx_spec.commands.bench import reach_lines

    costs = Costs(100.0, {2: 10.0, 4: 20.0, 8: 30.0}, {1: 105.0, 2: 120.0, 4: 150.0, 8: 200.0, 16: 300.0}, 0)
    got = {(r.block, r.source): r for r in reach_table(costs, dflash_max=4)}
    assert sorted(got) == [(2, "dflash"), (2, "lookup"), (4, "dflash"), (4, "lookup"), (8, "lookup"), (16, "lookup")]
    assert got[(4, "dflash")].break_even == pytest.approx(1.7) and got[(16, "lookup")].perfect == pytest.approx(16 / 3)
    assert all(r.source == "lookup" for r in reach_table(costs))  # no drafter: the lookup only
    gap = Costs(100.0, {4: 20.0}, costs.tt_ms, 0)  # Td not measured at 2: no DFlash price there (not Td(4))
    assert [(r.block, r.source) for r in reach_table(gap, dflash_max=4)][:3] == [
        (2, "lookup"),
        (4, "dflash"),
        (4, "lookup"),
    ]
    methods = [Method("dflash", 4), Method("dflash", 4, full_vocab=True)]
    samples = [Sample(m, 0, "c1", "code", _run(_steps([(3, 2)] * 8), 0.1)) for m in methods]
    samples.append(Sample(methods[0], 0, "p1", "prose", _run(_steps([(3, 1)] * 8), 0.1)))
    rows = summarize(samples, costs)
    assert rows[0].tau_by_kind == {"code": 3.0, "prose": 2.0} and rows[1].tau_by_kind == {"code": 3.0}
    text = reach_lines(reach_table(costs, dflash_max=4), rows, ["code", "prose"])
    assert "4      1.70                   x2.35" in text  # break-even tau, perfect speedup
    assert "dflash B=4: measured tau code 3.00 (x1.76), prose 2.00 (x1.18)" in text  # 3 / 1.7, 2 / 1.7
    assert "full-vocab:" not in text  # its draft pass is not the curve's
