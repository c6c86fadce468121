"""Suffix drafter (drafter.kind=suffix): drafts text copied from the batch's sibling rows, as they are generated,
and from the last generate() calls' rollouts. Nothing to train and no weights: its update is the index.

In GRPO the G samples of a prompt share most of their text, and the task's scratchpads repeat their phrasing from
one problem to the next; a row whose last n tokens occurred before (in a sibling, in itself, in a recent rollout)
is likely to go on as those occurrences did. The index counts, for every n-gram (n = drafter.suffix.min_ngram ..
max_ngram), the tokens that followed it. Each draft: the longest suffix of the row's text (drafts so far included)
that the index holds; the draft distribution q is its continuation counts, normalized, and the draft is sampled
from q (greedy drafts: its most frequent continuation, one-hot). No match drafts the row's last token (one-hot).

Drafts come with q, so rejection sampling (accept with min(1, p/q), else sample from (p - q)+) keeps the output
distribution exactly the policy's. Sampled from the counts rather than one-hot on the latest occurrence, they are
accepted more where the siblings took different turns (measured: see bench/NOTES.md, Suffix).

The index is a suffix trie over contexts read backwards: the root's children are keyed by a context's last token,
theirs by the one before, and a node at depth n >= min_ngram counts the tokens that followed its n-gram. Counting a
position walks one path (max_ngram dict steps); the longest match of a context is the deepest node with counts on
its path. Against a dict of n-gram tuples, lookups cost more (a walk, where the dict mostly matched the longest
n-gram at once) and a generation's start less (measured: see bench/NOTES.md, Suffix). What the trie
buys is the history: un-counting one generation costs the same however many are kept.

A generation's rows are texts (prompt + committed response tokens) from its new_state on; every position of a kept
row whose next token is known is counted once. The texts of the last drafter.suffix.history generations stay: when a
generation starts (once per RL step), the oldest one past the history is un-counted (its emptied nodes pruned),
rather than the index rebuilt from every kept text. Pure Python:
microseconds per position, far below a verify step.

The prompt cache (drafter.suffix.prompt_cache: how many prompts): each prompt's rollouts of the last generation that
had it, kept past the history (as SPEC-RL reuses a prompt's earlier rollouts). A generation whose prompt comes back
after its rollouts left the index (an RL run over a dataset revisits each prompt every few dozen steps) counts them
again, from the n-grams ending on the prompt's last token on, for as long as that generation is kept. A prompt is
keyed by its tokens (the embedded engine's right-padded prompts with trailing pad zeros stripped: a prompt that ends
in token 0 may share a key with a shorter one, which costs drafts, never correctness).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
import torch.nn as nn

from drafttrain.drafters.contract import Drafter, Reads


class SuffixDrafter(nn.Module, Drafter):
    kind = "suffix"
    follows_policy = False  # it reads the text, not the policy
    trains = False  # no weights: its update is the index
    reads = Reads()

    def __init__(self, vocab_size: int, max_ngram: int = 8, min_ngram: int = 2, history: int = 2,
                 prompt_cache: int = 4096):
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"drafter.suffix.min_ngram: must be in [1, drafter.suffix.max_ngram = {max_ngram}], "
                             f"got {min_ngram}")
        if prompt_cache < 0:
            raise ValueError(f"drafter.suffix.prompt_cache: must be >= 0 (0 = off), got {prompt_cache}")
        self.vocab_size, self.max_ngram, self.min_ngram, self.history = vocab_size, max_ngram, min_ngram, history
        self.prompt_cache = prompt_cache
        self.texts: deque[_Generation] = deque()  # the kept generations, oldest first
        self.root: tuple[dict, dict] = ({}, {})  # trie node: (children by the token one further back, next counts)
        # prompt -> (id of the latest generation that counted them, its rollouts' texts, where their counting starts)
        self.cache: OrderedDict[tuple, tuple[int, list[array], int]] = OrderedDict()

    # ---- no weights ---------------------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        if state_dict:
            raise ValueError(f"suffix drafter: takes no weights, got {sorted(state_dict)[0]!r} (drafter.kind=suffix "
                             f"has nothing to load)")
        return None

    # ---- the index ------------------------------------------------------------------------------------------------
    def _count(self, text: list[int], lo: int, hi: int, delta: int = 1) -> None:
        """Add delta to the continuation counts of the n-grams ending at positions lo .. hi-1 of text (their next token
        is known). Un-counting (delta < 0) prunes the nodes it leaves empty."""
        n0, n1 = self.min_ngram, self.max_ngram
        if delta > 0:  # the hot path (every committed token): no path kept, nothing to prune
            for e in range(max(lo, n0 - 1), hi):
                nxt, node = text[e + 1], self.root
                for n in range(1, min(n1, e + 1) + 1):
                    kids, tok = node[0], text[e - n + 1]
                    node = kids.get(tok) or kids.setdefault(tok, ({}, {}))
                    if n >= n0:
                        c = node[1]
                        c[nxt] = c.get(nxt, 0) + delta
            return
        for e in range(max(lo, n0 - 1), hi):
            nxt, node, path = text[e + 1], self.root, []
            for n in range(1, min(n1, e + 1) + 1):
                tok = text[e - n + 1]
                path.append((node, tok))
                node = node[0][tok]  # counted before: its path exists
                if n >= n0:
                    c = node[1]
                    v = c[nxt] + delta
                    if v > 0:
                        c[nxt] = v
                    else:
                        del c[nxt]
            for parent, tok in reversed(path):  # deepest first: a node with nothing left goes
                child = parent[0][tok]
                if child[0] or child[1]:
                    break
                del parent[0][tok]

    def start_generation(self, rows: list[list[int]]) -> None:
        """A generation starts: the last one's rollouts go to the prompt cache, the generations past the history are
        un-counted, and `rows` (this generation's texts, grown in place by extend; the vLLM proposer appends rows as
        requests arrive) are kept from now on."""
        if self.texts:
            self._remember(self.texts[-1])
        gid = self.texts[-1].id + 1 if self.texts else 1  # ids increase: note_prompt compares them
        while len(self.texts) > self.history:
            g = self.texts.popleft()
            for t in g.rows:
                self._count(t, 0, len(t) - 1, -1)
            for t, lo in g.recalled:
                self._count(t, lo, len(t) - 1, -1)
        self.texts.append(_Generation(gid, rows))

    def adopt(self, old: "SuffixDrafter") -> None:
        """Take over `old`'s index (shared, not copied): a hot-swap builds the engine's drafter afresh from its
        template, and the index, the history and the prompt cache are what a weightless drafter has learnt."""
        self.root, self.texts, self.cache = old.root, old.texts, old.cache

    def note_prompt(self, text: list[int], prompt: list[int]) -> None:
        """Row `text` of the current generation answers `prompt`: its rollout joins the prompt cache when the
        generation ends, and the prompt's cached rollouts are counted again if they have left the index."""
        if not self.prompt_cache or not self.texts:  # no generation started: nothing to answer for
            return
        g, key = self.texts[-1], tuple(prompt)
        g.prompts.append((text, key))
        hit = self.cache.get(key)
        if hit is None:
            return
        self.cache.move_to_end(key)
        counted_in, texts, lo = hit
        if counted_in >= self.texts[0].id:  # still in the index: a kept generation counted them
            return
        for t in texts:
            self._count(t, lo, len(t) - 1)
            g.recalled.append((t, lo))
        self.cache[key] = (g.id, texts, lo)

    def _remember(self, g: "_Generation") -> None:
        """A finished generation's rollouts, per prompt, replace that prompt's in the cache (least recently used
        prompts go past prompt_cache). Their counting, on recall, starts at the n-grams that end on the prompt's
        last token (the prompt's own text drafts nothing a row needs), so each is kept from the prompt's last
        max_ngram - 1 tokens on, as 32-bit ints (4 bytes a token, against 8 to 36 for a list's)."""
        by: dict[tuple, list[list[int]]] = {}
        for text, key in g.prompts:
            by.setdefault(key, []).append(text)
        for key, texts in by.items():
            lo = max(len(key) - 1, 0)
            s0 = max(lo - self.max_ngram + 1, 0)
            self.cache[key] = (g.id, [array("i", t[s0:]) for t in texts], lo - s0)
            self.cache.move_to_end(key)
        while len(self.cache) > self.prompt_cache:
            self.cache.popitem(last=False)

    def counts(self, ngram) -> dict[int, int] | None:
        """token -> count after exactly this n-gram (None: not indexed)."""
        node = self.root
        for tok in reversed(list(ngram)):
            node = node[0].get(tok)
            if node is None:
                return None
        return node[1] or None

    def continuations(self, text: list[int]) -> dict[int, int] | None:
        """token -> count after the longest suffix of text the index holds (None: no match)."""
        node, best = self.root, None
        for n in range(1, min(self.max_ngram, len(text)) + 1):
            node = node[0].get(text[-n])
            if node is None:
                break
            if n >= self.min_ngram and node[1]:
                best = node[1]
        return best

    # ---- the engine's calls ---------------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int, prompts: torch.Tensor | None = None) -> "SuffixState":
        """prompts [B, P] right-padded with zeros: each row's text starts with its token 0 (the engine feeds the
        rest); each row's prompt, trailing zeros stripped, keys the prompt cache. No prompts (a timing call,
        measure_costs): the state indexes into a scratch drafter, so that synthetic text never enters the index."""
        if prompts is None:
            scratch = SuffixDrafter(self.vocab_size, self.max_ngram, self.min_ngram, self.history, 0)
            return scratch.new_state(batch, max_len, torch.zeros(batch, 1, dtype=torch.long, device="cpu"))  # text
        rows = [[t] for t in prompts[:, 0].tolist()]
        self.start_generation(rows)
        if self.prompt_cache:
            for text, p in zip(rows, prompts.tolist()):
                while len(p) > 1 and p[-1] == 0:
                    p.pop()
                self.note_prompt(text, p)
        return SuffixState(rows, self.texts[-1], self)

    def complete(self, st: "SuffixState", texts: list[list[int]]) -> None:
        """The generation ended: texts[i] is row i's whole text (prompt + response; rows in new_state's order). The
        engine calls drafters only at SD steps, so a row that finished after AR steps (the toggle off) or within its
        last drafts was indexed only up to its last SD step: its rest is indexed now, for the history and the prompt
        cache. A generation already dropped from the index (a timing call started others since) is left as it was."""
        g, ix = st.generation, st.index
        if not any(x is g for x in ix.texts):
            return
        for row, full in zip(g.rows, texts):
            if len(full) > len(row) and full[:len(row)] == row:
                ix.extend(row, full[len(row):])

    def extend(self, text: list[int], new: list[int]) -> None:
        """Append a row's new committed tokens to its text and index them."""
        old = len(text)
        text.extend(new)
        self._count(text, max(old - 1, 0), len(text) - 1)  # the previous newest position's next token is known

    def draft(self, text: list[int], k: int, u: list[float] | None) -> tuple[list[int], list[dict[int, float]]]:
        """k drafts after text from the continuation counts, each sampled at u[i] (None: the most frequent one),
        and their draft distributions (one-hot where nothing matched)."""
        ctx, row, qs = text[-self.max_ngram:], [], []
        for i in range(k):
            c = self.continuations(ctx)
            if c is None:
                d = ctx[-1] if ctx else 0
                q = {d: 1.0}
            elif u is None:  # the most frequent; ties to the lowest id (not the order rows were indexed in)
                d = max(c.items(), key=lambda tc: (tc[1], -tc[0]))[0]
                q = {d: 1.0}
            else:
                tot, acc, d = sum(c.values()), 0.0, None
                q = {t: v / tot for t, v in c.items()}
                for t, p in q.items():  # inverse CDF of the draw u
                    acc += p
                    if d is None and u[i] < acc:
                        d = t
                d = t if d is None else d  # u at the top of the last bin's rounding
            row.append(d)
            qs.append(q)
            ctx = ctx[1:] + [d] if len(ctx) >= self.max_ngram else ctx + [d]
        return row, qs

    @torch.no_grad()
    def propose(self, st, new_ids, aux, n_new, start, k, params, greedy_drafts, generator=None):
        """Append each row's n_new[b] new tokens (positions start[b]+1 ..) to its text and index them, every row's
        before any drafts (so no row's drafts depend on the batch's order), then draft k tokens per row from the
        continuation counts. Returns (drafts [B, k], q [B, k, V]; None with greedy drafts: one-hot)."""
        ids, n, s = new_ids.tolist(), n_new.tolist(), start.tolist()
        B, ix = len(st.rows), st.index  # the index the state's texts are in (a timing call's: a scratch one)
        for j, text in enumerate(st.rows):
            at = s[j] + 1
            if at != len(text):  # only a synthetic timing call re-writes positions (measure_costs)
                if at < len(text):  # positions from at-1 on lose their next token: un-counted, so kept rows stay exact
                    ix._count(text, at - 1, len(text) - 1, -1)
                    del text[at:]
                else:
                    ix.extend(text, [0] * (at - len(text)))
            ix.extend(text, ids[j][:n[j]])
        dev = new_ids.device  # the engine's: its generator draws there, its drafts and probs are read there
        u = None if greedy_drafts else torch.rand(B, k, generator=generator, device=dev).tolist()
        drafts, entries = [], []  # entries: (row, step, token, q) of the draft distributions
        for j, text in enumerate(st.rows):
            row, qs = ix.draft(text, k, None if u is None else u[j])
            drafts.append(row)
            entries.extend((j, i, t, p) for i, q in enumerate(qs) for t, p in q.items())
        d = torch.tensor(drafts, dtype=torch.long, device=dev).view(B, k)
        if greedy_drafts:
            return d, None
        q = torch.zeros(B, k, self.vocab_size, device=dev)
        r, i, t, p = zip(*entries)
        q[torch.tensor([r, i, t], device=dev).unbind()] = torch.tensor(p, device=dev)
        return d, q


class _Generation:
    """One kept generation: its rows' texts (counted from position 0), the prompt each row answers (for the prompt
    cache), and the cached texts it counted again (text, the first position counted)."""

    def __init__(self, gid: int, rows: list[list[int]]):
        self.id, self.rows = gid, rows
        self.prompts: list[tuple[list[int], tuple]] = []
        self.recalled: list[tuple[array, int]] = []


class SuffixState:
    """Per-generation state: the active rows' texts (lists shared with the drafter's index), the generation (every
    row's, finished ones included: complete()), and the drafter whose index holds them."""

    def __init__(self, rows: list[list[int]], generation: _Generation, index: SuffixDrafter):
        self.rows, self.generation, self.index = rows, generation, index

    def select_rows(self, idx: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in idx.tolist()]


def from_config(cfg, policy) -> SuffixDrafter:
    """The registry entry: cfg is a DrafterConfig (its suffix section); the policy gives its vocabulary size."""
    s = cfg.suffix
    return SuffixDrafter(policy.config.vocab_size, s.max_ngram, s.min_ngram, s.history, s.prompt_cache)


# ---- its config section: drafter.suffix -------------------------------------------------------------------------
@dataclass
class Section:  # drafter.suffix: drafts copied from sibling rows and recent rollouts; nothing to train
    max_ngram: int = 8  # longest context suffix looked up
    min_ngram: int = 2  # shortest context suffix that may propose a continuation
    history: int = 2  # earlier generate() calls (RL steps) whose rollouts stay in the index
    prompt_cache: int = 4096  # prompts whose rollouts outlive the history, reused when one recurs (~4 B/token); 0 = off


def checks(s) -> list[tuple[bool, str, str]]:
    """(ok, key within drafter.suffix, message)."""
    return [(s.min_ngram >= 1, "min_ngram", f"must be >= 1, got {s.min_ngram}"),
            (s.max_ngram >= s.min_ngram, "max_ngram",
             f"must be >= drafter.suffix.min_ngram = {s.min_ngram}, got {s.max_ngram}"),
            (s.history >= 0, "history", f"must be >= 0, got {s.history}"),
            (s.prompt_cache >= 0, "prompt_cache", f"must be >= 0 (0 = off), got {s.prompt_cache}")]
