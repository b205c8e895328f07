"""One rank of a test group (started twice by tests/test_distributed.py with the environment
mlx.launch sets: MLX_RANK, MLX_HOSTFILE). Loads the tiny pair saved under ROOT with the target
sharded, then rank 0 leads the cases in the job file and writes the committed tokens as JSON
while the other rank follows. Usage: python distributed_worker.py JOB.json
"""

import json
import os
import signal
import sys
import time
from functools import partial
from types import SimpleNamespace

from mlx_spec import distributed
from mlx_spec.decode import plain_steps, spec_steps
from mlx_spec.eagle import load_eagle
from mlx_spec.generation import GenConfig
from mlx_spec.loading import check_pair, load_drafter, load_target_model
from mlx_spec.mtp import load_mtp
from mlx_spec.policy import PLAIN, Decision
from mlx_spec.sampling import SamplingConfig
from mlx_spec.target import Target, union_taps

import mlx.core as mx


class Cycling:
    """A draft policy (rank 0's) that drafts ``plan`` in turn, cycle by cycle: a lookup draft
    where the lookup has a proposal, else a plain step."""

    def __init__(self, plan):
        self.plan, self.i = plan, 0
        self.sources = tuple(dict.fromkeys(s for s, _ in plan))
        self.max_lookup = 8

    def _next(self, ctx):
        source, rows = self.plan[self.i % len(self.plan)]
        if source == "lookup":
            rows = min(rows, len(ctx.lookup) + 1)
        return Decision(source, rows) if rows > 1 else Decision(PLAIN, 1)

    def stays_plain(self, ctx):
        return self._next(ctx).source == PLAIN

    def choose(self, ctx):
        d = self._next(ctx)
        self.i += 1
        return d

    def pick(self, decision, drafts, confidence, ctx=None, *, trim=False):
        return decision

    def observe(self, step):
        pass


def main(job_path: str) -> int:
    job = json.loads(open(job_path).read())
    group = distributed.init_group()
    rank = group.rank()
    models, pairs = {}, []
    for phase in job["phases"]:  # every rank loads every phase's pair, sharding each target
        t = phase["target"]
        if t not in models:
            models[t] = load_target_model(t, shard=partial(distributed.shard_target, group=group))[0]
        drafter, _ = load_drafter(phase["drafter"])
        chains = {}
        eagle = None
        if phase.get("eagle"):  # chain drafters beside DFlash: one target view for all of them
            eagle, _ = load_eagle(phase["eagle"])
            eagle.bind(Target(models[t], ()))
        taps = union_taps(drafter.args.target_layer_ids, eagle.taps if eagle else ())
        target = Target(models[t], taps, final_hidden=bool(phase.get("mtp")))
        if phase.get("mtp"):
            chains["mtp"] = load_mtp(phase["mtp"], target)
        if eagle is not None:
            chains["eagle"] = eagle.bind(target)
        check_pair(target, drafter)
        drafter.bind(target.embed, target.head)
        pairs.append((models[t], target, drafter, chains))

    def run_steps(pair, ids, cfg, method, block, policy=None):
        model, target, drafter, chains = pair
        if method == "plain":
            return plain_steps(model, ids, max_tokens=cfg.max_tokens, sampling=cfg.sampling)
        return spec_steps(
            target,
            drafter,
            ids,
            block_size=block,
            max_tokens=cfg.max_tokens,
            sampling=cfg.sampling,
            policy=policy,
            chains=chains or None,
        )

    results = []

    def write(extra=None):
        with open(job["out"], "w") as f:
            json.dump({"results": results, "group": distributed.group_info(group).as_dict(), **(extra or {})}, f)

    for k, (phase, pair) in enumerate(zip(job["phases"], pairs)):
        if rank != 0:
            run = partial(run_steps, pair)
            if job.get("die_rank") == rank and k == job.get("die_phase", 0):

                def run(*a, _run=run):  # follow until a given step, then die (or hang)
                    for n, s in enumerate(_run(*a), 1):
                        if n == job.get("die_step", 3):
                            if job.get("die_how") == "hang":  # the whole process stops, watchdog too
                                os.kill(os.getpid(), signal.SIGSTOP)
                            os._exit(9)
                        yield s

            distributed.follow(group, run, timeout=job.get("timeout", 20.0))
            continue
        leader = distributed.Leader(group, timeout=job.get("timeout", 20.0))
        t_fail = []

        def failed(why, t_fail=t_fail):  # the watchdog fired: this thread may be stuck in a collective
            t_fail.append(time.perf_counter())
            if job.get("die_how") == "hang":
                results.append(
                    {
                        "phase": k,  # noqa: B023
                        "tokens": [],
                        "error": f"GroupFailed: {why}",
                        "healthy": leader.healthy,  # noqa: B023
                        "health": leader.health(),  # noqa: B023
                    }
                )
                write({"watchdog_s": t_fail[0] - t_start[0]})  # noqa: B023
                os._exit(0)

        leader.on_failure(failed)
        t_start = [time.perf_counter()]
        for case in phase["cases"]:
            info = SimpleNamespace(
                method="plain" if case["block"] == 1 else "dflash", block_size=case["block"], adaptive_max=0
            )
            cfg = leader.seeded(
                GenConfig(
                    max_tokens=case["max_tokens"],
                    sampling=SamplingConfig(case.get("temperature", 0.0), seed=case.get("seed")),
                )
            )
            t0 = t_start[0] = time.perf_counter()
            toks, sources, err = [], [], None
            try:
                method = "plain" if case["block"] == 1 else "spec"
                policy = None
                if case.get("policy") == "chains":  # every source in turn, rank 0's choices shared
                    policy = leader.share(Cycling([("mtp", 3), ("eagle", 4), ("dflash", 3), ("lookup", 4)]))
                elif case.get("policy"):  # the adaptive policy (dflash + lookup), rank 0's choices shared
                    from mlx_spec.costs import Costs
                    from mlx_spec.policy import DraftPolicy

                    costs = Costs(1.0, {2: 0.5, 4: 0.6, 8: 0.8}, {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8}, 64)
                    if case["policy"] == "plain":  # drafting never pays: runs of pipelined plain steps
                        costs = Costs(1.0, {2: 50.0, 4: 60.0, 8: 80.0}, {1: 1.0, 2: 40.0, 4: 60.0, 8: 90.0}, 64)
                    policy = leader.share(DraftPolicy(costs, case["block"]))
                steps = leader.lead(
                    run_steps(pair, case["prompt"], cfg, method, case["block"], policy),
                    case["prompt"],
                    cfg,
                    info,
                    policy,
                )
                for s in steps:
                    toks.extend(s.tokens)
                    sources.append(s.source)
                    if len(toks) >= job.get("leader_stop_step", 1 << 30):
                        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 hangs, its watchdog too
                    if case.get("stop_after") and len(toks) >= case["stop_after"]:
                        steps.close()
                        break
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
            results.append(
                {
                    "phase": k,
                    "block": case["block"],
                    "policy": case.get("policy") or False,
                    "tokens": toks,
                    "sources": sources,
                    "error": err,
                    "s": time.perf_counter() - t0,
                    "healthy": leader.healthy,
                    "health": leader.health(),
                    "wire": dict(leader.wire.stats),
                }
            )
            if err:
                break
        if not leader.healthy:
            break
        leader.shutdown()
    if rank == 0:
        write()
    mx.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
