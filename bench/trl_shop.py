"""The shop's warm start side by side with TRL: the same SFT then RL on the same data, by rlflow
(configs/smollm2-shop.yaml, one `rlflow run`: warm start, then RL) and by TRL (SFTTrainer, then GRPOTrainer with
the shop as an `environment_factory` class), each arm's wall time and its held-out greedy success.

    .venv/bin/python bench/trl_shop.py [--seeds 0] [--iterations 10] [--sft-epochs 3] [--arms rlflow trl] [--quick]

Both arms: SmolLM2-135M-Instruct (builtin) with Qwen2.5's ChatML template, which TRL ships (its tools and tool
calls, Hermes style: TRL's environment_factory needs a template that declares tools and a parser for the calls,
and SmolLM2's own declares none; both are ChatML, so the model's special tokens are the same); the demonstrations
are the reference policy's episodes of the 41 training tasks as tool calls (rlflow record), SFT 3 epochs of
batches of 4 at lr 5e-5 (linear), then RL: 4 tasks x 4 episodes a step, lr 1e-6, no KL, DAPO's loss, at most
12 actions an episode. Each step of either arm is one rlflow iteration. Held-out success is measured the same
way for both: rlflow's evaluate stage (greedy, the 13 tasks of shop_heldout.jsonl, each episode's checker) on
rlflow's v0 and last policy, and on TRL's SFT and GRPO outputs (their saved folders as the model).

TRL's side, as its docs have it: SFTTrainer on the `messages` rows (assistant_only_loss with TRL's training
template), then GRPOTrainer(environment_factory=ShopEnv): the environment's reset(**row) gives the first message
(the actions, the task and the page), its methods are the tools (the browser's click, type, select, goto,
answer), get_reward the task's checker. ShopEnv drives the same Browser (tasks/envs/builtin/browser.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "configs" / "smollm2-shop.yaml"
_R = yaml.safe_load(RECIPE.read_text())            # both arms run the recipe's settings
RL = {"lr": _R["train"]["lr"], "generations": _R["generate"]["num_generations"],
      "prompts": _R["generate"]["prompts_per_iteration"], "max_turns": _R["env"]["max_turns"],
      "max_tokens": _R["env"]["max_tokens"]}
TURN = ["-o", "generate.max_completion_length=64"]      # a turn: one tool call (~40 tokens; the recipe's 32 fit text)
QUICK = {"max_chars": 900, "max_turns": 3, "prompts": 1, "generations": 2, "batch": 2, "held_out": 2, "demos": 4}
SMALL: list[str] = []     # --quick: every rlflow command's overrides (the plumbing, not the numbers)
SFT = {"epochs": _R["warmup"]["epochs"], "batch": _R["warmup"]["batch_size"], "lr": _R["warmup"]["lr"]}

from bench.warm_start_letters import rlflow  # noqa: E402
from bench.work import keep_option, work_folder  # noqa: E402
from tasks.core import layout  # noqa: E402
from tasks.core.store import Store  # noqa: E402
from tasks.envs.builtin.browser import Browser  # noqa: E402
from tasks.envs.builtin.webshop import serve  # noqa: E402


class ShopEnv:
    """The shop as TRL's environment_factory class: one Browser (one episode) per instance, driven on one event
    loop of this process (so one Chromium for all)."""

    base_url = ""
    max_chars = 3000
    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    def __init__(self):
        self._browser: Browser | None = None
        self._done = False

    @classmethod
    def _run(cls, coro):
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, daemon=True, name="shop-env").start()
        return asyncio.run_coroutine_threadsafe(coro, cls._loop).result()

    def reset(self, **row) -> str:
        if self._browser is not None:
            self._run(self._browser.close())
        self._browser, self._done = Browser(self.base_url, max_chars=self.max_chars), False
        task = {k: row[k] for k in ("prompt", "start", "check") if k in row}
        return self._run(self._browser.reset(task))[0]["content"]

    def _act(self, name: str, **arguments) -> str:
        if self._done:
            return "The task is over: answer given."
        step = self._run(self._browser.step({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]}))
        self._done = step.done
        return step.observation[-1]["content"] if step.observation else f"answered {arguments.get('text')!r}"

    def get_reward(self) -> float:
        return float(self._browser.reward) if self._browser is not None else 0.0

    # the tools: the browser's actions, with its docstrings
    def click(self, ref: int) -> str:
        """Click an element of the page.

        Args:
            ref: the element's number in the page's tree
        """
        return self._act("click", ref=ref)

    def type(self, ref: int, text: str, submit: bool = False) -> str:
        """Type text into a field of the page, replacing what it held.

        Args:
            ref: the field's number in the page's tree
            text: what to type
            submit: press Enter after typing
        """
        return self._act("type", ref=ref, text=text, submit=submit)

    def select(self, ref: int, option: str) -> str:
        """Choose an option of a list (a select box).

        Args:
            ref: the list's number in the page's tree
            option: the option's text
        """
        return self._act("select", ref=ref, option=option)

    def goto(self, url: str) -> str:
        """Open a URL of the task's site.

        Args:
            url: a full URL, or a path on the site such as /cart
        """
        return self._act("goto", url=url)

    def answer(self, text: str) -> str:
        """Give the task's answer and end the task (on a task that asks for no answer: done).

        Args:
            text: the answer
        """
        return self._act("answer", text=text)


def tools_model(work: Path) -> Path:
    """SmolLM2-135M-Instruct (builtin) with TRL's Qwen2.5 chat template: both arms' model."""
    import trl
    from transformers import AutoTokenizer

    from tasks.core.config import load_config
    from tasks.core.models import base_path

    src = Path(base_path(load_config(RECIPE, ["warmup=null"])))
    dest = work / "smollm2-tools"
    shutil.copytree(src, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tok.save_pretrained(dest)
    return dest


def held_out(model: Path, work: Path, name: str, url: str) -> float:
    """rlflow's evaluate stage on `model` as the starting model: greedy success on the held-out tasks."""
    from tasks.core.config import load_config
    from tasks.evaluate import evaluate

    cfg = load_config(RECIPE, [f"model.name_or_path={model}", "warmup=null", f"env.kwargs.base_url={url}",
                               f"run.name={name}", f"store.uri={work / 'eval-store'}",
                               f"tracking.uri=sqlite:///{work / 'eval.db'}", "eval.screenshots=0", TURN[1],
                               *(o for o in SMALL[1::2] if not o.startswith("warmup."))])
    return evaluate(cfg, 0)["metrics"]["eval/greedy_pass_at_1"]


def trl_arm(model: Path, demos: Path, work: Path, seed: int, steps: int, url: str) -> tuple[float, float, float]:
    """TRL: SFTTrainer on the demonstrations, then GRPOTrainer with ShopEnv; (seconds, held-out after SFT, after
    RL)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in demos.read_text().splitlines()]
    sft_rows = [{"messages": r["messages"], "tools": json.loads(r["tools"])} for r in rows]
    t0 = time.perf_counter()
    common = {"use_cpu": True, "bf16": False, "report_to": [], "save_strategy": "no", "logging_steps": 1,
              "seed": seed, "gradient_checkpointing": True}       # (as the recipe: train.gradient_checkpointing)
    sft = SFTTrainer(model=str(model), train_dataset=Dataset.from_list(sft_rows), args=SFTConfig(
        output_dir=str(work / f"trl-sft-s{seed}"), num_train_epochs=SFT["epochs"], per_device_train_batch_size=1,
        gradient_accumulation_steps=SFT["batch"], learning_rate=SFT["lr"], lr_scheduler_type="linear",
        warmup_steps=0, assistant_only_loss=True, max_length=None, **common))
    sft.train()
    sft_dir = work / f"trl-sft-s{seed}" / "final"
    sft.save_model(str(sft_dir))
    sft_s = time.perf_counter() - t0
    ShopEnv.base_url = url
    train = [json.loads(line) for line in (ROOT / "configs" / "data" / "shop_train.jsonl").read_text().splitlines()]
    tasks = Dataset.from_list([{"prompt": [{"role": "user", "content": ""}], "start": r["start"],
                                "check": json.dumps(r["check"]), "task": r["prompt"]} for r in train])
    t1 = time.perf_counter()
    grpo = GRPOTrainer(model=str(sft_dir), environment_factory=_factory, train_dataset=tasks, args=GRPOConfig(
        output_dir=str(work / f"trl-grpo-s{seed}"), max_steps=steps, learning_rate=RL["lr"], beta=0.0,
        loss_type="dapo", num_generations=RL["generations"], per_device_train_batch_size=RL["generations"],
        gradient_accumulation_steps=RL["prompts"], max_completion_length=1500 if SMALL else RL["max_tokens"],
        temperature=1.0, max_tool_calling_iterations=RL["max_turns"], lr_scheduler_type="constant", **common))
    grpo.train()
    rl_dir = work / f"trl-grpo-s{seed}" / "final"
    grpo.save_model(str(rl_dir))
    seconds = sft_s + time.perf_counter() - t1
    return seconds, held_out(sft_dir, work, f"trl-sft-s{seed}", url), held_out(rl_dir, work, f"trl-rl-s{seed}", url)


def _factory() -> ShopEnv:
    return _Task()


class _Task(ShopEnv):
    """ShopEnv reading the dataset's columns: `task` is the prompt's words, `check` its checker (JSON)."""

    def reset(self, **row) -> str:
        return super().reset(prompt=row["task"], start=row["start"], check=json.loads(row["check"]))


def rlflow_arm(model: Path, demos: Path, work: Path, seed: int, iterations: int, url: str) -> tuple[float, float,
                                                                                                         float]:
    name = f"rlflow-s{seed}"
    t0 = time.perf_counter()
    rlflow(["run", str(RECIPE), "-o", f"model.name_or_path={model}", "-o", f"env.kwargs.base_url={url}",
            "-o", f"warmup.path={demos}", "-o", f"run.iterations={iterations}", "-o", f"eval.every={iterations}",
            "-o", f"run.name={name}", "-o", f"run.seed={seed}", "-o", "eval.screenshots=0",
            "-o", f"warmup.epochs={SFT['epochs']}", *TURN, *SMALL,
            "--summary-json", str(work / f"{name}.json")], work)
    held = json.loads((work / f"{name}.json").read_text())["held_out"]
    store = Store.open(str(work / "rlflow-store"))       # (its evaluations' time left out, as TRL's arm's is)
    evals = sum(store.manifest(layout.evaluation(name, it))["meta"]["metrics"]["eval/seconds"]
                for it in (0, iterations))
    return time.perf_counter() - t0 - evals, held["0"], held[str(iterations)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--iterations", type=int, default=10, help="RL steps of each arm (rlflow iterations)")
    ap.add_argument("--sft-epochs", type=int, default=SFT["epochs"])
    ap.add_argument("--quick", action="store_true", help="4 demonstrations, 2 episodes of 3 actions a step, 2 "
                    "held-out tasks: the plumbing of both arms, not the numbers")
    ap.add_argument("--arms", nargs="+", default=["rlflow", "trl"], choices=["rlflow", "trl"])
    keep_option(ap)
    args = ap.parse_args()
    SFT["epochs"] = args.sft_epochs
    if args.quick:
        q = QUICK
        RL.update(prompts=q["prompts"], generations=q["generations"], max_turns=q["max_turns"])
        SFT["batch"] = q["batch"]
        ShopEnv.max_chars = q["max_chars"]
        SMALL.extend(a for o in (f"env.kwargs.max_chars={q['max_chars']}", f"env.max_turns={q['max_turns']}",
                                 f"generate.prompts_per_iteration={q['prompts']}",
                                 f"generate.num_generations={q['generations']}", f"warmup.batch_size={q['batch']}",
                                 f"eval.max_prompts={q['held_out']}") for a in ("-o", o))
    work = work_folder("rlflow-trl-shop-", args.keep)
    t0 = time.perf_counter()
    with serve() as url:
        model = tools_model(work)
        demos = work / "demos.jsonl"
        out = rlflow(["record", str(RECIPE), "--policy", "tasks.envs.builtin.webshop:reference_tool_calls",
                      "--out", str(demos), "-o", f"model.name_or_path={model}", "-o", f"env.kwargs.base_url={url}",
                      "-o", f"warmup.path={demos}", *TURN, *SMALL,
                      *(["--rows", f"0-{QUICK['demos'] - 1}"] if SMALL else [])], work)
        print(out.stderr.strip().splitlines()[-1], f"({time.perf_counter() - t0:.0f} s)")
        print(f"SmolLM2-135M (tool calls) in the shop: SFT, then {args.iterations} RL steps; held-out greedy success "
              f"on 10 tasks")
        print(f"{'seed':>4}  {'arm':<7} {'after SFT':>9} {'after RL':>9} {'seconds':>8}")
        arms = {"rlflow": rlflow_arm, "trl": trl_arm}
        for seed in args.seeds:
            for arm in args.arms:
                seconds, sft, rl = arms[arm](model, demos, work, seed, args.iterations, url)
                print(f"{seed:>4}  {arm:<7} {sft:9.3f} {rl:9.3f} {seconds:8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
