"""Tiny in-process models and scripted drafters for the tests (nothing is downloaded)."""

from __future__ import annotations

from mlx_spec.drafter import DFLASH1, DFLASH2, ContextCache, Drafter, DrafterArgs, Proposal
from mlx_spec.eagle import Eagle3, Eagle3Args, eagle_config, save_eagle
from mlx_spec.mtp import MTPHead
from mlx_spec.target import Target

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model

VOCAB = 128

TARGET_CONFIGS = {
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


def tiny_model(kind: str = "qwen3", seed: int = 0, **over):
    """A tiny float32 mlx-lm model with sharpened logits (random models are near-uniform);
    ``over``: config fields to change (e.g. ``head_dim=32``)."""
    import importlib

    cfg = dict(TARGET_CONFIGS[kind], **over)
    mod = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    # Sharpen embedding and head so greedy continuations vary and are not a sea of near-ties.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 4
    model.lm_head.weight = model.lm_head.weight * 4
    mx.eval(model.parameters())
    return model, cfg


def drafter_config(
    target_cfg: dict,
    *,
    v2: bool = False,
    layers: int = 1,
    taps=(0, 2),
    window: int | None = None,
    block_size: int = 8,
    is_causal=None,
) -> dict:
    H = target_cfg["hidden_size"]
    cfg = {
        "architectures": [DFLASH2 if v2 else DFLASH1],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": target_cfg["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "block_size": block_size,
        "dflash_config": {"mask_token_id": target_cfg["vocab_size"] - 1, "target_layer_ids": list(taps)},
    }
    if window:
        cfg["layer_types"] = ["sliding_attention"] * layers
        cfg["sliding_window"] = window
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    if v2:
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8)
    return cfg


def tiny_drafter(model, target_cfg, seed: int = 1, **kw):
    cfg = drafter_config(target_cfg, **kw)
    mx.random.seed(seed)
    d = Drafter(DrafterArgs.from_config(cfg))
    mx.eval(d.parameters())
    target = Target(model, d.args.target_layer_ids)
    d.bind(target.embed, target.head)
    return target, d, cfg


def greedy_reference(model, prompt, n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(tok)
    return out


class ScriptedDrafter:
    """Drafts from a known continuation: right for ``right`` positions per block, then wrong.

    ``right=None`` is an oracle (always right); ``right=0`` is always wrong.
    """

    def __init__(self, full: list[int], vocab: int, right: int | None = None):
        self.full, self.vocab, self.right = full, vocab, right
        self.args = DrafterArgs(
            hidden_size=1,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            intermediate_size=1,
            vocab_size=vocab,
            num_target_layers=1,
            target_layer_ids=[0],
            mask_token_id=0,
        )

    def make_cache(self):
        return [ContextCache()]

    def add_context(self, features, cache):
        cache[0].offset += features.shape[1]

    def propose(self, anchor, features, cache, block_size, temperature=0.0, key=None, confidence=False):
        if features is not None:
            cache[0].offset += features.shape[1]
        start = cache[0].offset  # absolute position of the anchor
        out = []
        for k in range(1, block_size):
            tok = self.full[start + k] if start + k < len(self.full) else 0
            if self.right is not None and k > self.right:
                tok = (tok + 1) % self.vocab
            out.append(tok)
        conf = mx.full((len(out),), 0.9) if confidence else None
        return Proposal(mx.array(out, mx.int32), None, conf)


def _sharpen(head, seed):
    mx.random.seed(seed)
    params = [(k, v * 3 if k.endswith("weight") and v.ndim == 2 else v) for k, v in tree_flatten(head.parameters())]
    head.load_weights(params)
    mx.eval(head.parameters())


def write_mtp_checkpoint(root, kind: str, per_expert: bool = False, seed: int = 3):
    """A tiny target checkpoint carrying an MTP head in the original layout (``mtp.*`` tensors in
    their own safetensors file, as the original repos shard them). Returns (dir, model, head)."""
    if kind in TARGET_CONFIGS:
        model, cfg = tiny_model(kind)
    else:
        from test_hybrid import build  # (a test module's builder: imported where it is needed)

        model, cfg = build(kind)
    cfg = dict(cfg, num_nextn_predict_layers=1)
    save_model(root, model)
    save_config(dict(cfg), root / "config.json")
    mx.random.seed(seed)
    head = MTPHead(cfg["model_type"], cfg)
    _sharpen(head, seed)
    flat = dict(tree_flatten(head.parameters()))
    if per_expert:  # the original per-expert names
        for n in ("gate_proj", "up_proj", "down_proj"):
            w = flat.pop(f"layers.0.mlp.switch_mlp.{n}.weight")
            for e in range(w.shape[0]):
                flat[f"layers.0.mlp.experts.{e}.{n}.weight"] = w[e]
    mx.save_safetensors(str(root / "model-mtp.safetensors"), {"mtp." + k: v for k, v in flat.items()})
    return root, model, head


def make_eagle(tmp, layout: str, reduced: bool, seed: int = 5, layer_ids=(1, 2, 3), kind: str = "llama"):
    """An EAGLE-3 checkpoint for the tiny ``kind`` target, saved in ``layout`` under ``tmp``;
    returns (that target, the drafter's config)."""
    model, tcfg = tiny_model(kind)
    vd = 64 if reduced else None
    cfg = eagle_config(tcfg, layout=layout, intermediate_size=96, draft_vocab_size=vd, layer_ids=layer_ids)
    mx.random.seed(seed)
    d = Eagle3(Eagle3Args.from_config(cfg))
    _sharpen(d, seed)
    if reduced:
        ids = np.sort(np.random.default_rng(seed).choice(VOCAB, 64, replace=False))
        d.set_d2t(ids - np.arange(64))
    save_eagle(d, tmp, cfg, layout)
    return model, cfg


def save_chain_family(root, kind: str = "llama", eagle: bool = True, d2t: bool = True):
    """One tiny target with every drafter kind, on disk: the target folder (with a tokenizer), an
    MTP head in its own folder ``mtp`` (``mtp.*`` tensors beside a config declaring one MTP
    layer, as ``train mtp`` writes one: mlx-lm loads a converted target folder strictly), a
    DFlash 2 drafter and an EAGLE-3 drafter (llama), with a reduced vocabulary (``d2t``) or
    without. Returns a dict of the folders."""
    import json
    from pathlib import Path

    from mlx_spec.loading import save_drafter

    root = Path(root)
    out = {}
    (root / "mtp").mkdir(parents=True, exist_ok=True)
    _, model, _ = write_mtp_checkpoint(root / "mtp", kind)
    cfg = json.loads((root / "mtp" / "config.json").read_text())
    save_model(root / "target", model)
    save_config({k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"}, root / "target" / "config.json")
    out["mtp"] = root / "mtp"
    save_tiny_tokenizer(root / "target")
    cfg = json.loads((root / "target" / "config.json").read_text())
    _, d, dcfg = tiny_drafter(model, cfg, v2=True)
    save_drafter(d, root / "drafter", dcfg)
    out.update(target=root / "target", drafter=root / "drafter")
    if eagle:
        make_eagle(root / "eagle", "eagle", reduced=d2t)
        out["eagle"] = root / "eagle"
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_tokenizer(path, vocab_size: int = VOCAB, extra_specials=(), template: str = CHAT_TEMPLATE) -> None:
    """A character-level tokenizer (printable ASCII + newline + specials) with a ChatML template.
    ``extra_specials`` (e.g. "<think>", "</think>") take ids right after the characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars + list(extra_specials))}
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(specials + list(extra_specials))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", unk_token="<unk>", bos_token=None, pad_token="<|endoftext|>"
    )
    hf.chat_template = template
    hf.save_pretrained(str(path))


def save_tiny_pair(root, kind: str = "qwen3", v2: bool = True, target_over: dict | None = None, **drafter_kw):
    """Write a tiny target (with tokenizer) and drafter to disk; returns (target_dir, drafter_dir).
    ``target_over``: target config fields to change (``tiny_model``)."""
    from pathlib import Path

    from mlx_spec.loading import save_drafter

    from mlx_lm.utils import save_config, save_model

    root = Path(root)
    model, cfg = tiny_model(kind, **(target_over or {}))
    save_model(root / "target", model)
    save_config(dict(cfg), root / "target" / "config.json")
    save_tiny_tokenizer(root / "target")
    _, d, dcfg = tiny_drafter(model, cfg, v2=v2, **drafter_kw)
    save_drafter(d, root / "drafter", dcfg)
    return root / "target", root / "drafter"


def tiny_engine_loader(root, block_size: int = 4, context: int | None = None):
    """An Engine loader for a tiny pair saved under ``root`` (runs on the engine thread):
    a ``session.Session`` whose context is ``context`` capped at the target's trained one."""
    from mlx_spec.generation import engine_info
    from mlx_spec.loading import load_pair
    from mlx_spec.session import Session

    t, d = save_tiny_pair(root)

    def loader():
        pair = load_pair(str(t), str(d))
        return Session.of(pair, engine_info(pair, block_size, "flag"), context=context)

    return loader
