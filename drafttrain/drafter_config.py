"""The drafter's config section (drafter.*): what every kind shares, and one sub-section per kind (drafter.<kind>).
Part of the run configuration (config.py imports it); a field's trailing `# ...` comment is its key's doc there too."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Eagle3Section:  # drafter.eagle3: sizes of a fresh EAGLE-3 drafter (a checkpoint at drafter.path fixes its own)
    aux_layer_ids: Optional[list[int]] = None  # policy layers whose inputs feed the drafter; null = kind's default
    draft_vocab_size: Optional[int] = None  # draft vocabulary size; null = the policy's vocabulary
    intermediate_size: Optional[int] = None  # drafter MLP width; null = the policy's


@dataclass
class SelfQuantSection:  # drafter.selfquant: the policy quantized into its own drafter
    quant: str = "int8"  # int8 (per-output-channel) | int4 (group-wise)
    backend: str = "ao"  # ao (torch fbgemm int8 / aten int4 CPU kernels) | bnb (bitsandbytes) | ref
    group_size: int = 64  # int4: in-features per scale (bnb: nf4 blocksize)


@dataclass
class SuffixSection:  # drafter.suffix: drafts copied from sibling rows and recent rollouts; nothing to train
    max_ngram: int = 8  # longest context suffix looked up
    min_ngram: int = 2  # shortest context suffix that may propose a continuation
    history: int = 2  # earlier generate() calls (RL steps) whose rollouts stay in the index
    prompt_cache: int = 4096  # prompts whose rollouts outlive the history, reused when one recurs (~4 B/token); 0 = off


@dataclass
class DraftModelSection:  # drafter.draft_model: a small separate LM (own KV cache), distilled online from the policy
    layers: int = 1  # decoder layers of a fresh draft model: the policy's first ones, copied


@dataclass
class MtpSection:  # drafter.mtp: a DeepSeek-style MTP head on the policy's final hidden state (vLLM: its eagle form)
    intermediate_size: Optional[int] = None  # the head's MLP width; null = the policy's (a checkpoint fixes its own)


@dataclass
class AutoSection:  # drafter.auto: several drafters at once; the engine picks one (or none) per active-batch bucket
    kinds: list[str] = field(default_factory=lambda: ["eagle3", "suffix"])  # member kinds (not selfquant, not auto)
    paths: list[Optional[str]] = field(default_factory=lambda: ["checkpoints/eagle3", None])  # each member's checkpoint


@dataclass
class DrafterConfig:
    kind: str = "eagle3"  # a registered kind (drafters/base.py): eagle3 | mtp | draft_model | selfquant | suffix | auto
    path: Optional[str] = "checkpoints/eagle3"  # speculators-format folder; null = a fresh random drafter
    ttt_steps: int = 3  # training-time-test unroll length n
    ttt_decay: float = 0.8  # step i weighs ttt_decay**i
    eagle3: Eagle3Section = field(default_factory=Eagle3Section)  # kind eagle3's settings
    selfquant: SelfQuantSection = field(default_factory=SelfQuantSection)  # kind selfquant's settings
    suffix: SuffixSection = field(default_factory=SuffixSection)  # kind suffix's settings
    draft_model: DraftModelSection = field(default_factory=DraftModelSection)  # kind draft_model's settings
    mtp: MtpSection = field(default_factory=MtpSection)  # kind mtp's settings
    auto: AutoSection = field(default_factory=AutoSection)  # kind auto's members


def drafter_checks(d: DrafterConfig) -> list[tuple[bool, str, str]]:
    """(ok, key, message) for what types alone cannot say about drafter.*; config.validate raises the first failure."""
    e3, sq, sx = d.eagle3, d.selfquant, d.suffix
    return [
        (sq.quant in ("int8", "int4"), "drafter.selfquant.quant", f"must be int8 or int4, got {sq.quant!r}"),
        (sq.backend in ("ao", "bnb", "ref"), "drafter.selfquant.backend",
         f"must be ao, bnb or ref, got {sq.backend!r}"),
        (sq.group_size >= 1, "drafter.selfquant.group_size", f"must be >= 1, got {sq.group_size}"),
        (d.kind not in ("selfquant", "suffix", "auto") or d.path is None, "drafter.path",
         f"must be null for drafter.kind={d.kind} (it is built from the policy, not loaded)"),
        # an empty path read as "no drafter" (a fresh random one), or as the project root / the working directory
        (d.path is None or d.path.strip() != "", "drafter.path",
         "is empty: give a folder, or drafter.path=null for a fresh random drafter"),
        (e3.draft_vocab_size is None or e3.draft_vocab_size >= 1, "drafter.eagle3.draft_vocab_size",
         f"must be >= 1 or null (the policy's), got {e3.draft_vocab_size}"),
        (e3.intermediate_size is None or e3.intermediate_size >= 1, "drafter.eagle3.intermediate_size",
         f"must be >= 1 or null (the policy's), got {e3.intermediate_size}"),
        (sx.min_ngram >= 1, "drafter.suffix.min_ngram", f"must be >= 1, got {sx.min_ngram}"),
        (sx.max_ngram >= sx.min_ngram, "drafter.suffix.max_ngram",
         f"must be >= drafter.suffix.min_ngram = {sx.min_ngram}, got {sx.max_ngram}"),
        (sx.history >= 0, "drafter.suffix.history", f"must be >= 0, got {sx.history}"),
        (sx.prompt_cache >= 0, "drafter.suffix.prompt_cache", f"must be >= 0 (0 = off), got {sx.prompt_cache}"),
        (d.mtp.intermediate_size is None or d.mtp.intermediate_size >= 1, "drafter.mtp.intermediate_size",
         f"must be >= 1 or null (the policy's), got {d.mtp.intermediate_size}"),
        (len(d.auto.kinds) == len(d.auto.paths), "drafter.auto.paths",
         f"must give one path (or null) per drafter.auto.kinds entry: {len(d.auto.kinds)} kinds, "
         f"{len(d.auto.paths)} paths"),
        (len(set(d.auto.kinds)) == len(d.auto.kinds) and not {"auto", "selfquant"} & set(d.auto.kinds),
         "drafter.auto.kinds", f"must be distinct kinds other than auto and selfquant, got {list(d.auto.kinds)}"),
        (d.draft_model.layers >= 1, "drafter.draft_model.layers", f"must be >= 1, got {d.draft_model.layers}"),
    ]
