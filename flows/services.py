"""The services a flow run starts beside its stages and keeps up while it lasts, and Launchers, what the flow
holds for a run: each stage's launcher (flows/launch.py: Local, Sky; None for inline stages) and these services,
ended together with the flow (close).

    EnvServer      env.where: local | sky: the environment server(s) the episodes talk to (tasks/envs/runtime/server.py;
                   env.servers > 1: a pool of them behind one front, tasks/envs/runtime/pool.py)
    JudgeServers   reward.models with where: local | sky: a judge server per model (tasks/scoring/judge_server.py)
    spawn_server   one server process here (tasks/core/fleet.py: start_server), not starting being an InfraError
    Launchers      the launcher of each stage, the services above, and generate.replicas' launch command on sky;
                   `services(stage)`: a stage's context (tasks/core/placement.py: Services)

Each service is started at the first stage that needs it and checked before each one: one that stopped
answering (its process died, its spot cluster was preempted) is started again, so the retry finds it up.

More: docs/internals.md (flows/services.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import TYPE_CHECKING

from flows.launch import BRIDGE, InfraError, Local, Sky, recipe_path
from tasks.core.errors import UserError
from tasks.core.fleet import DidNotStart, Starts, bearer, start_server
from tasks.core.placement import Services, placement_of
from tasks.envs.runtime.server import READY, TOKEN_VAR

if TYPE_CHECKING:
    from collections.abc import Callable

    from tasks.core.config import Config


class EnvServer:
    """env.where: local | sky (or a URL of yours): the environment server the episodes of generate and evaluate
    talk to (tasks/envs/runtime/server.py). Started at the first stage that needs it and checked before each one: a
    server that stopped answering (its process died, its spot cluster was preempted) is started again, so the
    retry of a stage that failed with it finds it up. The stages get its URL and token in their context
    (tasks/core/placement.py: Services): they are the run's, not the config's, and a new server after a
    preemption has another address. Ended with the flow: its process, or its cluster (Sky.close).

    env.servers: N > 1 (a pool): N servers, processes here or a cluster each (<cluster>-env-<i>, port
    env.server_port + 1 + i), behind one front (tasks/envs/runtime/pool.py) whose URL the stages get. The front runs
    where the stages can reach it: here when they run here (env.where: local, or every episode stage on this
    machine), else on a cluster of its own (<cluster>-env-front, port env.server_port). This object owns the
    members: a thread reads the front's /health every WATCH_SECONDS, starts a new member for each one the front
    lost (or reuses it, with a new generation, if it answers again) and sends the front the table."""

    READY_SECONDS = 600.0           # from start to answering: imports, the factory's preflight, a forkserver
    WATCH_SECONDS = 1.0             # env.servers > 1: how often the pool's health is read

    def __init__(self, cfg: Config, config_path: str, overrides: list[str], sky: Sky):
        import secrets

        self.cfg, self.config_path, self.overrides, self.sky = cfg, config_path, list(overrides), sky
        self.placement = placement_of(cfg)      # env: yours (a URL) | local | sky; env_servers
        self.url = cfg.env.url                  # (env.where a URL: yours, its address; else the flow's server's)
        self.token = os.environ.get(TOKEN_VAR, "") if self.url else secrets.token_urlsafe(24)
        self.proc = None                # env.servers 1: the server's process (env.where: local); N: the front's
        self.lock = threading.RLock()
        self.tail: list[str] = []
        # env.servers > 1: per member {"url", "proc", "generation", "starts"}; generation counts its replacements
        # (the front tells a replaced member's episodes from the new one's by it); starts: tasks/core/fleet.py
        self.members: list[dict] = []
        self.watcher: threading.Thread | None = None
        self.stopping = threading.Event()
        self.log = print
        self.stalled = False            # a stage's every episode timed out: started again before its retry

    def answers(self) -> bool:
        from tasks.core.daemon import answers_http

        return bool(self.url) and answers_http(f"{self.url.rstrip('/')}/health", timeout=10)

    def services(self, log) -> Services:
        """The server's URL and token for a stage, after making sure it answers."""
        with self.lock:
            self.stopping.clear()
            self.log = log
            place = self.placement
            if self.stalled and place.env != "yours":
                event(log, "every episode of the last stage timed out: starting the environment server(s) again")
                self.stalled = False
                if place.env_servers > 1:
                    self._replace(list(range(len(self.members))), log, force=True)
                elif place.env == "local":
                    self.url = self._start_local(log)
                else:
                    self.url = self._start_sky(log)
            if place.env_servers > 1 and place.env != "yours":
                self._pool(log)
            elif not self.answers():
                if place.env == "yours":
                    raise InfraError(f"the environment server at {self.url} (env.where) does not answer")
                if self.url:
                    event(log, f"the environment server at {self.url} stopped answering: starting it again")
                self.url = self._start_local(log) if place.env == "local" else self._start_sky(log)
            return Services(env_url=self.url, env_token=self.token)

    def _argv(self, module: str = "tasks.envs.runtime.server") -> list[str]:
        return ["-m", module, "--config", self.config_path, "--overrides-json",
                json.dumps(self.overrides), "--idle-minutes", str(self.cfg.launcher.idle_minutes_to_autostop)]

    def _start_local(self, log) -> str:
        self._end(self.proc)
        self.proc, url = self._spawn("tasks.envs.runtime.server", "environment server", "env server", log)
        return url

    def _spawn(self, module: str, name: str, short: str, log):
        """`python -m module` here (a free port, ended with the flow): (its process, its URL) once it answers. Its
        output goes to the flow's log after `short`."""
        proc, url, self.tail = spawn_server([*self._argv(module), "--port", "0", "--exit-with-parent"],
                                            {TOKEN_VAR: self.token}, READY, name, short, log, self.READY_SECONDS)
        return proc, url

    def _sky_env(self, port: int, **more) -> dict:
        return {"CONFIG": self.config_path, "OVERRIDES": json.dumps(self.overrides), "PORT": port,
                TOKEN_VAR: self.token, "IDLE_MINUTES": self.cfg.launcher.idle_minutes_to_autostop, **more}

    def _start_sky(self, log) -> str:
        return self.sky.serve("env", self.cfg.env.server_port, int(self.READY_SECONDS),
                              self._sky_env(self.cfg.env.server_port), log)

    @staticmethod
    def _end(proc) -> None:
        if proc is not None:
            from tasks.core.processes import kill_group

            kill_group(proc)

    def stop(self) -> None:
        self.stopping.set()
        held = self.lock.acquire(timeout=60)      # (a replacement under way ends first; its new process too)
        try:
            for proc in [self.proc, *(m["proc"] for m in self.members)]:
                self._end(proc)
            self.proc = None
            for m in self.members:
                m["proc"] = None
        finally:
            if held:
                self.lock.release()

    # ------------------------------------------------------------------------------------------ env.servers > 1

    def _front_here(self) -> bool:
        """The pool's front on this machine: env.where local, or every stage with episodes runs here."""
        place = self.placement
        stages = ["generate"] + (["evaluate"] if self.cfg.eval.every else [])
        return place.env == "local" or bool(place.replicas) or all(place.where(s) != "sky" for s in stages)

    def _pool(self, log) -> None:
        """Every member answering (a lost one started again), the front answering (started again if it does not),
        and the front holding the members' table; the watcher started."""
        from concurrent.futures import ThreadPoolExecutor

        from tasks.core.daemon import answers_http

        if not self.members:
            self.members = [{"url": None, "proc": None, "generation": -1, "starts": Starts()}
                            for _ in range(self.placement.env_servers)]
        front = self._front_health()
        with ThreadPoolExecutor(min(len(self.members), 32)) as ex:
            answering = list(ex.map(lambda m: bool(m["url"]) and answers_http(f"{m['url']}/health", timeout=10),
                                    self.members))
        lost = [i for i, ok in enumerate(answering) if not ok or not self._alive(i, front)]
        self._replace(lost, log, first=True)
        if not any(m["url"] for m in self.members):
            raise InfraError(f"none of the {len(self.members)} environment servers of the pool started, the last: "
                             f"{self.members[-1]['starts'].error}")
        if front is None:
            if self.url:
                event(log, f"the environment pool's front at {self.url} stopped answering: starting it again")
            self.url = self._start_front(log)
        self._tell_front()
        if self.watcher is None or not self.watcher.is_alive():
            self.watcher = threading.Thread(target=self._watch, daemon=True, name="env-pool-watch")
            self.watcher.start()

    def _start_front(self, log) -> str:
        if self._front_here():
            self._end(self.proc)
            self.proc, url = self._spawn("tasks.envs.runtime.pool", "environment pool's front", "env pool", log)
            return url
        return self.sky.serve("env", self.cfg.env.server_port, int(self.READY_SECONDS),
                              self._sky_env(self.cfg.env.server_port, ROLE="front"), log, member="front")

    def _start_member(self, i: int, log) -> tuple:
        if self.placement.env == "local":
            return self._spawn("tasks.envs.runtime.server", f"environment server {i}", f"env server {i}", log)
        port = self.cfg.env.server_port + 1 + i
        return None, self.sky.serve("env", port, int(self.READY_SECONDS), self._sky_env(port), log, member=str(i))

    def _replace(self, lost: list[int], log, first: bool = False, force: bool = False) -> None:
        """Start members `lost` again (at once, in threads): a new generation each. One that still answers (the
        front lost it: a dropped connection) is kept as it is, with the new generation. A user error (the
        factory's preflight) is raised; one that did not start is left out, tried again by the watcher."""
        from concurrent.futures import ThreadPoolExecutor

        from tasks.core.daemon import answers_http

        def one(i: int):
            m = self.members[i]
            alive = m["proc"] is None or m["proc"].poll() is None
            if not force and m["url"] and alive and answers_http(f"{m['url']}/health", timeout=10):
                event(log, f"environment server {i} of the pool answers again: kept, its open episodes failed")
                return None
            self._end(m["proc"])
            m["proc"], m["url"] = None, None
            if self.stopping.is_set():
                return None
            proc, url = self._start_member(i, log)
            if self.stopping.is_set():
                self._end(proc)
                return None
            m["proc"], m["url"] = proc, url
            return None

        if not lost:
            return
        if not first or any(self.members[i]["generation"] >= 0 for i in lost):
            event(log, f"environment servers {lost} of the pool lost: replacing them")
        with ThreadPoolExecutor(min(len(lost), 32)) as ex:
            futures = {i: ex.submit(one, i) for i in lost}
        said = None
        for i, f in futures.items():
            m = self.members[i]
            if (e := f.exception()) is None:
                if m["url"]:
                    m["generation"] += 1      # (the first start: generation 0)
                    m["starts"].started()
                continue
            if isinstance(e, UserError):
                said = said or e
            m["starts"].failure(e)
            event(log, f"environment server {i} of the pool did not start: {e}")
        if said is not None:
            raise said

    def _front_health(self) -> dict | None:
        import httpx

        if not self.url:
            return None
        try:
            r = httpx.get(f"{self.url}/health", timeout=10)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _alive(self, i: int, front: dict | None) -> bool:
        """Member i, as far as the flow knows without asking it: started, its process running (here), and live at
        the front with its generation."""
        m = self.members[i]
        if not m["url"] or (m["proc"] is not None and m["proc"].poll() is not None):
            return False
        if front is None:
            return True
        seen = (front.get("members") or [])[i:i + 1]
        return bool(seen) and seen[0]["live"] and seen[0]["generation"] == m["generation"]

    def _tell_front(self) -> dict:
        import httpx

        table = [{"url": m["url"], "generation": max(m["generation"], 0)} for m in self.members]
        try:
            r = httpx.put(f"{self.url}/pool/members", json={"members": table}, timeout=30,
                          headers=bearer(self.token))
            r.raise_for_status()
            return r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise InfraError(f"the environment pool's front at {self.url} did not take its members: {e}") from None

    def _watch(self) -> None:
        """While the run lasts: each member the front lost (or whose process ended) is replaced, and the front told."""
        while not self.stopping.wait(self.WATCH_SECONDS):
            if (front := self._front_health()) is None:
                continue                  # the front itself: started again before the next stage (env)
            if all(self._alive(i, front) for i in range(len(self.members))):
                continue
            with self.lock:               # (read again under the lock: env() may have replaced them meanwhile)
                if self.stopping.is_set() or (front := self._front_health()) is None:
                    continue
                lost = [i for i in range(len(self.members))
                        if not self._alive(i, front) and self.members[i]["starts"].due()]
                if not lost:
                    continue
                try:
                    self._replace(lost, self.log)
                    self._tell_front()
                except Exception as e:  # noqa: BLE001 - tried again on the next round; env() raises what stays
                    event(self.log, f"environment pool: replacing {lost} failed: {e}")


class Told:
    """Where a fleet's lines go when the flow runs it: each to the flow's log (`log`), and its events (a member
    lost, replaced, started again, one that did not start) to the console too (`note`), as they happen: a user
    watching the run learns of a member lost when it is, not from a log file afterwards."""

    def __init__(self, log: Callable[[str], object], note: Callable[[str], object]):
        self.log, self.note = log, note

    def __call__(self, line: str) -> None:
        self.log(line)

    def event(self, line: str) -> None:
        self.log(line)
        self.note(line)


def event(log: Callable[[str], object], line: str) -> None:
    """A fleet event: Told.event when the flow gave one, else just the line to `log`."""
    (log.event if isinstance(log, Told) else log)(line)


def spawn_server(argv: list[str], env: dict[str, str], ready: str, name: str, short: str, log,
                 timeout: float, python: str = sys.executable) -> tuple:
    """tasks/core/fleet.py: start_server, a member that did not start being an infrastructure failure (retried).
    (The environment server, its pool's members and front, the judge servers.)"""
    try:
        return start_server(argv, env, ready, name, short, log, timeout, python)
    except DidNotStart as e:
        raise InfraError(str(e)) from None


class JudgeServers:
    """reward.models with where: local | sky: a judge server per model (tasks/scoring/judge_server.py) that the
    reward and evaluate stages ask, as EnvServer serves the environments: started at the first stage that needs
    it, checked before each one and started again when it stopped answering (its process died, its spot cluster
    was preempted), so the retry of a stage that failed with it (JudgeUnavailable) finds it up and asks only what
    the answer cache lacks. Local: a process here (engine vllm: in the vLLM environment's interpreter); sky: a
    cluster per model (<cluster>-judge-<name>, sky/judge.yaml, its port). The stages get the URLs ({name: url})
    and the run's token in their context (Services). Ended with the flow."""

    READY_SECONDS = 900.0          # imports, the model's load (a GGUF converted once), vLLM's start

    def __init__(self, cfg: Config, config_path: str, overrides: list[str], sky: Sky):
        import secrets

        self.cfg, self.config_path, self.overrides, self.sky = cfg, config_path, list(overrides), sky
        self.placement = placement_of(cfg)
        served = self.placement.served_judges()         # where: local | sky, by name
        self.specs = [m for m in cfg.reward.models if m.name in served]
        self.token = secrets.token_urlsafe(24)
        self.urls: dict[str, str] = {}
        self.procs: dict[str, object] = {}
        self.lock = threading.Lock()

    def services(self, log) -> Services:
        """The judge servers' URLs and token for a stage, after making sure each answers."""
        from tasks.core.daemon import answers_http

        with self.lock:
            for spec in self.specs:
                url = self.urls.get(spec.name)
                if url and answers_http(f"{url}/health", timeout=10):
                    continue
                if url:
                    event(log, f"the judge server of {spec.name} at {url} stopped answering: starting it again")
                self.urls[spec.name] = self._start(spec, log)
            return Services(judges=dict(self.urls), judge_token=self.token)

    def _start(self, spec, log) -> str:
        from tasks.core.placement import JUDGE_TOKEN_VAR as JUDGE_TOKEN
        from tasks.scoring.judges import READY as JUDGE_READY

        idle = str(self.cfg.launcher.idle_minutes_to_autostop)
        if self.placement.judges[spec.name] == "sky":
            return self.sky.serve("judge", spec.port, int(self.READY_SECONDS), {
                "CONFIG": self.config_path, "OVERRIDES": json.dumps(self.overrides), "MODEL": spec.name,
                "ENGINE": spec.engine, "PORT": spec.port, JUDGE_TOKEN: self.token, "IDLE_MINUTES": idle},
                log, member=spec.name)
        EnvServer._end(self.procs.pop(spec.name, None))
        python, resolved = sys.executable, []
        if spec.engine == "vllm":      # (resolved and pin-checked here: the vLLM environment cannot read GGUF files)
            from tasks.engines.vllm_offline import installed_python
            from tasks.scoring.judges import model_path

            python = installed_python(self.cfg, f"reward.models ({spec.name}).engine: vllm")
            resolved = ["--model-path", model_path(self.cfg, spec, f"reward.models ({spec.name})")]
        proc, url, _ = spawn_server(["-m", "tasks.scoring.judge_server", "--config", self.config_path,
                                     "--overrides-json", json.dumps(self.overrides), "--model", spec.name,
                                     "--port", "0", "--exit-with-parent", "--idle-minutes", idle, *resolved],
                                    {JUDGE_TOKEN: self.token}, JUDGE_READY, f"judge server ({spec.name})",
                                    f"judge {spec.name}", log, self.READY_SECONDS, python)
        self.procs[spec.name] = proc
        return url

    def stop(self) -> None:
        with self.lock:
            for proc in self.procs.values():
                EnvServer._end(proc)
            self.procs.clear()


class Launchers:
    """The launcher of each stage, where the run's placement says (tasks/core/placement.py: launcher.mode /
    launcher.stages); None for inline stages (the flow calls the stage function itself)."""

    def __init__(self, cfg: Config, config_path: str = "", overrides: list[str] | None = None):
        self.cfg, self.config_path, self.overrides = cfg, config_path, list(overrides or [])
        self.placement = placement_of(cfg)
        self._by_mode = {"local": Local(cfg), "sky": Sky(cfg)}
        self.env_server = (EnvServer(cfg, config_path, overrides or [], self._by_mode["sky"])
                           if self.placement.env_remote() else None)
        self.judges = JudgeServers(cfg, config_path, overrides or [], self._by_mode["sky"])
        self.note: Callable[[str], object] | None = None    # the console (the flow sets it): fleet events (Told)

    def for_stage(self, stage: str):
        if self.placement.routes(stage):
            return None               # the stage only shards and routes, here; its replicas do the sampling
        return self._by_mode.get(self.placement.where(stage))

    def services(self, stage: str, log) -> Services:
        """`stage`'s context: the servers it uses (each checked, started again where it stopped answering) and
        how its router launches replicas."""
        services = Services()
        log = Told(log, self.note) if self.note is not None else log
        if stage in ("generate", "evaluate") and self.env_server is not None:
            services |= self.env_server.services(log)
        if stage in ("reward", "evaluate") and self.judges.specs:
            services |= self.judges.services(log)
        if stage in ("generate", "evaluate"):
            services |= self._replica_launch()
        return services

    def _replica_launch(self) -> Services:
        """generate.replicas with the generate stage on sky: how the router launches replica i (its own cluster
        <prefix>-<run>-replica-<i>, sky/replica.yaml, port generate.replica_port + i); the clusters are the flow's
        to tear down (close). --fresh: a replica launched again on a cluster still up (it hung rather than was
        preempted) first has the hung one's job cancelled, which holds its port. Else nothing: local processes."""
        if self.placement.replicas_where != "sky":
            return Services()
        from tasks.engines.replicas import TOKEN_VAR

        sky, lc, gc = self._by_mode["sky"], self.cfg.launcher, self.cfg.generate
        names = [sky.cluster("replica", str(i)) for i in range(self.placement.replicas)]
        sky.launched.update(names)
        start = [sky.python, str(BRIDGE), "serve", "--cluster", "{cluster}", "--recipe",
                 str(recipe_path(self.cfg, "replica")), "--port", "{port}", "--wait", str(int(gc.server_start_timeout)),
                 "--idle-minutes", str(lc.idle_minutes_to_autostop), "--launch", "--fresh",
                 f"--env=CONFIG={self.config_path}", f"--env=OVERRIDES={json.dumps(self.overrides)}",
                 "--env=PORT={port}", f"--env={TOKEN_VAR}={{token}}"]
        if lc.accelerators.get("generate"):
            start += ["--accelerators", lc.accelerators["generate"]]
        return Services(replica_launch={"start": start, "port_base": gc.replica_port, "clusters": names})

    def close(self, log) -> None:
        if self.env_server is not None:
            self.env_server.stop()
        self.judges.stop()
        for launcher in self._by_mode.values():
            launcher.close(log)
