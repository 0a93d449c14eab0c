"""The streaming sampler's decode steps on vLLM (generate.engine vllm with generate.streaming): one engine in a
worker process of its own (tasks/engines/vllm_offline.py's, the protocol's `stream` and `reload` requests in
tasks/engines/vllm_worker.py) that keeps the batch's rows as running requests, up to STEPS engine steps per
worker request (fewer when a row finishes).

    decoder = VLLMDecoder(cfg, params)        # Stream's decoder (tasks/engines/hf_stream.py: HFDecoder's twin)
    decoder.load(key, path)                   # the first call starts the engine; later ones load in place
    decoder.step_batch(rows, version, stop)   # rows join as requests, decode until done or `stop`

Interruption: a newer policy (full weights: vLLM's in-place reload; LoRA: the next version's adapter) is loaded
with the running requests aborted, their tokens kept in their rows; at the next step each continues as a new
request whose prompt is its prompt and its tokens so far, so their KV cache is computed again under the new
weights and every later token is exactly the new version's. Nothing decoded is discarded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.contracts import SamplingParams
from tasks.core.models import load_tokenizer, stop_token_ids
from tasks.engines.vllm_offline import OfflineSession, lora_id, model_of, request_seed

if TYPE_CHECKING:
    from tasks.core.config import Config

EXTENSION = "tasks.engines.vllm_worker.WorkerExtension"     # its rlflow_reload_weights: the in-place load
STEPS = 8       # engine steps per worker request at most (fewer when a row finishes): a newer policy waits <= 8


class VLLMDecoder:
    """The streaming sampler's rows as running requests of one vLLM engine (its worker: an OfflineSession)."""

    def __init__(self, cfg: Config, params: SamplingParams):
        self.cfg, self.params = cfg, params
        self.session: OfflineSession | None = None
        self.running: dict[str, object] = {}     # request id -> its row (tasks/engines/streaming.py: Row)
        self.made = 0                            # requests made (each one's id and seed)
        self.reloads: list[float] = []           # each in-place load's seconds (abort, load, cache emptied)

    def load(self, key: str, path: str) -> None:
        """Policy `key` (at `path`) in the engine: started with it, or loaded in place with the running requests
        aborted (each continues from its tokens at the next step, under the new weights)."""
        if self.session is None:
            self.session = OfflineSession(self.cfg, key, path, load_tokenizer(path), worker_extension_cls=EXTENSION)
            return
        _, adapter = model_of(self.cfg, key, path)
        if adapter:
            self.session.lora = {"name": Path(key).name, "id": lora_id(key), "path": path}
        self.reloads.append(self.session.ask({"reload": None if adapter else path, "abort": list(self.running)})
                            ["seconds"])
        self.running.clear()

    def step_batch(self, rows: list, version: int, stop) -> bool:
        """Decode `rows` under policy `version` (the one loaded) until one has finished, or `stop(finished,
        rows)` says so after a worker request (up to STEPS engine steps); True when stopped with rows unfinished.
        Rows not running join as requests (their prompt and tokens so far, the tokens left of their limit);
        running requests whose rows left are aborted."""
        gc, tok = self.cfg.generate, self.session.tokenizer
        mine = {id(r) for r in rows}
        abort = [rid for rid, r in self.running.items() if id(r) not in mine]
        for rid in abort:
            del self.running[rid]
        running = {id(r) for r in self.running.values()}
        add = []
        for r in rows:
            if id(r) not in running:
                rid, self.made = str(self.made), self.made + 1
                limit = gc.max_completion_length if r.limit is None else r.limit
                add.append([rid, r.prompt + r.tokens, limit - len(r.tokens), request_seed(self.params.seed, self.made),
                            r.sampling or {}])
                self.running[rid] = r
        sampling = {"temperature": self.params.temperature, "top_p": self.params.top_p, "top_k": self.params.top_k,
                    "stop_token_ids": stop_token_ids(tok)}
        while True:
            out = self.session.ask({"stream": {"add": add, "abort": abort, "lora": self.session.lora,
                                               "sampling": sampling, "steps": STEPS}})
            add, abort = [], []
            for rid, ids, logps, finished, truncated in out["rows"]:
                r = self.running[rid]
                r.tokens += ids
                r.logprobs += logps
                r.versions += [version] * len(ids)
                if finished:
                    r.done, r.truncated = True, truncated
                    del self.running[rid]
            if not self.running:
                return False
            if out["running"] != len(self.running):
                raise RuntimeError(f"vLLM runs {out['running']} requests, the streaming sampler {len(self.running)}")
            if stop(sum(r.done for r in rows), len(rows)) or any(f for *_, f, _ in out["rows"]):
                return True             # (finished rows leave at once: the running requests go on, nothing refilled)

    def close(self) -> None:
        """The engine's worker ended (a stopped sampler: its running requests with it)."""
        if self.session is not None:
            self.session.close()
            self.session, self.running = None, {}
