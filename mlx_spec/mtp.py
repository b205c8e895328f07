"""Multi-token-prediction heads from the target's own checkpoint (Qwen3-Next, Qwen3.5, Qwen3.6).

Layout (the ``mtp.`` tensors of the original checkpoints, which mlx-lm's ``sanitize`` drops):

    mtp.pre_fc_norm_embedding.weight   (H,)      norm of the next token's embedding
    mtp.pre_fc_norm_hidden.weight      (H,)      norm of the target's hidden state
    mtp.fc.weight                      (H, 2H)   over concat(embedding, hidden), in that order
    mtp.layers.0.*                     one full-attention decoder layer of the target's family
                                       (dense MLP, or the MoE block with per-expert
                                       ``experts.E.{gate,up,down}_proj`` or fused
                                       ``experts.gate_up_proj`` / ``experts.down_proj``)
    mtp.norm.weight                    (H,)

The head shares the target's embedding and LM head. Pass j reads (hidden, token): pass 1 the
target's final-normed hidden at the last committed position and the anchor, pass j > 1 the
head's own output (after ``mtp.norm``) and its previous draft; it predicts the token after.
These models' RMSNorms store ``weight - 1`` in the original files (mlx-lm adds 1 when it
converts the target), so the MTP norms get the same shift exactly when the target's files are
in the original form (the rule mlx-lm applies to the target).

Loading is strict: every ``mtp.`` tensor must be used and every parameter present, with its
shape; otherwise ``CheckpointError`` names them. A checkpoint without ``mtp.`` tensors (most
``mlx-community`` conversions strip them) is refused for ``--draft mtp`` by name. DeepSeek-V3's
layout (an extra ``model.layers.N`` with ``eh_proj`` / ``enorm`` / ``hnorm`` / ``shared_head``)
is recognized and refused: the target adapter does not run deepseek_v3 targets.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from .chain import ChainHead
from .errors import CheckpointError, UnsupportedModel
from .target import Target

# model_type -> the mlx-lm module whose decoder layer the MTP layer is. The Qwen3-Next / Qwen3.5
# family ship MTP heads; the dense families are what ``train mtp`` writes heads for.
MTP_TYPES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
GEMMA_NORMS = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}  # RMSNorm weights stored as weight - 1
DEEPSEEK_TYPES = {"deepseek_v3", "deepseek_v32", "glm4_moe", "kimi_k2"}
PREFIX = "mtp."
NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
STRIPPED = (
    "{path} has no mtp.* tensors: this conversion stripped the model's multi-token-prediction head "
    "(mlx-lm drops it, and most mlx-community conversions do not carry it). --draft mtp needs the "
    "original checkpoint ({hint}); load that one (with --target-bits to quantize it at load), or "
    "pick another drafter (--draft dflash|lookup)"
)


def text_config(config: dict) -> dict:
    """The language model's config (Qwen3.5 nests it under ``text_config``)."""
    return {**config, **config.get("text_config", {})} if "text_config" in config else config


def mtp_layers(config: dict) -> int:
    """MTP layers a config declares (``num_nextn_predict_layers`` or ``mtp_num_hidden_layers``)."""
    c = text_config(config)
    return int(c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0)


def decoder_layer(model_type: str, config: dict):
    """(mlx-lm args, one full-attention decoder layer of the target's family)."""
    family = MTP_TYPES[model_type]
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    c = dict(text_config(config), model_type=model_type)
    if family == "qwen3_5":
        args = mod.TextModelArgs.from_dict(c)
        return args, mod.DecoderLayer(args, args.full_attention_interval - 1)
    args = mod.ModelArgs.from_dict(c)
    if family == "qwen3_next":
        return args, mod.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)
    return args, mod.TransformerBlock(args)


class MTPHead(ChainHead):
    """A Qwen3-Next / Qwen3.5-family MTP head: fc + one decoder layer + norm."""

    kind = "mtp"
    taps = ()
    final_hidden = True

    def __init__(self, model_type: str, config: dict):
        super().__init__()
        args, layer = decoder_layer(model_type, config)
        H, eps = args.hidden_size, args.rms_norm_eps
        self.model_type = model_type
        self.moe = getattr(args, "num_experts", 0) > 0
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(H, eps=eps)
        self._vocab = args.vocab_size
        self._embed = None
        self._head = None

    def bind(self, embed, head) -> MTPHead:
        """Share the target's embedding and LM head (frozen, not parameters of the head)."""
        self._embed, self._head = embed, head
        return self

    def step(self, h, ids, caches, mask):
        e = self.pre_fc_norm_embedding(self._embed(ids))
        x = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(h)], axis=-1))
        for layer, c in zip(self.layers, caches):
            x = layer(x, mask, c)
        out = self.norm(x)
        return out, self._head(out)


def read_mtp_weights(path: Path) -> dict[str, mx.array]:
    """Every ``mtp.`` tensor of a checkpoint folder, prefix removed (lazy)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            w = mx.load(str(f))
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors file: {e}") from None
        out.update({k[len(PREFIX) :]: v for k, v in w.items() if k.startswith(PREFIX)})
    return out


def original_form(path: Path, model_type: str) -> bool:
    """True when the checkpoint is in the original (not mlx-lm-converted) form: the rule mlx-lm's
    sanitize uses to shift these models' norms (unstacked experts for qwen3_next, an unconverted
    conv1d for qwen3_5)."""
    for f in sorted(path.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if k.startswith(PREFIX):
                continue
            if model_type == "qwen3_next" and k.endswith(".mlp.experts.0.up_proj.weight"):
                return True
            if model_type != "qwen3_next" and "conv1d.weight" in k and v.shape[-1] != 1:
                return True
    return False


def sanitize(weights: dict[str, mx.array], n_experts: int, shift_norms: bool) -> dict[str, mx.array]:
    """Original ``mtp.`` names -> the head's parameter names: per-expert or fused expert tensors
    stacked into ``switch_mlp``; norms shifted by 1 when ``shift_norms``."""
    w = dict(weights)
    for pre in sorted({k.split(".mlp.experts.")[0] for k in w if ".mlp.experts." in k}):
        e = f"{pre}.mlp.experts"
        s = f"{pre}.mlp.switch_mlp"
        if f"{e}.gate_up_proj" in w:
            gu = w.pop(f"{e}.gate_up_proj")
            mid = gu.shape[-2] // 2
            w[f"{s}.gate_proj.weight"], w[f"{s}.up_proj.weight"] = gu[..., :mid, :], gu[..., mid:, :]
            if f"{e}.down_proj" in w:
                w[f"{s}.down_proj.weight"] = w.pop(f"{e}.down_proj")
            continue
        for n in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"{e}.{i}.{n}.weight" for i in range(n_experts)]
            if all(k in w for k in keys):
                w[f"{s}.{n}.weight"] = mx.stack([w.pop(k) for k in keys])
    if shift_norms:
        for k, v in w.items():
            if k.endswith(NORMS) and v.ndim == 1:
                w[k] = v + 1.0
    return w


def _names(keys, limit=8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_strict(model: nn.Module, weights: dict, what: str, prefix: str = "") -> None:
    """Refuse unused, missing or misshapen tensors by name (``prefix`` is how the file names them)."""
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    extra, missing = set(weights) - set(expected), set(expected) - set(weights)
    msg = []
    if extra:
        msg.append("unused tensors in the file: " + _names(prefix + k for k in extra))
    if missing:
        msg.append("parameters missing from the file: " + _names(prefix + k for k in missing))
    if msg:
        raise CheckpointError(f"{what}: " + "; ".join(msg))
    bad = {k: (tuple(weights[k].shape), s) for k, s in expected.items() if tuple(weights[k].shape) != s}
    if bad:
        raise CheckpointError(
            f"{what}: shape mismatch: "
            + ", ".join(f"{prefix}{k} file {f} vs model {m}" for k, (f, m) in sorted(bad.items())[:8])
        )


def _target_quant(target: Target):
    """(bits, group_size) of a quantized target's layers, else None."""
    for _, m in target.model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            return m.bits, m.group_size
    return None


def load_mtp(path: str | Path, target: Target, *, dtype=None, hint: str | None = None) -> MTPHead:
    """The MTP head of the checkpoint folder ``path`` whose target is ``target``, bound to it.

    Quantized like the target: ``mtp.`` tensors stored quantized load as they are; float ones
    are quantized to the target's bits and group size when the target is quantized. ``hint`` is
    where to get the original checkpoint (the catalog's repo), for the refusal of a stripped one.
    """
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: unreadable ({e})") from None
    mt = text_config(config).get("model_type") or config.get("model_type")
    if mt in DEEPSEEK_TYPES:
        raise UnsupportedModel(
            f"--draft mtp: {path} is a {mt} checkpoint; its MTP layer (eh_proj, enorm, "
            "hnorm, shared_head) is known, but the target adapter does not run "
            f"{mt} targets"
        )
    if mt not in MTP_TYPES:
        raise UnsupportedModel(
            f"--draft mtp: {mt} targets have no multi-token-prediction head we load "
            f"(known: {', '.join(sorted(MTP_TYPES))})"
        )
    if not target.final_hidden:
        raise UnsupportedModel("--draft mtp needs a target built with final_hidden=True")
    weights = read_mtp_weights(path)
    if not weights:
        raise CheckpointError(STRIPPED.format(path=path, hint=hint or "the model's original repo"))
    n = mtp_layers(config)
    if n > 1:
        raise UnsupportedModel(f"{path}: {n} MTP layers; only one-layer MTP heads are supported")
    head = MTPHead(mt, config)
    c = text_config(config)
    shift = mt in GEMMA_NORMS and original_form(path, mt)
    weights = sanitize(weights, int(c.get("num_experts") or 0), shift)
    if any(k.endswith(".scales") for k in weights):
        nn.quantize(head, class_predicate=lambda p, m: f"{p}.scales" in weights, **_quant_args(config))
    check_strict(head, weights, f"{path}: MTP head", PREFIX)
    head.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        head.set_dtype(dtype)
    q = _target_quant(target)
    if q and not any(k.endswith(".scales") for k in weights):
        bits, gs = q
        nn.quantize(
            head,
            group_size=gs,
            bits=bits,
            class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % gs == 0,
        )
    mx.eval(head.parameters())
    head.eval()
    return head.bind(target.embed, target.head)


def _quant_args(config: dict) -> dict:
    q = config.get("quantization") or config.get("quantization_config") or {}
    return {"group_size": q.get("group_size", 64), "bits": q.get("bits", 4)}


__all__ = [
    "MTP_TYPES",
    "STRIPPED",
    "MTPHead",
    "check_strict",
    "decoder_layer",
    "load_mtp",
    "mtp_layers",
    "read_mtp_weights",
    "sanitize",
    "text_config",
]
