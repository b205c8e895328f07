"""Chain drafters in the catalog and the memory plan: entries by name, planned from configs."""

import json

from mlx_spec import catalog, memory
from mlx_spec.config import LoadConfig
from mlx_spec.eagle import Eagle3, Eagle3Args, eagle_config, load_eagle, save_eagle
from mlx_spec.mtp import MTP_TYPES, MTPHead
from mlx_spec.quantize import QuantChoice
from mlx_spec.target import SUPPORTED, Target

import mlx.core as mx
import numpy as np
import pytest
from helpers import save_tiny_pair, tiny_model
from mlx.utils import tree_flatten
from test_hybrid import CONFIGS


def test_every_chain_entry_names_a_kind_a_layout_and_a_runnable_target():
    entries = catalog.load_chain()
    assert {e.kind for e in entries.values()} == {"mtp", "eagle"}
    for e in entries.values():
        assert e.architecture in SUPPORTED, e.name
        if e.kind == "mtp":
            assert e.drafter is None and e.architecture in MTP_TYPES and e.layout == "mtp"
        else:
            assert e.drafter and e.layout in ("eagle", "speculators")
        # no repo could be opened where the catalog was written: what comes from the cards is marked
        assert set(e.approximate) <= {"params_b", "active_params_b", "mtp_layers", "layout", "architecture", "license"}
        assert {"params_b", "architecture", "license"} <= set(e.approximate), e.name
        assert e.active_params_b is None or "active_params_b" in e.approximate, e.name
        assert e.kind == "mtp" or "layout" in e.approximate, e.name


def _real_bytes(head):
    return sum(v.nbytes for _, v in tree_flatten(head.parameters()))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next", "qwen3_5_moe"])
def test_the_plan_counts_an_mtp_head_as_its_real_weights_and_cache(kind):
    cfg = tiny_model("qwen3")[1] if kind == "qwen3" else dict(CONFIGS[kind])
    head = MTPHead(cfg["model_type"], cfg)
    mx.eval(head.parameters())
    rows = {r.name: r.bytes for r in memory.chain_items("mtp", cfg, context=300, depth=4, float_bytes=4)}
    assert rows["MTP head weights"] == _real_bytes(head)
    cache = head.make_cache()
    model, _ = tiny_model("qwen3")
    if kind == "qwen3":  # the real cache after 300 context rows and a 4-deep chain
        target = Target(model, (), final_hidden=True)
        head.bind(target.embed, target.head)
        out = target(mx.zeros((1, 300), mx.int32), target.make_cache())
        head.add_context(out.final, mx.zeros((300,), mx.int32), cache)
        head.propose(mx.array(1), 4, cache)
        mx.eval([c.keys for c in cache.layers])
        assert rows["MTP head draft KV cache"] == cache.nbytes


def test_the_plan_counts_an_eagle_drafter_and_its_three_taps():
    _, tcfg = tiny_model("llama")
    cfg = eagle_config(tcfg, intermediate_size=96, draft_vocab_size=64)
    d = Eagle3(Eagle3Args.from_config(cfg))
    mx.eval(d.parameters())
    rows = {r.name: r.bytes for r in memory.chain_items("eagle", tcfg, cfg, context=512, prompt=100, float_bytes=4)}
    assert rows["EAGLE-3 weights"] == _real_bytes(d)
    assert rows["target features for EAGLE-3"] == 3 * tcfg["hidden_size"] * 4 * 100
    q = {r.name: r.bytes for r in memory.chain_items("eagle", tcfg, cfg, context=512, bits=4, float_bytes=4)}
    assert q["EAGLE-3 weights"] < rows["EAGLE-3 weights"] / 3


def test_models_lists_the_chain_drafters(capsys):
    from argparse import Namespace

    from mlx_spec.commands import models

    assert models.run(Namespace(target_bits="4", context=4096, budget_gb=64.0, json=True)) == 0
    chain = {c["name"]: c for c in json.loads(capsys.readouterr().out)["chain"]}
    assert chain["qwen3-next-80b-a3b-instruct-mtp"]["drafter"] is None
    assert chain["qwen3-next-80b-a3b-instruct-mtp"]["fits"] == "~yes"
    assert chain["qwen3.5-122b-a10b-mtp"]["fits"] == "~no"
    assert chain["llama3.1-8b-instruct-eagle3"]["layout"] == "eagle"


def test_plan_for_counts_the_loaded_chain_drafters_at_their_loaded_size(tmp_path):
    tdir, _ = save_tiny_pair(tmp_path)
    tcfg = json.loads((tdir / "config.json").read_text())
    cfg = eagle_config(tcfg, draft_vocab_size=32)
    d = Eagle3(Eagle3Args.from_config(cfg))
    d.set_d2t(np.arange(0, 64, 2) - np.arange(32))
    save_eagle(d, tmp_path / "eagle", cfg)
    quant = QuantChoice(None, None, 64, False, "")
    budget = (8 << 20, "test")
    base = memory.plan_for(str(tdir), None, quant, context=1024, metal=False, budget=budget)
    chains = {"mtp": None, "eagle": str(tmp_path / "eagle")}  # the head in the target's folder; a folder
    plan = memory.plan_for(str(tdir), None, quant, context=1024, metal=False, budget=budget, chains=chains)
    rows = {i.name: i.bytes for i in plan.items}
    loaded, _ = load_eagle(tmp_path / "eagle", dtype=mx.float32)  # float32 on the CPU backend
    assert rows["EAGLE-3 weights"] == _real_bytes(loaded)
    mtp = MTPHead(tcfg["model_type"], tcfg)
    mx.eval(mtp.parameters())
    assert rows["MTP head weights"] == _real_bytes(mtp)
    added = [i for i in plan.items if i.name not in {j.name for j in base.items}]
    assert [i.name for i in added] == [
        "MTP head weights",
        "MTP head draft KV cache",
        "EAGLE-3 weights",
        "EAGLE-3 draft KV cache",
        "target features for EAGLE-3",
    ]
    others = {j.name: j.bytes for j in base.items}
    assert all(rows[n] == b for n, b in others.items())  # nothing else moved
    assert plan.total == base.total + sum(i.bytes for i in added)
    assert plan.max_context < base.max_context  # the largest context that fits counts them too
    # a batch's sequences each hold their chain caches and EAGLE-3's prompt features
    assert memory.batch_room(plan).need(1024) > memory.batch_room(base).need(1024)
    # the loader's call site: a LoadConfig's plan with the chain drafters it loads
    lc = LoadConfig(target=str(tdir), no_draft=True, context=1024, tune=False, budget=8 << 20)
    _, via_config = memory.plan_for_config(lc, None, chains=chains)
    assert [i.name for i in via_config.items] == [i.name for i in plan.items]
