import json, sys
from collections import defaultdict
from mlx_spec.lookup import SuffixIndex
from mlx_spec.adaptive import Copy
c = Copy()
stats = defaultdict(lambda: [0, 0])
for f in ('/work/main/runs/replies-agent128.json', '/work/main/runs/replies-chat64.json'):
    d = json.load(open(f)); eos = d["eos"]
    for pid, r in d["replies"].items():
        kind = "agent" if r["kind"] == "agent" else "chat"
        reply = r["reply"][:128]
        idx = SuffixIndex(r["prompt"], 4, stop=eos)
        idx.extend(reply[:1])
        since = 99  # reply tokens since the last token the lookup's first guess got wrong
        for n in range(1, len(reply)):
            look, m = idx.propose(32)
            a = 0
            while a < len(look) and n + a < len(reply) and look[a] == reply[n + a]:
                a += 1
            tag = "new" if idx._run == 0 else "run"
            rec = "recent-miss" if since <= 4 else "clean"
            b0 = c.bucket(m)
            for k in range(min(a + 1, len(look), len(reply) - n)):
                b = c.bucket(m + k)
                stats[(kind, b, tag, rec)][0] += 1; stats[(kind, b, tag, rec)][1] += k < a
            stats[(kind, b0, "first", rec)][0] += 1; stats[(kind, b0, "first", rec)][1] += a > 0
            since = 0 if a == 0 and look else since + 1
            idx.extend(reply[n:n + 1])
tops = [t for t in c.tops]
for key in sorted(stats, key=str):
    j, h = stats[key]
    if j >= 5: print(key, "<", tops[key[1]], f"{h}/{j} = {h/j:.2f}")
