"""The browser environment (tasks/envs/builtin/browser.py) on the shop (tasks/envs/builtin/webshop.py), served on
127.0.0.1 by a fixture and driven through Debian's chromium by Playwright: every task solved by the reference policy
through the episode loop (text actions and tool calls, thread and process isolation), mistakes as observations,
wrong answers scored 0, and the config through the flow with the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import pytest

from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.errors import UserError
from tasks.envs.builtin.browser import Browser
from tasks.envs.builtin.webshop import BY_SLUG, HELD_OUT, PEOPLE, main, order_pool, reference_action, serve, shop_tasks
from tasks.envs.runtime.episodes import run_episodes
from tests.conftest import AT_LENGTH, CHROMIUM
from tests.test_envs import Scripted

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
BROWSER = ROOT / "configs" / "browser.yaml"


@pytest.fixture(scope="module")
def shop():
    with serve() as url:
        yield url


def _cfg(shop: str, *more: str):
    # action_timeout 120 s (Playwright's per action; 5 s by default): a hang guard, not a bound. A clean clone's
    # make test failed a page load at 5 s while the other xdist worker loaded the cores.
    return load_config(BROWSER, ["model.name_or_path=builtin:tiny-lm", f"env.kwargs.base_url={shop}",
                                 "env.kwargs.action_timeout=120", "env.max_tokens=60000",
                                 "generate.max_prompt_length=60000", "generate.max_completion_length=120", *more])


def _episodes(cfg, rows: list[dict], tok, tools: bool):
    table = dict(enumerate(rows))
    engine = Scripted(lambda context: reference_action(context, tool_call=tools))
    return run_episodes(cfg, table, list(table), engine.session("base", "unused", tok),
                        SamplingParams(n=1, max_new_tokens=120, temperature=1.0, top_p=1.0, seed=3))[0]


def test_the_configs_task_file_is_the_shops_task_set():
    rows = [json.loads(line) for line in (ROOT / "configs" / "data" / "shop_tasks.jsonl").read_text().splitlines()]
    assert rows == shop_tasks() and len(rows) == 54
    for split, name in (("train", "shop_train.jsonl"), ("held-out", "shop_heldout.jsonl")):
        lines = (ROOT / "configs" / "data" / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == shop_tasks(split)


def test_held_out_tasks_are_new_instances_of_skills_the_training_split_shows():
    """No held-out product, search word, category or customer in a training task; every way a held-out order or
    question differs (quantity, size or none, shipping, which end of a category) shown by a training task."""
    train, held, pool = shop_tasks("train"), shop_tasks("held-out"), order_pool(500, seed=7)
    assert (len(train), len(held)) == (41, 13) and pool == order_pool(500, seed=7) != order_pool(500, seed=8)
    assert len({r["prompt"] for r in pool}) > 450 and {r["kind"] for r in pool} == {"order"}
    train = train + pool
    words = [BY_SLUG[s].name for s in HELD_OUT["products"]] + [f'"{t}"' for t in HELD_OUT["searches"]]
    words += [f"the {c} category" for c in HELD_OUT["categories"]] + [n for n, _ in PEOPLE["held-out"]]
    assert not [(w, r["prompt"]) for r in train for w in words if w in r["prompt"]]
    order = re.compile(r"Order (\d+) .+?( in size .+?)? with (\w+) shipping")

    def shapes(rows):
        return {(m[1], bool(m[2]), m[3]) for r in rows if (m := order.match(r["prompt"]))}

    quantities, sized, shippings = (set(x) for x in zip(*shapes(train)))
    assert all(q in quantities and s in sized and sh in shippings for q, s, sh in shapes(held))
    assert {r["kind"] for r in held} <= {r["kind"] for r in train}


@pytest.mark.parametrize("argv", [["--tasks", "--split", "held-out", "--pool", "3"], ["--tasks", "--pool", "-1"],
                                  ["--pool", "3"]])
def test_the_task_printer_refuses_a_pool_it_would_not_print(argv, capsys):
    """Generated orders are training ones: asked for with the held-out split (or without --tasks), one line, exit 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr()
    assert exit_.value.code == 2 and not err.out and "--pool" in err.err.splitlines()[-1]


def test_every_task_is_solved_by_the_reference_policy_through_the_episode_loop(shop, tokenizer, chatml):
    """All 54 tasks and two generated orders (make test: half of them, every kind; make drills: all), half with text
    actions (the tiny tokenizer's template has no tools) and half with Hermes tool calls declared through a ChatML
    template: each episode's checker gives 1; the answer, final URL and checks are its env_state; the model's
    tokens are the actions it wrote, the pages are masked out."""
    rows = shop_tasks() + order_pool(2, seed=1)          # (and generated training orders)
    assert {r["kind"] for r in rows} == {"price", "stock", "search", "cheapest", "most expensive", "order"}
    cfg = _cfg(shop, "env.isolation=thread")
    halves = rows[0::2], rows[1::2]
    if "RLFLOW_DRILL_TRIALS" not in os.environ:      # (make test: every other task of each half, and the orders)
        halves = tuple([r for i, r in enumerate(h) if i % 2 == 0 or r["kind"] == "order"] for h in halves)
    text = _episodes(cfg, halves[0], tokenizer, tools=False)
    called = _episodes(cfg, halves[1], chatml, tools=True)
    for r in text + called:
        assert r.env_error is None and r.env_return == 1.0, (r.prompt, r.turns[-2:], r.env_state)
        assert r.env_state["checks"] and all(r.env_state["checks"].values())
    order = next(r for r, row in zip(text, halves[0]) if row["kind"] == "order")
    assert order.env_state["url"].endswith("/orders/1") and order.env_state["answer_text"] == "done"
    model = [t for t, m in zip(order.completion_ids, order.mask) if m]
    written = tokenizer.decode(model, skip_special_tokens=True)
    assert written.startswith("type [") and written.endswith("answer [done]") and "Page:" not in written
    assert "Page:" in tokenizer.decode(order.completion_ids, skip_special_tokens=True)
    assert '"name": "click"' in chatml.decode(called[0].prompt_ids)          # the tools, declared to the model
    assert [m["role"] for m in called[0].turns][:2] == ["assistant", "tool"]


def test_episodes_in_processes_of_their_own_are_solved_too(shop, tokenizer):
    """env.isolation: process: a Chromium in each episode's process (an order and a price)."""
    rows = shop_tasks()
    one_each = [next(r for r in rows if r["kind"] == kind) for kind in ("order", "price")]
    records = _episodes(_cfg(shop, "env.isolation=process"), one_each, tokenizer, tools=False)
    assert [(r.env_error, r.env_return) for r in records] == [(None, 1.0)] * len(one_each)


def test_mistakes_are_observations_and_wrong_answers_score_zero(shop):
    async def episode():
        b = Browser(shop)
        first = (await b.reset({"prompt": "What does the Tea Tin cost?", "start": "/",
                                "check": {"answer": {"exact": "6.25"}}}))[0]["content"]
        assert "Task: What does the Tea Tin cost?" in first and "link 'Tea Tin'" in first
        said = []
        for message in [
                {"role": "assistant", "content": "I am not sure"},                              # no action
                {"role": "assistant", "content": "click [999999]"},                             # not on the page
                {"role": "assistant", "content": "type [abc] [x]"},                             # not a number
                {"role": "assistant", "content": "goto [http://example.com/]"},                 # another site
                {"role": "assistant", "content": "", "tool_calls": [{"type": "error", "error": "bad JSON"}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "scroll", "arguments": {}}}]},      # no such action
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "click", "arguments": {"id": 3}}}]},   # bad arguments
                {"role": "assistant", "content": "select [2] [x]"}]:                           # not a list
            step = await b.step(message)
            assert not step.done and step.reward == 0.0
            assert "Page: Home - Corner Shop" in step.observation[-1]["content"]
            said.append(step.observation[0]["content"].split("\n")[0])
        assert said[0].startswith("No action found") and "no element [999999]" in said[1]
        assert "could not read the action" in said[2] and "only ['127.0.0.1:" in said[3]
        assert said[4] == "bad JSON" and "no action 'scroll'" in said[5] and "click: bad arguments" in said[6]
        assert "is not a list" in said[7] or "no element [2]" in said[7]
        blocked = await b._page.evaluate("fetch('http://192.0.2.1/').then(() => 'fetched', () => 'blocked')")
        assert blocked == "blocked"                 # other hosts are cut off at the network too, at once
        step = await b.step({"role": "assistant", "content": "answer [$7.00]"})
        await b.close()
        return step, b

    step, b = asyncio.run(episode())
    assert step.done and step.reward == 0.0 and b.checks == {"answer.exact": False} and step.observation == []


def test_partial_credit_pays_the_share_of_the_checks_parts_and_a_success_stays_1(shop, tokenizer):
    """env.kwargs.partial_credit c: an episode whose checks do not all pass earns c x the share of their parts that
    do (each string a page must show); a success still earns 1, so eval.pass_threshold 1 counts successes alone."""
    order = next(r for r in shop_tasks() if r["kind"] == "order")
    wanted = order["check"]["pages"][0]["must_include"]
    wrong = {**order, "check": {"pages": [{"url": "/orders/last",
                                           "must_include": [wanted[0], "Ship to: Nobody, Nowhere", wanted[2]]}]}}
    shaped = _episodes(_cfg(shop, "env.isolation=thread", "env.kwargs.partial_credit=0.5"), [order, wrong],
                       tokenizer, tools=False)
    assert [r.env_return for r in shaped] == [1.0, pytest.approx(0.5 * 2 / 3)]
    assert shaped[1].env_state["checks"] == {"pages[0]": False}
    plain = _episodes(_cfg(shop, "env.isolation=thread"), [wrong], tokenizer, tools=False)
    assert plain[0].env_return == 0.0
    with pytest.raises(UserError, match="env.kwargs.partial_credit"):
        Browser(shop, partial_credit=1.0)


def test_a_page_is_numbered_the_same_in_every_episode(shop):
    """Element numbers count the page's shown nodes in tree order (1..n), so the home page reads the same in an
    episode started after another has made pages of its own, and alongside it (Chromium's own node ids, which the
    numbers were before, differed there: a model that learned [3] for the search box missed [5])."""
    row = {"prompt": "What does the Tea Tin cost?", "start": "/", "check": {"answer": {"exact": "6.25"}}}

    def page(content: str) -> str:
        return content[content.index("Page: "):]

    async def episodes():
        first, second, third = Browser(shop), Browser(shop), Browser(shop)
        home = page((await first.reset(row))[0]["content"])
        box = re.search(r"\[(\d+)\] searchbox", home).group(1)
        await first.step({"role": "assistant", "content": f"type [{box}] [wool] [1]"})       # pages made between
        again = page((await second.reset(row))[0]["content"])
        together = await asyncio.gather(second.step({"role": "assistant", "content": f"type [{box}] [tea] [1]"}),
                                        third.reset(row))
        found = together[0].observation[0]["content"]
        for b in (first, second, third):
            await b.close()
        return home, again, page(together[1][0]["content"]), found

    home, again, alongside, found = asyncio.run(episodes())
    assert again == home == alongside
    numbers = [int(n) for n in re.findall(r"^\s*\[(\d+)\]", home, re.M)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > 20
    assert "1 product found" in found and "Tea Tin" in found       # the number typed into is the search box


def test_a_chromium_that_died_is_started_again_for_the_next_episode(shop):
    from playwright.async_api import Error as PlaywrightError

    from tasks.envs.builtin.browser import _Chromium

    async def episodes():
        row = {"prompt": "What does the Tea Tin cost?", "start": "/", "check": {"answer": {"exact": "6.25"}}}
        first = Browser(shop)
        await first.reset(row)
        shared = _Chromium.shared[asyncio.get_running_loop()]
        dead = shared.browser
        await dead.close()                                  # Chromium gone under a live episode
        second = Browser(shop)
        page = (await second.reset(row))[0]["content"]      # a new Chromium for the next episode
        with pytest.raises(PlaywrightError):
            await first.step({"role": "assistant", "content": "click [12]"})      # (its episode fails alone)
        relaunched = shared.browser is not dead and shared.browser.is_connected()
        await first.close()
        await second.close()
        return page, relaunched, shared.users

    page, relaunched, users = asyncio.run(episodes())
    assert "link 'Tea Tin'" in page and relaunched and users == 0


def test_a_chromium_on_another_machine_drives_the_episodes_over_the_devtools_protocol(shop, tokenizer, tmp_path):
    """env.kwargs.cdp_url: a Chromium started elsewhere (here: a process of its own with a DevTools port, as on
    an environment machine) hosts the episodes' contexts; the stage only holds Playwright's connection. Closing
    disconnects and leaves it running; one that does not answer is the preflight's one line."""
    import subprocess
    import urllib.request

    from tasks.core.errors import UserError
    from tasks.envs.builtin.webshop import free_port

    port = free_port()
    chromium = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-dev-shm-usage",
                                 f"--remote-debugging-port={port}", f"--user-data-dir={tmp_path / 'profile'}",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/json/version", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        Browser.preflight(base_url=shop, cdp_url=url)
        rows = [next(r for r in shop_tasks() if r["kind"] == kind) for kind in ("order", "search")]
        records = _episodes(_cfg(shop, "env.isolation=thread", f"env.kwargs.cdp_url={url}"), rows, tokenizer,
                            tools=False)
        assert [(r.env_error, r.env_return) for r in records] == [(None, 1.0)] * 2
        assert chromium.poll() is None                     # disconnected from, not closed
    finally:
        chromium.kill()
        chromium.wait()
    with pytest.raises(UserError, match=r"^env.kwargs.cdp_url: no Chromium \(DevTools protocol\) answers at "):
        Browser.preflight(base_url=shop, cdp_url=url)


def test_the_browser_on_an_environment_server_solves_its_tasks_with_the_tools_declared(shop, chatml, monkeypatch):
    """env.where: local: Chromium and Playwright live in the environment server's process (as on the env
    cluster); the stage sends only the calls. The tools' schemas come back from the server into the prompt."""
    from flows.services import EnvServer
    from tasks.envs.runtime.server import TOKEN_VAR, URL_VAR

    for var in (URL_VAR, TOKEN_VAR):
        monkeypatch.delenv(var, raising=False)
    overrides = ["model.name_or_path=builtin:tiny-lm", f"env.kwargs.base_url={shop}", "env.max_tokens=60000",
                 "generate.max_prompt_length=60000", "generate.max_completion_length=120", "env.where=local"]
    cfg = load_config(BROWSER, overrides)
    server = EnvServer(cfg, str(BROWSER), overrides, None)
    try:
        for k, v in server.services(print).variables().items():
            monkeypatch.setenv(k, v)
        rows = [next(r for r in shop_tasks() if r["kind"] == kind) for kind in ("order", "cheapest", "stock")]
        records = _episodes(cfg, rows, chatml, tools=True)
    finally:
        server.stop()
    assert [(r.env_error, r.env_return) for r in records] == [(None, 1.0)] * 3
    assert '"name": "click"' in chatml.decode(records[0].prompt_ids)
    assert "/orders/" in records[0].env_state["url"] and all(records[0].env_state["checks"].values())


def test_evaluated_episodes_are_pictured_page_by_page_with_the_action_taken_on_each(shop, tokenizer, tmp_path):
    """env.kwargs.screenshots (what the evaluate stage sets, eval.screenshots): each page the reference policy acted
    on is a JPEG with that action; screens.py files them (a strip per episode, an index) and leaves the records
    only their count; `limit` episodes are pictured."""
    from PIL import Image

    from tasks.envs.runtime.screens import file_frames, load_index

    rows = [r for r in shop_tasks("train") if r["kind"] in ("order", "price")][:3]
    records = _episodes(_cfg(shop, "env.isolation=thread", "env.kwargs.screenshots=true"), rows, tokenizer,
                        tools=False)
    written = [tokenizer.decode([t for t, m in zip(r.completion_ids, r.mask) if m], skip_special_tokens=True)
               for r in records]
    assert file_frames(records, tmp_path, limit=2) == 2
    index = load_index(tmp_path)
    assert [e["prompt"] for e in index] == [r["prompt"] for r in rows[:2]]
    for e, r, text in zip(index, records, written):
        actions = [f["action"] for f in e["frames"]]
        assert "".join(actions) == text and actions[-1].startswith("answer [") and e["return"] == 1.0
        assert r.env_state["screens"] == len(actions) and "jpeg" not in json.dumps(r.env_state)
        with Image.open(tmp_path / "screens" / e["frames"][0]["file"]) as first:
            assert first.format == "JPEG" and first.size == (800, 480)
        with Image.open(tmp_path / "screens" / e["strip"]) as strip:
            assert strip.height == 240 and strip.width > 240 * len(actions)
        assert e["frames"][-1]["url"].startswith(shop)
    assert records[2].env_state["screens"] >= 2 and not (tmp_path / "screens" / "e02").exists()

    # the Prefect report's section (flows/dashboard.py: Report.picture): each strip inline, its task, return and
    # actions as plain text
    import base64
    from types import SimpleNamespace

    from flows.dashboard import Report

    report = SimpleNamespace(pictures=[])
    Report.picture(report, 4, tmp_path / "screens", index)
    md = "\n".join(report.pictures)
    assert "### Evaluated episodes of v4 (2 of 2 pictured; every frame in MLflow: screens/v000004)" in md
    for e in index:
        strip = base64.b64encode((tmp_path / "screens" / e["strip"]).read_bytes()).decode()
        assert f"**{e['prompt']}** — return 1" in md and f"](data:image/jpeg;base64,{strip})" in md
        assert " · ".join(f"{i}. {f['action']}" for i, f in enumerate(e["frames"], 1)) in md.splitlines()
    assert "`" not in md


def test_trls_side_of_the_shop_benchmark_sees_the_task_and_tools_rlflow_sees(shop):
    """bench/trl_shop.py's ShopEnv (TRL's environment_factory class): reset gives TRL the first message rlflow's
    episode starts with, its methods are the browser's tools with the same schemas (TRL declares them from the
    methods, as rlflow does), and the reference policy's actions solve a task through them."""
    from bench.trl_shop import ShopEnv, _Task
    from tasks.envs.runtime.tools import schemas

    row = shop_tasks("train")[0]
    ShopEnv.base_url = shop
    env = _Task()
    first = env.reset(task=row["prompt"], start=row["start"], check=json.dumps(row["check"]))

    async def rlflows() -> tuple[str, list]:
        b = Browser(shop, max_chars=ShopEnv.max_chars)
        try:
            return (await b.reset(row))[0]["content"], b.tools
        finally:
            await b.close()

    theirs, tools = asyncio.run(rlflows())
    assert re.sub(r"\[\d+\]", "[N]", first) == re.sub(r"\[\d+\]", "[N]", theirs)   # (numbers: per browser)
    mine = [getattr(env, t.__name__) for t in tools]
    assert schemas(mine) == schemas(tools)
    for _ in range(4):
        action = reference_action(f"Task: {row['prompt']}\n\n{first}", tool_call=True)
        call = json.loads(action.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        first = getattr(env, call["name"])(**call["arguments"])
        if call["name"] == "answer":
            break
    assert env.get_reward() == 1.0


def test_a_check_that_is_not_one_of_the_checkers_fails_the_episode_at_reset(shop, tokenizer):
    rows = [{"prompt": "x", "start": "/", "check": {"answer": {"exact": "1"}, "screenshot": True}}]
    [r] = _episodes(_cfg(shop, "env.isolation=thread"), rows, tokenizer, tools=False)
    assert r.env_return is None and "keys among ['answer', 'url', 'pages']" in r.env_error


def test_without_chromium_the_environment_refuses_before_the_run_with_one_line(monkeypatch):
    """No Chromium on the machine (none on PATH, no Playwright download): the preflight's one line (the CLI's
    cases, exit 2 and nothing written, are in test_bad_input)."""
    from tasks.core.errors import UserError
    from tasks.envs.builtin import browser

    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    monkeypatch.setattr(browser, "_playwright_chromium", lambda: False)
    with pytest.raises(UserError, match=r"^env: the browser environment needs Chromium, and none was found \(make "
                                        r"setup installs Debian's chromium"):
        Browser.preflight(base_url="http://127.0.0.1:9")


@pytest.mark.slow
def test_the_browser_config_runs_through_the_flow_with_the_tiny_model(shop, tmp_path, prefect_api, monkeypatch):
    """configs/browser.yaml, one iteration with the real hf engine and the tiny model (which writes no valid
    action: each page it is shown says so): the episodes ran against the shop, none failed. The evaluation's
    greedy episode is pictured (eval.screenshots): its frames are the run's MLflow artifacts, its strip is in the
    Prefect report, inline."""
    import base64

    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    from flows.training import train_flow
    from tasks.core import layout
    from tasks.core.rollout import load
    from tasks.core.store import Store

    monkeypatch.chdir(tmp_path)
    out = train_flow(str(BROWSER), [
        "model.name_or_path=builtin:tiny-lm", f"env.kwargs.base_url={shop}", "env.kwargs.max_chars=300",
        "run.name=shop", "run.iterations=1", "store.uri=store", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "generate.prompts_per_iteration=2", "generate.num_generations=2", "generate.max_prompt_length=200",
        "generate.max_completion_length=8", "env.max_turns=2", "env.max_tokens=1000", "train.micro_batch_size=4",
        "eval.every=1", "eval.max_prompts=2", "eval.num_generations=1", "eval.screenshots=1", "eval.baseline=false",
        "warmup=null"])
    assert out["iterations_completed"] == 1
    store = Store.open(str(tmp_path / "store"))
    meta = store.manifest(layout.rollouts("shop", 1))["meta"]["metrics"]
    assert meta["env/episodes"] == 4 and meta["env/errors"] == 0 and meta["env/turns_mean"] >= 1
    records = load(store, layout.rollouts("shop", 1))
    assert all("Page: " in json.dumps(r.turns) or r.truncated for r in records)
    assert store.manifest(layout.evaluation("shop", 1))["meta"]["metrics"]["eval/screens_episodes"] == 1
    shots = [f.path for f in MlflowClient(f"sqlite:///{tmp_path}/m.db").list_artifacts(out["mlflow_run_id"],
                                                                                          "screens/v000001")]
    assert {"screens/v000001/index.json", "screens/v000001/e00.jpg", "screens/v000001/e00"} <= set(shots)
    with get_client(sync_client=True) as client:
        [report] = [a for a in client.read_artifacts() if a.key == "shop-report"][-1:]
    strip = re.search(r"!\[episode 0\]\(data:image/jpeg;base64,([A-Za-z0-9+/=]+)\)", report.data)
    assert strip and base64.b64decode(strip.group(1))[:3] == b"\xff\xd8\xff"          # a JPEG
    assert "Evaluated episodes of v1" in report.data and "(no action)" in report.data


def test_the_smollm2_shop_recipes_warm_start_at_a_small_size(shop, tmp_path, monkeypatch):
    """make test's smoke of configs/smollm2-shop.yaml (the RL iteration after it: the test below, make drills):
    the reference policy's episode of a training task recorded, and `rlflow sft`'s warm start (one step) of
    SmolLM2-135M on it, published as v0."""
    from flows.warmup import sft_command
    from tasks.core import layout
    from tasks.core.store import Store
    from tasks.envs.runtime.demonstrations import record, write

    monkeypatch.chdir(tmp_path)
    recipe = ROOT / "configs" / "smollm2-shop.yaml"
    small = [f"env.kwargs.base_url={shop}", "env.kwargs.max_chars=600", "env.max_turns=3"]
    kept, episodes, _ = record(load_config(recipe, small), "tasks.envs.builtin.webshop:reference_action", rows=[0])
    assert len(kept) == 1 and all(e.env_return == 1.0 for e in episodes)
    write(kept, tmp_path / "demos.jsonl")
    assert sft_command(load_config(recipe, [
        *small, "store.uri=store", f"tracking.uri=sqlite:///{tmp_path}/m.db", f"warmup.path={tmp_path / 'demos.jsonl'}",
        "warmup.epochs=1", "warmup.batch_size=1"])) == 0
    v0 = Store.open(str(tmp_path / "store")).manifest(layout.policy("smollm2-shop", 0))
    assert v0["meta"]["metrics"]["sft/steps"] == 1


@AT_LENGTH                 # (an RL iteration of SmolLM2 in Chromium: ~3-6 min on 2 cores; the CI budget)
def test_the_smollm2_shop_recipe_at_a_small_size_through_the_flow(shop, tmp_path, prefect_api, monkeypatch):
    """configs/smollm2-shop.yaml, small (pages cut at 600 characters, two turns): the reference policy's episode of
    a training task recorded (three turns), the warm start (one step) on it, then one RL iteration of
    SmolLM2-135M in Chromium from v0; every episode ran against the shop without an error. (The held-out
    evaluation of the recipe at its size: bench/shop_learning.py.)"""
    from flows.training import train_flow
    from tasks.core import layout
    from tasks.core.store import Store
    from tasks.envs.runtime.demonstrations import record, write

    monkeypatch.chdir(tmp_path)
    recipe = ROOT / "configs" / "smollm2-shop.yaml"
    small = [f"env.kwargs.base_url={shop}", "env.kwargs.max_chars=600", "env.max_turns=2",
             "generate.max_completion_length=24"]
    kept, episodes, _ = record(load_config(recipe, [*small, "env.max_turns=3"]),
                               "tasks.envs.builtin.webshop:reference_action", rows=[0])
    assert len(kept) == 1 and all(e.env_return == 1.0 for e in episodes)
    write(kept, tmp_path / "demos.jsonl")
    out = train_flow(str(recipe), [
        *small, "run.iterations=1", "store.uri=store", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        f"warmup.path={tmp_path / 'demos.jsonl'}", "warmup.epochs=1", "warmup.batch_size=1",
        "generate.prompts_per_iteration=1", "generate.num_generations=2", "eval.every=0"])
    assert out["iterations_completed"] == 1
    store = Store.open(str(tmp_path / "store"))
    assert store.manifest(layout.policy("smollm2-shop", 0))["meta"]["metrics"]["sft/steps"] == 1
    meta = store.manifest(layout.rollouts("smollm2-shop", 1))["meta"]["metrics"]
    assert meta["env/episodes"] == 2 and meta["env/errors"] == 0
