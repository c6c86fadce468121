"""The prompts a run trains and evaluates on, how they are tokenized, and how a response is rewarded: the shipped
task (data.path unset), or the user's own prompts (data.*) and verifier (reward.fn).

    prompts = Prompts(cfg.data, cfg.reward, tok)   # its two sections
    rows = prompts.rows(16, seed)                  # training prompts: dicts with at least "prompt"
    ids = prompts.encode(rows[0])                  # token ids (the tokenizer's chat template where data.chat_template)
    r = prompts.reward(rows[0], prompts.decode(response_ids))

data.path is read with `datasets`: a folder written by save_to_disk with load_from_disk, a .jsonl/.json/.parquet/.csv
file with load_dataset; data.split picks the split. data.eval_size rows, drawn once with a fixed seed, are held out
of training for eval.json. reward.fn = "module:function", called as fn(prompt, response, row) -> float; unset, the
shipped task scores its `A:` answer and user data the exact match of the stripped response with data.answer_field.
A reward that raises or is not a finite number stops the run with one line naming reward.fn and the row. A file
with no rows is refused; rows with an empty prompt are skipped, and that and a data.eval_size the data cannot
hold are said once each (Prompts.notes, printed by the job).
"""
from __future__ import annotations

import importlib
import math
import random

from drafttrain.config import ConfigError, resolve_path
from drafttrain.policy import decode, encode_prompt, make_prompts
from drafttrain.policy import reward as task_reward
from drafttrain.policy.task import longest_problem

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HOLDOUT_SEED = 12345  # the held-out rows of a user's data set: the same in every run on it


class RewardError(ValueError):
    """reward.fn raised or returned something that is not a finite number (one line: the key and the row)."""


def load_rows(data_cfg):
    """The user's prompts as a datasets.Dataset (data.path, data.split); a one-line ConfigError naming the key."""
    import datasets

    path = resolve_path(data_cfg.path)
    if not path.exists():
        raise ConfigError(f"data.path: no such file or folder: {path}")
    if _blank(path):  # datasets' readers fail on it with a bare StopIteration
        raise ConfigError(f"data.path: {path}: no rows")
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        elif path.suffix.lower() in FORMATS:
            ds = datasets.load_dataset(FORMATS[path.suffix.lower()], data_files=str(path))
        else:
            raise ConfigError(f"data.path: {path}: unknown format {path.suffix!r} (known: "
                              f"{', '.join(FORMATS)}, or a folder written by Dataset.save_to_disk)")
    except ConfigError:
        raise
    except Exception as e:  # unreadable file, not a saved dataset folder
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"data.path: {path} cannot be read: {why}") from None
    if isinstance(ds, datasets.DatasetDict):
        if data_cfg.split not in ds:
            raise ConfigError(f"data.split: {data_cfg.split!r} is not a split of {path} (it has {', '.join(ds)})")
        ds = ds[data_cfg.split]
    if data_cfg.prompt_field not in ds.column_names:
        raise ConfigError(f"data.prompt_field: no column {data_cfg.prompt_field!r} in {path} (columns: "
                          f"{', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise ConfigError(f"data.path: {path}: no rows")
    return ds


def _blank(path) -> bool:
    """A file holding nothing but whitespace (read until the first other byte)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def drop_empty_prompts(ds, field: str, path) -> tuple[object, str | None]:
    """The rows whose prompt is a non-empty string, and a one-line note counting the others (None if none); fewer
    than 2 left (one is held out) is a ConfigError."""
    keep = [i for i, p in enumerate(ds[field]) if isinstance(p, str) and p.strip()]
    note = None
    if len(keep) < len(ds):
        note = (f"[drafttrain] data.prompt_field: skipped {len(ds) - len(keep)} of {len(ds)} rows of {path} whose "
                f"{field!r} is empty or not text")
        ds = ds.select(keep)
    if len(ds) < 2:
        raise ConfigError(f"data.path: {path} holds {len(ds)} rows with a non-empty {field!r}; at least 2 are "
                          f"needed (one is held out)")
    return ds, note


def stop_ids(policy, tok) -> tuple[int, ...]:
    """The tokens that end a response: the tokenizer's EOS and the policy's generation_config.eos_token_id (an id or
    a list: chat models often end a turn with their own token)."""
    ids = [tok.eos_token_id]
    gen = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    ids += gen if isinstance(gen, (list, tuple)) else [gen]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_reward(spec: str):
    """reward.fn "module:function" -> the function; a one-line ConfigError when it does not resolve."""
    mod, _, name = spec.partition(":")
    if not mod or not name:
        raise ConfigError(f"reward.fn: {spec!r} must be an import path module:function")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward.fn: {spec!r} does not resolve: {e}") from None
    if not callable(fn):
        raise ConfigError(f"reward.fn: {spec!r} is not callable")
    return fn


class Prompts:
    def __init__(self, data, reward, tok, stop_ids: tuple[int, ...] | None = None):
        """data, reward: the config's data.* and reward.* sections."""
        self.data, self.reward_fn, self.tok, d = data, reward.fn, tok, data
        self.own = d.path is not None
        self.fn = load_reward(reward.fn) if reward.fn else None
        self.stop_ids = tuple(stop_ids) if stop_ids else (tok.eos_token_id,)
        self.chat = False
        self.notes: list[str] = []  # one-line warnings about the data, for the job to print once
        if not self.own:
            return
        ds, note = drop_empty_prompts(load_rows(d), d.prompt_field, resolve_path(d.path))
        self.notes += [note] if note else []
        if self.fn is None and (d.answer_field is None or d.answer_field not in ds.column_names):
            raise ConfigError(f"data.answer_field: no column {d.answer_field!r} in {d.path} to score responses "
                              f"against; name it, or give reward.fn")
        self.chat = bool(getattr(tok, "chat_template", None)) if d.chat_template is None else bool(d.chat_template)
        if self.chat and not getattr(tok, "chat_template", None):
            raise ConfigError("data.chat_template: true, but the policy's tokenizer has no chat template")
        order = list(range(len(ds)))
        random.Random(HOLDOUT_SEED).shuffle(order)
        n_eval = min(d.eval_size, len(ds) - 1)
        if n_eval < d.eval_size:
            self.notes.append(f"[drafttrain] data.eval_size: {d.eval_size}, but {d.path} holds {len(ds)} usable rows: "
                              f"{n_eval} held out for eval.json, {len(ds) - n_eval} left for training")
        self.held, self.train = [ds[i] for i in order[:n_eval]], [ds[i] for i in order[n_eval:]]
        # every prompt tokenized once, here, batched through datasets' map: encode looks them up, and the longest
        # sizes the engine's rows
        texts = ds[d.prompt_field]
        ids = ds.map(lambda b: {"ids": [self._tokenize(t) for t in b[d.prompt_field]]}, batched=True, batch_size=64,
                     remove_columns=ds.column_names, keep_in_memory=True)["ids"]  # no cache file beside the data
        self._ids = dict(zip(texts, ids))
        self.longest = max(map(len, ids))

    def _row(self, row: dict) -> dict:
        return {**row, "prompt": row[self.data.prompt_field]}

    @staticmethod
    def _task_rows(n: int, seed: int) -> list[dict]:
        return [{"prompt": p.prompt, "answer": p.answer} for p in make_prompts(n, seed)]

    def rows(self, n: int, seed: int) -> list[dict]:
        """n training prompts, deterministic in seed (drawn without replacement while the data lasts)."""
        if not self.own:
            return self._task_rows(n, seed)
        rng = random.Random(seed)
        idx = rng.sample(range(len(self.train)), n) if n <= len(self.train) else \
            [rng.randrange(len(self.train)) for _ in range(n)]
        return [self._row(self.train[i]) for i in idx]

    def eval_rows(self, n: int, seed: int) -> list[dict]:
        """The held-out prompts eval.json scores: n fixed problems of the task, or up to n of the held-out rows."""
        if not self.own:
            return self._task_rows(n, seed)
        return [self._row(r) for r in self.held[:n]]

    def eval_count(self, n: int) -> int:
        """How many prompts eval_rows(n, ...) holds: what eval.json really scores."""
        return n if not self.own else min(n, len(self.held))

    def encode(self, row: dict) -> list[int]:
        """A row's prompt token ids (the user's: tokenized at load)."""
        text = row["prompt"]
        if not self.own:
            return encode_prompt(self.tok, text)
        return list(self._ids[text]) if text in self._ids else self._tokenize(text)

    def _tokenize(self, text: str) -> list[int]:
        if self.chat:
            out = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return self.tok(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if not self.own:
            return decode(self.tok, ids)
        ids = list(ids)
        cut = [i for i, t in enumerate(ids) if t in self.stop_ids]
        return self.tok.decode(ids[:cut[0]] if cut else ids, skip_special_tokens=True)

    def longest_prompt(self) -> int:
        """Tokens of the longest prompt a run can draw."""
        return len(encode_prompt(self.tok, longest_problem().prompt)) if not self.own else self.longest

    def reward(self, row: dict, text: str) -> float:
        if self.fn is not None:
            try:
                v = self.fn(row["prompt"], text, row)
            except Exception as e:
                raise RewardError(f"reward.fn: {self.reward_fn} raised {type(e).__name__}: {e} on the row with "
                                  f"prompt {_short(row['prompt'])}") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"reward.fn: {self.reward_fn} returned {v!r}, not a finite number, on the row "
                                  f"with prompt {_short(row['prompt'])}")
            return float(v)
        if not self.own:
            return task_reward(row["answer"], text)
        return float(text.strip() == str(row[self.data.answer_field]).strip())


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")

