import json, sys
sys.path.insert(0, "/tmp/h10a"); sys.path.insert(0, "/work/main/scripts")
import harness
from harness import *
from mlx_spec.lookup import SuffixIndex
def analyse(tokens, costs="issue17-bench9-mkl", make=None):
    harness.COSTS = CURVES[costs]
    data = json.load(open(FILES["agent"])); eos = data["eos"]
    tot = dict(short=0.0, nshort=0, waste=0.0, nwaste=0, missed=0.0, nmissed=0, ms=0.0)
    for pid, r in data["replies"].items():
        reply = r["reply"][:tokens]
        full = reply + ([eos[0]] if len(r["reply"]) < data["tokens"] and len(reply) < tokens else [])
        if copy_share(r["prompt"], reply) < 0.5: continue
        pol = (make or policy_factory())()
        ctxs = []; ch = pol.choose
        def noting(ctx, ch=ch):
            ctxs.append(ctx); return ch(ctx)
        pol.choose = noting
        steps, _ = replay(r["prompt"], full, harness.COSTS, tokens, lambda p: SuffixIndex(p, 4, stop=eos), eos=eos, policy=pol)
        n = 1
        C = harness.COSTS
        for s, c in zip(steps, ctxs):
            a = 0
            while a < len(c.lookup) and n + a < len(full) and c.lookup[a] == full[n + a]: a += 1
            tot["ms"] += s.elapsed_ms
            if s.block_size > 1 and s.accepted == s.drafted and a > s.drafted:
                tot["nshort"] += 1
            if s.block_size > 1 and s.accepted < s.drafted:
                tot["nwaste"] += 1; tot["waste"] += C.verify(s.block_size) - C.verify(s.accepted + 1 if s.accepted else 1)
            if s.block_size == 1 and a >= 3:
                tot["nmissed"] += 1
            n += len(s.tokens)
    return tot
for t in (64, 128):
    print(t, analyse(t))
