"""Loading targets and drafters, strictly, and checking that a pair fits.

A local path never touches the network; anything else is a Hugging Face repo id
(huggingface-hub). A drafter checkpoint loads only if every tensor in the file is used, every
parameter is present and every shape matches; otherwise ``CheckpointError`` names them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load

from . import backend, catalog, default_target, hub, quantize
from .drafter import DFLASH1, DFLASH2, Drafter, DrafterArgs, DraftVocab, parameter_names
from .errors import BadModelFile, CheckpointError, IncompatiblePair, MlxSpecError, UnsupportedModel
from .integrity import check_model_dir
from .modelfiles import read_json, safetensors_header
from .target import KVQuant, Target, kv_problem, union_taps

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_DRAFTER = "smollm2-135m-dflash2"
# the embedded pair's chain drafters: used with the default target when these folders exist
DEFAULT_MTP = "smollm2-135m-mtp"
DEFAULT_EAGLE = "smollm2-135m-eagle3"
DFLASH, LOOKUP, MTP, EAGLE = "dflash", "lookup", "mtp", "eagle"  # (policy's names: a lower layer)
CHAIN_KINDS = (MTP, EAGLE)
ALL_SOURCES = (DFLASH, LOOKUP, MTP, EAGLE)
# The drafting window (``--draft-window``) a drafter runs with unless told otherwise: the bundled
# drafter was trained on 256-token sequences, and at 4 K tokens of context its acceptance is higher
# attending over the last 512 positions than over all of them (docs/context.md); other drafters
# attend over every position.
DEFAULT_DRAFT_WINDOWS = {DEFAULT_DRAFTER: 512}


def default_draft_window(drafter_id: str | None) -> int | None:
    """The drafting window a drafter runs with by default (None: every position)."""
    if drafter_id is None:
        return None
    return DEFAULT_DRAFT_WINDOWS.get(Path(str(drafter_id)).name)


def draft_window(asked: int | None, drafter_id: str | None) -> int | None:
    """The window a run uses: ``asked`` (``--draft-window``; 0 = every position), else the
    drafter's default."""
    if asked is None:
        return default_draft_window(drafter_id)
    return asked or None


V2_ONLY = ("attention_conv", "mlp_conv", "candidate_selector")


def resolve(path_or_id: str, what: str) -> Path:
    """A local directory, a bundled name under models/, or a Hugging Face repo id."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    bundled = MODELS_DIR / path_or_id
    if bundled.exists():
        return bundled
    if path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") != 1:
        raise MlxSpecError(f"{what} '{path_or_id}' not found (not a directory, not a repo id)")

    # a complete earlier download is used offline; else huggingface-hub fetches (resumable, with
    # its progress bars) after the memory plan has been checked from metadata (memory.model_source)
    return hub.download(path_or_id)


def default_dtype():
    """float32 on the CPU backend (its fp16/bf16 kernels are slow); the file's dtype on a GPU
    backend (Metal, CUDA). See backend.Backend.cast_float32."""
    return backend.current().default_dtype()


def _read_config(path: Path) -> dict:
    try:
        return read_json(path / "config.json")  # bounded size and depth (BadModelFile)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json") from None


def _read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    weights = {}

    for f in files:
        safetensors_header(f)  # every range inside the file, no overlaps, before MLX reads it
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise CheckpointError(f"{f}: unreadable safetensors file: {e}") from None
    return weights


def _names(keys, limit=8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(path: Path, vocab_size: int):
    """The sorted ids of a checkpoint's reduced draft vocabulary (``draft_vocab.json``: {"ids":
    [...]}) as an int32 numpy array, or None without the file. A bad file is refused by name."""
    f = Path(path) / DRAFT_VOCAB_FILE
    if not f.exists():
        return None
    try:
        ids = json.loads(f.read_text())["ids"]
        arr = np.asarray(ids)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f'{f}: unreadable draft vocabulary ({type(e).__name__}: {e}); expected {{"ids": [sorted target token ids]}}'
        ) from None
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise CheckpointError(f"{f}: 'ids' must be a non-empty list of integers")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise CheckpointError(f"{f}: ids outside the vocabulary [0, {vocab_size})")
    if (np.diff(arr) <= 0).any():
        raise CheckpointError(f"{f}: ids must be sorted and unique")
    return arr.astype(np.int32)


def write_draft_vocab(path: str | Path, ids, note: str = "") -> None:
    """Write ``draft_vocab.json`` (sorted unique ids) beside a checkpoint. The official layout is
    untouched: loaders that do not know the file draft over the full head."""
    ids = np.unique(np.asarray(ids, np.int64))
    body = {"format": "mlx_spec draft vocabulary 1", "note": note, "size": int(len(ids)), "ids": [int(i) for i in ids]}
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / DRAFT_VOCAB_FILE).write_text(json.dumps(body))


def load_drafter(
    path_or_id: str | Path, *, dtype=None, bits: int | None = None, group_size: int = 64, activations: str | None = None
) -> tuple[Drafter, dict]:
    """Load a DFlash / DFlash 2 checkpoint strictly. Returns (drafter, config).

    ``bits`` quantizes the drafter's own layers (never the target's shared embedding/head)
    before its weights are materialized; an already quantized checkpoint loads as it is.
    ``activations`` ("float32" | "float16" | "bfloat16"): float weights (and quantization scales)
    in that dtype and its inputs cast to it, whatever the file's dtype (``quantize.choose`` on a
    GPU backend; a non-finite pass still switches it to float32, see ``Drafter.settle``).
    """
    path = resolve(str(path_or_id), "drafter")
    if path.is_dir():
        check_model_dir(path, "drafter", str(path_or_id))
    config = _read_config(path)
    _check_drafter_config(config, path / "config.json")
    arch = (config.get("architectures") or [None])[0]
    if arch not in (DFLASH1, DFLASH2):
        raise CheckpointError(
            f"{path}: architectures={config.get('architectures')} is not a DFlash drafter "
            f"(expected {DFLASH1} or {DFLASH2})"
        )
    try:
        args = DrafterArgs.from_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: missing or bad key {e}") from None
    if args.mask_token_id is None:
        raise CheckpointError(f"{path}/config.json: no mask_token_id (dflash_config)")
    try:
        model = Drafter(args)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise CheckpointError(
            f"{path}/config.json: these values do not make a drafter ({type(e).__name__}: {e})"
        ) from None
    weights = model.sanitize(_read_weights(path))
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model, q["group_size"], q["bits"], class_predicate=lambda p, m: f"{p}.scales" in weights)  # noqa: F821
    expected = parameter_names(model)
    extra = set(weights) - set(expected)
    missing = set(expected) - set(weights)
    if extra and arch == DFLASH1 and any(k.split(".")[2 if k.startswith("layers.") else 0] in V2_ONLY for k in extra):
        raise CheckpointError(
            f"{path}: the file holds DFlash 2 tensors ({_names(extra)}) but config.json says "
            f"architectures=['{DFLASH1}']; refusing to load a DFlash 2 checkpoint as DFlash 1"
        )
    if extra or missing:
        msg = [f"{path}: checkpoint does not match a {arch} with this config"]
        if extra:
            msg.append(f"unused tensors in the file: {_names(extra)}")
        if missing:
            msg.append(f"parameters missing from the file: {_names(missing)}")
        raise CheckpointError("; ".join(msg))
    bad = {k: (tuple(weights[k].shape), s) for k, s in expected.items() if tuple(weights[k].shape) != s}
    if bad:
        raise CheckpointError(
            f"{path}: shape mismatch: "
            + ", ".join(f"{k} file {f} vs model {m}" for k, (f, m) in sorted(bad.items())[:8])
        )
    model.load_weights(list(weights.items()), strict=True)
    del weights  # lazy sources: let each be freed once its (quantized) copy is materialized
    if activations not in (None, "float32", "float16", "bfloat16"):
        raise MlxSpecError(f"drafter activations must be float32, float16 or bfloat16, not {activations!r}")
    if activations is not None:
        dtype = getattr(mx, activations)
    dtype = default_dtype() if dtype is None else dtype
    quantize.prepare(model, bits=bits, group_size=group_size, dtype=dtype, what=f"drafter {path}")
    if activations is not None:
        model.act_dtype = dtype
    model.eval()
    model.shipped_vocab = read_draft_vocab(path, args.vocab_size)
    return model, config


_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_OPTIONAL_SIZES = (
    "num_key_value_heads",
    "head_dim",
    "block_size",
    "num_target_layers",
    "max_position_embeddings",
    "sliding_window",
    "target_hidden_size",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)
_OPTIONAL_FLOATS = (
    "rms_norm_eps",
    "rope_theta",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)
MAX_SIZE = 1 << 24  # no dimension of a drafter comes near this


def _check_drafter_config(config: dict, f: Path) -> None:
    """The types and ranges of a drafter's config.json, before any of it builds a module: a
    crafted value is refused by name (BadModelFile), never a traceback from deep inside."""

    def is_size(v, least=1) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and least <= v <= MAX_SIZE

    dc = config.get("dflash_config", {})
    if dc is not None and not isinstance(dc, dict):
        raise BadModelFile(f, "dflash_config must be an object", "dflash_config")
    dc = dc or {}
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise BadModelFile(f, "architectures must be a list of names", "architectures")

    def get(key):
        return dc[key] if key in dc else config.get(key)

    for key in _SIZE_KEYS:
        if key in config and not is_size(config[key]):
            raise BadModelFile(f, f"{config[key]!r} is not a size (an integer in 1..{MAX_SIZE})", key)
    for key in _OPTIONAL_SIZES:
        v = get(key)
        if v is not None and not is_size(v):
            raise BadModelFile(f, f"{v!r} is not a size (an integer in 1..{MAX_SIZE})", key)
    for key in _OPTIONAL_FLOATS:
        v = get(key)
        if v is not None and not (
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        ):
            raise BadModelFile(f, f"{v!r} is not a finite positive number", key)
    mask = get("mask_token_id")
    if mask is not None and not (is_size(mask, 0) and mask < config.get("vocab_size", MAX_SIZE)):
        raise BadModelFile(f, f"{mask!r} is not a token id of the vocabulary", "mask_token_id")
    ids = get("target_layer_ids")
    if ids is not None and not (isinstance(ids, list) and ids and all(is_size(i, 0) for i in ids)):
        raise BadModelFile(f, f"{ids!r} is not a non-empty list of layer indices", "target_layer_ids")
    types = config.get("layer_types")
    if types is not None and not (
        isinstance(types, list)
        and len(types) == config.get("num_hidden_layers")
        and all(isinstance(t, str) for t in types)
    ):
        raise BadModelFile(f, "layer_types must name one kind per layer", "layer_types")
    for key in ("rope_scaling", "rope_parameters", "quantization"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise BadModelFile(f, f"{key} must be an object", key)
    q = config.get("quantization")
    if q is not None and not (is_size(q.get("group_size")) and q.get("bits") in (2, 3, 4, 5, 6, 8)):
        raise BadModelFile(f, "quantization needs an integer group_size and bits in 2..8", "quantization")
    for key in ("is_causal",):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise BadModelFile(f, f"{key} must be true or false", key)


def save_drafter(model: Drafter, path: str | Path, config: dict, dtype=None) -> None:
    """Write the official layout: config.json + model.safetensors (codebooks without .weight)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("_codebook.weight"):
            k = k[: -len(".weight")]
        flat[k] = v.astype(dtype) if dtype is not None else v
    mx.save_safetensors(str(path / "model.safetensors"), flat, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def check_pair(target: Target, drafter: Drafter) -> None:
    """Refuse a drafter that does not fit the target, before any generation."""
    a = drafter.args
    problems = []
    if a.hidden_size != target.hidden_size:
        problems.append(
            f"drafter hidden_size {a.hidden_size} != target hidden_size {target.hidden_size}"
            " (the drafter shares the target's embedding and head)"
        )
    if a.target_hidden_size != target.hidden_size:
        problems.append(
            f"drafter expects target features of width {a.target_hidden_size}, target has {target.hidden_size}"
        )
    if a.vocab_size != target.vocab_size:
        problems.append(f"drafter vocab_size {a.vocab_size} != target vocab_size {target.vocab_size}")
    if a.num_target_layers != target.num_layers:
        problems.append(
            f"drafter was trained for a {a.num_target_layers}-layer target, this target has {target.num_layers}"
        )
    bad = [j for j in a.target_layer_ids if not 0 <= j < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for {target.num_layers} layers")
    if not 0 <= a.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {a.mask_token_id} outside the target vocabulary")
    if problems:
        raise IncompatiblePair("drafter does not fit the target: " + "; ".join(problems))


@dataclass
class Pair:
    """A loaded target (+ optional drafters) and its tokenizer. Owned by one thread.

    ``target`` is the one view the decode loop runs: it returns the union of every loaded
    drafter's taps (DFlash's layers, EAGLE-3's three) and, with an MTP head, the final-normed
    hidden; each drafter reads its slice (``target.feature_view``)."""

    model: Any  # the mlx-lm model
    tokenizer: Any  # mlx-lm TokenizerWrapper
    target: Target | None
    drafter: Drafter | None
    target_id: str
    drafter_id: str | None
    drafter_config: dict | None
    kv: KVQuant | None = None  # the target's K/V quantized (--kv-bits): every path's caches alike
    chains: dict = field(default_factory=dict)  # kind ("mtp", "eagle") -> chain.ChainDrafter
    chain_ids: dict = field(default_factory=dict)  # kind -> the folder it was loaded from
    sources: tuple | None = None  # the draft sources it runs (None: dflash + lookup with a drafter)

    @property
    def draft_sources(self) -> tuple[str, ...]:
        """The draft sources this pair runs: what loading resolved, else DFlash and lookup with
        a drafter, nothing without (plain decoding)."""
        if self.sources is not None:
            return tuple(self.sources)
        return (DFLASH, LOOKUP) if self.drafter is not None else ()


def load_target_model(path_or_id: str, *, dtype=None, bits: int | None = None, group_size: int = 64, shard=None):
    """mlx-lm model + tokenizer; ``path_or_id`` may be the default target's id.

    Loaded lazily, cast to ``dtype`` (default: float32 on CPU) and quantized to ``bits`` before
    any weight is materialized; an already quantized checkpoint loads as it is. ``shard(model)``
    (distributed.shard_target over a group) splits it before materializing, so a rank only ever
    holds its shard.
    """
    if path_or_id == default_target.DEFAULT_TARGET_ID:
        path = default_target.ensure_default_target().path
    else:
        path = resolve(path_or_id, "target")
        if not path.is_dir():
            raise CheckpointError(
                f"target '{path_or_id}' is a file, not a model folder (config.json, "
                "*.safetensors, tokenizer); a GGUF file converts with `mlx_spec convert`"
            )
        check_model_dir(path, "target", path_or_id)
        _check_untrusted(path)
    try:
        model, tokenizer = load(str(path), lazy=True)
    except MlxSpecError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:  # a file mlx-lm cannot read
        raise CheckpointError(f"target {path}: could not load it ({type(e).__name__}: {e})") from None
    dtype = default_dtype() if dtype is None else dtype
    quantize.prepare(
        model, bits=bits, group_size=group_size, dtype=dtype, what=f"target {path_or_id}", before_materialize=shard
    )
    return model, tokenizer


def _check_untrusted(path: Path) -> None:
    """A downloaded target folder's configs and weight headers, checked before mlx-lm and
    transformers parse them (``modelfiles``: sizes, depth, offsets; BadModelFile)."""
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        if (path / name).is_file():
            read_json(path / name)
    for f in sorted(path.glob("*.safetensors")):
        safetensors_header(f)


def _is_quantized(model) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def target_dir(target_id: str) -> Path:
    """The folder a target loads from (the default target's converted copy, a local folder or a
    downloaded repo): where its own MTP head is."""
    if target_id == default_target.DEFAULT_TARGET_ID:
        return default_target.ensure_default_target().path
    return resolve(target_id, "target")


def has_mtp_tensors(folder: str | Path) -> bool:
    """Whether a checkpoint folder holds ``mtp.*`` tensors (from the safetensors headers only)."""
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            if any(k.startswith("mtp.") for k in safetensors_header(f)):
                return True
        except (OSError, ValueError, MlxSpecError):
            continue
    return False


def resolve_eagle(ref: str | Path) -> Path:
    """An EAGLE-3 drafter: a folder, a bundled name under models/, a catalog chain entry's name
    or a Hugging Face repo id."""
    entries = catalog.load_chain()
    entry = entries.get(str(ref))
    if entry is not None:
        if entry.kind != EAGLE:
            raise MlxSpecError(f"--eagle {ref}: that catalog entry is an {entry.kind} head, not an EAGLE-3 drafter")
        ref = entry.drafter
    return resolve(str(ref), "EAGLE-3 drafter")


def load_pair(
    target_id: str,
    drafter_id: str | None,
    *,
    no_draft: bool = False,
    target_bits: int | None = None,
    drafter_bits: int | None = None,
    group_size: int = 64,
    draft_vocab: str = "auto",
    shard=None,
    drafter_activations: str | None = None,
    sources: tuple[str, ...] = (DFLASH, LOOKUP),
    mtp: str | Path | None = None,
    eagle: str | Path | None = None,
    mtp_hint: str | None = None,
    kv: KVQuant | None = None,
    draft_window: int | None = None,
) -> Pair:
    """Load a pair. ``no_draft`` is the only way to get plain decoding. The target is quantized
    before the drafters bind to its embedding and head, so those exist once. ``draft_vocab``:
    "auto" drafts over the checkpoint's reduced vocabulary when it ships one
    (``draft_vocab.json``), "full" always over the whole head. ``shard``: see ``load_target_model``.

    ``sources``: the draft sources (``--draft``; ``("auto",)``: every one this pair has). A
    source asked for by name that cannot run is refused by name: dflash without ``drafter_id``,
    mtp on a folder without ``mtp.*`` tensors (``mtp``, default: the target's own folder; the
    stripped-conversion message, ``mtp_hint`` naming the original repo), eagle without ``eagle``
    (a folder or catalog name), a drafter that does not fit the target. ``kv``: the target's K/V
    cache quantized (``--kv-bits``; refused by name where it cannot work); ``draft_window``: the
    DFlash drafter keeps the last that many context positions."""
    if draft_vocab not in ("auto", "full"):
        raise MlxSpecError(f"draft vocabulary must be 'auto' or 'full', not {draft_vocab!r}")
    auto = tuple(sources) == ("auto",)
    want = set(ALL_SOURCES) if auto else set(sources)
    bad = want - set(ALL_SOURCES)
    if bad:
        raise MlxSpecError(f"unknown draft sources {sorted(bad)} (known: {', '.join(ALL_SOURCES)}, or auto)")
    if not no_draft and EAGLE in want and eagle is None and not auto:
        raise MlxSpecError(
            "--draft eagle needs an EAGLE-3 drafter: --eagle PATH (a checkpoint folder or a catalog "
            "name, `mlx_spec models`)"
        )
    if not no_draft and DFLASH in want and drafter_id is None and not auto:
        raise MlxSpecError("no drafter given; pass --drafter PATH or --no-draft for plain decoding")
    model, tokenizer = load_target_model(target_id, bits=target_bits, group_size=group_size, shard=shard)
    if kv is not None and (why := kv_problem(model, kv)) is not None:
        raise UnsupportedModel(why)
    if no_draft:
        return Pair(model, tokenizer, None, None, target_id, None, None, kv, sources=())
    drafter = config = None
    if DFLASH in want and drafter_id is not None:
        drafter, config = load_drafter(
            drafter_id, bits=drafter_bits, group_size=group_size, activations=drafter_activations
        )
    heads, ids = {}, {}
    eagle_d = None
    if EAGLE in want and eagle is not None:
        from .eagle import load_eagle  # (startup: models)

        epath = resolve_eagle(eagle)
        eagle_d, _ = load_eagle(epath, dtype=default_dtype())
        eagle_d.bind(Target(model, ()))  # the fit, and the taps it reads
        ids[EAGLE] = str(epath)
    mtp_dir = None
    if MTP in want:
        mtp_dir = Path(mtp).expanduser() if mtp is not None else target_dir(target_id)
        if auto and not has_mtp_tensors(mtp_dir):
            mtp_dir = None
    # the one target view: every drafter's taps, and the final hidden for an MTP head
    taps = union_taps(drafter.args.target_layer_ids if drafter is not None else (), eagle_d.taps if eagle_d else ())
    target = Target(model, taps, final_hidden=mtp_dir is not None, kv=kv)
    if mtp_dir is not None:
        from .mtp import load_mtp  # (startup: models)

        heads[MTP] = load_mtp(mtp_dir, target, dtype=default_dtype(), hint=mtp_hint)
        ids[MTP] = str(mtp_dir)
    if eagle_d is not None:
        heads[EAGLE] = eagle_d.bind(target)
    if drafter is not None:
        check_pair(target, drafter)
        vocab = None
        if draft_vocab == "auto" and drafter.shipped_vocab is not None:
            vids = mx.array(drafter.shipped_vocab)
            vocab = DraftVocab(vids, target.head_rows(vids))
        drafter.bind(target.embed, target.head, vocab)
        drafter.context_limit = draft_window
    order = ALL_SOURCES if auto else tuple(sources)
    runs = tuple(s for s in order if (s != DFLASH or drafter is not None) and (s not in CHAIN_KINDS or s in heads))
    return Pair(
        model,
        tokenizer,
        target,
        drafter,
        target_id,
        str(drafter_id) if drafter is not None else None,
        config,
        kv,
        chains=heads,
        chain_ids=ids,
        sources=runs,
    )


__all__ = [
    "load_drafter",
    "read_draft_vocab",
    "write_draft_vocab",
    "DRAFT_VOCAB_FILE",
    "save_drafter",
    "check_pair",
    "load_pair",
    "Pair",
    "has_mtp_tensors",
    "resolve_eagle",
    "target_dir",
    "resolve",
    "load_target_model",
]
