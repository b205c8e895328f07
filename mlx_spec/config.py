"""What loading a pair needs, as one frozen value.

``LoadConfig`` is built once from the command line (``cli.load_config``) or by a library user;
everything below the front ends (session, memory plan, tuner, engine) takes it, never an argparse
namespace. It checks its own values on construction, so a bad flag is refused before anything
loads. Sampling has its own frozen config: ``sampling.SamplingConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .default_target import DEFAULT_TARGET_ID
from .errors import BadRequest

BITS = ("4", "8", "none")
DRAFT_VOCABS = ("auto", "full")
DEFAULT_CONTEXT = 4096
# --draft: the draft sources a pair may use (policy.KNOWN); "auto" = every one the loaded pair has
DRAFT_SOURCES = ("dflash", "lookup", "mtp", "eagle")
# The default engine's sources, in --draft's syntax: the one place to switch the default (e.g. to
# "auto" once chain drafters are measured on the embedded pair).
DEFAULT_DRAFT = "dflash,lookup"


def parse_draft(text: str) -> tuple[str, ...]:
    """``--draft``'s value as a tuple of sources (``("auto",)`` for auto), refused by name when
    it names an unknown source, repeats one or mixes auto with others."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names:
        raise BadRequest(f"--draft must name a draft source ({', '.join(DRAFT_SOURCES)}) or auto")
    bad = [x for x in names if x not in (*DRAFT_SOURCES, "auto")]
    if bad:
        raise BadRequest(
            f"--draft: unknown source {', '.join(repr(x) for x in bad)} "
            f"(known: {', '.join(DRAFT_SOURCES)}, or auto for every source the pair has)"
        )
    if "auto" in names and len(names) > 1:
        raise BadRequest("--draft auto means every source the pair has: give it alone")
    if len(set(names)) != len(names):
        raise BadRequest(f"--draft names a source twice: {text}")
    return tuple(names)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One pair to load and how. Field names follow the flags (``cli.add_model_args``)."""

    target: str = DEFAULT_TARGET_ID  # a path, a Hugging Face repo id, or the default target's id
    drafter: str | None = None  # None: the bundled drafter with the default target, else refused
    no_draft: bool = False  # plain decoding of the target: the only way to get it
    block_size: int | None = None  # --block-size: wins over tuning and the checkpoint
    target_bits: str | None = None  # "4" | "8" | "none" | None (as the checkpoint is)
    drafter_bits: str | None = None
    group_size: int | None = None  # None: quantize's default (64)
    draft_vocab: str = "auto"  # "auto": the drafter's reduced vocabulary when it ships one; "full"
    context: int = DEFAULT_CONTEXT  # tokens the memory plan must fit (serve: the per-request limit)
    prompt_tokens: int | None = None  # plan for a prompt of this many tokens (None: the whole context)
    budget: int | None = None  # memory budget in bytes (None: this machine's)
    force: bool = False  # start even when the memory plan exceeds the budget
    tune: bool = True  # False (--no-tune): the checkpoint's block size unless block_size
    tune_budget_s: float | None = None  # first-launch tuning time budget (None: the tuner's default)
    adaptive: bool = True  # the per-cycle drafting policy (plain / DFlash / lookup / chains); False: --no-adaptive
    draft: str = DEFAULT_DRAFT  # --draft: the draft sources, comma-separated, or "auto"
    mtp: str | None = None  # --mtp: a folder with the mtp.* tensors (None: the target's own checkpoint)
    eagle: str | None = None  # --eagle: an EAGLE-3 checkpoint folder or catalog name (None: the embedded pair's)
    prefix_cache: int = 0  # bytes of K/V kept between turns / requests (0 = off)
    ranks: int = 1  # machines the target is sharded over (plan --ranks; under mlx.launch: the group's size)
    kv_bits: int | None = None  # --kv-bits: the target's K/V cache quantized to 4 or 8 bits (None: as computed)
    kv_group_size: int = 64  # --kv-group-size
    draft_window: int | None = None  # --draft-window: drafter context rows kept (None: the drafter's default, 0: all)

    def __post_init__(self):
        if not self.target:
            raise BadRequest("--target must name a model (a path, a repo id or the default target)")
        if self.block_size is not None and self.block_size < 2:
            raise BadRequest(
                f"--block-size must be >= 2 for speculative decoding (got {self.block_size}); "
                "use --no-draft for plain decoding"
            )
        for name in ("target_bits", "drafter_bits"):
            value = getattr(self, name)
            if value is not None and value not in BITS:
                raise BadRequest(f"--{name.replace('_', '-')} must be one of {', '.join(BITS)} (got {value!r})")
        if self.group_size is not None and self.group_size not in (32, 64, 128):
            raise BadRequest(f"--group-size must be 32, 64 or 128 (got {self.group_size})")
        if self.draft_vocab not in DRAFT_VOCABS:
            raise BadRequest(f"--draft-vocab must be 'auto' or 'full' (got {self.draft_vocab!r})")
        if self.context < 2:
            raise BadRequest(f"--context must be >= 2 (got {self.context})")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise BadRequest(f"--prompt-tokens must be >= 1 (got {self.prompt_tokens})")
        if self.budget is not None and self.budget <= 0:
            raise BadRequest(f"the memory budget must be > 0 (got {self.budget} bytes)")
        if self.tune_budget_s is not None and not self.tune_budget_s > 0:
            raise BadRequest(f"--tune-budget must be > 0 seconds (got {self.tune_budget_s:g})")
        if self.ranks < 1:
            raise BadRequest(f"--ranks must be >= 1 (got {self.ranks})")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            raise BadRequest(f"--kv-bits must be 4 or 8 (got {self.kv_bits})")
        if self.kv_group_size not in (32, 64, 128):
            raise BadRequest(f"--kv-group-size must be 32, 64 or 128 (got {self.kv_group_size})")
        if self.kv_bits is not None and self.ranks > 1:
            raise BadRequest(
                "--kv-bits is not offered for a target sharded over a group (--ranks): the sharded "
                "attention's quantized cache is untested; drop one of them"
            )
        if self.draft_window is not None and self.draft_window < 0:
            raise BadRequest(f"--draft-window must be >= 1 position, or 0 for all (got {self.draft_window})")
        if self.draft_window and self.no_draft:
            raise BadRequest("--draft-window bounds the drafter's context: it has no use with --no-draft")
        if self.prefix_cache < 0:
            raise BadRequest(f"--prefix-cache-mb must be >= 0 (got {self.prefix_cache / 2**20:g})")
        sources = parse_draft(self.draft)
        if not self.adaptive and "dflash" not in sources and sources != ("auto",):
            raise BadRequest(
                "--no-adaptive drafts a fixed DFlash block every cycle: it needs dflash among --draft "
                f"(got --draft {self.draft}; the per-cycle policy chooses the chain depth and lookup length)"
            )

    @property
    def draft_sources(self) -> tuple[str, ...]:
        """``draft`` parsed: the sources asked for, or ``("auto",)``."""
        return parse_draft(self.draft)

    @property
    def speculative(self) -> bool:
        """Whether a drafter is asked for (the tuner may still choose plain decoding)."""
        return not self.no_draft
