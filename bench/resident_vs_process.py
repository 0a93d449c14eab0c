"""Iterations that cost their compute: train.mode resident (one trainer process across iterations, lean
checkpoints, a full one every K) against process (a fresh trainer per iteration, a full checkpoint every
iteration), the same config and seeds, side by side on this machine.

    python bench/resident_vs_process.py                                   # ~200M parameters (builtin:medium-lm)
    python bench/resident_vs_process.py --model builtin:tiny-lm --iterations 10     # the demo's size
    python bench/resident_vs_process.py --set publish.dtype=bfloat16       # fp32 training, bf16 policies (GPU)

Both sides run the four stage functions in a loop on a local file store (no Prefect, no MLflow: what differs
is the trainer), 8 completions of <= 4 tokens per iteration, rewards replaced by seeded random numbers (so
every update moves the weights). Printed per mode, over the iterations after the first (which pays the
process mode's and the resident trainer's start alike): wall time per iteration without the reward stage,
its compute (sampling + the optimiser passes, from the stage metrics) and the rest (I/O: loading,
checkpoints, publishing), bytes added to the store's disk per iteration (a linked file counts once); then
the resident trainer is lost (held by this process, train.host auto here: dropped, as a dead process would
lose it; `--host detached`: its process SIGKILLed) and the time until its first new step (restore + replay +
check, the train/restore_seconds metric) is compared with the time to read its newest full checkpoint plus
the replayed compute; then the bytes of a bf16 policy published as a delta
against whole (publish.delta=always: on a file store auto publishes whole). Both modes must publish the same
policies (asserted: bit-identical on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tasks.core import layout, rollout  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.hashing import sha256_file  # noqa: E402
from tasks.core.policy import materialize  # noqa: E402
from tasks.core.store import open_store  # noqa: E402
from tasks.engines import trainer as held_trainers  # noqa: E402
from tasks.engines.detached import state_dir  # noqa: E402
from tasks.engines.trainer import InProcessTrainer  # noqa: E402
from tasks.generate import generate  # noqa: E402
from tasks.publish import publish  # noqa: E402
from tasks.reward import reward  # noqa: E402
from tasks.train import finish_trainer, open_trainer, train  # noqa: E402

CONFIG = ROOT / "configs" / "tiny.yaml"


def overrides(args, work: Path, name: str, mode: str, extra=()) -> list[str]:
    return [f"run.name={name}", f"store.uri={work}/store", f"model.name_or_path={args.model}", f"train.mode={mode}",
            f"train.host={args.host}",
            f"train.checkpoint_every={args.checkpoint_every}", "generate.prompts_per_iteration=2",
            "generate.num_generations=4", "generate.max_completion_length=4", "train.micro_batch_size=8",
            f"train.lr={args.lr}", "train.device=cpu", "publish.register_model=false", *args.set, *extra]


def written(store, keys: list[str], seen: set) -> int:
    """Bytes these (file store) folders added to the disk: a file linked from another one (a whole policy
    published from its checkpoint, a lean checkpoint's policy) counts once."""
    total = 0
    for key in keys:
        for path in (store.path / key).rglob("*") if (store.path / key).is_dir() else ():
            st = path.stat()
            if path.is_file() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def score(cfg, it: int) -> None:
    """The reward stage, then seeded random rewards in its place: a random-init model earns almost none, and
    groups of equal rewards (zero advantages) would leave the weights unchanged, which is not what a run
    that learns publishes (the same numbers in both modes)."""
    reward(cfg, it)
    store, g = open_store(cfg), torch.Generator().manual_seed(it)
    with tempfile.TemporaryDirectory() as tmp:
        store.get_folder(layout.rewards(cfg.run.name, it), Path(tmp) / "in")
        records = rollout.read(Path(tmp) / "in")
        for r in records:
            r.reward = float(torch.rand((), generator=g))
        (Path(tmp) / "out").mkdir()
        rollout.write(records, Path(tmp) / "out")
        store.delete_folder(layout.rewards(cfg.run.name, it))
        store.put_folder(layout.rewards(cfg.run.name, it), Path(tmp) / "out", meta={"iteration": it})


def iteration(cfg, it: int) -> dict:
    run = cfg.run.name
    t0 = time.perf_counter()
    g = generate(cfg, it, layout.BASE if it == 1 else layout.policy(run, it - 1))["metrics"]
    t1 = time.perf_counter()
    score(cfg, it)
    t2 = time.perf_counter()
    t = train(cfg, it)["metrics"]
    publish(cfg, it)
    wall = time.perf_counter() - t0 - (t2 - t1)         # (the reward stage does not differ between the modes)
    compute = g["generate/sampling_seconds"] + t["train/update_seconds"]
    return {"wall": wall, "compute": compute, "io": wall - compute}


def keys_of(run: str, it: int) -> list[str]:
    return [layout.rollouts(run, it), layout.rewards(run, it), layout.checkpoint(run, it), layout.policy(run, it),
            layout.full_checkpoint(run, it)]


def run_mode(args, work: Path, mode: str) -> tuple[list[dict], object]:
    cfg = load_config(CONFIG, overrides(args, work, mode, mode))
    rows = [iteration(cfg, it) for it in range(1, args.iterations + 1)]
    store, deadline = open_store(cfg), time.monotonic() + 300
    fulls = [layout.full_checkpoint(mode, k) for k in range(args.checkpoint_every, args.iterations + 1,
                                                            args.checkpoint_every)]
    while mode == "resident" and time.monotonic() < deadline and not all(store.manifest(k) for k in fulls):
        time.sleep(0.5)                                  # background full checkpoints: counted once committed
    seen: set = set()
    written(store, keys_of(mode, 1), seen)
    for it, row in enumerate(rows[1:], start=2):
        row["bytes"] = written(store, keys_of(mode, it), seen)
    return rows, cfg


def summary(rows: list[dict]) -> dict:
    measured = rows[1:]
    return {k: statistics.mean(r[k] for r in measured) for k in ("wall", "compute", "io", "bytes")}


def resume_after_kill(cfg, iterations: int) -> dict:
    """Lose the resident trainer (detached: SIGKILL its process; held by this process: drop it, as the death of
    the process holding it would); time the next train step against a bare read of the newest full checkpoint
    it restores from (a copy out of the store, verified), plus the compute of the iterations it replays (the new
    step's update seconds for each)."""
    run, store = cfg.run.name, open_store(cfg)
    trainer = open_trainer(cfg)
    if isinstance(trainer, InProcessTrainer):
        held_trainers._HELD.pop(run)[1].close()              # (close lets a background full checkpoint finish)
    else:
        pid = json.loads((state_dir() / f"{run}.json").read_text())["pid"]
        time.sleep(2.0)                                 # let a background full checkpoint finish
        os.kill(pid, signal.SIGKILL)
    from tasks.engines.training import newest_full

    it = iterations + 1
    warm = None
    if not isinstance(trainer, InProcessTrainer):          # as the flow does (flows/training.py: _warm_trainer)
        warm = threading.Thread(target=trainer.prepare, args=(it - 1,))
        warm.start()
    t0 = time.perf_counter()
    generate(cfg, it, layout.policy(run, it - 1))
    score(cfg, it)
    overlapped = time.perf_counter() - t0
    key, full_at = newest_full(store, run, it - 1)
    if key is None:
        raise SystemExit("no full checkpoint to resume from: run more iterations than --checkpoint-every")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store.get_folder(key, Path(tmp))
        read = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = train(cfg, it)["metrics"]
    first_step = time.perf_counter() - t0
    if warm is not None:
        warm.join()
    log = state_dir() / f"{run}.log"
    served = [line for line in (log.read_text().splitlines() if log.exists() else ())
              if line.startswith(f"train {it}: ok in ")]
    replayed = range(full_at + 1, it)
    replayed_compute = len(replayed) * m["train/update_seconds"]     # the same update, by the same trainer
    return {"read_full": read, "first_step": first_step, "replayed": len(replayed),
            "restore": m["train/restore_seconds"], "replayed_compute": replayed_compute,
            "update": m["train/update_seconds"], "served": float(served[-1].split()[-2]) if served else math.nan,
            "host": type(trainer).__name__, "overlapped": overlapped if warm is not None else 0.0}


def delta_bytes(args, work: Path) -> dict:
    """A bf16 policy (what a GPU run publishes) at a real RL learning rate: delta vs whole bytes."""
    cfg = load_config(CONFIG, overrides(args, work, "bf16", "resident",
                                        ["publish.dtype=bfloat16", "train.lr=1e-6", "publish.anchor_every=10",
                                         "publish.delta=always"]))
    for it in (1, 2, 3):
        iteration(cfg, it)
    finish_trainer(cfg)
    store = open_store(cfg)
    whole = store.manifest(layout.policy("bf16", 1))
    delta = store.manifest(layout.policy("bf16", 3))
    return {"whole": sum(f["size"] for f in whole["files"].values()),
            "delta": sum(f["size"] for f in delta["files"].values()), "is_delta": "anchor" in delta["meta"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:medium-lm")
    ap.add_argument("--iterations", type=int, default=11)
    ap.add_argument("--checkpoint-every", type=int, default=10)     # train.checkpoint_every's default
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--host", default="auto", help="train.host of the resident side (auto: caller, in this process)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for both modes, e.g. publish.dtype=bfloat16 (a GPU run's default)")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"model {args.model}; {args.iterations} iterations (the first not counted); "
          f"resident: a full checkpoint every {args.checkpoint_every}; overrides {args.set}")
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-") as tmp:
        os.environ["RLFLOW_CACHE"] = str(Path(tmp) / "cache")
        work = Path(tmp)
        process_rows, _ = run_mode(args, work, "process")
        resident_rows, cfg = run_mode(args, work, "resident")
        store = open_store(cfg)
        for it in range(1, args.iterations + 1):                 # (a delta names its run's anchor: rebuild)
            a, b = (sha256_file(materialize(store, layout.policy(m, it)) / "model.safetensors")
                    for m in ("process", "resident"))
            assert a == b, f"iteration {it}: the modes published different weights"
        p, r = summary(process_rows), summary(resident_rows)
        print("\n| mode | wall s/iter | compute s/iter | I/O s/iter | MB written/iter |")
        print("|---|---:|---:|---:|---:|")
        for name, s in (("process", p), ("resident", r)):
            print(f"| {name} | {s['wall']:.2f} | {s['compute']:.2f} | {s['io']:.2f} | {s['bytes'] / 1e6:.1f} |")
        print(f"\nresident vs process: {p['wall'] / r['wall']:.2f}x faster per iteration; I/O "
              f"{p['io'] / max(r['io'], 1e-9):.2f}x less; {p['bytes'] / max(r['bytes'], 1):.2f}x fewer bytes")
        k = resume_after_kill(cfg, args.iterations)
        bound = 1.2 * k["read_full"] + k["replayed_compute"]
        print(f"resume of a lost trainer ({k['host']}): {k['restore']:.2f} s until the first new step (the newest "
              f"full checkpoint restored, {k['replayed']} iteration(s) replayed and checked) vs reading that "
              f"checkpoint {k['read_full']:.2f} s + the replayed compute {k['replayed_compute']:.2f} s: "
              f"{k['restore'] / bound:.2f} of 1.2x read + replay; the whole step {k['first_step']:.2f} s (its update "
              f"{k['update']:.2f} s; a detached trainer's own time {k['served']:.2f} s, process start not included"
              + (f"; it started and restored while generate + reward ran, {k['overlapped']:.2f} s)" if k["overlapped"]
                 else ")"))
        finish_trainer(cfg)
        d = delta_bytes(args, work)
        print(f"bf16 policy at lr 1e-6: whole {d['whole'] / 1e6:.1f} MB, delta {d['delta'] / 1e3:.1f} kB "
              f"({d['delta'] / d['whole']:.5f} of whole; published as a delta: {d['is_delta']})")


if __name__ == "__main__":
    main()
