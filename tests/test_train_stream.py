"""`train run`: generate-and-train in one process, the replay buffer, resume, prompt pools, and
the shared drafter forward (issue 16 item 4, issue 22)."""

import ast
import json
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

from mlx_spec.errors import BadRequest
from mlx_spec.train.replay import ReplayBuffer
from mlx_spec.train.stream import StreamConfig, held_out_by_kind, lr_at, run_stream, stream_prompts
from mlx_spec.train.trainer import Recipe

import mlx.core as mx
import numpy as np
import pytest
from helpers import save_tiny_pair

MASK = 127
KINDS = ("code", "prose", "math")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    tdir, ddir = save_tiny_pair(root)
    words = ["sea", "code", "sum", "tree", "list", "rain", "map", "five", "cat", "loop", "sky", "add"]
    lines = [json.dumps({"id": f"{KINDS[i % 3]}-{i}", "prompt": f"{words[i % 12]} {i}"}) for i in range(30)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root, tdir, ddir


def _cfg(root, tdir, out, **kw):
    recipe = Recipe(
        layers=1,
        intermediate_size=64,
        selector_rank=16,
        selector_top_k=8,
        mask_token_id=MASK,
        seqs_per_step=2,
        anchors=4,
        lr=3e-3,
        block_size=4,
    )
    base = dict(
        out=str(out),
        target=str(tdir),
        prompts=str(root / "prompts.jsonl"),
        tokens=120,
        batch_size=3,
        max_tokens=10,
        top_k=4,
        replay_mb=0.06,
        steps_per_batch=2,
        checkpoint_batches=2,
        eval_per_kind=1,
        eval_prompts=0,
        eval_max_tokens=6,
        seed=0,
        recipe=recipe,
    )
    base.update(kw)
    return StreamConfig(**base)


def _weights(run: Path) -> dict:
    return mx.load(str(run / "ckpt" / "model.safetensors"))


def test_replay_buffer_is_bounded_and_round_trips(tmp_path):
    buf = ReplayBuffer(4000)
    rng = np.random.default_rng(0)
    for i in range(50):
        n = int(rng.integers(5, 12))
        buf.add(f"s{i}", np.arange(n), 2, rng.normal(size=(n, 16)), np.zeros((n, 4)), np.zeros((n, 4)))
        assert buf.nbytes <= 4000
    assert buf.evicted > 30 and buf.ids[-1] == "s49"  # oldest first out, newest kept
    buf.save(tmp_path / "r.npz")
    again = ReplayBuffer(4000)
    again.load(tmp_path / "r.npz")
    assert again.ids == buf.ids and again.nbytes == buf.nbytes and again.evicted == buf.evicted
    assert all((a == b).all() for a, b in zip(again.features, buf.features))
    with pytest.raises(BadRequest, match="larger than the replay buffer"):
        buf.add("big", np.arange(500), 2, np.zeros((500, 16)), np.zeros((500, 4)), np.zeros((500, 4)))


def test_train_run_bounded_checkpointed_and_resume_is_exact(pair, tmp_path):
    """An interrupted run resumed equals an uninterrupted one; memory and disk stay bounded by
    the buffer while the data grows past it; token ids of every response are kept."""
    from mlx_spec.loading import load_pair
    from mlx_spec.train.data import export_tokens

    root, tdir, _ = pair
    peak = []
    full = run_stream(
        _cfg(root, tdir, tmp_path / "full", eval_prompts=2), progress=lambda p: peak.append(p.replay_bytes)
    )
    assert not full["stopped"] and full["tokens"] >= 120 and full["step"] == 2 * full["batches"]
    cap = int(0.06 * 2**20)
    assert max(peak) <= cap and full["replay_evicted"] > 0  # the data outgrew the buffer
    run = tmp_path / "full"
    assert (run / "ckpt" / "replay.npz").stat().st_size <= cap + 4096
    assert not list(run.rglob("*.feat.npy"))
    assert len(list((run / "tokens").glob("*.npz"))) == full["batches"]
    ex = export_tokens(run, tmp_path / "tokens.npz")
    assert ex["sequences"] == 3 * full["batches"] - full["skipped"]
    assert (run / "loss.png").exists() and (run / "tau.png").exists() and full["evals"][0]["tau"] >= 1.0
    from mlx_spec.prompts import load_prompts

    held = load_prompts(run / "eval_prompts.jsonl")  # for `train eval --prompts`: the run's held-out set
    assert held == stream_prompts(_cfg(root, tdir, run))[1]
    pair2 = load_pair(str(tdir), str(run / "ckpt"))  # loads strictly, decodes
    assert pair2.drafter.args.block_size == 4

    # Interrupted mid-batch (after 3 steps: one of the second batch's two still pending), resumed.
    stop = threading.Event()

    def interrupt(p):
        if p.steps == 3:
            stop.set()

    part = run_stream(_cfg(root, tdir, tmp_path / "part"), progress=interrupt, stop=stop)
    assert part["stopped"] and part["step"] == 3
    with pytest.raises(BadRequest, match="already holds a run"):
        run_stream(_cfg(root, tdir, tmp_path / "part"))
    with pytest.raises(BadRequest, match="different settings"):
        run_stream(_cfg(root, tdir, tmp_path / "part", resume=True, steps_per_batch=3))
    rest = run_stream(_cfg(root, tdir, tmp_path / "part", resume=True))
    assert rest["step"] == full["step"] and rest["tokens"] == full["tokens"]
    a, b = _weights(run), _weights(tmp_path / "part")
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    # A larger budget continues the same run.
    more = run_stream(_cfg(root, tdir, tmp_path / "part", resume=True, tokens=160))
    assert more["tokens"] >= 160 and more["step"] > full["step"]


def test_trainer_forward_equals_inference_after_two_steps(pair, tmp_path):
    """After two training steps, the trainer's block forward, logits and selector scores are the
    drafter's inference forward on the same blocks (one code path, issue 16 item 4)."""
    from mlx_spec.train.trainer import block_hidden, make_batch, to_mx, train_step

    root, tdir, _ = pair
    cfg = _cfg(root, tdir, tmp_path / "run", tokens=20, steps_per_batch=2)
    run_stream(cfg)
    from mlx_spec.loading import load_pair

    p = load_pair(str(tdir), str(tmp_path / "run" / "ckpt"))
    d = p.drafter
    buf = ReplayBuffer(2**20)
    buf.load(tmp_path / "run" / "ckpt" / "replay.npz")
    tcfg = cfg.recipe
    import mlx.optimizers as optim

    opt = optim.AdamW(learning_rate=1e-2)
    rng = np.random.default_rng(5)
    for _ in range(2):
        train_step(d, opt, to_mx(make_batch(buf, rng, tcfg, MASK), tcfg), tcfg)
    nb = make_batch(buf, rng, tcfg, MASK)
    b = to_mx(nb, tcfg)
    h = block_hidden(d, b["features"], b["blocks"], b["anchors"], b["seq"], b["mask"])
    sel = d.candidate_selector
    for n in range(len(nb.anchors)):
        a, s = int(nb.anchors[n]), int(nb.seq[n])
        ref = d.hidden(b["blocks"][n : n + 1], b["features"][s : s + 1, :a], d.make_cache())[0]
        assert mx.abs(h[n] - ref).max().item() < 1e-4, n
        assert mx.abs(d.logits(h[n], full=True) - d.logits(ref, full=True)).max().item() < 1e-3
        # the selector's first row (predecessor = the anchor), training form vs the lattice
        unary = d.logits(ref[1:], full=True)
        cand, lattice = sel.lattice(ref[1:], unary, mx.array(int(nb.blocks[n, 0])))
        u = mx.take_along_axis(unary, cand, axis=-1)
        train_form = sel.scores(ref[1:2], u[:1], mx.array([[int(nb.blocks[n, 0])]]), cand[:1])[0, 0]
        assert mx.abs(train_form - lattice[0, 0]).max().item() < 1e-4


def test_held_out_prompts_by_kind_are_never_trained_on(pair):
    from mlx_spec.loading import load_target_model

    root, tdir, _ = pair
    tok = load_target_model(str(tdir))[1]
    cfg = _cfg(root, tdir, root / "x", prompts="broad", num_prompts=120, eval_per_kind=2)
    train, evals = stream_prompts(cfg)
    kinds = Counter(p.kind for p in evals)
    assert set(kinds) == {"code", "prose", "math", "chat", "agent"} and set(kinds.values()) == {2}
    trained = {tuple(p.encode(tok)) for p in train}
    assert not trained & {tuple(p.encode(tok)) for p in evals}  # by token ids
    from mlx_spec.prompts import load_prompts
    from mlx_spec.train.stream import write_eval_prompts

    write_eval_prompts(root / "held.jsonl", evals)  # chat and agent turns keep their messages
    assert load_prompts(root / "held.jsonl") == evals
    assert len(trained) == len(train)  # drawn without repeats
    assert [p.id for p in stream_prompts(cfg)[0][:20]] == [p.id for p in train[:20]]  # deterministic
    dup = held_out_by_kind([p for p in train[:5]] + [replace(train[0], id="copy")], 1)
    assert not {p.text for p in dup[0]} & {p.text for p in dup[1] if p.messages is None}


def test_broad_mix_has_every_kind_and_agent_turns_carry_a_file():
    from mlx_spec.train.prompts import BROAD_MIX, broad_prompts

    ps = broad_prompts(200, seed=1)
    kinds = Counter(p.kind for p in ps)
    assert set(kinds) == set(BROAD_MIX) and sum(kinds.values()) == 200
    agent = next(p for p in ps if p.kind == "agent")
    assert agent.messages[0]["role"] == "system" and "```python" in agent.messages[1]["content"]
    chat = next(p for p in ps if p.kind == "chat")
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user"]
    texts = [p.text or json.dumps(p.messages) for p in ps]
    assert len(set(texts)) == len(texts)


def test_chat_data_directory_drops_trailing_assistant_turns(tmp_path):
    from mlx_spec.train.stream import _chat_dir_prompts

    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(conv) + "\n")
    [p] = _chat_dir_prompts(tmp_path)
    assert p.messages == ({"role": "user", "content": "hi"},) and p.kind == "chat"


def test_lr_follows_the_budget():
    t = Recipe(lr=1.0, warmup=0.1)
    assert lr_at(t, 0.0) == pytest.approx(0.01) and lr_at(t, 0.1) == pytest.approx(1.0)
    assert lr_at(t, 1.0) == pytest.approx(0.1) and lr_at(t, 2.0) == pytest.approx(0.1)


TRAINING_PATH = ["mlx_spec/train", "mlx_spec/drafter.py", "mlx_spec/target.py", "mlx_spec/decode.py"]


def _unguarded_backend_calls(path: Path) -> list[str]:
    """``mx.metal.*`` (other than the ``is_available`` check) and CPU pinning (``mx.cpu``,
    ``set_default_device``) outside an ``if`` that asks which backend is there."""
    tree = ast.parse(path.read_text())
    bad = []

    def dotted(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.append(node.id)
        return ".".join(reversed(parts))

    def visit(node, guarded):
        if isinstance(node, (ast.If, ast.IfExp)) and any(
            s in ast.unparse(node.test) for s in ("is_available", "default_device")
        ):
            guarded = True
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            if (
                name.startswith("mx.metal.")
                and name != "mx.metal.is_available"
                or name in ("mx.cpu", "mx.set_default_device", "mx.set_default_stream")
            ) and not guarded:
                bad.append(f"{path}:{node.lineno}: {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return bad


def test_training_path_has_no_cpu_or_metal_only_calls():
    root = Path(__file__).resolve().parent.parent
    files = [f for p in TRAINING_PATH for f in ((root / p).rglob("*.py") if (root / p).is_dir() else [root / p])]
    assert len(files) >= 6
    assert [b for f in files for b in _unguarded_backend_calls(f)] == []
    # the scan does catch one
    probe = root / "tests" / "_probe_backend.py"
    try:
        probe.write_text(
            "import mlx.core as mx\nmx.metal.clear_cache()\nif mx.metal.is_available():\n"
            "    mx.metal.set_cache_limit(0)\n"
        )
        assert [b.split(": ")[1] for b in _unguarded_backend_calls(probe)] == ["mx.metal.clear_cache"]
    finally:
        probe.unlink()


def test_train_run_command_end_to_end(pair, tmp_path):
    root, tdir, _ = pair
    base = [
        sys.executable,
        "-m",
        "mlx_spec",
        "train",
        "run",
        "--target",
        str(tdir),
        "--out",
        str(tmp_path / "r"),
        "--prompts",
        str(root / "prompts.jsonl"),
        "--batch-size",
        "3",
        "--max-tokens",
        "8",
        "--top-k",
        "4",
        "--replay-mb",
        "0.1",
        "--steps-per-batch",
        "1",
        "--layers",
        "1",
        "--intermediate-size",
        "64",
        "--selector-rank",
        "16",
        "--anchors",
        "4",
        "--block-size",
        "4",
        "--mask-token-id",
        str(MASK),
        "--eval-per-kind",
        "1",
        "--eval-prompts",
        "1",
        "--eval-max-tokens",
        "4",
    ]
    r = subprocess.run(base + ["--tokens", "20"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] >= 20 and out["step"] == out["batches"] and "tok/s" in r.stderr
    r = subprocess.run(base + ["--tokens", "40", "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] >= 40 and "resumed" in r.stderr


def test_time_budget_ends_the_run(pair, tmp_path):
    root, tdir, _ = pair
    out = run_stream(_cfg(root, tdir, tmp_path / "t", tokens=None, minutes=1e-5, steps_per_batch=1))
    assert out["batches"] == 1 and out["step"] == 1 and not out["stopped"]
    with pytest.raises(BadRequest, match="budget"):
        run_stream(_cfg(root, tdir, tmp_path / "none", tokens=None))
    # 0 means "no budget of that kind": only a negative one is refused, and the message says so
    with pytest.raises(BadRequest, match=r"^--minutes -1: a budget cannot be negative \(0 or left out: no budget"):
        run_stream(_cfg(root, tdir, tmp_path / "neg", tokens=0, minutes=-1))


def test_trainer_holds_no_copy_of_the_drafter():
    """The trainer calls the drafter's pieces: no private members, no softcap or selector formula."""
    root = Path(__file__).resolve().parent.parent / "mlx_spec" / "train"
    for f in root.glob("*.py"):
        src = f.read_text()
        assert "._embed" not in src and "._kv" not in src and "._head" not in src, f
        assert "tanh" not in src and "output_multiplier" not in src and "predecessor_codebook(" not in src, f
    from mlx_spec.drafter import DecoderLayer, DFlash2DecoderLayer, Drafter, DrafterArgs

    from helpers import drafter_config, tiny_model

    _, tcfg = tiny_model()
    for v2, cls in ((False, DecoderLayer), (True, DFlash2DecoderLayer)):
        d = Drafter(DrafterArgs.from_config(drafter_config(tcfg, v2=v2)))
        assert all(type(layer) is cls for layer in d.layers)  # chosen when built, not per call


def test_memory_plan_counts_the_replay_buffer():
    from mlx_spec.errors import PlanError
    from mlx_spec.train.stream import check_plan, memory_rows

    cfg = StreamConfig(out="x", target="y", replay_mb=512)
    rows = memory_rows(cfg, target_bytes=2**30, n_features=2880, drafter_params=15_000_000)
    assert [r.bytes for r in rows][-1] == 512 * 2**20 and "replay buffer" in rows[-1].what
    check_plan(rows, 4 * 2**30, "physical memory")
    with pytest.raises(PlanError, match="lower --replay-mb"):
        check_plan(rows, 2**30, "physical memory")


# ---- hybrid (GatedDeltaNet + attention) targets --------------------------------------------


@pytest.fixture(scope="module")
def hybrid_pair(pair, tmp_path_factory):
    """A tiny qwen3_5 target (GatedDeltaNet and attention layers) with the tiny tokenizer."""
    from helpers import save_tiny_tokenizer
    from mlx_lm.utils import save_config, save_model
    from test_hybrid import build

    root = tmp_path_factory.mktemp("hybrid")
    model, cfg = build("qwen3_5", num_hidden_layers=6)  # default taps 1, 2, 3: GDN and attention
    save_model(root / "target", model)
    save_config(dict(cfg), root / "target" / "config.json")
    save_tiny_tokenizer(root / "target")
    return pair[0], root / "target", model


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_batched_generation_on_a_hybrid_target_equals_single_sequences(kind):
    """Left-padded batched generation through GDN layers (padding masked out of the conv window
    and the recurrent state; finished rows dropped from both cache kinds) gives each prompt the
    plain greedy reply and the features of an unpadded forward; `--from-tokens` features agree."""
    from mlx_spec.target import Target
    from mlx_spec.train.data import DataConfig, featurize_batch, generate_batch

    from helpers import greedy_reference
    from test_hybrid import build

    model, _ = build(kind, num_hidden_layers=6)
    target = Target(model, [0, 3, 4])
    assert {0, 4} <= target.gdn and 3 not in target.gdn  # GDN and attention layers tapped
    prompts = [[1, 5, 9, 17, 33, 2, 8], [4, 40, 77], [3, 9, 12, 50, 6]]
    refs = [greedy_reference(model, p, 12) for p in prompts]
    eos = [refs[1][3]]  # the second prompt stops early: its row leaves the batch
    res = generate_batch(target, prompts, DataConfig(max_tokens=12, top_k=4), eos, pad_id=0)
    for p, ref, (resp, feats, ti, tl) in zip(prompts, refs, res):  # noqa: B007
        want = ref[: ref.index(eos[0]) + 1] if eos[0] in ref else ref
        assert resp == want
        seq = p + resp
        full = target(mx.array([seq[:-1]]), target.make_cache()).hidden[0]
        assert feats.shape == (len(seq), full.shape[-1]) and not feats[-1].any()
        assert np.allclose(feats[:-1], np.array(full), atol=2e-2, rtol=1e-2)
        again, _, _ = featurize_batch(target, [seq], [len(p)], 4, pad_id=0)[0]
        assert np.allclose(again[:-1], feats[:-1], atol=2e-2, rtol=1e-2)
    assert len(res[1][0]) < len(res[0][0])


def test_train_run_on_a_hybrid_target_end_to_end_and_resume_is_exact(hybrid_pair, tmp_path):
    """`train run` on a qwen3_5 target: generation, taps of GDN and attention layers, training,
    checkpoint with held-out tau (real hybrid speculative decoding), and an exact resume."""
    from mlx_spec.loading import load_pair

    root, tdir, _ = hybrid_pair
    kw = dict(tokens=60, eval_prompts=0)
    cfg = _cfg(root, tdir, tmp_path / "full", **kw | {"eval_prompts": 2})
    full = run_stream(cfg)
    ev = full["evals"][0]  # an eval ran, by real hybrid speculative decoding, with sane figures
    assert not full["stopped"] and full["step"] == 2 * full["batches"] and ev["tau_by_kind"]
    assert 0.0 <= ev["acceptance_rate"] <= 1.0 and 1.0 <= ev["tau"] <= cfg.recipe.block_size, ev
    p = load_pair(str(tdir), str(tmp_path / "full" / "ckpt"))
    assert p.target.gdn and set(p.drafter.args.target_layer_ids) & p.target.gdn
    stop = threading.Event()
    part = run_stream(
        _cfg(root, tdir, tmp_path / "part", **kw), stop=stop, progress=lambda pr: pr.steps == 3 and stop.set()
    )
    assert part["stopped"] and part["step"] == 3
    rest = run_stream(_cfg(root, tdir, tmp_path / "part", resume=True, **kw))
    assert rest["step"] == full["step"]
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "part")
    assert all(mx.array_equal(a[k], b[k]) for k in a)


def test_one_meaning_per_setting_and_resume_of_an_older_run_config(pair, tmp_path):
    """The recipe lives once (``StreamConfig.recipe``, ``TrainConfig.recipe``); the seed once per
    config; checkpoints count batches in `train run` (``checkpoint_batches``) and steps in `train
    drafter` (``checkpoint_every``); both use the same eval defaults. A run_config.json of the
    older layout (recipe under "train" with a second, unused seed; ``checkpoint_every`` counting
    batches) still resumes, compared field by field; unknown layouts are refused by name."""
    from dataclasses import asdict, fields

    from mlx_spec.errors import CheckpointError
    from mlx_spec.train.trainer import RECIPE_FIELDS, TrainConfig

    stream = {f.name for f in fields(StreamConfig)}
    drafter = {f.name for f in fields(TrainConfig)}
    assert not (stream | drafter) & RECIPE_FIELDS and "checkpoint_every" not in stream
    assert StreamConfig(out="", target="").eval_prompts == TrainConfig(data="", out="").eval_prompts
    assert StreamConfig(out="", target="").eval_max_tokens == TrainConfig(data="", out="").eval_max_tokens

    root, tdir, _ = pair
    cfg = _cfg(root, tdir, tmp_path / "r", tokens=20)
    run_stream(cfg)
    new = json.loads((tmp_path / "r" / "run_config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("recipe", "checkpoint_batches")}
    old["checkpoint_every"] = new["checkpoint_batches"]
    old["train"] = {
        **new["recipe"],
        "data": "",
        "out": "",
        "steps": 1000,
        "seed": 7,
        "checkpoint_every": 100,
        "eval_prompts": 4,
        "eval_max_tokens": 96,
    }
    (tmp_path / "r" / "run_config.json").write_text(json.dumps(old))
    with pytest.raises(BadRequest, match=r"recipe\.lr"):
        run_stream(replace(cfg, resume=True, tokens=30, recipe=replace(cfg.recipe, lr=1e-3)))
    with pytest.raises(BadRequest, match="steps_per_batch") as e:  # the renamed setting is no difference
        run_stream(replace(cfg, resume=True, tokens=30, steps_per_batch=3))
    assert "checkpoint_batches" not in str(e.value)
    out = run_stream(replace(cfg, resume=True, tokens=30))
    assert out["tokens"] >= 30
    assert json.loads((tmp_path / "r" / "run_config.json").read_text()) == json.loads(
        json.dumps(asdict(replace(cfg, resume=True, tokens=30)))
    )  # rewritten in the current layout
    (tmp_path / "r" / "run_config.json").write_text(json.dumps({**new, "replay_policy": "fifo"}))
    with pytest.raises(CheckpointError, match="replay_policy"):
        run_stream(replace(cfg, resume=True, tokens=40))


def test_train_drafter_reads_an_older_flat_train_config():
    from mlx_spec.train.trainer import Recipe, TrainConfig, settings, settings_diff

    cfg = TrainConfig(data="d", out="o", recipe=Recipe(layers=3))
    from dataclasses import asdict

    flat = {k: v for k, v in asdict(cfg).items() if k != "recipe"} | asdict(cfg.recipe)
    assert settings(flat) == settings(asdict(cfg))
    assert settings_diff(settings(flat), settings(asdict(replace(cfg, recipe=Recipe(layers=2)))), set()) == [
        "recipe.layers"
    ]
