"""Replay ``tuner.decide`` on the tables `mlx_spec tune` printed (saved text output): what the
current decision rule would choose from each run's measurements (model speedup, noise, E(B)),
beside what that run stored. Nothing is timed or loaded.

    python scripts/tune_replay.py runs/tune8-1.txt runs/tune8-2.txt ...
"""

import argparse
import re

from mlx_spec.tuner import Candidate, decide

ROW = re.compile(r"^([* ])\s*(off|\d+)\s+(\d+|-)\s+(\S+)\s+(\S+)\s+(\S+)%")


def candidates(path: str) -> tuple[list[Candidate], str | None]:
    """The table's candidates and the block the run stored ("off", "4", ...; None: none marked)."""
    out, stored = [], None
    with open(path) as f:
        for line in f:
            m = ROW.match(line)
            if m:
                star, b, t, tau, model, noise = m.groups()
                block = 1 if b == "off" else int(b)
                out.append(Candidate(block, False, predicted=float(model), tau=None if tau == "-" else float(tau),
                                     noise=float(noise) / 100, threads=None if t == "-" else int(t)))
                stored = b if star == "*" else stored
    return out, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+", metavar="FILE", help="saved output of `mlx_spec tune` (format 3 tables)")
    for path in ap.parse_args().tables:
        try:
            cands, stored = candidates(path)
        except (OSError, ValueError) as e:
            ap.error(f"{path}: not a `mlx_spec tune` table this script reads ({e})")
        if not any(c.block == 1 for c in cands) or not any(c.block > 1 for c in cands):
            ap.error(f"{path}: no plain row or no block rows: not a `mlx_spec tune` table of this format")
        threads = max((c.threads for c in cands if c.threads is not None), default=None)  # all cores: the default
        d = decide(cands, default_threads=threads)
        now = "off" if d.block == 1 else f"B={d.block}"
        print(f"{path}: stored {stored or '?'}, now {now} at {d.threads} threads | {d.why}")


if __name__ == "__main__":
    main()
