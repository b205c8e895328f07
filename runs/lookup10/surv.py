import json
from collections import defaultdict
from mlx_spec.lookup import SuffixIndex
from mlx_spec.adaptive import Copy
c = Copy()
T = int(__import__("sys").argv[1])
agree = defaultdict(list); cond = defaultdict(lambda: [0, 0])
for f in ('/work/main/runs/replies-agent128.json',):
    d = json.load(open(f)); eos = d["eos"]
    for pid, r in d["replies"].items():
        reply = r["reply"][:T]
        idx = SuffixIndex(r["prompt"], 4, stop=eos); idx.extend(reply[:1])
        for n in range(1, len(reply) - 32):  # only where 32 more tokens exist
            look, m = idx.propose(32)
            a = 0
            while a < len(look) and look[a] == reply[n + a]: a += 1
            agree[c.bucket(m)].append(a)
            for k in range(min(a + 1, len(look))):
                b = c.bucket(m + k); cond[b][0] += 1; cond[b][1] += k < a
            idx.extend(reply[n:n + 1])
cb = {b: h / j for b, (j, h) in cond.items()}
for b in sorted(agree):
    xs = agree[b]
    emp = [sum(x >= k for x in xs) / len(xs) for k in (1, 2, 4, 8, 16, 32)]
    # model: product of measured bucket conds, starting at a typical m of the bucket
    m0 = ([0, 2, 3, 5, 10, 20, 40])[b]
    prod, mod = 1.0, []
    for k in range(1, 33):
        prod *= cb.get(c.bucket(m0 + k - 1), 0)
        if k in (1, 2, 4, 8, 16, 32): mod.append(prod)
    print(f"bucket<{c.tops[b]} n={len(xs)} emp S(1,2,4,8,16,32)=" + " ".join(f"{x:.2f}" for x in emp) + "  model " + " ".join(f"{x:.2f}" for x in mod))
