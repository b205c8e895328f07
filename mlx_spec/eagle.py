"""EAGLE-3 drafters: one decoder layer over three fused target layers, drafting a chain.

Two published layouts load (``layout`` below), with the same tensors under two names:

- ``eagle`` (the EAGLE authors' ``LlamaForCausalLMEagle3``, also SpecForge): the layer's config
  at the top level of config.json, tensors ``midlayer.*``; RMSNorm of the hidden input after the
  residual is taken (``norm_before_residual`` false unless the config says so).
- ``speculators`` (``Eagle3Speculator``, ``speculators_model_type: eagle3``): the layer's config
  under ``transformer_layer_config``, tensors ``layers.0.*``; ``norm_before_residual`` defaults
  to true.

Tensors: ``fc.weight`` (H, 3 H_t) over the concatenated target taps; the layer
(``hidden_norm``, ``input_layernorm``, ``self_attn.{q,k,v}_proj`` over 2H = concat(normed token
embedding, normed hidden), ``o_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``);
``norm.weight``; ``lm_head.weight`` (V_d, H) over the draft vocabulary; ``d2t`` (V_d,) with
target id = draft id + d2t[draft id], and ``t2d`` (V,) booleans (which target ids are in the
draft vocabulary); optionally ``embed_tokens.weight`` (else the target's embedding is shared).

Taps: ``eagle_aux_hidden_state_layer_ids`` (top level or under ``eagle_config``), else the
published default (2, N // 2, N - 3) for an N-layer target. EAGLE's layer id i is the *input*
of decoder layer i, our tap i - 1. Pass j reads the fused taps (pass 1) or the layer's own
output before ``norm`` (pass j > 1), with the embedding of the previous token; drafts are mapped
back to target ids through d2t exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

from .chain import ChainHead
from .drafter import MLP
from .errors import CheckpointError, IncompatiblePair
from .mtp import check_strict
from .target import Target

EAGLE_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCH = "Eagle3Speculator"


def default_layer_ids(n_target_layers: int) -> list[int]:
    """The published default: low, middle, high (EAGLE layer ids: inputs of those layers)."""
    N = n_target_layers
    return [2, N // 2, N - 3]


@dataclass(frozen=True)
class Eagle3Args:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...] | None  # EAGLE layer ids; None: the default for the target
    layout: str = "eagle"
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    norm_before_residual: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict) -> Eagle3Args:
        archs = config.get("architectures") or []
        spec = SPECULATORS_ARCH in archs or config.get("speculators_model_type") == "eagle3"
        if not spec and not any(a in EAGLE_ARCHS for a in archs):
            raise CheckpointError(
                f"architectures={archs} is not an EAGLE-3 drafter (expected one of "
                f"{', '.join(EAGLE_ARCHS + (SPECULATORS_ARCH,))})"
            )
        lc = config.get("transformer_layer_config", config) if spec else config
        ec = config.get("eagle_config") or {}
        ids = config.get("eagle_aux_hidden_state_layer_ids", ec.get("eagle_aux_hidden_state_layer_ids"))
        try:
            H = lc["hidden_size"]
            return cls(
                hidden_size=H,
                num_attention_heads=lc["num_attention_heads"],
                num_key_value_heads=lc.get("num_key_value_heads", lc["num_attention_heads"]),
                intermediate_size=lc["intermediate_size"],
                vocab_size=lc["vocab_size"],
                draft_vocab_size=config.get("draft_vocab_size", lc.get("draft_vocab_size", lc["vocab_size"])),
                target_hidden_size=config.get("target_hidden_size") or lc.get("target_hidden_size") or H,
                layer_ids=tuple(ids) if ids is not None else None,
                layout="speculators" if spec else "eagle",
                head_dim=lc.get("head_dim"),
                rms_norm_eps=lc.get("rms_norm_eps", 1e-6),
                rope_theta=lc.get("rope_theta", 10000.0),
                rope_scaling=lc.get("rope_scaling"),
                max_position_embeddings=lc.get("max_position_embeddings", 4096),
                attention_bias=lc.get("attention_bias", False),
                norm_before_residual=config.get("norm_before_residual", spec),
            )
        except KeyError as e:
            raise CheckpointError(f"EAGLE-3 config: missing key {e}") from None


class Attention(nn.Module):
    """Llama attention whose q/k/v read 2H inputs (embedding and hidden, concatenated)."""

    def __init__(self, a: Eagle3Args):
        super().__init__()
        hd, b = a.hd, a.attention_bias
        self.n_heads, self.n_kv, self.scale = a.num_attention_heads, a.num_key_value_heads, hd**-0.5
        self.q_proj = nn.Linear(2 * a.hidden_size, self.n_heads * hd, bias=b)
        self.k_proj = nn.Linear(2 * a.hidden_size, self.n_kv * hd, bias=b)
        self.v_proj = nn.Linear(2 * a.hidden_size, self.n_kv * hd, bias=b)
        self.o_proj = nn.Linear(self.n_heads * hd, a.hidden_size, bias=b)
        self.rope = initialize_rope(hd, a.rope_theta, False, a.rope_scaling, a.max_position_embeddings)

    def __call__(self, x, mask, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv, -1).transpose(0, 2, 1, 3)
        off = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=off), self.rope(k, offset=off)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Layer(nn.Module):
    def __init__(self, a: Eagle3Args):
        super().__init__()
        H, eps = a.hidden_size, a.rms_norm_eps
        self.norm_before_residual = a.norm_before_residual
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = MLP(H, a.intermediate_size)

    def __call__(self, emb, h, mask, cache):
        if self.norm_before_residual:
            h = self.hidden_norm(h)
            residual = h
        else:
            residual, h = h, self.hidden_norm(h)
        x = mx.concatenate([self.input_layernorm(emb), h], axis=-1)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3(ChainHead):
    """An EAGLE-3 drafter. ``bind(target)`` before use (taps, shared embedding, vocabulary)."""

    kind = "eagle"
    final_hidden = False

    def __init__(self, args: Eagle3Args, own_embedding: bool = False):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(3 * args.target_hidden_size, H, bias=False)
        self.midlayer = Layer(args)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(H, args.draft_vocab_size, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self._vocab = args.vocab_size
        self._embed = None
        self.d2t: np.ndarray | None = None  # (V_d,) offsets, as in the file
        self._taps: tuple[int, ...] = ()

    @property
    def taps(self) -> tuple[int, ...]:
        """The target taps (outputs of decoder layers) this drafter reads, set by ``bind``."""
        return self._taps

    def layer_ids(self, n_target_layers: int) -> list[int]:
        a = self.args
        return list(a.layer_ids) if a.layer_ids is not None else default_layer_ids(n_target_layers)

    def bind(self, target: Target) -> Eagle3:
        """Check the drafter fits ``target``, share its embedding, set the taps to read."""
        a, problems = self.args, []
        if a.target_hidden_size != target.hidden_size:
            problems.append(
                f"drafter fuses target features of width {a.target_hidden_size}, "
                f"the target's hidden size is {target.hidden_size}"
            )
        if a.vocab_size != target.vocab_size:
            problems.append(f"drafter vocab_size {a.vocab_size} != target vocab_size {target.vocab_size}")
        ids = self.layer_ids(target.num_layers)
        if len(ids) != 3:
            problems.append(f"EAGLE-3 reads 3 target layers, the config names {len(ids)}: {ids}")
        bad = [i for i in ids if not 1 <= i <= target.num_layers]
        if bad:
            problems.append(
                f"layer ids {bad} out of range for a {target.num_layers}-layer target "
                "(an EAGLE layer id is the input of that decoder layer, 1..N)"
            )
        if problems:
            raise IncompatiblePair("EAGLE-3 drafter does not fit the target: " + "; ".join(problems))
        self._taps = tuple(i - 1 for i in ids)
        if "embed_tokens" not in self:
            self._embed = target.embed
        return self

    def set_d2t(self, d2t: np.ndarray | None) -> None:
        """The draft -> target map (None: the draft vocabulary is the target's, in order)."""
        self.d2t = d2t
        self._draft_ids = None if d2t is None else mx.array(np.arange(len(d2t)) + d2t, mx.int32)

    def fuse(self, features):
        return self.fc(features)

    def step(self, h, ids, caches, mask):
        emb = self.embed_tokens(ids) if "embed_tokens" in self else self._embed(ids)
        out = self.midlayer(emb, h, mask, caches[0])
        return out, self.lm_head(self.norm(out))


def check_vocab(args: Eagle3Args, d2t, t2d, what: str) -> np.ndarray | None:
    """Validate d2t / t2d; returns d2t (int64) or None for the identity. Refuses by name."""
    V, Vd = args.vocab_size, args.draft_vocab_size
    if d2t is None:
        if Vd != V:
            raise CheckpointError(
                f"{what}: draft_vocab_size {Vd} < vocab_size {V} but the file has no d2t "
                "(the map from draft ids back to target ids)"
            )
        if t2d is not None:
            raise CheckpointError(f"{what}: t2d without d2t")
        return None
    d2t = np.asarray(d2t).astype(np.int64)
    if d2t.shape != (Vd,):
        raise CheckpointError(f"{what}: d2t has shape {d2t.shape}, expected ({Vd},) (draft_vocab_size)")
    tid = np.arange(Vd) + d2t
    if tid.min() < 0 or tid.max() >= V:
        raise CheckpointError(f"{what}: d2t maps draft ids outside the target vocabulary [0, {V})")
    if len(np.unique(tid)) != Vd:
        raise CheckpointError(f"{what}: d2t maps two draft ids to one target id")
    if t2d is not None:
        t2d = np.asarray(t2d).astype(bool)
        if t2d.shape != (V,):
            raise CheckpointError(f"{what}: t2d has shape {t2d.shape}, expected ({V},) (vocab_size)")
        if t2d.sum() != Vd or not t2d[tid].all():
            raise CheckpointError(f"{what}: t2d does not mark exactly the target ids d2t maps to")
    return d2t


def _to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.int64) if a.dtype != mx.bool_ else a)


def load_eagle(path: str | Path, *, dtype=None) -> tuple[Eagle3, dict]:
    """Load an EAGLE-3 checkpoint folder strictly (either layout). Returns (drafter, config);
    call ``drafter.bind(target)`` before use (and build the target with ``drafter.taps``)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: unreadable ({e})") from None
    try:
        args = Eagle3Args.from_config(config)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors file: {e}") from None
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    d2t = check_vocab(args, None if d2t is None else _to_numpy(d2t), None if t2d is None else _to_numpy(t2d), str(path))
    outside = "midlayer." if args.layout == "speculators" else "layers.0."
    stray = [k for k in weights if k.startswith(outside)]
    if stray:
        raise CheckpointError(
            f"{path}: {args.layout} layout, but the file names the layer "
            f"'{outside}' ({stray[0]}, ...): config and tensors disagree"
        )
    inside = "layers.0." if args.layout == "speculators" else "midlayer."
    named = {("midlayer." + k[len(inside) :] if k.startswith(inside) else k): v for k, v in weights.items()}
    model = Eagle3(args, own_embedding="embed_tokens.weight" in named)
    expected = {k for k, _ in tree_flatten(model.parameters())}
    rename = {k: (inside + k[len("midlayer.") :] if k.startswith("midlayer.") else k) for k in expected | set(named)}
    try:
        check_strict(model, named, f"{path}: EAGLE-3 drafter ({args.layout} layout)")
    except CheckpointError as e:  # say the names as the file spells them
        msg = str(e)
        for ours, theirs in sorted(rename.items(), key=lambda kv: -len(kv[0])):
            if ours != theirs:
                msg = msg.replace(ours, theirs)
        raise CheckpointError(msg) from None
    model.load_weights(list(named.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    model.set_d2t(d2t)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def save_eagle(model: Eagle3, path: str | Path, config: dict, layout: str = "eagle") -> None:
    """Write ``config`` and the tensors in ``layout`` ("eagle": midlayer.*, "speculators":
    layers.0.*), with d2t / t2d when the draft vocabulary is reduced."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = {}
    for k, v in tree_flatten(model.parameters()):
        if layout == "speculators" and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer.") :]
        flat[k] = v
    if model.d2t is not None:
        flat["d2t"] = mx.array(model.d2t.astype(np.int64))
        t2d = np.zeros(model.args.vocab_size, bool)
        t2d[np.arange(len(model.d2t)) + model.d2t] = True
        flat["t2d"] = mx.array(t2d)
    mx.save_safetensors(str(path / "model.safetensors"), flat, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def eagle_config(
    target_config: dict,
    *,
    layout: str = "eagle",
    intermediate_size: int | None = None,
    draft_vocab_size: int | None = None,
    layer_ids=None,
) -> dict:
    """A config for an EAGLE-3 layer on a target of ``target_config`` (the trainer writes it)."""
    t = target_config
    layer = {
        "model_type": "llama",
        "hidden_size": t["hidden_size"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t.get("num_key_value_heads", t["num_attention_heads"]),
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "intermediate_size": intermediate_size or t["intermediate_size"],
        "vocab_size": t["vocab_size"],
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "rope_theta": t.get("rope_theta", 10000.0),
        "max_position_embeddings": t.get("max_position_embeddings", 4096),
        "num_hidden_layers": 1,
    }
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(t["num_hidden_layers"])
    extra = {
        "draft_vocab_size": draft_vocab_size or t["vocab_size"],
        "target_hidden_size": t["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": ids,
    }
    if layout == "speculators":
        return {
            "architectures": [SPECULATORS_ARCH],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "norm_before_residual": True,
            **extra,
        }
    return {"architectures": [EAGLE_ARCHS[0]], **layer, "norm_before_residual": False, **extra}


__all__ = [
    "EAGLE_ARCHS",
    "SPECULATORS_ARCH",
    "Eagle3",
    "Eagle3Args",
    "check_vocab",
    "default_layer_ids",
    "eagle_config",
    "load_eagle",
    "save_eagle",
]
