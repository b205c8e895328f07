"""Lookup-only replay of cached replies with variant Copy models: per prompt speedup + clairvoyant."""
import json, sys
sys.path.insert(0, "/work/main/scripts")
import mlx_spec  # noqa
from lookup_replay import replay, CurveTimed, clairvoyant, queue_rule
from mlx_spec.adaptive import LOOKUP
from mlx_spec.bench import copy_share, copy_oracle, copy_max_draft, oracle_ceiling
from mlx_spec.costs import Costs
from mlx_spec.lookup import SuffixIndex

COSTS = Costs.from_dict(json.load(open("/work/main/runs/issue17-bench9-mkl.json"))["costs"])
FILES = {"agent": "/work/main/runs/replies-agent128.json", "chat": "/work/main/runs/replies-chat64.json",
         "chat128": "/tmp/h10a/replies-chat128.json"}

CURVES = {k: Costs.from_dict(json.load(open(f"/work/main/runs/{k}.json"))["costs"])
          for k in ("issue17-bench9-mkl", "blas9-mkl", "issue17-bench6", "issue17-agent8")}
CURVES.update({k + "~": c.smoothed() for k, c in list(CURVES.items())})  # the policy's own view as the truth

def run(make_policy, sets=(("agent", 64), ("agent", 128), ("chat", 64)), verbose=False, cv=False, costs=None):
    global COSTS
    if costs is not None:
        COSTS = CURVES[costs]
    out = {}
    for name, tokens in sets:
        try:
            data = json.load(open(FILES[name]))
        except FileNotFoundError:
            continue
        if tokens > data["tokens"]:
            continue
        eos = data["eos"]; make = lambda p: SuffixIndex(p, 4, stop=eos)
        tot = {}
        per = {}
        for pid, r in data["replies"].items():
            reply = r["reply"][:tokens]
            ended = len(r["reply"]) < data["tokens"]
            full = reply + ([eos[0]] if ended and len(reply) < tokens else [])
            share = copy_share(r["prompt"], reply)
            steps, _ = replay(r["prompt"], full, COSTS, tokens, make, eos=eos, policy=make_policy())
            ms = sum(s.elapsed_ms for s in steps)
            n = len(full) - 1
            per[pid] = n * COSTS.t1_ms / ms
            keys = [r["kind"]] + (["copying"] if share >= 0.5 else []) + ["all"]
            for k in keys:
                t = tot.setdefault(k, [0, 0.0]); t[0] += n; t[1] += ms
            if verbose:
                print(pid, f"{per[pid]:.2f}x", " ".join(f"{s.block_size}:{s.accepted}" for s in steps))
        out[(name, tokens)] = ({k: v[0] * COSTS.t1_ms / v[1] for k, v in tot.items()}, per)
    return out

def show(label, res, base=None):
    for key, (tot, per) in res.items():
        s = " ".join(f"{k} {v:.3f}" + (f"({(v / base[key][0][k] - 1) * 100:+.1f}%)" if base else "") for k, v in tot.items())
        print(f"{label:28s} {key[0]}{key[1]}: {s}")

def policy_factory(copy_factory=None, **kw):
    def make():
        p = CurveTimed(COSTS, 8, sources=(LOOKUP,), **kw)  # (COSTS: the module global at call time)
        if copy_factory is not None:
            p.copy = copy_factory()
        return p
    return make

if __name__ == "__main__":
    r = run(policy_factory(), verbose=True)
    show("base", r)
