"""Per-token conditional acceptance of the index's proposals, by match bucket and by features."""
import json, sys
from collections import defaultdict
sys.path.insert(0, "/work/main/scripts")
from mlx_spec.lookup import SuffixIndex
from mlx_spec.adaptive import Copy

c = Copy()
def bucket(m): return c.bucket(m)
stats = defaultdict(lambda: [0, 0])  # key -> judged, hits
for f in ('/work/main/runs/replies-agent128.json', '/work/main/runs/replies-chat64.json'):
    d = json.load(open(f)); eos = d["eos"]
    for pid, r in d["replies"].items():
        kind = "agent" if r["kind"] == "agent" else "chat"
        reply = r["reply"][:64]
        idx = SuffixIndex(r["prompt"], 4, stop=eos)
        idx.extend(reply[:1])
        prev = None  # (n at which proposal made, proposal, agreement)
        for n in range(1, len(reply)):
            look, m = idx.propose(32)
            a = 0
            while a < len(look) and n + a < len(reply) and look[a] == reply[n + a]:
                a += 1
            # continuation: previous proposal (made at n0) covered reply[n0:n] fully and its tail continues as this one
            cont = False
            if prev is not None:
                n0, look0, a0 = prev
                k = n - n0
                cont = a0 >= k and look0[k:k + 4] == look[:min(4, len(look0) - k)] and len(look0) > k
            run = idx._run
            for k in range(min(a + 1, len(look), len(reply) - n)):
                hit = k < a
                for key in ((kind, bucket(m + k)), (kind, bucket(m + k), "cont" if cont else "fresh")):
                    stats[key][0] += 1; stats[key][1] += hit
            prev = (n, look, a)
            idx.extend(reply[n:n + 1])
tops = [t for t, _ in __import__("mlx_spec.adaptive", fromlist=["x"]).LOOKUP_PRIOR]
for key in sorted(stats, key=str):
    j, h = stats[key]
    print(key, "bucket<", tops[key[1]], f"{h}/{j} = {h/j:.3f}")
