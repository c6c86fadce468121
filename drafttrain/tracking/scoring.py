"""What the tracker scores, teacher-forced: the update's estimate, the serving drafter (publish gate) and measure()'s
live vs frozen step-0 drafter, each in the torch engine's runtime form (int8 changes acceptance a little).

Rows: a random sample (the captured rows come in the loss's micro-batch order, by advantage and length: the last
ones are the longest with no gradient). The estimate and the gate score rows held out of training.
"""
from __future__ import annotations

import copy

import torch

from drafttrain.config import max_draft_len
from drafttrain.drafters.base import runtime_copy
from drafttrain.engines import drafter_int8
from drafttrain.spec import SpecStats
from drafttrain.tracking.acceptance import teacher_forced_acceptance
from drafttrain.tracking.buffer import collate
from drafttrain.tracking.gate import ALL, score


class Scorer:
    def __init__(self, online, engine, drafter, publisher, steps: int, gens: dict):
        """online, engine: the config's online.* and engine.* sections."""
        self.online, self.engine_cfg, self.publisher, self.steps, self.gen = online, engine, publisher, steps, gens
        self.frozen = copy.deepcopy(drafter).eval().requires_grad_(False)  # the step-0 drafter
        self._frozen_rt = None  # its runtime form, for measure()
        self._serving_rt = None  # (engine version, runtime form of the weights it serves), for the publish gate
        self.heldout: list[dict] = []  # the most recent held-out rows (records), the estimate's and the gate's
        self.k = max_draft_len(engine)  # the estimate's and the gate's k

    @property
    def version(self) -> int:
        return self.publisher.version

    def runtime_form(self, drafter, owned: bool = False):
        """`drafter` as the torch engine runs it (int8 linears if engine.drafter_int8, also cheaper to score).
        vLLM runs the fp32 head: fp32 there."""
        return runtime_copy(drafter, drafter_int8(self.engine_cfg), owned)

    def serving_weights(self) -> dict:
        """The weights the engines serve now: the version on probation (inline canary), else the last good one."""
        p = self.publisher.pending
        return p["weights"] if p is not None and p["version"] == self.version else self.publisher.good_weights

    def serving_form(self):
        """runtime_form of the serving weights, cached per engine version (the gate scores it every update)."""
        if self._serving_rt is None or self._serving_rt[0] != self.version:
            d = copy.deepcopy(self.frozen)
            d.load_state_dict(self.serving_weights())
            self._serving_rt = (self.version, self.runtime_form(d, owned=True))
        return self._serving_rt[1]

    def served(self, version: int, form) -> None:
        """`form` is now what the engines serve at `version` (a publish): the gate's next reference."""
        self._serving_rt = (version, form)

    def estimate(self, drafter, rows: dict, members=(ALL,)) -> tuple[dict, object]:
        """teacher_forced_acceptance of each member (tracking/gate.py) of the trained drafter on the estimate's
        rows ({member: result}), and the drafter's runtime form."""
        form = self.runtime_form(drafter)
        return {m: score(form, rows, self.k, m, teacher_forced_acceptance) for m in members}, form

    def serving_scores(self, rows: dict, member: str = ALL) -> dict:
        """teacher_forced_acceptance of (a member of) the serving drafter on the estimate's rows. A held-out row is
        scored once per serving version (kept with the row: rows stay for a few steps, the serving drafter changes
        only at a publish or a rollback), by measure() when it ran, so the gate pays for at most the new rows', not
        every row's. The cache is the reported member's (measure's): another member is scored afresh."""
        if member != ALL and member != self.frozen.scored:
            return score(self.serving_form(), rows, self.k, member, teacher_forced_acceptance)
        if not self.heldout:  # the latest step's rows: no cache
            return teacher_forced_acceptance(self.serving_form(), rows, self.k)
        todo = [r for r in self.heldout if r.get("served", (None,))[0] != self.version]
        if todo:
            out = teacher_forced_acceptance(self.serving_form(), collate(todo, self.steps), self.k)
            for r, m, n in zip(todo, out["row_mal"].tolist(), out["row_steps"].tolist()):
                r["served"] = (self.version, m, n)
        mal = torch.tensor([r["served"][1] for r in self.heldout], dtype=torch.float64)  # [n]
        steps = torch.tensor([r["served"][2] for r in self.heldout], dtype=torch.float64)
        ok = steps > 0
        st = SpecStats(verify_rows=float(steps[ok].sum()), emitted=float((mal[ok] * steps[ok]).sum()))
        return {"mal": st.mean_accepted_length if st.verify_rows else 1.0, "stats": st, "row_mal": mal}

    def keep_heldout(self, latest: list[dict]) -> None:
        """The latest step's rows held out of training join the estimate's rows: the most recent, over the last
        steps, up to online.estimate_rows (a random sample of one step's where it holds more)."""
        n = self.online.estimate_rows
        new = sample(records(latest, self.steps, heldout_only=True), n, self.gen["estimate"])
        self.heldout = ([{k: v.clone() if torch.is_tensor(v) else v for k, v in r.items()} for r in new]
                        + self.heldout)[:n]

    def estimate_rows(self, latest: list[dict]) -> dict | None:
        """The rows the estimate and the gate score: the held-out ones; with none held out (online.holdout_frac=0),
        a sample of the latest step's rows, which the update trained on. None: no rows at all."""
        if self.heldout:
            return collate(self.heldout, self.steps)
        return rows(latest, self.steps, self.online.estimate_rows, self.gen["estimate"]) if latest else None

    def due(self, step: int | None, last: bool = False) -> bool:
        """measure() scores at step 0, every online.measure_every steps and the last (step None: always)."""
        return step is None or last or step % self.online.measure_every == 0

    def measure(self, pending: list[dict], k: int, serving_form) -> dict:
        """Live (serving_form) vs frozen step-0 drafter on the rows captured since the last update: the held-out
        ones first, then a random sample of the rest, online.measure_rows in all. The served drafter's scores of
        held-out rows are kept with them for the gate."""
        every, m = records(pending, self.steps, where=True), self.online.measure_rows
        held = [bool(pending[r["where"][0]]["heldout"][r["where"][1]]) for r in every]
        recs = [r for r, h in zip(every, held) if h][:m]
        recs += sample([r for r, h in zip(every, held) if not h], m - len(recs), self.gen["measure"])
        batch = collate(recs, self.steps)
        if self._frozen_rt is None:
            self._frozen_rt = self.runtime_form(self.frozen)
        live = teacher_forced_acceptance(serving_form, batch, k)
        frozen = teacher_forced_acceptance(self._frozen_rt, batch, k)
        if k == self.k:  # kept with the held-out rows' features, for keep_heldout
            for r, mal, n in zip(recs, live["row_mal"].tolist(), live["row_steps"].tolist()):
                f, b = pending[r["where"][0]], r["where"][1]
                if bool(f["heldout"][b]):
                    f.setdefault("served", {})[b] = (self.version, mal, n)
        return {"live_tf_mal": live["mal"], "live_tf_acc_pos": live["acceptance_per_position"],
                "frozen_tf_mal": frozen["mal"], "frozen_tf_acc_pos": frozen["acceptance_per_position"]}

    def state_dict(self) -> dict:
        """The frozen step-0 drafter's weights, the held-out rows (the estimate's and the gate's: an exact resume
        needs them) and the row generators it was given (the tracker's capture draws too: one dict)."""
        return {"frozen": self.frozen.state_dict(), "heldout": list(self.heldout),
                "row_gens": {k: g.get_state() for k, g in self.gen.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.frozen.load_state_dict(state["frozen"])
        self._frozen_rt = None
        self.heldout = list(state.get("heldout", []))  # older checkpoints: none
        for k, g in state.get("row_gens", {}).items():
            self.gen[k].set_state(g)


def records(features: list[dict], steps: int, heldout_only: bool = False, where: bool = False) -> list[dict]:
    """Every sequence of several build_features batches as a record (collate's input), heldout_only: of the rows
    held out of training. A row the served drafter was scored on (measure) carries that score ("served");
    where: each record also says which (batch, row) it is."""
    recs = []
    for i, f in enumerate(features):
        for b in range(f["aux"].shape[0]):
            if heldout_only and not bool(f["heldout"][b]):
                continue
            n = int(f["lengths"][b])
            recs.append({"aux": f["aux"][b, :n], "next_ids": f["next_ids"][b, :n + steps - 1],
                         "target_probs": f["target_probs"][b, :n + steps], "valid": f["valid"][b, :n + steps],
                         "first": int(f["first_ids"][b]) if "first_ids" in f else 0})
            if b in f.get("served", {}):
                recs[-1]["served"] = f["served"][b]
            if where:
                recs[-1]["where"] = (i, b)
    return recs


def rows(features: list[dict], steps: int, max_rows: int, gen: torch.Generator) -> dict:
    """max_rows sequences drawn at random (all if fewer) from several build_features batches, in one padded batch."""
    return collate(sample(records(features, steps), max_rows, gen), steps)


def sample(recs: list, n: int, gen: torch.Generator) -> list:
    """n of recs drawn at random, in their order (all if there are no more than n)."""
    if len(recs) <= n:
        return recs
    return [recs[i] for i in sorted(torch.randperm(len(recs), generator=gen)[:n].tolist())]
