"""What `serve` runs with when --context and --prefix-cache-mb are not given: the target's trained
context capped by the memory plan, and a prefix cache sized from the plan's headroom
(memory.serve_sizing, pure; session.serve_sizing on a tiny pair on disk); and its model-name flags."""

import argparse
from dataclasses import replace

from mlx_spec import memory
from mlx_spec.commands import serve
from mlx_spec.config import LoadConfig
from mlx_spec.errors import BadRequest
from mlx_spec.server.schemas import ModelNames
from mlx_spec.session import serve_sizing

import pytest
from helpers import save_tiny_pair

MiB = 2**20
DIMS = memory.ModelDims(
    layers=4,
    hidden=256,
    intermediate=512,
    heads=4,
    kv_heads=2,
    head_dim=64,
    vocab=1000,
    kinds=("full",) * 4,
    max_position=8192,
)
INPUTS = memory.PlanInputs(target=DIMS, target_weights=100 * MiB)


def plan_at(budget: int, inputs=INPUTS):
    def at(n: int, pc: int):
        return memory.make_plan(
            replace(inputs, prefix_cache=pc), context=n, block_size=1, budget=budget, budget_source="test"
        )

    return at


def test_the_trained_context_and_two_contexts_of_prefix_cache_when_memory_allows():
    at = plan_at(4096 * MiB)
    s = memory.serve_sizing(at, 8192)
    one = memory.entry_bytes(at(8192, 0))
    assert s.context == 8192 and s.prefix_cache == memory.PREFIX_CONTEXTS * one
    assert at(s.context, s.prefix_cache).fits
    assert "trained context" in s.why and "2 whole contexts" in s.why


def test_memory_caps_the_context_so_one_context_of_prefix_cache_still_fits():
    at = plan_at(400 * MiB)
    assert not at(8192, memory.entry_bytes(at(8192, 0))).fits
    s = memory.serve_sizing(at, 8192)
    assert 0 < s.context < 8192 and s.context % memory.SIZING_STEP == 0
    one = memory.entry_bytes(at(s.context, 0))
    assert s.prefix_cache >= one and at(s.context, s.prefix_cache).fits
    bigger = s.context + memory.SIZING_STEP
    assert not at(bigger, memory.entry_bytes(at(bigger, 0))).fits  # the largest step that fits
    assert "capped by the memory plan" in s.why and "8192" in s.why


def test_given_values_are_kept_and_a_config_without_a_trained_context_says_so():
    at = plan_at(4096 * MiB)
    s = memory.serve_sizing(at, 8192, context=1000, prefix_cache=5 * MiB)
    assert (s.context, s.prefix_cache) == (1000, 5 * MiB)
    s = memory.serve_sizing(at, 8192, context=2048)
    assert s.context == 2048 and s.prefix_cache == 2 * memory.entry_bytes(at(2048, 0))
    s = memory.serve_sizing(at, None)
    assert s.context == 4096 and "no trained context" in s.why
    # a small headroom: half of it, never less than one whole context
    tight = plan_at(
        memory.make_plan(INPUTS, context=8192, block_size=1, budget=1, budget_source="t").total
        + memory.entry_bytes(at(8192, 0))
        + MiB
    )
    s = memory.serve_sizing(tight, 8192)
    assert s.context == 8192 and s.prefix_cache == memory.entry_bytes(at(8192, 0))


def test_session_sizes_a_pair_on_disk(tmp_path):
    t, d = save_tiny_pair(tmp_path)
    cfg = LoadConfig(target=str(t), drafter=str(d), prefix_cache=256 * MiB, tune=False)
    sized, why = serve_sizing(cfg, context=True, prefix_cache=True)
    assert sized.context == 4096  # the tiny target's max_position_embeddings
    plan = memory.plan_for_config(replace(sized, prefix_cache=0), str(d))[1]
    assert sized.prefix_cache == 2 * memory.entry_bytes(plan) != 256 * MiB
    assert "4096" in why
    kept, why = serve_sizing(replace(cfg, context=1024), context=False, prefix_cache=False)
    assert (kept.context, kept.prefix_cache, why) == (1024, 256 * MiB, None)


def _args(*argv):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_serve_flags_leave_context_and_prefix_to_the_plan_and_name_the_models():
    a = _args()
    assert a.context is None and a.prefix_cache_mb is None and serve.model_names(a) == ModelNames()
    a = _args(
        "--context",
        "2048",
        "--prefix-cache-mb",
        "64",
        "--served-model-name",
        "coder,claude-sonnet-4-6",
        "--served-model-name",
        "gpt-4o",
        "--strict-model-name",
    )
    assert (a.context, a.prefix_cache_mb) == (2048, 64)
    assert serve.model_names(a) == ModelNames(("coder", "claude-sonnet-4-6", "gpt-4o"), strict=True)
    with pytest.raises(BadRequest, match="non-empty"):
        serve.model_names(_args("--served-model-name", "a,,b"))
