"""The Mac configuration, run on this CPU: every Metal branch with MLX's real kernels.

``backend.use("metal")`` (the ``mac`` fixture; ``MLX_SPEC_BACKEND_AS=metal`` for a whole
process) makes the package take the branches an Apple Silicon Mac takes: the file's dtype kept
(no float32 cast), the default target's 4-bit GGUF weights kept, the drafter quantized as the
Mac default says, a Metal working set as budget and wired limit. The models are made as a Mac
loads them: float16 weights quantized with float16 scales and float32 norms (a kept Q4_1 GGUF's
layout, built here from a tiny GGUF with the default target's mixed tensor types too).
"""

from __future__ import annotations

from mlx_spec import backend, default_target, loading, memory, quantize, verify
from mlx_spec.batch import BatchDecoder, batched_steps
from mlx_spec.decode import spec_steps

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import greedy_reference, tiny_drafter, tiny_model
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from test_hybrid import build

PROMPTS = ([1, 5, 9, 17, 33, 2, 8], [(7 * i + 3) % 120 + 4 for i in range(30)], [4, 4, 4, 90, 12])
N = 24
GROUP = 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 wide


@pytest.fixture
def mac():
    with backend.use("metal") as b:
        yield b


def mac_layout(model, bits: int = 4):
    """Float16 weights quantized with float16 scales, float32 norms: a kept GGUF on a Mac."""
    model.set_dtype(mx.float16)
    quantize.quantize_module(model, bits, GROUP)
    norms = [
        (k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters()) if k.split(".")[-2].endswith("norm")
    ]
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())
    return model


def mac_drafter(model, cfg, bits: str | None = None, **kw):
    """A float16 drafter prepared as the Mac chooses for a 4-bit target: by default the measured
    drafter precision, or ``bits`` ("4", "8") as --drafter-bits asks (16-bit activations).
    Prepared before it binds to the target, as loading does."""
    from mlx_spec.drafter import Drafter, DrafterArgs
    from mlx_spec.target import Target

    from helpers import drafter_config

    dcfg = drafter_config(cfg, **{k: v for k, v in kw.items() if k != "seed"})
    mx.random.seed(kw.get("seed", 1))
    d = Drafter(DrafterArgs.from_config(dcfg))
    qc = quantize.choose(None, bits, None, metal=backend.current().gpu, checkpoint=(4, GROUP))
    act = getattr(mx, qc.drafter_activations) if qc.drafter_activations else mx.float16
    quantize.prepare(d, bits=qc.drafter_bits, group_size=GROUP, dtype=act)  # as loading.load_drafter
    d.act_dtype = act if qc.drafter_activations else None
    target = Target(model, d.args.target_layer_ids)
    d.bind(target.embed, target.head)
    return target, d, qc


def _tokens(steps):
    return [t for s in steps for t in s.tokens]


# -- the branches -------------------------------------------------------------------------------


def test_the_mac_fixture_takes_every_metal_branch(mac):
    assert mac.kind == "metal" and mac.faked and mac.gpu and not mac.cast_float32
    assert loading.default_dtype() is None  # the file's dtype kept
    assert default_target.choose_dtype(backend.current().fast_quantized)[0] == "keep"  # Q4_1 kept
    qc = quantize.choose(None, None, None, metal=backend.current().gpu, checkpoint=(4, 32))
    assert qc.target_bits == 4  # the checkpoint's bits kept
    assert (qc.drafter_bits, qc.drafter_activations) == (quantize.GPU_DRAFTER_BITS, quantize.GPU_DRAFTER_ACTIVATIONS)
    assert "drafter precision" in qc.reason and "activations" in qc.describe()
    budget, source = memory.device_budget()
    assert source.startswith("Metal recommended working set") and budget == mac.wired_limit
    assert memory.set_wired_limit() is None  # faked: no Metal allocator to wire
    assert verify.tolerance("float16", 1.0) > verify.tolerance("float16", 1.0, "cpu")


def test_without_the_fixture_this_machine_is_the_cpu_backend():
    b = backend.current()
    assert b.kind == "cpu" and loading.default_dtype() == mx.float32
    assert quantize.choose(None, None, None, metal=b.gpu, checkpoint=None).drafter_bits is None


# -- the kept GGUF target -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kept_gguf(tmp_path_factory):
    """A tiny GGUF with the default target's tensor types (Q4_1 attention and MLP, Q8_0
    embedding, F32 norms), converted as the Mac default does (weights kept)."""
    from mlx_spec.gguf import convert_gguf

    from test_gguf import tiny_model as gguf_model
    from test_gguf import train_tokenizer, write_gguf

    tk = train_tokenizer()
    model, args = gguf_model(tk.get_vocab_size())
    types = {k: Q.Q4_1 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    types["token_embd"] = Q.Q8_0
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(folder / "tiny.gguf", model, args, tk, types=types)
    return convert_gguf(folder / "tiny.gguf", folder / "keep", dtype="keep")


def _target(kind: str, tmp_path, kept_gguf):
    """(model, config dict) loaded through the package's loader under the Mac fixture."""
    from mlx_lm.utils import save_config, save_model

    if kind == "kept-gguf":
        path = kept_gguf
    else:
        model, cfg = tiny_model("llama")
        if kind == "float16":
            model.set_dtype(mx.float16)
        path = tmp_path / kind
        save_model(path, model)
        save_config(cfg, path / "config.json")
        from helpers import save_tiny_tokenizer

        save_tiny_tokenizer(path)
    model, _ = loading.load_target_model(str(path))
    import json

    return model, json.loads((path / "config.json").read_text()), path


@pytest.mark.parametrize("kind", ["float32", "float16", "kept-gguf"])
def test_the_plans_kv_bytes_are_what_the_loaded_cache_holds(mac, kind, tmp_path, kept_gguf):
    model, cfg, path = _target(kind, tmp_path, kept_gguf)
    if kind == "kept-gguf":  # the layout the bug was about: float16 scales, float32 norms
        dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
        assert dtypes["model.layers.0.self_attn.q_proj.scales"] == mx.float16
        assert dtypes["model.norm.weight"] == mx.float32
    quant = quantize.choose(
        None, None, None, metal=True, checkpoint=quantize.checkpoint_quantization(cfg), drafter=False
    )
    inputs = memory.inputs_for(cfg, quantize.safetensors_tensors(path), None, (), quant, metal=True)
    dims = memory.target_dims(cfg)
    planned = memory.kv_bytes(dims, inputs.act_bytes) * dims.layers
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 5, 9, 17, 33]]), cache=cache))
    held = sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in cache)
    assert planned == held, (kind, inputs.act_bytes, [c.keys.dtype for c in cache][:1])
    pair = loading.Pair(model, None, None, None, str(path), None, None)
    assert memory.loaded_sizes(pair).target_kv_per_token == held


# -- decoding is lossless in the Mac configuration ----------------------------------------------


@pytest.fixture(scope="module")
def mac_dense():
    with backend.use("metal"):
        model, cfg = tiny_model("qwen3")
        mac_layout(model)
        refs = [greedy_reference(model, p, N) for p in PROMPTS]
    return model, cfg, refs


@pytest.mark.parametrize("bits", [None, "4"], ids=["default", "4-bit-f16"])
@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_greedy_single_stream_equals_plain_dense(mac, mac_dense, v2, bits):
    model, cfg, refs = mac_dense
    target, d, qc = mac_drafter(model, cfg, bits, v2=v2)
    assert any(v.dtype == mx.uint32 for _, v in d.own_parameters()) == (qc.drafter_bits is not None)
    for p, ref in zip(PROMPTS, refs):
        steps = list(spec_steps(target, d, p, block_size=4, max_tokens=N))
        assert _tokens(steps) == ref
    d.settle()
    assert d.health().nonfinite == 0 and d.health().passes > 0


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_moe"], ids=["hybrid-gdn-moe", "moe"])
def test_greedy_single_stream_equals_plain_hybrid_and_moe(mac, kind):
    model, cfg = build(kind)
    mac_layout(model)
    target, d, _ = mac_drafter(model, cfg, "4", v2=True)
    for p in PROMPTS[:2]:
        ref = greedy_reference(model, p, N)
        assert _tokens(spec_steps(target, d, p, block_size=4, max_tokens=N)) == ref, kind


@pytest.mark.parametrize("v2", [False, True], ids=["dflash1", "dflash2"])
def test_batched_equals_alone_with_the_packed_drafter(mac, mac_dense, v2):
    """The quantized drafter keeps its one pass for all sequences (the self-check used the
    packed width of a quantized fc and fell back to one pass per sequence)."""
    model, cfg, refs = mac_dense
    target, d, _ = mac_drafter(model, cfg, "4", v2=v2)
    assert d.fc.weight.dtype == mx.uint32 and d.fc.scales.dtype == mx.float16
    dec = BatchDecoder(target, d, block_size=4, max_batch=4, prefill_chunk=16)
    assert dec.packed_drafter, "the packed drafter pass fell back on a quantized float16 drafter"
    got = {i: [] for i in range(len(PROMPTS))}
    for j, st in batched_steps(dec, [dict(prompt=p, max_tokens=N) for p in PROMPTS]):
        got[j].extend(st.tokens)
    for i, ref in enumerate(refs):
        assert got[i] == ref, i


def test_sampling_keeps_the_target_distribution(mac):
    """T = 1 through drafted blocks of a quantized float16 pair: the joint law of two tokens is
    the target's p(y1) p(y2 | y1)."""
    import importlib

    from mlx_spec.sampling import SamplingConfig, target_probs

    from helpers import TARGET_CONFIGS
    from test_batch import AlwaysDraft
    from test_sampling import gof_pvalue

    V = 8
    tcfg = dict(TARGET_CONFIGS["qwen3"], vocab_size=V)
    mod = importlib.import_module("mlx_lm.models.qwen3")
    mx.random.seed(0)
    model = mac_layout(mod.Model(mod.ModelArgs.from_dict(tcfg)))
    prompt, cfg = [1, 5, 9], SamplingConfig(1.0)
    p0 = np.array(target_probs(model(mx.array([prompt]))[0, -1], cfg).astype(mx.float32))
    p1 = np.array(target_probs(model(mx.array([prompt + [a] for a in range(V)]))[:, -1], cfg).astype(mx.float32))
    exact = (p0[:, None] * p1).reshape(-1)
    exact /= exact.sum()
    target, d, _ = mac_drafter(model, tcfg, "4", seed=5)
    n = 240
    dec = BatchDecoder(target, d, block_size=3, max_batch=n, policy=AlwaysDraft())
    jobs = [dict(prompt=prompt, max_tokens=3, sampling=SamplingConfig(1.0, seed=1000 + i)) for i in range(n)]
    got = {i: [] for i in range(n)}
    drafted = 0
    for j, st in batched_steps(dec, jobs):
        got[j].extend(st.tokens)
        drafted += st.drafted
    counts = np.bincount([got[i][0] * V + got[i][1] for i in range(n)], minlength=V * V)
    assert drafted > 0
    assert gof_pvalue(counts, exact) > 0.001


# -- verify on a near tie built on purpose -------------------------------------------------------


def test_verify_calls_a_float16_near_tie_numeric_and_a_real_gap_a_mismatch(mac):
    """A flip just inside the backend's float16 allowance is a near tie, just outside it a
    mismatch; the same flip inside Metal's allowance is beyond the CPU's (the boundary moves with
    the backend in use)."""
    mag = 8.0
    tol = verify.tolerance("float16", mag)
    assert tol == verify.tolerance("float16", mag, "metal") > verify.tolerance("float16", mag, "cpu")

    def verdict(gap, backend_kind=None):
        single = mx.array([0.0, mag, mag - gap, 1.0])
        batched = mx.array([0.0, mag - gap, mag, 1.0])
        t = None if backend_kind is None else verify.tolerance("float16", mag, backend_kind)
        return verify.classify(single, batched, 1, 2, "float16", t).verdict

    assert verdict(0.95 * tol) == verify.NUMERIC
    assert verdict(1.05 * tol) == verify.MISMATCH
    assert verdict(0.95 * tol, "cpu") == verify.MISMATCH


# -- drafter precision and non-finite passes -----------------------------------------------------


def test_a_drafter_that_overflows_in_float16_falls_back_to_float32_once(mac_dense, caplog):
    """A norm weight scaled so the float16 activations overflow: the pass is caught by its
    finiteness flag, counted, warned about, and the drafter runs float32 from then on; greedy
    output stays the target's."""
    model, cfg, refs = mac_dense
    target, d, _ = tiny_drafter(model, cfg, seed=3)
    d.set_dtype(mx.float16)
    d.act_dtype = mx.float16
    # float16's largest value is 65504: context rows scaled to ~6e4 overflow in the attention
    # projections, while float32 holds them (and the norms after them bring them back)
    d.hidden_norm.weight = mx.full(d.hidden_norm.weight.shape, 60000.0, mx.float16)
    with caplog.at_level("WARNING"):
        steps = list(spec_steps(target, d, PROMPTS[0], block_size=4, max_tokens=N))
    d.settle()
    h = d.health()
    assert _tokens(steps) == refs[0]
    assert h.nonfinite >= 1 and h.activations == "float32" and h.fallback
    assert "float32" in caplog.text and "non-finite" in caplog.text
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(d.parameters()))
    later = h.nonfinite
    list(spec_steps(target, d, PROMPTS[1], block_size=4, max_tokens=N))
    d.settle()
    assert d.health().nonfinite == later  # float32 holds the same weights without overflow


def test_a_finite_drafter_reports_every_pass_finite(mac_dense):
    model, cfg, _ = mac_dense
    target, d, _ = tiny_drafter(model, cfg)
    list(spec_steps(target, d, PROMPTS[0], block_size=4, max_tokens=N))
    d.settle()
    h = d.health()
    assert h.passes > 0 and h.nonfinite == 0 and h.fallback is None


@pytest.mark.skipif(backend.detect().kind != "metal", reason="Metal only: calibrates verify's tolerance there")
def test_metal_calibration_of_verify_tolerance():
    """Single-row against multi-row logits of a kept 4-bit float16 model on Metal: the largest
    disagreement, in float16 ulps of the logits' magnitude, must sit inside verify's allowance."""
    model, _ = tiny_model("qwen3")
    mac_layout(model)
    ids = mx.array([PROMPTS[1]])
    full = model(ids)[0]
    cache = make_prompt_cache(model)
    rows = [model(ids[:, i : i + 1], cache=cache)[0, 0] for i in range(ids.shape[1])]
    one = mx.stack(rows)
    mag = float(mx.abs(full).max())
    ulps = float(mx.abs(full.astype(mx.float32) - one.astype(mx.float32)).max()) / (verify.EPS["float16"] * mag)
    print(
        f"Metal calibration: single-row vs multi-row logits differ by {ulps:.2f} float16 ulps of {mag:.2f}; "
        f"allowance {verify.ULPS_GPU['float16']}"
    )
    assert ulps <= verify.ULPS_GPU["float16"]
