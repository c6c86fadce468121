"""Handles on vLLM engines an RL stack owns: a running server (VllmServer) or a user's own vllm.LLM (attach). The
tracker publishes to them as to its own engines (the drafter side of the RolloutEngine contract):

    servers = [VllmServer("http://10.0.0.5:8000", api_key=KEY), VllmServer("http://10.0.0.6:8000", api_key=KEY)]
    tracker = DraftTracker.from_recipe("eagle3_track", policy=policy, engines=servers)   # binds: checks each one
    ... the stack's own rollouts on those servers; tracker.on_policy_update(policy, step) publishes v+1 to each
    engine = attach(llm)                                   # the same for a vllm.LLM built in this process

What a handle does (drafttrain's vLLM plugin answers on the engine's side; the launcher: python -m drafttrain.serve):
- bind(policy, drafter): the engine must serve this policy (vocabulary, hidden size) with a drafter of the
  tracker's kind and shapes; one-line ValueError otherwise. drafttrain's weight transport is set up in the engine.
- load_drafter(weights, version): checked as the embedded engine checks, pushed by vLLM's native draft weight update,
  read back through the worker's kernels (a push that did not land puts the served weights back), and the version
  stored in the worker; drafter_version is read back from it.
- A server that does not answer is reported in one line and skipped (load_drafter does not raise); a watcher thread
  (every watch_s) gives it the current drafter once it answers again. It also catches a drafter that vanished: a
  server restarted (its version reads back as none) or woken from a level-2 sleep or otherwise rewritten (the probe
  of its weights no longer matches what was pushed); either is re-pushed, with one line.
- spec_since_swap(version): mean accepted length and verify steps from the engine's own spec-decode counters since
  that version was pushed: what the publisher's canary judges a server by (hotswap.Publisher.poll).
Self-drafters (selfquant) and the suffix drafter are served only by drafttrain's own engines.
"""
from __future__ import annotations

import threading

from drafttrain.engines.base import StaleVersionError
from drafttrain.engines.vllm_link import HttpLink, LocalLink, ServerDown
from drafttrain.engines.vllm_transfer import read_back, swap_drafter
from drafttrain.engines.vllm_worker import vllm_name


class _Handle:
    remote = True  # the publisher pushes to several of these at once

    def __init__(self, link, policy=None, drafter=None, watch_s: float = 2.0, log=print):
        self.link, self.url, self.log = link, link.url, log
        self.lock = threading.RLock()  # held by every push: hold it to keep pushes out of a generate
        self._version, self._wanted = 0, None  # what it serves; (weights, version) it should serve
        self._served: dict = {}
        self._down = False
        self._baseline = None  # (version, spec counters at its push)
        self.template = self.form = None
        self.worker_info: dict = {}
        self._stop = threading.Event()
        self._watch_s = watch_s
        self._watcher = None
        if policy is not None and drafter is not None:
            self.bind(policy, drafter)

    # ---- set-up ---------------------------------------------------------------------------------------------
    def bind(self, policy, drafter=None) -> None:
        """Check the engine against the tracker's policy and drafter (one-line ValueError naming what differs), set
        up drafttrain's weight transport in it, and start watching it (drafter None: the policy check and the
        transport only, for a stack that pushes policy weights alone)."""
        from drafttrain.engines.vllm_forms import form_of

        info = self._info(f"{self.url}: does not answer")
        cfg = policy.config
        for key in ("vocab_size", "hidden_size"):
            if int(info[key]) != int(getattr(cfg, key)):
                raise ValueError(f"{self.url}: serves another policy: {key} {info[key]}, the tracker's policy has "
                                 f"{getattr(cfg, key)}")
        self.worker_info = info
        self._enable_transfer()
        if drafter is None:
            return
        if not info.get("method"):
            raise ValueError(f"{self.url}: serves no drafter (started without --speculative-config); start it with "
                             f"python -m drafttrain.serve POLICY --drafter DRAFTER")
        self.form = form_of(drafter.kind)
        if self.form.method != info["method"] or getattr(drafter, "follows_policy", False):
            raise ValueError(f"{self.url}: serves a {info['method']!r} drafter; drafter.kind={drafter.kind} is "
                             f"vLLM's {self.form.method!r}" + ("" if self.form.method != info["method"] else
                                                             " and is swapped only in drafttrain's own engines"))
        self.template = self.form.template(drafter)
        _check_shapes(self.url, self._drafter_tensors(self.form.tensors(self.template)), info, self.form.eagle_names)
        sd = self.form.tensors(self.template)
        self._fixed = {n: sd[n].clone() for n in info["drafter_shared"] if n in sd}
        self._version = int(info["drafter_version"] or 0)
        self._served = {n: t.detach().clone() for n, t in self._drafter_tensors(sd).items()}
        self.watch(self._watch_s)

    def watch(self, interval_s: float) -> None:
        """check() every interval_s in a daemon thread (started once; 0: not watched)."""
        self._watch_s = interval_s
        if interval_s and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"drafttrain-watch-{self.url}")
            self._watcher.start()

    def _enable_transfer(self) -> None:
        backend = self.link.rpc("dt_enable_transfer")["backend"]
        if backend != "InlineWeightTransferEngine":
            raise ValueError(f"{self.url}: its weight transfer backend is {backend}; drafttrain pushes drafters "
                             f"with its own (drafttrain_inline): start the server without --weight-transfer-config")

    def _info(self, down: str) -> dict:
        try:
            return self.link.rpc("dt_info")
        except ServerDown:
            raise ValueError(down) from None
        except NotImplementedError:
            raise ValueError(f"{self.url}: its vLLM workers lack drafttrain's methods (drafttrain is not installed "
                             f"where the server runs, or VLLM_PLUGINS leaves its plugin out)") from None

    def _drafter_tensors(self, sd: dict) -> dict:
        drop = set(self.worker_info["drafter_shared"]) | {"t2d"}
        if not self.worker_info["drafter_has_d2t"]:
            drop.add("d2t")
        return {n: t for n, t in sd.items() if n not in drop}

    # ---- the contract's drafter side ------------------------------------------------------------------------
    @property
    def drafter_version(self) -> int:
        return self._version

    def rpc(self, method: str, *args):  # read_back's and swap_drafter's way in
        return self.link.rpc(method, *args)

    def _push(self, weights: dict, draft: bool) -> None:
        self.link.push(weights, draft)

    def load_drafter(self, weights: dict, version: int) -> None:
        """Swap, read back, version stored in the engine. A server that does not answer is skipped with one line
        (it gets this drafter when it answers again); refusals (StaleVersionError, ValueError) raise."""
        if self.template is None:
            raise ValueError(f"{self.url}: load_drafter before bind(policy, drafter) (DraftTracker binds its engines)")
        with self.lock:
            if version <= max(self._version, self._wanted[1] if self._wanted else -1):
                raise StaleVersionError(f"load_drafter: version {version} is not newer than the served version "
                                        f"{self._version}")
            self._wanted = ({n: t.detach().to("cpu", copy=True) for n, t in weights.items()}, version)
            self._deliver("")

    def reset_drafter(self, weights: dict, version: int = 0) -> None:
        """Serve `weights` as `version` whatever the server served before (an earlier run's drafter, a newer version):
        a fresh start. A server that does not answer raises ServerDown."""
        with self.lock:
            self._wanted = ({n: t.detach().to("cpu", copy=True) for n, t in weights.items()}, version)
            self._deliver("")
            if self._down:
                raise ServerDown(f"{self.url} does not answer")

    def _deliver(self, why: str) -> None:
        """Push what the engine should serve; a server down is reported once and left for the watcher."""
        weights, version = self._wanted
        try:
            self._enable_transfer()  # a restarted server has none set up yet
            swap_drafter(self, weights, version)
            self.link.rpc("dt_drafter_version", version)
            self.link.reset_prefix_cache()
        except ServerDown as e:
            if not self._down:
                self.log(f"[drafttrain] {e}: skipped; it gets drafter v{version} once it answers")
            self._down = True
            return
        self._version, self._down = version, False
        self._baseline = (version, self.link.spec_counters())
        if why:
            self.log(f"[drafttrain] {self.url}: {why}; drafter v{version} pushed again")

    def check(self) -> str | None:
        """One look at the engine: down, back, restarted, its drafter rewritten; re-pushes where needed. Returns
        what it found (None: all well)."""
        with self.lock:
            if self._wanted is None:
                self._wanted = (self._served, self._version)
            if not self.link.alive():
                if not self._down:
                    self.log(f"[drafttrain] {self.url} does not answer: skipped; it gets drafter "
                              f"v{self._wanted[1]} once it answers")
                self._down = True
                return "down"
            try:
                served = self.link.rpc("dt_drafter_version")["version"]
                why = None
                if self._down:
                    why = "answers again"
                elif served != self._wanted[1] and not (served is None and self._wanted[1] == 0):
                    why = f"serves drafter version {served} (restarted?), not v{self._wanted[1]}"
                elif self._served:
                    try:
                        read_back(self, self._served, draft=True, what="check")
                    except ValueError:
                        why = "its drafter weights changed under it (a level-2 wake or another writer)"
                if why is not None:
                    self._deliver(why)
                return why
            except ServerDown:
                self._down = True
                return "down"

    def _watch(self) -> None:
        last = None
        while not self._stop.wait(self._watch_s):
            try:
                self.check()
                last = None
            except Exception as e:  # noqa: BLE001 - the watcher reports (once per new failure) and keeps watching
                msg = f"[drafttrain] {self.url}: check failed ({type(e).__name__}: {str(e).splitlines()[0]})"
                if msg != last:
                    self.log(msg)
                last = msg

    def spec_since_swap(self, version: int) -> tuple[float, float] | None:
        """(mean accepted length, verify steps) from the engine's spec-decode counters since `version` was pushed;
        None where it counts none or serves another version."""
        base = self._baseline
        if base is None or base[0] != version or base[1] is None or self._down:
            return None
        try:
            now = self.link.spec_counters()
        except ServerDown:
            return None
        drafts, accepted = now[0] - base[1][0], now[1] - base[1][1]
        if drafts <= 0:
            return None
        return 1.0 + accepted / drafts, drafts

    def update_policy(self, policy=None) -> None:
        """The stack pushes its own policy weights into its engines (drafttrain's rollout engine over servers:
        engines/vllm_server_engine.py)."""

    def close(self) -> None:
        self._stop.set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, drafter_version={self._version})"


class VllmServer(_Handle):
    """A running vLLM server (python -m drafttrain.serve, or any server with drafttrain installed, started with
    VLLM_SERVER_DEV_MODE=1). api_key: the server's key (None: DRAFTTRAIN_API_KEY or VLLM_API_KEY of this process)."""

    def __init__(self, url: str, api_key: str | None = None, policy=None, drafter=None, watch_s: float = 2.0,
                 timeout_s: float = 60.0, log=print):
        import os

        key = api_key or os.environ.get("DRAFTTRAIN_API_KEY") or os.environ.get("VLLM_API_KEY")
        link = HttpLink(url, key, timeout_s)
        if not link.alive():
            raise ValueError(f"{link.url}: does not answer at /health (is the server up? python -m drafttrain.serve "
                             f"starts one)")
        super().__init__(link, policy, drafter, watch_s, log)


def attach(llm, policy=None, drafter=None, log=print) -> _Handle:
    """The handle for a vllm.LLM built in this process (TRL's colocate engine, any script's): call
    bind(policy, drafter) or pass them here (DraftTracker binds its engines). No watcher: the process owns it."""
    return _Handle(LocalLink(llm), policy, drafter, watch_s=0.0, log=log)


def _check_shapes(url: str, tensors: dict, info: dict, eagle: bool) -> None:
    """Each tensor the tracker's drafter pushes must fit the served drafter's parameter (shards of a fused one
    stacked along dim 0); one-line ValueError naming the first that does not."""
    params = {n: tuple(s) for n, s in info["drafter_params"].items()}
    stacked: dict[str, list] = {}
    for name, t in tensors.items():
        theirs, shard = vllm_name(name, eagle)
        stacked.setdefault(theirs, []).append((name, tuple(t.shape), shard))
    for theirs, parts in stacked.items():
        name, shape, shard = parts[0]
        if theirs not in params:
            raise ValueError(f"{url}: its drafter has no tensor for {name} (the tracker's drafter is another "
                             f"architecture)")
        want, got = shape if shard is None else (sum(p[1][0] for p in parts),) + shape[1:], params[theirs]
        if theirs.endswith(("embed_tokens.weight", "lm_head.weight")) and got[1:] == want[1:]:
            got = (want[0],) + got[1:] if want[0] <= got[0] < want[0] + 64 else got  # vLLM pads rows to 64
        if want != got:
            raise ValueError(f"{url}: its drafter's {theirs} has shape {list(params[theirs])}, the tracker's "
                             f"drafter has {list(want)} ({name})")


__all__ = ["ServerDown", "VllmServer", "attach"]
