"""Block-size tuner: measure on this machine, store the best block (or "off") per machine and pair
(for a pair without a DFlash drafter: each chain drafter's depth and prior).

- ``store``: the key (the machine and the models' weights, however they are spelled), the
  result (``TuneResult``, ``Candidate``), saving and loading it under ``<cache>/tuning/``.
- ``decide``: the cost model, ``decide`` (the pure choice, ties broken by rule) and the race
  that checks it on a clear margin.
- ``run``: ``tune``, the sweep in named phases (acceptance, pass costs, race, calibration,
  decision), and ``ensure_tuned``, what generate, chat and serve call on start.

How the choice is made and why it is the same run after run: docs/tuner.md.
"""

from .decide import (
    CHECK_ROUNDS,
    CLEAR_Z,
    MIN_NOISE_DF,
    NOISE_CAP,
    NOISE_FLOOR,
    Check,
    Decision,
    Key,
    Lap,
    RaceResult,
    check,
    checks,
    cycle_overhead,
    decide,
    default_candidates,
    median_se,
    predict,
    race,
    race_check,
)
from .run import DEFAULT_BUDGET_S, ChainSweep, Sweep, TuneSkipped, apply_threads, ensure_tuned, tune
from .store import (
    FORMAT,
    READ_FORMATS,
    Candidate,
    TuneResult,
    cpu_name,
    identity,
    key_hash,
    load_result,
    machine_info,
    models_of,
    quantization,
    result_path,
    same_models,
    save_result,
    tune_key,
    weights_id,
)

__all__ = [
    "CHECK_ROUNDS",
    "CLEAR_Z",
    "DEFAULT_BUDGET_S",
    "FORMAT",
    "MIN_NOISE_DF",
    "NOISE_CAP",
    "NOISE_FLOOR",
    "READ_FORMATS",
    "Candidate",
    "ChainSweep",
    "Check",
    "Decision",
    "Key",
    "Lap",
    "RaceResult",
    "Sweep",
    "TuneResult",
    "TuneSkipped",
    "apply_threads",
    "check",
    "checks",
    "cpu_name",
    "cycle_overhead",
    "decide",
    "default_candidates",
    "ensure_tuned",
    "identity",
    "key_hash",
    "load_result",
    "machine_info",
    "median_se",
    "models_of",
    "predict",
    "quantization",
    "race",
    "race_check",
    "result_path",
    "same_models",
    "save_result",
    "tune",
    "tune_key",
    "weights_id",
]
