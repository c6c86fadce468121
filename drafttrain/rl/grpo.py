"""The embedded GRPO host (Shao et al. 2024): small on purpose; it hosts drafttrain, it is not the product.

Per step: P prompts x G samples from the rollout engine (speculative decoding); exact-match rewards;
group-normalised advantages A = (r - mean_group) / (std_group + eps); the clipped policy-gradient loss
    L = -mean_tokens min(rho A, clip(rho, 1-eps, 1+eps) A),  rho = pi_theta(y_t) / pi_behaviour(y_t)
with the behaviour log-probs taken from the engine's verify pass. The loss forward runs inside
tracker.capture(), so the drafter's features cost no extra pass.

rl.mode=sync: generate, then train. rl.mode=async: the rollouts for step t+1 are generated with the step-t policy
while step t trains (one step stale; rho corrects for it). No KL term, no reference model.
"""
from __future__ import annotations

import contextlib
import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from drafttrain.config import ConfigError, sampling_params
from drafttrain.data import Prompts, stop_ids
from drafttrain.device import module_device, now
from drafttrain.rl.watch import check_finite, unfinished
from drafttrain.spec import processed_logprobs


@dataclass
class Rollouts:
    step: int
    prompts: list[list[int]]  # one per sample (each prompt repeated G times)
    responses: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    batch: object  # RolloutBatch
    canary: dict = field(default_factory=dict)  # the inline canary's verdict on this batch, if it gave one


class GRPO:
    def __init__(self, rl, sampling, engine_cfg, policy, tok, engine, prompts: Prompts, tracker=None,
                 accelerator=None, rank: int = 0):
        """rl, sampling, engine_cfg: the config's rl.*, sampling.* and engine.* sections (from_config: a Config)."""
        self.rl, self.sampling, self.engine_cfg = rl, sampling, engine_cfg
        self.policy, self.tok, self.engine, self.tracker = policy, tok, engine, tracker
        self.rank, self.device = rank, module_device(policy)  # the run's device (run.device)
        self.prompts = prompts  # the task's, or data.path's (with reward.fn)
        self._check_room(policy)
        self.opt = torch.optim.AdamW(policy.parameters(), lr=rl.lr, weight_decay=0.0)
        # several processes: the gradients are averaged once per update (average_grads), as DDP would, and the
        # policy is never handed to accelerate, whose DeepSpeed engine (under a DeepSpeed launch) is the drafter's
        self.acc = accelerator
        self.model = policy
        self._pool = ThreadPoolExecutor(max_workers=1) if rl.mode == "async" else None

    @classmethod
    def from_config(cls, cfg, policy, tok, engine, tracker=None, accelerator=None, rank: int = 0, prompts=None):
        """From a whole Config: its sections, and its data.* / reward.* prompts unless given."""
        prompts = prompts if prompts is not None else Prompts(cfg.data, cfg.reward, tok, stop_ids(policy, tok))
        return cls(cfg.rl, cfg.sampling, cfg.engine, policy, tok, engine, prompts, tracker, accelerator, rank)

    def _check_room(self, policy) -> None:
        """At start-up: a row's positions (engine.max_len, capped by the policy's) hold the longest prompt plus a full
        response. generate refuses a longer prompt, and a shorter room would cut responses off unscored."""
        s, max_len = self.sampling, self.engine_cfg.max_len
        prompt = self.prompts.longest_prompt()
        need, pos = prompt + s.max_new_tokens, getattr(policy.config, "max_position_embeddings", max_len)
        if max_len < need:
            raise ConfigError(f"engine.max_len: must be >= {need}, the longest prompt ({prompt} tokens) + "
                              f"sampling.max_new_tokens ({s.max_new_tokens}), got {max_len}")
        if pos < need:
            raise ConfigError(f"sampling.max_new_tokens: {s.max_new_tokens} + the longest prompt ({prompt} "
                              f"tokens) exceeds the policy's {pos} positions (max_position_embeddings)")

    def rollout(self, step: int) -> Rollouts:
        rl = self.rl
        seed = rl.prompt_seed * 1_000_003 + step * 101 + self.rank  # each step (and process) its own prompts
        rows = self.prompts.rows(rl.prompts_per_step, seed=seed)
        prompts = [self.prompts.encode(r) for r in rows for _ in range(rl.group_size)]
        params = sampling_params(self.sampling, stop_token_ids=self.prompts.stop_ids, seed=seed)
        if self.tracker is not None:  # the first batch of a new drafter version is its (inline) canary
            batch, canary = self.tracker.generate(self.engine, prompts, params, speculative=self.engine_cfg.speculative)
            self.tracker.set_probe(prompts[:: rl.group_size], self.prompts.stop_ids)
        else:
            batch, canary = self.engine.generate(prompts, params, speculative=self.engine_cfg.speculative), {}
        P = self.prompts
        rewards = [P.reward(rows[i // rl.group_size], P.decode(r)) for i, r in enumerate(batch.tokens)]
        if rl.truncated_reward is not None:
            cap, stop = self.sampling.max_new_tokens, set(self.prompts.stop_ids)
            rewards = [rl.truncated_reward if unfinished(t, cap, stop) else r for r, t in zip(rewards, batch.tokens)]
        return Rollouts(step, prompts, batch.tokens, batch.logprobs, rewards, batch, canary)

    def evaluate(self) -> dict:
        """Held-out accuracy (mean reward) of the current policy on rl.eval_prompts fixed problems (rl.eval_seed), or
        on data.path's held-out rows: sampled (sampling.temperature) and greedy, through the rollout engine, seeded;
        decoded plainly or as the rollouts are (rl.eval_decode: SD is lossless, so only the time differs)."""
        rl, P = self.rl, self.prompts
        rows = P.eval_rows(rl.eval_prompts, seed=rl.eval_seed)
        prompts = [P.encode(r) for r in rows]
        out = {}
        for name, T in (("sampled", self.sampling.temperature), ("greedy", 0.0)):
            params = sampling_params(self.sampling, temperature=T, stop_token_ids=P.stop_ids, seed=rl.eval_seed)
            spec = self.engine_cfg.speculative and rl.eval_decode == "rollout"
            batch = self.engine.generate(prompts, params, speculative=spec)
            out[f"eval_{name}_acc"] = statistics.fmean(P.reward(r, P.decode(t)) for r, t in zip(rows, batch.tokens))
        return out

    def average_grads(self) -> None:
        """Several processes: every policy gradient becomes its mean over the processes (one all-reduce of all of them
        flattened; a process that ran no backward adds zeros). Every process then takes the same update."""
        if self.acc is None or self.acc.num_processes == 1:
            return
        params = [p for p in self.policy.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        flat = self.acc.reduce(flat.to(self.acc.device), "mean").to(params[0].device)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()

    def advantages(self, rewards: list[float]) -> torch.Tensor:
        G = self.rl.group_size
        r = torch.tensor(rewards, device=self.device).view(-1, G)  # [P, G]
        return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)  # [P*G]

    def _micro_batch(self, ro: Rollouts, idx: list[int], L: int) -> tuple[torch.Tensor, ...]:
        """Rows idx right-padded to L, filled on the host and moved to the policy's device in one copy each: ids,
        mask [b, L], resp [b, L] (positions whose *next* token is a response token), old logprobs [b, L], starts [b]."""
        b = len(idx)
        ids, mask = (torch.zeros(b, L, dtype=torch.long, device="cpu") for _ in range(2))
        resp, old = torch.zeros(b, L, dtype=torch.bool, device="cpu"), torch.zeros(b, L, device="cpu")
        for j, i in enumerate(idx):
            p, r = len(ro.prompts[i]), len(ro.responses[i])
            ids[j, : p + r] = torch.tensor(ro.prompts[i] + ro.responses[i], device="cpu")
            mask[j, : p + r] = 1
            resp[j, p - 1: p + r - 1] = True
            old[j, p - 1: p + r - 1] = torch.tensor(ro.logprobs[i], device="cpu")
        starts = torch.tensor([len(ro.prompts[i]) for i in idx], device="cpu")
        return tuple(t.to(self.device, non_blocking=True) for t in (ids, mask, resp, old, starts))

    def train_step(self, ro: Rollouts, last: bool = False) -> dict:
        """One clipped policy-gradient update on a rollout batch (micro-batched, token-mean loss).

        Micro-batches hold sequences of similar length (less padding; `micro_batches`). A sequence whose advantage is
        0 (its group's rewards were all equal) adds no gradient, so those go last and run without autograd, and only
        where the tracker reads their features (tracker.reads_rows): the policy's update itself needs no forward of
        them."""
        rl, T = self.rl, self.sampling.temperature or 1.0
        params = sampling_params(self.sampling, temperature=T)  # the rollouts' top-k / top-p (greedy rollouts: T = 1)
        adv = self.advantages(ro.rewards)  # [N]
        n_tok = sum(len(r) for r in ro.responses)
        reads = self.tracker is not None and self.tracker.reads_rows(ro.step, last)
        ungraded = reads and self.tracker.reads_rows(ro.step, last, ungraded=True)
        lens = [len(p) + len(r) for p, r in zip(ro.prompts, ro.responses)]
        self.model.train()
        losses, clipped, graded = 0.0, 0, 0
        for idx in micro_batches(lens, [bool(a) for a in adv], rl.micro_batch, rl.micro_tokens):
            grad = bool(adv[idx].any())
            if not grad and not ungraded:
                break  # the rest have advantage 0 too (they sort last)
            ids, mask, resp, old, starts = self._micro_batch(ro, idx, L=max(lens[i] for i in idx))
            # a micro-batch with no advantage runs only for the tracker (its forward is the tracker's time), which
            # reads hidden states alone: no loss to take, and the LM head runs for one position, not the vocabulary
            ctx = (self.tracker.capture(self.policy, response_start=starts, extra=not grad) if reads
                   else contextlib.nullcontext())
            with ctx, torch.set_grad_enabled(grad):
                out = self.model(input_ids=ids, attention_mask=mask, **({} if grad else {"logits_to_keep": 1}))
            if not grad:
                continue
            logits = out.logits  # [b, L, V]
            # the distribution the engine sampled from (its top-k / top-p support too): ratio 1 on fresh rollouts
            logp = processed_logprobs(logits, params)[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            m = resp[:, :-1]
            ratio = (logp - old[:, :-1]).exp()
            a = adv[idx].view(-1, 1)
            obj = torch.minimum(ratio * a, ratio.clamp(1 - rl.clip_eps, 1 + rl.clip_eps) * a)
            loss = -(obj * m).sum() / n_tok
            check_finite("loss", loss, ro.step, rl.lr)
            losses += float(loss.detach())
            loss.backward()  # clip_frac: the share of the tokens the update learns from whose ratio was clipped
            clipped += int((((ratio - 1).abs() > rl.clip_eps) & m & (a != 0)).sum())
            graded += int((m & (a != 0)).sum())
        self.average_grads()
        check_finite("gradient norm", torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0), ro.step, rl.lr)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.eval()
        return {"rl_loss": losses, "clip_frac": clipped / max(graded, 1)}

    def run_step(self, step: int, ro: Rollouts, last: bool = False) -> tuple[dict, Rollouts | None]:
        """Train on `ro` (this step's rollouts), update the engine's policy and the drafter; return the metrics
        and the next step's rollouts (None after the last step)."""
        t0 = now(self.device)
        nxt = self._pool.submit(self.rollout, step + 1) if self._pool and not last else None  # step-t policy
        rec = rollout_metrics(ro)
        rec.update(self.train_step(ro, last))  # its loss forward feeds the tracker's capture
        if self.tracker is not None:  # the drafter that generated ro vs the frozen step-0 drafter, when due
            rec.update(self.tracker.measure(step=step, last=last))
            rec.update(self.tracker.on_policy_update(self.policy, step))
        ro_next = nxt.result() if nxt is not None else None
        if self.tracker is not None:
            rec.update(self.tracker.wait())  # async: its canary must not see a half-refreshed policy
        self.engine.update_policy()
        if ro_next is None and not last:
            ro_next = self.rollout(step + 1)
        if ro_next is not None:
            rec.update(ro_next.canary)  # sync: the verdict on the drafter this step published
        rec["rl_step_s"] = now(self.device) - t0
        return rec, ro_next


def micro_batches(lens: list[int], graded: list[bool], rows: int, tokens: int) -> list[list[int]]:
    """Row indices in micro-batches: the graded rows (a nonzero advantage) first, then the others, each part by
    length, cut wherever the next row would bring a micro-batch past `rows` rows or past `tokens` padded tokens
    (its rows x its longest); a row longer than `tokens` goes alone. Padding costs what the rows do: one row 20x the
    median, batched with 15 short ones, made all 16 cost as much as it."""
    order = sorted(range(len(lens)), key=lambda i: (not graded[i], lens[i]))
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if cur and len(cur) < rows and graded[cur[0]] == graded[i] and (len(cur) + 1) * lens[i] <= tokens:
            cur.append(i)
        else:
            out.append([i])
    return out


def rollout_metrics(ro: Rollouts) -> dict:
    lens = sorted(len(r) for r in ro.responses)
    st, tl = ro.batch.stats, ro.batch.timeline
    # live_mal is over the decode steps that drafted; live_k, their drafts per row (engine.k=auto drafts fewer at large
    # batches, and a step of k drafts emits at most k + 1 tokens); None where the engine keeps no per-step k (vLLM)
    drafted = [(b, k) for b, k in zip(tl.batch, tl.k) if k > 0]
    return {"step": ro.step, "reward_mean": statistics.fmean(ro.rewards), "resp_len_mean": statistics.fmean(lens),
            "resp_len_p90": lens[min(len(lens) - 1, math.ceil(0.9 * len(lens)) - 1)], "resp_len_max": lens[-1],
            "rollout_tokens": ro.batch.num_tokens,
            "rollout_tokens_per_s": ro.batch.num_tokens / max(ro.batch.wall_s, 1e-9),
            "rollout_wall_s": ro.batch.wall_s, "rollout_prefill_s": ro.batch.timeline.prefill_s,
            "rollout_tail10_s": tail_s(tl, len(ro.responses), 0.1),
            "live_mal": st.mean_accepted_length,
            "live_k": sum(b * k for b, k in drafted) / sum(b for b, _ in drafted) if drafted else None,
            "live_acc_pos": st.acceptance_per_position, "rollout_drafter_version": ro.batch.drafter_version}


def tail_s(tl, rows: int, frac: float) -> float | None:
    """Seconds of a batch's decode steps during which only its longest-running `frac` of rows were still active (the
    tail: ceil(frac * rows) rows or fewer); None where the engine keeps no per-step batch (vLLM)."""
    if not tl.batch or len(tl.ends) != len(tl.batch):
        return None
    cut, t0 = math.ceil(frac * rows), tl.ends[0] - (tl.ends[1] - tl.ends[0] if len(tl.ends) > 1 else 0.0)
    starts = [t0, *tl.ends[:-1]]
    return sum(e - s for s, e, b in zip(starts, tl.ends, tl.batch) if b <= cut)
