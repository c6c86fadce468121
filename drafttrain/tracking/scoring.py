"""What the tracker scores, teacher-forced: the update's estimate, the serving drafter (publish gate) and measure()'s
live vs frozen step-0 drafter, each in the torch engine's runtime form (int8 changes acceptance a little).

Rows: records of the feature buffer, the tracker's one store; a random sample (the captured rows come in the loss's
micro-batch order, by advantage and length: the last ones are the longest with no gradient). The estimate and the
gate score rows held out of training. The targets are the policy's distributions from each record's hidden state
and the head the tracker holds (drafters/targets.py).
"""
from __future__ import annotations

import copy
import functools

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

    def estimate(self, drafter, rows: dict, head, members=(ALL,)) -> tuple[dict, object]:
        """teacher_forced_acceptance of each member (tracking/gate.py) of the trained drafter on the estimate's
        rows ({member: result}), and the drafter's runtime form."""
        form = self.runtime_form(drafter)
        tfa = functools.partial(teacher_forced_acceptance, head=head)
        return {m: score(form, rows, self.k, m, tfa) for m in members}, form

    def serving_scores(self, recs: list[dict], head, member: str = ALL) -> dict:
        """teacher_forced_acceptance of (a member of) the serving drafter on the estimate's records. A held-out
        record's score is kept with it (it stays the gate's for a few steps; the serving drafter changes only at a
        publish or a rollback, the targets' head once per policy update), so the gate pays for the rows not yet
        scored under both, mostly none: measure() scored this step's. The cache is the reported member's: another
        is scored afresh."""
        tfa = functools.partial(teacher_forced_acceptance, head=head)
        if member != ALL and member != self.frozen.scored:
            return score(self.serving_form(), collate(recs, self.steps), self.k, member, tfa)
        if not all(r["heldout"] for r in recs):  # the latest step's rows (none held out): scored once, no cache
            return tfa(self.serving_form(), collate(recs, self.steps), self.k)
        key = (self.version, head.tag)
        todo = [r for r in recs if r.get("served", (None,))[0] != key]
        if todo:
            out = tfa(self.serving_form(), collate(todo, self.steps), self.k)
            for r, m, n in zip(todo, out["row_mal"].tolist(), out["row_steps"].tolist()):
                r["served"] = (key, m, n)
        mal = torch.tensor([r["served"][1] for r in recs], dtype=torch.float64, device="cpu")  # [n]
        steps = torch.tensor([r["served"][2] for r in recs], dtype=torch.float64, device="cpu")
        ok = steps > 0
        st = SpecStats(verify_rows=float(steps[ok].sum()), emitted=float((mal[ok] * steps[ok]).sum()))
        return {"mal": st.mean_accepted_length if st.verify_rows else 1.0, "stats": st, "row_mal": mal}

    def keep_heldout(self, buffer, version: int) -> None:
        """Policy `version`'s rows held out of training join the estimate's rows (flagged in the buffer): the most
        recent, over the last steps, up to online.estimate_rows, a random sample of one step's where it holds more
        (its last rows are the loss forward's last micro-batches: the longest)."""
        held = [r for r in buffer.of_version(version) if r["heldout"]]
        for r in sample(held, self.online.estimate_rows, self.gen["estimate"]):
            r["estimate"] = True

    def estimate_records(self, buffer, version: int) -> list[dict]:
        """The records the estimate and the gate score: keep_heldout's newest online.estimate_rows; with none held out
        (online.holdout_frac=0), a sample of policy `version`'s, which the update trained on. []: none at all."""
        n = self.online.estimate_rows
        held = [r for r in reversed(buffer.records) if r.get("estimate")][:n]
        return held or sample(buffer.of_version(version), n, self.gen["estimate"])

    def due(self, step: int | None, last: bool = False) -> bool:
        """measure() scores at step 0, every online.measure_every steps and the last (step None: always)."""
        return step is None or last or step % self.online.measure_every == 0

    def measure(self, recs: list[dict], k: int, serving_form, head) -> dict:
        """Live (serving_form) vs frozen step-0 drafter on one step's records: the held-out ones first, then a random
        sample of the rest, online.measure_rows in all. The served drafter's scores of held-out records are kept
        with them for the gate."""
        m = self.online.measure_rows
        chosen = [r for r in recs if r["heldout"]][:m]
        chosen += sample([r for r in recs if not r["heldout"]], m - len(chosen), self.gen["measure"])
        batch = collate(chosen, self.steps)
        if self._frozen_rt is None:
            self._frozen_rt = self.runtime_form(self.frozen)
        live = teacher_forced_acceptance(serving_form, batch, k, head)
        frozen = teacher_forced_acceptance(self._frozen_rt, batch, k, head)
        if k == self.k:  # kept with the held-out records, for the gate
            key = (self.version, head.tag)
            for r, mal, n in zip(chosen, live["row_mal"].tolist(), live["row_steps"].tolist()):
                if r["heldout"]:
                    r["served"] = (key, mal, n)
        return {"live_tf_mal": live["mal"], "live_tf_acc_pos": live["acceptance_per_position"],
                "frozen_tf_mal": frozen["mal"], "frozen_tf_acc_pos": frozen["acceptance_per_position"]}

    def state_dict(self) -> dict:
        """The frozen step-0 drafter's weights and the row generators it was given (the tracker's capture draws too:
        one dict). The held-out rows are records of the buffer, saved with it."""
        return {"frozen": self.frozen.state_dict(), "row_gens": {k: g.get_state() for k, g in self.gen.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.frozen.load_state_dict(state["frozen"])
        self._frozen_rt = None
        for k, g in state.get("row_gens", {}).items():
            self.gen[k].set_state(g)


def sample(recs: list, n: int, gen: torch.Generator) -> list:
    """n of recs drawn at random, in their order (all if there are no more than n)."""
    if len(recs) <= n:
        return recs
    return [recs[i] for i in sorted(torch.randperm(len(recs), generator=gen, device="cpu")[:n].tolist())]
