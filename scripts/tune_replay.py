"""Replay ``tuner.decide`` on the tables `mlx_spec tune` printed (saved text output): what the
current decision rule would choose from each run's measurements (model speedup, noise, E(B)),
beside what that run stored. Nothing is timed or loaded.

    python scripts/tune_replay.py runs/tune8-1.txt runs/tune8-2.txt ...
"""

import argparse
import re

from mlx_spec.tuner import Candidate, decide

ROW = re.compile(r"^[* ]\s*(off|\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)%")


def candidates(path: str) -> list[Candidate]:
    out = []
    for line in open(path):
        m = ROW.match(line)
        if m:
            block = 1 if m.group(1) == "off" else int(m.group(1))
            tau = None if m.group(3) == "-" else float(m.group(3))
            out.append(Candidate(block, False, predicted=float(m.group(4)), tau=tau,
                                 noise=float(m.group(5)) / 100, threads=int(m.group(2))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+", metavar="FILE", help="saved output of `mlx_spec tune` (format 3 tables)")
    for path in ap.parse_args().tables:
        try:
            cands = candidates(path)
        except (OSError, ValueError) as e:
            ap.error(f"{path}: not a `mlx_spec tune` table this script reads ({e})")
        if not any(c.block == 1 for c in cands) or not any(c.block > 1 for c in cands):
            ap.error(f"{path}: no plain row or no block rows: not a `mlx_spec tune` table of this format")
        stored = [line.split()[1] for line in open(path) if line.startswith("*")]
        threads = max((c.threads for c in cands), default=None)  # all cores: the default count
        d = decide(cands, default_threads=threads)
        now = "off" if d.block == 1 else f"B={d.block}"
        print(f"{path}: stored {stored[0] if stored else '?'}, now {now} at {d.threads} threads | {d.why}")


if __name__ == "__main__":
    main()
