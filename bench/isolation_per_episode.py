"""What an episode's environment costs with env.isolation: process against thread, per episode, with no model:
each episode's handle is driven directly (isolation.py: start_environment, then reset, one step, close), one
episode after another, as the episode loop drives them for a one-turn episode. Sampling is not in it.

    python bench/isolation_per_episode.py [--episodes 64] [--repeats 3]
    python bench/isolation_per_episode.py --reference /tmp/rlflow-before      # the same, with another checkout

Environments: (a) plain, the letters game (tasks/envs/builtin/games.py: SayTheLetters, rlflow's protocol); (b) a TRL
environment class with two tools, in a module of the working directory as a user's would be; (c) the same, run
from a TRL user's script: its __main__ also imports `trl`'s GRPOTrainer (episodes/8, one repeat: before the fix
each episode's process imported it again, seconds each). Each (environment, isolation, checkout) runs in a
process of its own (one forkserver serves a process, prepared for one config), whose __main__ imports
tasks.generate as the stage's does (`python -m tasks.generate`). The first episode (the forkserver's start, once
per process, about 1 s) is not counted. With --reference DIR (a checkout of rlflow, e.g.
`git archive <commit> | tar -x -C /tmp/rlflow-before`) each row is measured with that code too, side by side, and the
ratio printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(os.environ.get("RLFLOW_BENCH_ROOT") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(ROOT))

import tasks.generate  # noqa: E402, F401  (the stage's __main__ imports it: a child that runs __main__ again pays it)

if os.environ.get("RLFLOW_BENCH_SCRIPT"):      # (the third row: __main__ is a TRL user's script, its imports)
    from trl import GRPOConfig, GRPOTrainer  # noqa: F401

TRL_CLASS = '''
class Notes:
    """A TRL environment_factory class: reset(**row), public methods are tools, get_reward()."""

    def reset(self, **kwargs):
        self.notes = []
        return "Take notes."

    def add_note(self, text: str) -> str:
        """Add a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return f"{len(self.notes)} notes"

    def count_notes(self, prefix: str = "") -> int:
        """Count the notes that start with a prefix.

        Args:
            prefix: what they start with
        """
        return sum(n.startswith(prefix) for n in self.notes)

    def get_reward(self) -> float:
        return float(len(self.notes))
'''

FACTORIES = {"plain": "tasks.envs.builtin.games:SayTheLetters", "trl": "bench_notes:Notes",
             "trl-script": "bench_notes:Notes"}


def measure(env: str, isolation: str, episodes: int, repeats: int) -> list[float]:
    """ms per episode, one number per repeat (in this process: its forkserver is prepared for this config)."""
    from tasks.core.config import load_config
    from tasks.envs.runtime.isolation import start_environment, warm_up
    from tasks.envs.runtime.protocol import factory_of

    cfg = load_config(ROOT / "configs" / "letters.yaml",
                      [f"env.factory={FACTORIES[env]}", f"env.isolation={isolation}", "env.max_turns=1"])
    make = factory_of(cfg)
    row = {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0}

    def one() -> None:
        handle = start_environment(cfg, make, row)
        handle.reset(row)
        handle.step({"role": "assistant", "content": "a"})
        handle.close()
        assert handle.state is not None

    if isolation == "process":
        warm_up(cfg)
    one()                                                 # (first use in this process, as a stage's first episode)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(episodes):
            one()
        out.append((time.perf_counter() - t0) / episodes * 1000)
    return out


def run_one(root: Path, env: str, isolation: str, args, work: Path) -> float:
    """The median of a fresh process's repeats (this script, `--one`), with `root`'s code."""
    episodes, repeats = (max(4, args.episodes // 8), 1) if env == "trl-script" else (args.episodes, args.repeats)
    script = {"RLFLOW_BENCH_SCRIPT": "1"} if env == "trl-script" else {}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", env, isolation,
                           "--episodes", str(episodes), "--repeats", str(repeats)],
                          cwd=work, env={**os.environ, "RLFLOW_BENCH_ROOT": str(root), **script},
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{root} {env} {isolation}: {proc.stderr.strip().splitlines()[-1:]}")
    return statistics.median(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reference", type=Path, help="another rlflow checkout, measured side by side")
    ap.add_argument("--one", nargs=2, metavar=("ENV", "ISOLATION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.episodes, args.repeats)))
        return
    roots = {"this": Path(__file__).resolve().parents[1]}
    if args.reference:
        roots["reference"] = args.reference.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "bench_notes.py").write_text(TRL_CLASS)
        ms = {(env, iso, name): run_one(root, env, iso, args, work)
              for env in FACTORIES for iso in ("thread", "process") for name, root in roots.items()}
    print(f"{platform.node()}: {os.cpu_count()} CPUs, {args.episodes} one-turn episodes one after another, "
          f"median of {args.repeats}; ms per episode (start, reset, a step, close), no sampling")
    head = f"{'environment':<12} {'isolation':<9}" + "".join(f" {name:>10}" for name in roots)
    print(head + (f" {'this/ref':>9}" if args.reference else "") + f" {'vs thread':>10}")
    for env in FACTORIES:
        for iso in ("thread", "process"):
            line = f"{env:<12} {iso:<9}" + "".join(f" {ms[env, iso, name]:>10.2f}" for name in roots)
            if args.reference:
                line += f" {ms[env, iso, 'this'] / ms[env, iso, 'reference']:>8.3g}x"
            line += f" {ms[env, iso, 'this'] / ms[env, 'thread', 'this']:>9.1f}x"
            print(line)


if __name__ == "__main__":
    main()
