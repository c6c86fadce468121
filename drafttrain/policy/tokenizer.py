"""Character-level tokenizer for the task (policy/task.py), in HF format.

Built with the `tokenizers` library (a BPE model with no merges = one token per
character) and wrapped in `PreTrainedTokenizerFast`, so it saves as
`tokenizer.json` and loads anywhere HF tokenizers load (vLLM, TRL). Encoding a
string with special tokens prepends BOS; decoding concatenates characters.

Vocab: <pad> <bos> <eos> <unk>, then the task's characters, then unused
filler tokens up to a multiple of 8 (`VOCAB_SIZE`).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
CHARS = list("0123456789+-*=;:QA abcdefghijklmnop")  # a-p: the task's countdown labels
VOCAB_SIZE = 48  # specials + chars, padded with <unused_i>


def _vocab() -> dict[str, int]:
    tokens = SPECIALS + CHARS
    tokens += [f"<unused_{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == VOCAB_SIZE
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = _vocab()
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # batched generation: prompts end at the same column
    )
    tok.add_special_tokens({"additional_special_tokens": [t for t in vocab if t.startswith("<unused_")]})
    return tok


def load_tokenizer(path: str):
    """The checkpoint's tokenizer: this task's char tokenizer, or any other HF tokenizer (AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """BOS + one id per character."""
    return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)


def decode(tok: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Characters of `ids`, cut at the first EOS, a leading BOS (a prompt's) dropped. Any other special token stays,
    as its name (`<pad>`): dropped, it let `A:2 <pad> 9` pass the reward check as `A:29`."""
    ids = list(ids)
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    if ids and ids[0] == tok.bos_token_id:
        ids = ids[1:]
    return tok.decode(ids, skip_special_tokens=False)
