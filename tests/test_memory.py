"""The memory plan: arithmetic on synthetic configs, weights from headers, refusal, accuracy."""

import mlx_spec  # noqa: F401  (before mlx: loads the optimized BLAS when this file runs alone)
from mlx_spec import memory, quantize
from mlx_spec.errors import PlanError

import mlx.core as mx
import pytest
from helpers import TARGET_CONFIGS, drafter_config, save_tiny_pair, tiny_model

MiB = 2**20
DENSE = dict(TARGET_CONFIGS["qwen3"])  # L=4, H=64, 4 heads / 2 kv heads, head_dim 16, I=128, V=128
FLOAT = quantize.QuantChoice(None, None, 64, False, "")


def _inputs(tcfg, dcfg=None, quant=FLOAT, metal=False, **kw):
    tt = quantize.module_tensors(quantize.skeleton(tcfg))
    dt = quantize.module_tensors(_drafter(dcfg)) if dcfg else ()
    p = memory.inputs_for(tcfg, tt, dcfg, dt, quant, metal=metal)
    return memory.PlanInputs(**{**{f: getattr(p, f) for f in p.__dataclass_fields__}, **kw})


def _drafter(dcfg):
    from mlx_spec.drafter import Drafter, DrafterArgs

    return Drafter(DrafterArgs.from_config(dcfg))


def _rows(p, context, block, prompt=None):
    return {i.name: i.bytes for i in memory.items(p, context, block, prompt)}


def test_dense_plan_by_hand():
    dcfg = drafter_config(DENSE, layers=2, taps=(0, 2))
    p = _inputs(DENSE, dcfg)
    n_target = sum(t.numel for t in quantize.module_tensors(quantize.skeleton(DENSE)))
    assert p.target_weights == 4 * n_target
    model, _ = tiny_model("qwen3")  # the same config, materialized: the bytes agree
    assert p.target_weights == sum(t.numel * 4 for t in quantize.module_tensors(model))
    rows = _rows(p, context=1000, block=8, prompt=300)
    assert rows["target KV cache"] == 4 * (2 * 2 * 16 * 4) * 1024  # 4 layers x K+V x 1008 -> 1024 positions
    assert rows["drafter context cache"] == 2 * (2 * 2 * 16 * 4) * 1000  # 2 full layers x 1000 rows
    assert rows["target features for the drafter"] == 2 * 64 * 4 * 300  # 2 taps x H x prompt
    assert rows["drafter weights"] == 4 * sum(t.numel for t in quantize.module_tensors(_drafter(dcfg)))
    # 4-bit, group 32: every matrix quantized (scales/biases float32 on CPU), norms stay float32
    q4 = _inputs(DENSE, dcfg, quantize.QuantChoice(4, 4, 32, False, ""))
    mats = [t for t in quantize.module_tensors(quantize.skeleton(DENSE)) if len(t.shape) == 2]
    norms = n_target - sum(t.numel for t in mats)
    assert q4.target_weights == sum(m.numel // 2 + 2 * (m.numel // 32) * 4 for m in mats) + 4 * norms


def test_max_context_fits_and_falls_with_block_size():
    p = _inputs(DENSE, drafter_config(DENSE, layers=2))
    budget = sum(_rows(p, 3064, 8).values())  # KV for 3064 + 8 positions fills 3072 exactly
    plan = memory.make_plan(p, context=1000, block_size=8, budget=budget, budget_source="test")
    assert plan.fits and plan.max_context == 3064
    assert sum(_rows(p, plan.max_context, 8).values()) <= budget < sum(_rows(p, plan.max_context + 1, 8).values())
    big_block = memory.make_plan(p, context=1000, block_size=64, budget=budget, budget_source="test")
    assert big_block.max_context < plan.max_context
    assert plan.peak == plan.total - _rows(p, 1000, 8)["MLX cache allowance"]


def test_sliding_window_drafter_cache_is_bounded():
    p = _inputs(DENSE, drafter_config(DENSE, layers=2, window=64))
    per_row = 2 * 2 * 16 * 4
    assert _rows(p, 50, 8)["drafter context cache"] == 2 * per_row * 50
    assert _rows(p, 10_000, 8)["drafter context cache"] == 2 * per_row * 63  # window - 1 rows kept
    full = _inputs(DENSE, drafter_config(DENSE, layers=2))
    assert _rows(full, 10_000, 8)["drafter context cache"] == 2 * per_row * 10_000


HYBRID = {
    "model_type": "qwen3_5",
    "text_config": dict(
        model_type="qwen3_5_text",
        hidden_size=64,
        num_hidden_layers=8,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=128,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        full_attention_interval=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
    ),
}


def test_hybrid_recurrent_state_is_fixed_and_matches_mlx_lm():
    d = memory.target_dims(HYBRID)
    assert d.kinds.count("linear") == 6 and d.kinds.count("full") == 2
    p = _inputs(HYBRID)
    r1, r2 = _rows(p, 100, 8), _rows(p, 100_000, 8)
    assert r1["recurrent state"] == r2["recurrent state"] > 0
    assert r1["target KV cache"] == 2 * (2 * 2 * 16 * 4) * 256  # only the 2 attention layers
    # the conv + recurrent state per layer equals what mlx-lm's ArraysCache really holds
    model = quantize.skeleton(HYBRID)
    mx.eval(model.parameters())
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
    state = [c for c in cache if type(c).__name__ == "ArraysCache"][0]
    assert state[0].nbytes + state[1].nbytes == (d.conv_kernel - 1) * d.conv_dim * 4 + 4 * d.ssm_state


def test_moe_weights_and_active_width():
    cfg = dict(
        DENSE,
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    d = memory.target_dims(cfg)
    assert d.intermediate == 2 * 32
    p = _inputs(cfg)
    experts = 4 * 8 * 3 * 64 * 32  # layers x experts x (gate, up, down) x H x expert width
    router = 4 * 8 * 64
    dense_part = _inputs(DENSE).target_weights // 4 - 4 * 3 * 64 * 128  # same model minus dense MLPs
    assert p.target_weights == 4 * (experts + router + dense_part)


def test_refusal_names_the_biggest_items_and_force_passes():
    p = _inputs(DENSE, drafter_config(DENSE, layers=2))
    plan = memory.make_plan(p, context=4096, block_size=8, budget=100_000, budget_source="test budget")
    assert not plan.fits and plan.max_context == 0
    with pytest.raises(PlanError) as e:
        memory.check(plan)
    for item in plan.biggest(3):
        assert item.name in str(e.value)
    assert "--force" in str(e.value) and "test budget" in str(e.value)
    warned = []
    memory.check(plan, force=True, warn=warned.append)
    assert warned and "--force" in warned[0]
    near = memory.make_plan(p, context=4096, block_size=8, budget=int(plan.total / 0.95), budget_source="t")
    warned.clear()
    memory.check(near, warn=warned.append)
    assert warned and "95%" in warned[0]


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), v2=True, layers=2)


@pytest.mark.parametrize("bits", [None, 4])
def test_plan_from_files_equals_loaded_bytes(pair_dir, bits):
    from mlx_spec.loading import load_pair

    tdir, ddir = pair_dir
    quant = quantize.QuantChoice(bits, bits, 32, False, "")
    plan = memory.plan_for(str(tdir), str(ddir), quant, context=512, budget=(1 << 40, "test"))
    pair = load_pair(str(tdir), str(ddir), target_bits=bits, drafter_bits=bits, group_size=32)
    nbytes = [
        sum(t.numel * quantize.DTYPE_BYTES[t.dtype] for t in quantize.module_tensors(m))
        for m in (pair.model, pair.drafter)
    ]
    assert [plan.items[0].bytes, plan.items[1].bytes] == nbytes


def _cfg(tdir, ddir, **kw):
    from mlx_spec.config import LoadConfig

    return LoadConfig(**{**dict(target=str(tdir), drafter=str(ddir), context=2048, tune=False), **kw})


def test_open_session_refuses_over_budget_and_force_loads(pair_dir, monkeypatch):
    from mlx_spec.session import open_session

    monkeypatch.setattr(memory, "device_budget", lambda: (1 << 20, "tiny test budget"))
    lines = []
    with pytest.raises(PlanError) as e:
        open_session(_cfg(*pair_dir), log=lines.append)
    assert "biggest items: verify / prefill scratch" in str(e.value) and lines[0].startswith("memory plan:")
    session = open_session(_cfg(*pair_dir, force=True), log=lines.append)
    assert session.pair.drafter is not None and any("--force" in m for m in lines)
    assert session.info.mode == "speculative" and session.info.block_size_source == "checkpoint (--no-tune)"


def test_cli_generate_refuses_with_nonzero_exit(pair_dir, monkeypatch, capsys):
    from mlx_spec import cli

    monkeypatch.setattr(memory, "device_budget", lambda: (1 << 20, "tiny test budget"))
    tdir, ddir = pair_dir
    argv = [
        "generate",
        "--target",
        str(tdir),
        "--drafter",
        str(ddir),
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
        "--block-size",
        "4",
    ]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "memory plan" in err and "biggest items: verify / prefill scratch" in err


def test_plan_command_json(pair_dir, capsys):
    import json

    from mlx_spec import cli

    tdir, ddir = pair_dir
    assert cli.main(["plan", "--target", str(tdir), "--drafter", str(ddir), "--context", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["context"] == 1024 and out["total"] == sum(i["bytes"] for i in out["items"])
    assert cli.main(["plan", "--target", str(tdir), "--no-draft", "--budget-gb", "0.0001"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_live_numbers(pair_dir):
    p = memory.make_plan(_inputs(DENSE), context=64, block_size=1, budget=1 << 30, budget_source="t")
    live = memory.live(p)
    for k in ("active", "peak", "cache", "budget", "swap_used", "swap_total", "ram_total"):
        assert isinstance(live[k], int), k
    assert live["plan"]["total"] == p.total and live["budget"] == 1 << 30
    assert memory.live()["plan"] is None


ACCURACY = dict(
    TARGET_CONFIGS["qwen3"],
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=8192,
)


def test_planned_peak_within_15_percent_of_measured():
    """Prefill 256 + 64 generated tokens, block 8, random DFlash 2 drafter (small case of
    benchmarks/plan_accuracy.py; the peak is the prefill's: 64 tokens take the caches past their
    first growth, and 256 measured the same within 0.5 %)."""
    from mlx_spec.decode import spec_steps
    from mlx_spec.target import Target

    from mlx_lm.models import qwen3

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(ACCURACY))
    mx.eval(model.parameters())
    dcfg = drafter_config(ACCURACY, v2=True, layers=2, taps=(0, 1, 3), block_size=8)
    drafter = _drafter(dcfg)
    mx.eval(drafter.parameters())
    target = Target(model, drafter.args.target_layer_ids)
    drafter.bind(target.embed, target.head)
    p = memory.inputs_for(
        ACCURACY, quantize.module_tensors(model), dcfg, quantize.module_tensors(drafter), FLOAT, metal=False
    )
    plan = memory.make_plan(p, context=512, block_size=8, prompt=256, budget=1 << 40, budget_source="t")
    mx.clear_cache()
    mx.reset_peak_memory()
    prompt = [(7 * i + 3) % 8000 + 1 for i in range(256)]
    n = sum(len(s.tokens) for s in spec_steps(target, drafter, prompt, block_size=8, max_tokens=64))
    assert n == 64
    measured = mx.get_peak_memory()
    assert abs(plan.peak / measured - 1) < 0.15, (plan.peak / MiB, measured / MiB)


def test_the_resident_memory_bound_adds_the_plans_growth_to_what_was_measured_at_start():
    """RSS once loaded (measured) + the plan's per-sequence rows for the batch, its prefix cache
    and MLX cache allowance + the stated heap allowance; the runtime is the RSS outside MLX."""
    p = _inputs(DENSE, drafter_config(DENSE, layers=2), prefix_cache=5 * MiB)
    plan = memory.make_plan(p, context=1000, block_size=8, budget=1 << 40, budget_source="test")
    rows = {i.name: i.bytes for i in plan.items}
    one = (
        rows["target KV cache"]
        + rows["drafter context cache"]
        + rows["target features for the drafter"]
        + rows["verify / prefill scratch"]
    )
    b = memory.rss_bound(plan, rss=500 * MiB, mlx_active=300 * MiB, mlx_cache=2 * MiB, heap=10 * MiB)
    assert b.runtime == 198 * MiB  # RSS - MLX active - MLX cache, once loaded
    assert b.sequences == one == memory.batch_room(plan).need(1000)  # what admission counts a sequence
    assert (b.prefix_cache, b.mlx_cache, b.heap) == (5 * MiB, rows["MLX cache allowance"], 10 * MiB)
    assert b.total == 498 * MiB + one + 5 * MiB + rows["MLX cache allowance"] + 10 * MiB
    assert sum(b.terms().values()) == b.total
    assert memory.rss_bound(plan, rss=500 * MiB, mlx_active=300 * MiB).heap == memory.HEAP_ALLOWANCE
    # a batch of 4 counts four sequences; never more than the room admission leaves them
    four = memory.rss_bound(plan, rss=500 * MiB, mlx_active=300 * MiB, batch=4)
    assert four.sequences == 4 * one
    shared = plan.total - one
    tight = memory.make_plan(p, context=1000, block_size=8, budget=shared + 2 * one + 7, budget_source="test")
    assert memory.rss_bound(tight, rss=500 * MiB, mlx_active=300 * MiB, batch=4).sequences == 2 * one + 7


@pytest.mark.skipif(memory._malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_releasing_the_free_heap_hands_mallocs_free_pages_back_to_the_os():
    """Freed blocks in the middle of malloc's heap stay in the process (what freed MLX buffers
    do on Linux); release_free_heap gives their pages back."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 96 << 10  # below any mmap threshold: these come from malloc's heap
    blocks = [libc.malloc(size) for _ in range(1600)]
    assert all(blocks)
    try:
        for b in blocks:
            ctypes.memset(b, 1, size)  # (touched: resident)
        for i, b in enumerate(blocks):
            if i % 8:  # every 8th kept, so the freed runs lie inside the heap, not at its top
                libc.free(b)
        held = memory.rss()
        assert memory.release_free_heap()
        assert held - memory.rss() > 64 * MiB  # of the ~131 MiB freed
    finally:
        for b in blocks[::8]:
            libc.free(b)
