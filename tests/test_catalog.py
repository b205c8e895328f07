"""The catalog of known pairs (mlx_spec/catalog.json), --model NAME, and `mlx_spec models`."""

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

from mlx_spec import catalog, cli
from mlx_spec.default_target import DEFAULT_TARGET_ID
from mlx_spec.errors import BadRequest
from mlx_spec.loading import MODELS_DIR
from mlx_spec.target import SUPPORTED

import pytest

REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


def test_every_entry_parses_and_is_plausible():
    entries = catalog.load()
    assert len(entries) >= 16
    for name, e in entries.items():
        assert name == name.lower() and e.name == name
        assert e.dflash in (1, 2) and e.block_size >= 2 and e.params_b > 0
        assert set(e.approximate) <= set(catalog.Entry.__dataclass_fields__)
        if e.bundled:
            continue
        assert REPO.match(e.target) and REPO.match(e.drafter), name
        assert e.drafter.startswith("z-lab/") and "DFlash" in e.drafter
        assert "params_b" in e.approximate  # sizes are never claimed exactly
    assert entries["qwen3-4b"].drafter == "z-lab/Qwen3-4B-DFlash-b16" and entries["qwen3-4b"].block_size == 16
    assert entries["qwen3-8b"].drafter.endswith("-DFlash-b16")
    assert entries["llama3.1-8b-instruct"].drafter == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    assert entries["qwen3.5-27b"].target == "Qwen/Qwen3.5-27B" and entries["qwen3.5-27b"].thinks
    assert {e.name for e in entries.values() if not e.supported} == {"gpt-oss-20b", "gpt-oss-120b", "kimi-k2.5"}
    assert all(e.architecture in SUPPORTED for e in entries.values() if e.supported)


def test_the_default_pair_is_an_entry():
    e = catalog.get("smollm2-135m-instruct")
    assert e.bundled and e.target == DEFAULT_TARGET_ID and (MODELS_DIR / e.drafter / "config.json").is_file()
    cfg = json.loads((MODELS_DIR / e.drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and e.dflash == 2 and cfg["block_size"] == e.block_size
    assert e.approximate == ()


def test_lookup_is_case_insensitive_and_unknown_names_get_the_closest():
    assert catalog.get("Qwen3.5-9B").name == "qwen3.5-9b"
    with pytest.raises(BadRequest) as err:
        catalog.get("qwen35-9b")
    assert "unknown model 'qwen35-9b'" in str(err.value) and "qwen3.5-9b" in str(err.value)
    assert "mlx_spec models" in str(err.value)
    with pytest.raises(BadRequest) as err:
        catalog.get("zzzz")
    assert "closest" not in str(err.value)


def test_package_data_ships_the_catalog():
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert 'mlx_spec = ["catalog.json"]' in text


def _args(**kw):
    base = dict(model=None, target=DEFAULT_TARGET_ID, drafter=None, think=None, no_draft=False)
    return argparse.Namespace(**{**base, **kw})


def test_model_flag_fills_target_drafter_and_think():
    a = _args(model="qwen3.5-4b")
    cli.apply_model_name(a)
    assert (a.target, a.drafter, a.think) == ("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", True)
    a = _args(model="qwen3-8b")
    cli.apply_model_name(a)
    assert a.think is False and cli.think_kwargs(a) == {"enable_thinking": False}  # non-thinking drafter
    a = _args(model="qwen3-8b", think=True)  # the flag wins over the catalog
    cli.apply_model_name(a)
    assert cli.think_kwargs(a) == {"enable_thinking": True}
    a = _args(model="llama3.1-8b-instruct")
    cli.apply_model_name(a)
    assert a.think is None and cli.think_kwargs(a) is None  # no switch: the template's own
    a = _args()
    cli.apply_model_name(a)
    assert a.target == DEFAULT_TARGET_ID and a.drafter is None
    a = _args(model="smollm2-135m-instruct")  # the embedded pair: the default target's own drafter
    cli.apply_model_name(a)
    assert a.target == DEFAULT_TARGET_ID and a.drafter is None


def test_model_flag_refusals(capsys):
    for argv, want in [
        (["generate", "--model", "qwen35-4b", "--prompt", "x"], "closest: qwen3.5-4b"),
        (["plan", "--model", "gpt-oss-20b"], "target architecture 'gpt_oss'"),
        (["plan", "--model", "kimi-k2.5"], "nothing was downloaded"),
        (["plan", "--model", "qwen3-4b", "--target", "other/repo"], "drop --target other/repo"),
        (["plan", "--model", "qwen3-4b", "--drafter", "x/y"], "drop --drafter x/y"),
    ]:
        assert cli.main(argv) == 1
        assert want in capsys.readouterr().err


def _chain_args(**kw):
    return _args(**{"draft": None, "mtp": None, "eagle": None, **kw})


def test_model_flag_of_a_chain_entry_fills_target_and_its_head():
    """--model NAME of the catalog's chain table: the target, and the head that drafts (an MTP head
    from the target's own checkpoint, an EAGLE-3 drafter from its repo), --draft that source and
    lookup (dflash first with a --drafter); a --draft given must draft with it."""
    a = _chain_args(model="qwen3.5-27b-mtp")
    cli.apply_model_name(a)
    assert (a.target, a.draft, a.mtp, a.eagle, a.drafter) == ("Qwen/Qwen3.5-27B", "mtp,lookup", None, None, None)
    a = _chain_args(model="Qwen3.5-27B-MTP", drafter="z-lab/Qwen3.5-27B-DFlash")  # (any case)
    cli.apply_model_name(a)
    assert a.draft == "dflash,mtp,lookup" and a.drafter == "z-lab/Qwen3.5-27B-DFlash"
    a = _chain_args(model="llama3.1-8b-instruct-eagle3", draft="auto")
    cli.apply_model_name(a)
    entry = catalog.load_chain()["llama3.1-8b-instruct-eagle3"]
    assert (a.target, a.eagle, a.draft) == (entry.target, entry.drafter, "auto")
    a = _chain_args(model="qwen3-8b-speculators-eagle3", eagle="qwen3-8b-speculators-eagle3")  # its own name: fine
    cli.apply_model_name(a)
    assert a.eagle == "RedHatAI/Qwen3-8B-speculator.eagle3" and a.draft == "eagle,lookup"
    a = _chain_args(model="qwen3.5-27b-mtp", no_draft=True)  # plain decoding of the entry's target
    cli.apply_model_name(a)
    assert a.target == "Qwen/Qwen3.5-27B" and a.draft is None
    for kw, want in [
        (dict(model="qwen3.5-27b-mtp", draft="dflash,lookup"), "--draft dflash,lookup leaves it out (add mtp"),
        (
            dict(model="qwen3.5-27b-mtp", mtp="/x"),
            "drafts with its MTP head in the target's own checkpoint; drop --mtp",
        ),
        (dict(model="llama3.1-8b-instruct-eagle3", eagle="o/e"), "drop --eagle o/e"),
        (dict(model="qwen3.5-27b-mtp", target="o/t"), "--model qwen3.5-27b-mtp is target Qwen/Qwen3.5-27B; drop"),
        (dict(model="qwen3.5-27b-mpt"), "closest: qwen3.5-27b-mtp"),
    ]:
        with pytest.raises(BadRequest, match=re.escape(want)):
            cli.apply_model_name(_chain_args(**kw))


def test_a_chain_entry_the_loader_cannot_run_is_refused_by_name_before_any_download(monkeypatch):
    from mlx_spec.errors import CheckpointError, UnsupportedModel

    good = catalog.load_chain()
    mtp, eagle = good["qwen3.5-27b-mtp"], good["llama3.1-8b-instruct-eagle3"]
    bad = {
        "x-arch": replace(mtp, name="x-arch", architecture="gpt_oss"),
        "x-family": replace(mtp, name="x-family", architecture="qwen3_moe"),
        "x-layers": replace(mtp, name="x-layers", mtp_layers=3),
        "x-layout": replace(mtp, name="x-layout", layout="eagle"),
        "x-drafter": replace(eagle, name="x-drafter", drafter=None),
        "x-eagle-layout": replace(eagle, name="x-eagle-layout", layout="medusa"),
    }
    monkeypatch.setattr(catalog, "load_chain", lambda: {**good, **bad})
    for name, (err, want) in {
        "x-arch": (UnsupportedModel, "target architecture 'gpt_oss'"),
        "x-family": (UnsupportedModel, "the MTP loader reads the heads of "),
        "x-layers": (UnsupportedModel, "3 MTP layers; only one-layer MTP heads are supported"),
        "x-layout": (CheckpointError, "the entry says layout 'eagle'"),
        "x-drafter": (CheckpointError, "an EAGLE-3 entry needs the drafter's repo"),
        "x-eagle-layout": (UnsupportedModel, "EAGLE-3 layout 'medusa' is not one the loader reads"),
    }.items():
        with pytest.raises(err, match=re.escape(want)) as got:
            cli.apply_model_name(_chain_args(model=name))
        assert f"model '{name}'" in str(got.value)


def test_models_command_lists_every_entry(capsys):
    assert cli.main(["models", "--json", "--budget-gb", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in out["models"]}
    assert set(rows) == set(catalog.load()) and out["budget_source"] == "--budget-gb"
    assert rows["gpt-oss-20b"]["fits"] == "unsupported (gpt_oss)"
    assert rows["qwen3.5-4b"]["fits"] == "~yes" and rows["qwen3.5-4b"]["size_approximate"]
    assert rows["qwen3.5-122b-a10b"]["fits"] == "~no"  # ~70 GB of 4-bit weights against 8 GiB
    assert rows["qwen3.5-4b"]["downloaded"] in ("no", "yes", "target only", "drafter only")  # the HF cache (no network)
    assert rows["smollm2-135m-instruct"]["downloaded"].startswith("bundled")
    assert cli.main(["models"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["NAME", "ARCH", "DFLASH"] and "~yes" in table
    assert cli.main(["models", "--context", "1"]) == 1


def test_serve_defaults_and_detach_flags():
    from mlx_spec.commands import serve
    from mlx_spec.server.schemas import RequestDefaults

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    a = p.parse_args(["--model", "qwen3-8b", "--temp", "0.6", "--top-k", "20", "--max-tokens", "300"])
    cli.apply_model_name(a)
    assert serve.request_defaults(a) == RequestDefaults(0.6, None, 20, 300, {"enable_thinking": False})
    flags = serve._flags(a)  # what `serve --detach` hands the background server
    assert "--no-think" in flags and flags[flags.index("--temperature") + 1] == "0.6"
    assert flags[flags.index("--target") + 1] == "Qwen/Qwen3-8B" and "--max-tokens" in flags
    a = p.parse_args(["--think"])
    assert "--think" in serve._flags(a) and serve.request_defaults(a).template_kwargs == {"enable_thinking": True}
    for bad in (["--temp", "3"], ["--top-p", "0"], ["--top-k", "-1"], ["--max-tokens", "0"]):
        with pytest.raises(BadRequest):
            serve.request_defaults(p.parse_args(bad))
