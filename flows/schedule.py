"""The look-ahead schedule: generate and reward of later iterations started beside this iteration's train
(run.max_staleness), so the loop (flows/training.py) asks one thing per iteration, `ahead.take(it)`, and gets
generate's and reward's results of `it` whatever S is.

    ahead = Ahead(stage, ctx, first=1, now=NOW)
    g, r = ahead.take(it)     # S > 0: generate and reward of it+1..it+S start now, beside train(it); with
                              # generate.dynamic_sampling, as many rounds of both as the batch needs
    ...
    ahead.drain()             # the flow failed: wait for what still runs, so nothing writes after the flow ends

Which policy samples iteration N is fixed by the schedule (tasks/core/layout.py: behaviour_policy), never by
timing: v(N-1-S). docs/design-notes.md, "Generation beside training: a schedule, not a race".
"""

from __future__ import annotations

from tasks.core import layout


class Ahead:
    """Generate and reward, run ahead of train by run.max_staleness (S) iterations. Iteration N samples from
    v(N-1-S) (tasks/core/layout.py: behaviour_policy), published by the time iteration N-S trains, so when N
    trains the stages of N+1..N+S run beside it: Prefect task futures on the flow's task runner (threads), each
    stage on its own launcher, generates one after another and rewards one after another (a lane each). Which
    policy samples an iteration never depends on timing. S = 0: plain calls when the iteration asks, as before.
    `stage` is the flow's stage task (flows/repair.py: Repair), `ctx` its Run, `now` the dict where the loop
    says which stage it waits for (what an interrupted run reports). `stored`: the last iteration an earlier
    attempt of the run left outputs of (a resume): nothing runs ahead of one of those until its own stages have
    been checked against this config, so a resume the train stage refuses (a config edited) has written nothing
    of a later iteration first."""

    def __init__(self, stage, ctx, first: int, now: dict, stored: int = 0):
        self.stage, self.ctx, self.next, self.now, self.stored = stage, ctx, first, now, stored
        self.S, self.last = ctx.cfg.run.max_staleness, ctx.cfg.run.iterations
        self.gen: dict = {}
        self.rew: dict = {}

    def take(self, it: int) -> tuple[dict, dict]:
        """Generate's and reward's results of iteration `it` (waiting for them), after starting those of the
        iterations up to it+S (up to `it` alone while `it` is one an earlier attempt stored)."""
        run = self.ctx.cfg.run.name
        if self.S == 0:
            self.now.update(stage="generate")
            policy = layout.behaviour_policy(run, it, 0)
            g = self.stage("generate", it, self.ctx, policy)
            self.now.update(stage="reward")
            return self._rounds(it, policy, g, self.stage("reward", it, self.ctx))
        while self.next <= min(it if it <= self.stored else it + self.S, self.last):
            m = self.next
            self.gen[m] = self.stage.submit("generate", m, self.ctx, layout.behaviour_policy(run, m, self.S),
                                            wait_for=[self.gen[m - 1]] if m - 1 in self.gen else None)
            self.rew[m] = self.stage.submit("reward", m, self.ctx,
                                            wait_for=[self.gen[m]] + ([self.rew[m - 1]] if m - 1 in self.rew else []))
            self.next += 1
        policy = layout.behaviour_policy(run, it, self.S)       # (later ones wait for it+1.. only)
        return self._rounds(it, policy, self.stage.result(self.gen.pop(it), "generate", it, self.ctx, policy),
                            self.stage.result(self.rew.pop(it), "reward", it, self.ctx))

    def _rounds(self, it: int, policy: str, g: dict, r: dict) -> tuple[dict, dict]:
        """generate.dynamic_sampling: more rounds of generate and reward of iteration `it`, from the same policy,
        until reward says the batch is complete (tasks/reward.py); then generate's results of every round as
        one (their seconds summed). Rounds after the first run here, in the loop's thread: the look-ahead
        lanes carry the first rounds only."""
        rounds = [g]
        while not r.get("complete", True):
            n = len(rounds)
            self.now.update(stage=f"generate round {n}")
            rounds.append(self.stage("generate", it, self.ctx, policy, round=n))
            self.now.update(stage=f"reward round {n}")
            r = self.stage("reward", it, self.ctx, round=n)
        if len(rounds) == 1:
            return g, r
        metrics = dict(g["metrics"])
        for later in rounds[1:]:
            for name, value in later["metrics"].items():
                if name.endswith("seconds") or name.startswith("cost/"):
                    metrics[name] = metrics.get(name, 0.0) + value
        return {**g, "metrics": metrics}, r

    def drain(self) -> None:
        """Wait for every stage still running (a failed iteration's neighbours): retried or failed, they end."""
        for future in [*self.gen.values(), *self.rew.values()]:
            try:
                future.wait()
            except BaseException:   # noqa: BLE001 - the error that ended the flow is the one to report
                pass
