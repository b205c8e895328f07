"""Where does a batched step's time go? ``batch.BatchDecoder`` on the default target + drafter
at batch sizes 1, 2, 4, 8 (code prompts by default, ``--kinds`` for others; greedy), against the single-stream loop
(``decode.spec_steps``) for the batch of one. Per batch size: decode tok/s (prefill excluded),
ms per step, and the step split into its phases (drafter pass, packed target forward + the
host transfer of the choices, the rest: acceptance, rollback, bookkeeping), read from the
steps' own timings; with ``--cprofile`` the Python functions that cost most at the largest
batch. With ``--attention`` also the packed target forward alone at the largest batch, attention
for all sequences in one call (``batch.BatchKV``) against one call per sequence, same inputs.

    python benchmarks/batch_profile.py [--sizes 1,2,4,8] [--tokens 48] [--policy auto|always|plain] [--kinds code]
                                    [--compare] [--cprofile] [--attention]

Against mlx-lm in one process (what ``mlx_lm.server`` runs: ``mlx_lm.generate.BatchGenerator``),
so a drift of the machine hits both alike:

    python benchmarks/batch_profile.py --versus [--sizes 1,2,4,8] [--tokens 40]
        per batch size, a few steps of each in turn: mlx-lm, ours without a drafter, ours with
        drafting off, ours with the per-step policy, the same without widening (a sequence's
        plain step is not offered to the batch as a draft), ours with each sequence as alone
    python benchmarks/batch_profile.py --clients 8 [--requests 2] [--tokens 32]
        bench --concurrency's load (clients sending requests one after another) without HTTP

Prints one table; nothing is stored. Timings on a loaded machine are noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx_spec  # noqa: F401  (before MLX: it loads OpenBLAS)
from mlx_spec.batch import BatchBudget, BatchDecoder, batched_steps
from mlx_spec.decode import spec_steps
from mlx_spec.default_target import DEFAULT_TARGET_ID, resolve_target_id
from mlx_spec.loading import load_pair
from mlx_spec.prompts import builtin_prompts

import mlx.core as mx
from mlx_lm.generate import generation_stream


class Always(BatchBudget):
    def plan(self, wants, accs, plain_runs, probes, extra_rows=0, passes=None):
        return list(wants)


class Never(BatchBudget):
    def plan(self, wants, accs, plain_runs, probes, extra_rows=0, passes=None):
        return [1] * len(wants)


def run_batch(pair, make_policy, prompts, n, batch_policy, fast=True):
    dec = BatchDecoder(pair.target, pair.drafter, block_size=4, max_batch=len(prompts), policy=batch_policy())
    if not fast:
        dec.kv = None  # attention per sequence, each against its own KVCache
    jobs = [dict(prompt=p, max_tokens=n, policy=make_policy() if make_policy else None) for p in prompts]
    steps, tokens, t_first = [], 0, None
    for _, st in batched_steps(dec, jobs):
        if st.prefill:
            continue
        if t_first is None:
            t_first, c_first = time.perf_counter(), time.process_time()
        steps.append(st)
        tokens += len(st.tokens)
    wall, cpu = time.perf_counter() - t_first, time.process_time() - c_first
    return dec, steps, tokens, wall, cpu


def summarize(label, dec, steps, tokens, wall, cpu):
    # one entry per batched step: steps of one step share elapsed_ms
    per = {}
    for st in steps:
        per.setdefault((st.elapsed_ms, st.verify_ms), st)
    el = [k[0] for k in per]
    ver = [k[1] for k in per]
    drf = [s.draft_ms for s in per.values()]
    n = max(1, len(el))
    drafted = sum(1 for s in steps if s.drafted)
    acc = sum(s.accepted for s in steps) / max(1, sum(s.drafted for s in steps))
    print(
        f"{label:<28} {tokens / wall:7.1f} tok/s {tokens / cpu:7.1f} tok/CPU-s  {sum(el) / n:6.1f} ms/step  steps {n:4d}  "  # noqa: E501
        f"draft {statistics.fmean(drf) if drf else 0:5.1f}  verify {statistics.fmean(ver) if ver else 0:5.1f}  "
        f"drafted {drafted}/{len(steps)} acc {acc:.2f}"
    )
    pol = dec.policy
    if pol.obs:  # the step-cost line BatchBudget fitted, against the steps it measured
        errs = [abs(pol.costs(r, d, x, k) - ms) / ms for r, d, ms, _, x, k in pol.obs]
        k = pol.costs
        print(
            f"{'':<28} cost line: {k.base:.1f} + {k.row:.2f}*rows + {k.prefill_row:.2f}*prefill rows + "
            f"{k.seq:.2f}*drafting seqs + {k.draft_seq:.2f}*in drafter pass + {k.drafter_pass:.1f}*[draft pass] ms, "
            f"median error {100 * statistics.median(errs):.0f} %"
        )


def attention_bench(pair, prompts, reps=12):
    """The packed forward alone: the sequences decoding, 4 rows each, attention batched over the
    rows of ``BatchKV`` vs per sequence against its own caches (same inputs)."""
    from mlx_spec.batch import BatchKV, Seg

    t = pair.target
    dec = BatchDecoder(t, None, max_batch=len(prompts))
    if not dec.packed.slotted:
        print(f"no batched attention to compare: {dec.attention}")
        return
    out = {}
    for fast in (True, False):
        kv = BatchKV(dec.packed.slotted) if fast else None
        caches, rows = [], []
        for p in prompts:
            c = t.make_cache()
            dec.packed([Seg(mx.array(p, mx.int32), c, False, "last")], taps=False)
            mx.eval([x.state for x in c])
            caches.append(c)
            if kv is not None:
                rows.append(kv.join(c))
        ids = [mx.array([5, 6, 7, 8], mx.int32) for _ in prompts]
        times = []
        for r in range(reps):  # noqa: B007
            t0 = time.process_time()
            o = dec.packed(
                [Seg(i, c, True, "all", rows[k] if rows else None) for k, (i, c) in enumerate(zip(ids, caches))],
                taps=True,
                kv=kv,
            )
            mx.eval([x.logits for x in o], [x.hidden for x in o])
            times.append((time.process_time() - t0) * 1e3)
            for k, c in enumerate(caches):
                dec.packed.rollback(c, {}, 4, 0, rows[k] if rows else None)
        out[fast] = statistics.median(times[2:])
    print(
        f"packed forward, {len(prompts)} x 4 rows, CPU ms: attention in one call {out[True]:.1f}, "
        f"per sequence {out[False]:.1f} (x{out[False] / out[True]:.2f})"
    )


def _ours(pair, prompts, make_policy, batch_policy, drafter=True, widen=None):
    """A BatchDecoder with every sequence prefilled; returns one step as a function: tokens
    committed, and which sequences drafted / accepted (``drafter=False``: no drafter at all).
    ``widen``: whether a sequence's plain step is offered to the batch as a draft (default: yes,
    except "as each alone")."""
    dec = BatchDecoder(
        pair.target, pair.drafter if drafter else None, block_size=4, max_batch=len(prompts), policy=batch_policy()
    )
    dec.widen = batch_policy is not Always if widen is None else widen  # "as each alone": plain ones kept plain
    for p in prompts:
        dec.add(p, max_tokens=100_000, policy=make_policy() if make_policy and drafter else None)
    while any(s.anchor_id < 0 for s in dec._seqs.values()):
        dec.step()

    def step():
        out = [st for _, st in dec.step()]
        return (
            sum(len(st.tokens) for st in out),
            sum(st.drafted > 0 for st in out),
            sum(st.drafted for st in out),
            sum(st.accepted for st in out),
        )

    return step


def _theirs(pair, prompts):
    """mlx-lm's BatchGenerator (what mlx_lm.server runs) with every sequence decoding."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        pair.model, stop_tokens=[], completion_batch_size=len(prompts), prefill_batch_size=len(prompts)
    )
    gen.insert([list(p) for p in prompts], max_tokens=[100_000] * len(prompts))
    while len(gen._generation_batch) < len(prompts):
        gen.next()

    def step():
        return len(gen.next()[1]), 0, 0, 0

    return step


def versus(pair, make, prompts, sizes, tokens, block=4):
    """mlx-lm's BatchGenerator against ours (drafting off; the per-step policy; always drafting)
    at each batch size, stepped in turn in one process (``block`` steps of each, round robin, until
    each has committed ``tokens`` per sequence), so a drift of the machine hits all alike."""
    kinds = {
        "mlx-lm BatchGenerator": lambda ps: _theirs(pair, ps),
        "ours, no drafter": lambda ps: _ours(pair, ps, None, Never, drafter=False),
        "ours, drafting off": lambda ps: _ours(pair, ps, make, Never),
        "ours, per-step policy": lambda ps: _ours(pair, ps, make, BatchBudget),
        "ours, per-step, not widened": lambda ps: _ours(pair, ps, make, BatchBudget, widen=False),
        "ours, as each alone": lambda ps: _ours(pair, ps, make, Always),
    }
    print(f"{'':<24} {'tok/s':>7} {'ms/step':>8} {'steps':>5} {'drafting seq-steps':>18} {'acc':>5}")
    for B in sizes:
        ps = [prompts[i % len(prompts)] for i in range(B)]
        run = {k: f(ps) for k, f in kinds.items()}
        for f in run.values():  # warm-up
            f()
        mx.synchronize(generation_stream)
        got = {k: [0, 0.0, 0, 0, 0, 0] for k in run}  # tokens, seconds, steps, drafting, drafted, accepted
        while any(g[0] < B * tokens for g in got.values()):
            for k, f in run.items():
                g = got[k]
                if g[0] >= B * tokens:
                    continue
                t0 = time.perf_counter()
                for _ in range(block):
                    n, d, dr, ac = f()
                    g[0] += n
                    g[2] += 1
                    g[3] += d
                    g[4] += dr
                    g[5] += ac
                mx.synchronize(generation_stream)  # mlx-lm computes its next step in the background: charged here
                g[1] += time.perf_counter() - t0
        print(f"batch {B}")
        for k, (n, sec, st, d, dr, ac) in got.items():
            print(
                f"  {k:<22} {n / sec:7.1f} {1e3 * sec / st:8.1f} {st:5d} {d:8d}/{st * B:<9d} "
                f"{ac / dr if dr else 0:5.2f}"
            )


def flow(pair, make, prompts, clients, requests, tokens, rounds=2):
    """``clients`` clients, each sending ``requests`` requests one after another (``tokens`` each,
    greedy, EOS honoured), as ``bench --concurrency`` does over HTTP, but in one process and
    without a server: mlx-lm's BatchGenerator against ours (per-step policy; drafting off),
    whole runs alternated ``rounds`` times. Aggregate tok/s and p95 latency (in steps' time)."""
    from mlx_lm.generate import BatchGenerator

    eos = list(pair.tokenizer.eos_token_ids)
    order = [prompts[(c * requests + i) % len(prompts)] for c in range(clients) for i in range(requests)]

    def theirs():
        gen = BatchGenerator(
            pair.model, stop_tokens=[[e] for e in eos], completion_batch_size=clients, prefill_batch_size=clients
        )
        sent, uid_client, t_sent, lat, toks = [0] * clients, {}, {}, [], 0
        t0 = time.perf_counter()
        for c in range(clients):
            uid = gen.insert([order[c * requests]], max_tokens=[tokens])[0]
            uid_client[uid], t_sent[uid], sent[c] = c, time.perf_counter(), 1
        while uid_client:
            _, resp = gen.next()
            for r in resp:
                toks += 1
                if r.finish_reason is not None:
                    c = uid_client.pop(r.uid)
                    lat.append(time.perf_counter() - t_sent.pop(r.uid))
                    if sent[c] < requests:
                        uid = gen.insert([order[c * requests + sent[c]]], max_tokens=[tokens])[0]
                        uid_client[uid], t_sent[uid] = c, time.perf_counter()
                        sent[c] += 1
        gen.close()
        return toks, time.perf_counter() - t0, lat

    def ours(batch_policy, drafting=True):
        dec = BatchDecoder(pair.target, pair.drafter, block_size=4, max_batch=clients, policy=batch_policy())
        sent, sid_client, t_sent, lat, toks = [0] * clients, {}, {}, [], 0

        def add(c):
            sid = dec.add(
                order[c * requests + sent[c]],
                max_tokens=tokens,
                eos_ids=eos,
                policy=make() if make and drafting else None,
                speculate=drafting,
            )
            sid_client[sid], t_sent[sid] = c, time.perf_counter()
            sent[c] += 1

        t0 = time.perf_counter()
        for c in range(clients):
            add(c)
        while sid_client:
            for sid, st in dec.step():
                toks += len(st.tokens)
                if st.finish_reason is not None:
                    c = sid_client.pop(sid)
                    lat.append(time.perf_counter() - t_sent.pop(sid))
                    if sent[c] < requests:
                        add(c)
        return toks, time.perf_counter() - t0, lat

    runs = {
        "mlx-lm BatchGenerator": theirs,
        "ours, per-step policy": lambda: ours(BatchBudget),
        "ours, drafting off": lambda: ours(Never, drafting=False),
    }
    got = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            got[k].append(f())
    print(f"{clients} clients x {requests} requests x {tokens} tokens, {rounds} alternated rounds")
    for k, rs in got.items():
        toks, sec = sum(r[0] for r in rs), sum(r[1] for r in rs)
        lat = sorted(x for r in rs for x in r[2])
        p50, p95 = (lat[min(len(lat) - 1, int(round(q * (len(lat) - 1))))] for q in (0.5, 0.95))
        print(
            f"  {k:<22} {toks / sec:7.1f} tok/s  p50 {p50:5.2f} s  p95 {p95:5.2f} s  max {lat[-1]:5.2f} s  ({toks} tokens)"  # noqa: E501
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_ID)
    ap.add_argument("--drafter", default="models/smollm2-135m-dflash2")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--policy", default="auto", choices=("auto", "always", "plain"))
    ap.add_argument("--compare", action="store_true", help="also run each size with attention per sequence")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument(
        "--versus",
        action="store_true",
        help="only: mlx-lm's BatchGenerator against ours (no drafter, drafting off, per-step policy, as each "
        "alone), stepped in turn in one process",
    )
    ap.add_argument(
        "--clients",
        type=int,
        default=0,
        help="only: N clients x --requests requests of --tokens tokens, in one process (see flow())",
    )
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument(
        "--kinds",
        default="code",
        help="built-in prompt kinds, comma-separated (e.g. agent: "
        "multi-turn edits whose replies copy their prompt; lookup drafts)",
    )
    a = ap.parse_args()
    pair = load_pair(str(resolve_target_id(a.target) or a.target), a.drafter)

    make = None
    try:
        from mlx_spec.policy import PolicyFactory
        from mlx_spec.tuning import load_result, tune_key

        make = PolicyFactory(pair, load_result(tune_key(pair)), block_size=None, max_block=8)
    except Exception as e:  # noqa: BLE001
        print(f"(no per-sequence policy: {e})")
    bp = {"auto": BatchBudget, "always": Always, "plain": Never}[a.policy]
    prompts = [p.encode(pair.tokenizer) for p in builtin_prompts(tuple(a.kinds.split(",")))]
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.versus:
        versus(pair, make, prompts, sizes, a.tokens)
        return
    if a.clients:
        flow(pair, make, prompts, a.clients, a.requests, a.tokens)
        return
    dec = run_batch(pair, make, prompts[:2], 8, bp)[0]  # warm-up
    print(f"batched attention: {dec.attention}")
    for B in sizes:
        ps = [prompts[i % len(prompts)] for i in range(B)]
        summarize(f"batch {B}", *run_batch(pair, make, ps, a.tokens, bp))
        if a.compare:
            summarize(f"batch {B} (attn per seq)", *run_batch(pair, make, ps, a.tokens, bp, fast=False))
        if B == 1:
            t0 = c0 = None
            toks = 0
            for st in spec_steps(
                pair.target, pair.drafter, ps[0], block_size=4, max_tokens=a.tokens, policy=make() if make else None
            ):
                if st.prefill:
                    t0, c0 = time.perf_counter(), time.process_time()
                    continue
                toks += len(st.tokens)
            print(
                f"{'spec_steps (single stream)':<28} {toks / (time.perf_counter() - t0):7.1f} tok/s "
                f"{toks / (time.process_time() - c0):7.1f} tok/CPU-s"
            )
    if a.cprofile:
        B = sizes[-1]
        ps = [prompts[i % len(prompts)] for i in range(B)]
        pr = cProfile.Profile()
        pr.enable()
        run_batch(pair, make, ps, a.tokens, bp)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    if a.attention:
        B = sizes[-1]
        attention_bench(pair, [prompts[i % len(prompts)] for i in range(B)])


if __name__ == "__main__":
    main()
