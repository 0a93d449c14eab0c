"""A browser environment: Playwright driving a headless Chromium, WebArena's way (docs/environments.md).

    env:
      factory: "tasks.envs.builtin.browser:Browser"
      kwargs: {base_url: "http://127.0.0.1:8765"}      # the site (tasks/envs/builtin/webshop.py serves a shop)
      isolation: thread                                # one Chromium per stage process, a context per episode

A dataset row is a task: `prompt` (the intent), `start` (a path or URL, default "/") and `check` (how the
episode is scored). Each observation is the page's accessibility tree as text, one node a line with the number
that actions name it by; actions are tool calls or the same words as text (`click [25]`, `type [23] [2]`,
`answer [24.99]`, ...), and `answer` ends the episode: its checks give the reward, 1 or 0 (a share: `partial_credit`).

Without Playwright or a Chromium the environment refuses before the run starts, with one line (`preflight`).
More: docs/internals.md (tasks/envs/builtin/browser.py): observations, actions and checks, in full.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from typing import Any
from urllib.parse import urljoin, urlparse

from tasks.core.contracts import Step
from tasks.core.errors import UserError
from tasks.envs.runtime.protocol import require_answer

ACTIONS = ("Act with one action per turn: click [N], type [N] [text] (type [N] [text] [1] presses Enter after), "
           "select [N] [option], goto [url], answer [text] (ends the task; on a task that asks for no answer, "
           "answer [done]). N is an element's number in the page below.")
_ACTION = re.compile(r"\b(click|type|select|goto|answer|stop)\s*\[([^\]\n]*)\](?:\s*\[([^\]\n]*)\])?"
                     r"(?:\s*\[([^\]\n]*)\])?", re.IGNORECASE)
_HIDDEN = {"generic", "none", "InlineTextBox", "LineBreak", "", "presentation", "ListMarker"}
_UNNAMED = {"listitem", "list", "LabelText", "paragraph", "banner", "main", "search", "contentinfo", "region", "group",
            "Section", "form", "article", "navigation", "complementary", "emphasis", "strong"}   # shown when named
_PROPERTIES = ("level", "checked", "selected", "expanded", "disabled", "required", "focused", "invalid")
_MARK = "function(ref) { const el = this.nodeType === 1 ? this : this.parentElement; " \
        "el.setAttribute('data-rlflow-ref', ref); }"
_CHECKS = ("answer", "url", "pages")
SHOT_SIZE = {"width": 800, "height": 480}        # the page pictured (screenshots), in CSS pixels


class ActionError(Exception):
    """What the model did wrong: its text is the observation."""


def chromium_path(executable: str | None = None) -> str | None:
    """The Chromium to drive: env.kwargs.executable, else the system's (Debian's chromium), else None
    (Playwright's own download, when `playwright install chromium` was run)."""
    if executable:
        return executable
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class _Chromium:
    """One Chromium per event loop (its Playwright objects belong to the loop), shared by the episodes on it and
    closed when the last one closes; relaunched if it died. With a `cdp_url` it is another machine's Chromium
    (connected to over the DevTools protocol; closing disconnects and leaves it running)."""

    shared: dict[Any, _Chromium] = {}

    def __init__(self) -> None:
        self.users, self.playwright, self.browser = 0, None, None
        self.lock = asyncio.Lock()

    @classmethod
    async def acquire(cls, executable: str | None, headless: bool, cdp_url: str | None = None):
        me = cls.shared.setdefault(asyncio.get_running_loop(), cls())
        async with me.lock:
            if me.browser is None or not me.browser.is_connected():
                from playwright.async_api import async_playwright

                if me.playwright is None:
                    me.playwright = await async_playwright().start()
                if cdp_url:
                    me.browser = await me.playwright.chromium.connect_over_cdp(cdp_url)
                else:
                    args = ["--disable-dev-shm-usage"] + (["--no-sandbox"] if os.geteuid() == 0 else [])
                    me.browser = await me.playwright.chromium.launch(executable_path=executable, headless=headless,
                                                                     args=args)
            me.users += 1
            return me.browser

    @classmethod
    async def release(cls) -> None:
        loop = asyncio.get_running_loop()
        me = cls.shared.get(loop)
        if me is None:
            return
        async with me.lock:
            me.users -= 1
            if me.users > 0:
                return
            cls.shared.pop(loop, None)
            try:
                if me.browser is not None:
                    await me.browser.close()
            finally:
                if me.playwright is not None:
                    await me.playwright.stop()


class Browser:
    """rlflow's protocol over a Chromium page; its action methods are also its tools (their docstrings are the
    schemas the chat template declares)."""

    def __init__(self, base_url: str, executable: str | None = None, max_chars: int = 6000,
                 action_timeout: float = 5.0, allowed_hosts: list[str] | None = None, headless: bool = True,
                 cdp_url: str | None = None, screenshots: bool = False, partial_credit: float = 0.0):
        self.partial_credit = _share(partial_credit)
        self.base_url = base_url.rstrip("/") + "/"
        self.cdp_url = cdp_url
        self.executable, self.headless = chromium_path(executable), headless
        self.max_chars, self.timeout_ms = max_chars, int(action_timeout * 1000)
        self.hosts = set(allowed_hosts or []) | {urlparse(self.base_url).netloc}
        self.tools = [self.click, self.type, self.select, self.goto, self.answer]
        self.url, self.answer_text, self.checks, self.reward = "", None, {}, 0.0
        self.parts: list[bool] = []            # each part of the checks (an answer, a string a page must show)
        self._context = self._page = self._cdp = None
        self._refs: dict[int, int] = {}        # the observed page's numbers -> Chromium's backend node ids
        self._check: dict = {}
        # screenshots (the evaluate stage turns them on, eval.screenshots): the page before each action, with
        # the action taken on it: {"action", "url", "jpeg" (base64)}; tasks/envs/runtime/screens.py files them
        self._screenshots, self.screens = screenshots, []
        self._acquired = False

    @classmethod
    def preflight(cls, base_url: str | None = None, executable: str | None = None, cdp_url: str | None = None,
                  partial_credit: Any = 0.0, **_: Any) -> None:
        """Before the run starts: one line when Playwright, Chromium or the site is missing, or a setting is wrong."""
        _share(partial_credit)
        try:
            import playwright.async_api  # noqa: F401
        except ImportError:
            raise UserError("env: the browser environment needs playwright (pip install playwright; make setup "
                            "installs it)") from None
        if cdp_url:                                   # another machine's Chromium: it must answer
            require_answer(cdp_url.rstrip("/") + "/json/version", "Chromium (DevTools protocol)", field="cdp_url")
        path = chromium_path(executable) if not cdp_url else "remote"
        if executable and not os.access(executable, os.X_OK):
            raise UserError(f"env.kwargs.executable: {executable!r} is not an executable Chromium")
        if path is None and not _playwright_chromium():
            raise UserError("env: the browser environment needs Chromium, and none was found (make setup installs "
                            "Debian's chromium; or `playwright install chromium`; or set env.kwargs.executable)")
        if not base_url:
            raise UserError("env.kwargs.base_url: the browser environment needs the site's URL, e.g. "
                            "http://127.0.0.1:8765 (python -m tasks.envs.builtin.webshop serves the shop there)")
        require_answer(base_url, "site", "; start it first (python -m tasks.envs.builtin.webshop --port ...)")

    # ------------------------------------------------------------------------------------ the protocol

    async def reset(self, row: dict) -> list[dict]:
        check = row.get("check") or {}
        if isinstance(check, str):
            import json

            check = json.loads(check)
        check = _pruned(check)        # (a dataset's columns are one schema: a row's unused checks come back as None)
        if not isinstance(check, dict) or set(check) - set(_CHECKS):
            raise ValueError(f"the row's check must be an object with keys among {list(_CHECKS)}, not {check!r}")
        self._check = check
        browser = await _Chromium.acquire(self.executable, self.headless, self.cdp_url)
        self._acquired = True                 # (released by close: a launch that failed took no share)
        self._context = await browser.new_context(**({"viewport": SHOT_SIZE} if self._screenshots else {}))
        self._context.set_default_timeout(self.timeout_ms)
        await self._context.route("**/*", self._route)
        self._page = await self._context.new_page()
        self._cdp = await self._context.new_cdp_session(self._page)
        await self._page.goto(urljoin(self.base_url, str(row.get("start") or "/")), wait_until="load")
        task = str(row.get("prompt") or "").strip()
        page = await self._observe()
        await self._shoot()
        return [{"role": "user", "content": f"{ACTIONS}\n\nTask: {task}\n\n{page}"}]

    async def step(self, message: dict) -> Step:
        calls = message.get("tool_calls") or []
        as_tools = bool(calls)
        if not calls:
            calls = _text_actions(message.get("content") or "")
        if self.screens:                  # (the page last shot is the one this action was taken on)
            self.screens[-1]["action"] = "; ".join(map(_call_written, calls)) or \
                "(no action) " + str(message.get("content") or "")[:200]
        said: list[tuple[str, str]] = []
        for call in calls:
            name, result = await self._act(call)
            said.append((name, result))
            if self.answer_text is not None:
                return Step([], self.reward, True, {"checks": self.checks})
        if not said:
            said = [("error", f"No action found. {ACTIONS}")]
        page = await self._observe()
        await self._shoot()
        if as_tools:
            out = [{"role": "tool", "name": n, "content": r} for n, r in said]
            out[-1]["content"] += f"\n\n{page}"
            return Step(out, 0.0, False)
        return Step([{"role": "user", "content": "\n".join(r for _, r in said) + f"\n\n{page}"}], 0.0, False)

    async def close(self) -> None:
        try:
            if self._context is not None:
                await self._context.close()
        finally:
            if self._acquired:
                self._acquired = False
                await _Chromium.release()

    # ------------------------------------------------------------------------------------ the actions (tools)

    async def click(self, ref: int) -> str:
        """Click an element of the page.

        Args:
            ref: the element's number in the page's tree
        """
        await (await self._element(ref)).click()
        await self._settle()
        return f"clicked [{ref}]"

    async def type(self, ref: int, text: str, submit: bool = False) -> str:
        """Type text into a field of the page, replacing what it held.

        Args:
            ref: the field's number in the page's tree
            text: what to type
            submit: press Enter after typing
        """
        field = await self._element(ref)
        await field.fill(str(text))
        if submit:
            await field.press("Enter")
            await self._settle()
        return f"typed {str(text)!r} into [{ref}]" + (" and pressed Enter" if submit else "")

    async def select(self, ref: int, option: str) -> str:
        """Choose an option of a list (a select box).

        Args:
            ref: the list's number in the page's tree
            option: the option's text
        """
        box = await self._element(ref)
        if await box.evaluate("el => el.tagName") != "SELECT":
            raise ActionError(f"[{ref}] is not a list to select from")
        options = await box.evaluate("el => Array.from(el.options).map(o => [o.label, o.value])")
        chosen = next((o for o in options if str(option) in o), None)
        if chosen is None:
            raise ActionError(f"[{ref}] has no option {option!r} (options: {[label for label, _ in options]})")
        await box.select_option(value=chosen[1])
        await self._settle()
        return f"selected {option!r} in [{ref}]"

    async def goto(self, url: str) -> str:
        """Open a URL of the task's site.

        Args:
            url: a full URL, or a path on the site such as /cart
        """
        target = urljoin(self._page.url, str(url))
        if urlparse(target).scheme not in ("http", "https") or urlparse(target).netloc not in self.hosts:
            raise ActionError(f"goto: only {sorted(self.hosts)} may be visited, not {url!r}")
        await self._page.goto(target, wait_until="load")
        return f"opened {target}"

    async def answer(self, text: str) -> str:
        """Give the task's answer and end the task (on a task that asks for no answer: done).

        Args:
            text: the answer
        """
        self.answer_text = str(text)
        self.url = self._page.url
        self.checks = await self._run_checks(self.answer_text)
        passed = bool(self._check) and all(self.checks.values())
        self.reward = 1.0 if passed else self.partial_credit * sum(self.parts) / max(len(self.parts), 1)
        return f"answered {self.answer_text!r}"

    # ------------------------------------------------------------------------------------ inside

    async def _act(self, call: dict) -> tuple[str, str]:
        if call.get("type") != "function":
            return "error", str(call.get("error", "unsupported call"))
        name, args = call["function"]["name"], call["function"]["arguments"]
        name = "answer" if name == "stop" else name
        method = {t.__name__: t for t in self.tools}.get(name)
        if method is None:
            return "error", f"no action {name!r}. {ACTIONS}"
        try:
            if "ref" in args:
                args = {**args, "ref": int(args["ref"])}
            return name, await method(**args)
        except (TypeError, ValueError) as e:
            return name, f"{name}: bad arguments ({e})"
        except ActionError as e:
            return name, str(e)
        except Exception as e:  # noqa: BLE001 - Playwright's errors (a timeout, an element that cannot be used)
            return name, f"{name} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"

    async def _element(self, ref: int):
        if ref not in self._refs:
            raise ActionError(f"no element [{ref}] on the page (use a number from the page's tree)")
        backend = self._refs[ref]          # (the mark is the node's own id: a number is reused by the next page)
        try:
            node = await self._cdp.send("DOM.resolveNode", {"backendNodeId": backend})
            await self._cdp.send("Runtime.callFunctionOn", {"objectId": node["object"]["objectId"],
                                                            "functionDeclaration": _MARK,
                                                            "arguments": [{"value": str(backend)}]})
        except Exception:  # noqa: BLE001 - the node went with a navigation or a re-render
            raise ActionError(f"[{ref}] is no longer on the page") from None
        return self._page.locator(f'[data-rlflow-ref="{backend}"]').first

    async def _shoot(self) -> None:
        """screenshots: the page as it is now (a JPEG, base64), its action filled in by the next step."""
        if self._screenshots:
            import base64

            try:
                shot = await self._page.screenshot(type="jpeg", quality=60)
            except Exception:  # noqa: BLE001 - a page that cannot be pictured is still acted on
                return
            self.screens.append({"action": "", "url": self._page.url, "jpeg": base64.b64encode(shot).decode()})

    async def _settle(self) -> None:
        try:
            await self._page.wait_for_load_state("load")
        except Exception:  # noqa: BLE001 - a page still loading is observed as it is
            pass

    async def _route(self, route) -> None:
        if urlparse(route.request.url).netloc in self.hosts or route.request.url.startswith(("data:", "about:")):
            await route.continue_()
        else:
            await route.abort("blockedbyclient")

    async def _observe(self) -> str:
        """The page as its accessibility tree, one node a line: [number] role 'name' properties. The numbers count
        the page's shown nodes in tree order (1, 2, ...): the same page is numbered the same in every episode.
        Chromium's backend node ids (WebArena's numbers) depend on every page that browser made before: concurrent
        episodes saw the shop's search box as [3], [4] or [5], and a model that learned one missed the others."""
        self.url = self._page.url
        nodes = (await self._cdp.send("Accessibility.getFullAXTree"))["nodes"]
        by_id = {n["nodeId"]: n for n in nodes}
        lines: list[str] = []
        self._refs = {}
        stack: list[tuple[dict, int, str]] = [(nodes[0], 0, "")] if nodes else []
        while stack:
            node, depth, parent = stack.pop()
            role = str(node.get("role", {}).get("value", ""))
            name = str(node.get("name", {}).get("value", "")).strip()
            shown = not node.get("ignored") and role not in _HIDDEN and role != "RootWebArea" \
                and (name or role not in _UNNAMED)
            if role == "StaticText" and (not name or name in parent):        # (a field's text: its value)
                shown = False
            if shown and "backendDOMNodeId" in node:
                ref = len(self._refs) + 1
                self._refs[ref] = node["backendDOMNodeId"]
                lines.append("  " * depth + f"[{ref}] {role} {_quote(name)}{_props(node)}")
                depth, parent = depth + 1, f"{name} {node.get('value', {}).get('value', '')}"
            if role != "StaticText":
                stack += [(by_id[c], depth, parent) for c in reversed(node.get("childIds", [])) if c in by_id]
        title = await self._page.title()
        text = f"Page: {title} ({self._page.url})\n" + "\n".join(lines)
        if len(text) > self.max_chars:
            cut = text[:self.max_chars].rsplit("\n", 1)[0]
            text = f"{cut}\n... ({text.count(chr(10)) - cut.count(chr(10))} more lines)"
        return text

    async def _run_checks(self, answer: str) -> dict[str, bool]:
        """Each check's verdict; `self.parts` gets each part's (an exact answer, each string an answer or a page
        must include, the URL), which partial credit counts."""
        out: dict[str, bool] = {}
        parts: list[bool] = []
        spec = self._check
        if "answer" in spec:
            got, want = _norm(answer), spec["answer"]
            if "exact" in want:
                out["answer.exact"] = got == _norm(str(want["exact"]))
                parts.append(out["answer.exact"])
            if "must_include" in want:
                found = [_norm(str(s)) in got for s in want["must_include"]]
                out["answer.must_include"] = all(found)
                parts += found
        if "url" in spec:
            here = urlparse(self._page.url)
            out["url"] = urljoin(self.base_url, spec["url"]).rstrip("/") == f"{here.scheme}://{here.netloc}" \
                f"{here.path}{'?' + here.query if here.query else ''}".rstrip("/")
            parts.append(out["url"])
        for i, page_check in enumerate(spec.get("pages") or []):
            page = await self._context.new_page()
            wanted = page_check.get("must_include", [])
            try:
                await page.goto(urljoin(self.base_url, page_check["url"]), wait_until="load")
                body = _norm(await page.inner_text("body"))
                found = [_norm(str(s)) in body for s in wanted]
            except Exception:  # noqa: BLE001 - a page that does not open fails its check
                found = [False] * max(len(wanted), 1)
            finally:
                await page.close()
            out[f"pages[{i}]"] = all(found)
            parts += found or [True]                # (a page that opens, with nothing it must show)
        self.parts = parts
        return out


def _share(partial_credit: Any) -> float:
    try:
        share = float(partial_credit)
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 <= share < 1.0:
        raise UserError(f"env.kwargs.partial_credit: a share of the reward below a success's 1 (0 <= c < 1), not "
                        f"{partial_credit!r}")
    return share


def _pruned(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    return [_pruned(v) for v in value] if isinstance(value, list) else value


def _quote(name: str) -> str:
    return "'" + name.replace("\n", " ")[:200] + "'"


def _props(node: dict) -> str:
    out, role = [], node.get("role", {}).get("value")
    value = node.get("value", {}).get("value")
    if value not in (None, ""):
        out.append(f"value: {_quote(str(value))}")
    for p in node.get("properties", []):
        name, value = p.get("name"), p.get("value", {}).get("value")
        if name in _PROPERTIES and value not in (None, False, "false", "") and (name != "level" or role == "heading"):
            out.append(name if value is True or value == "true" else f"{name}: {value}")
    return (" " + " ".join(out)) if out else ""


def _norm(text: str) -> str:
    """An answer as compared: lower case, one space between words, no quotes, trailing full stop or $ sign."""
    text = " ".join(str(text).lower().split()).strip().strip("\"'").rstrip(".").strip()
    return text[1:] if text.startswith("$") else text


def written(name: str, arguments: dict) -> str:
    """An action in the text syntax (`click [25]`, `type [23] [2] [1]`): what a model without tools writes, and
    how a pictured frame names the action taken (the reference policy writes its text actions with it)."""
    return name + "".join(f" [{int(v) if isinstance(v, bool) else v}]" for v in arguments.values())


def _call_written(call: dict) -> str:
    """A parsed call (a tool call, or text read as one) in the text syntax; a call that could not be read, as such."""
    if call.get("type") != "function":
        return f"(unreadable) {call.get('error', '')}"[:200]
    args = call["function"]["arguments"]
    return written(call["function"]["name"], args if isinstance(args, dict) else {"": args})


def _text_actions(text: str) -> list[dict]:
    """The first action written as text (WebArena's syntax), as a tool call."""
    m = _ACTION.search(text)
    if m is None:
        return []
    verb, a, b, c = m.group(1).lower(), m.group(2), m.group(3), m.group(4)
    try:
        if verb == "click":
            args: dict = {"ref": int(a)}
        elif verb == "type":
            if b is None:
                raise ValueError("type needs [N] [text]")
            args = {"ref": int(a), "text": b, "submit": (c or "0").strip() in ("1", "true", "enter")}
        elif verb == "select":
            if b is None:
                raise ValueError("select needs [N] [option]")
            args = {"ref": int(a), "option": b}
        elif verb == "goto":
            args = {"url": a}
        else:
            args = {"text": a}
    except ValueError as e:
        return [{"type": "error", "error": f"could not read the action {m.group(0)!r}: {e}. {ACTIONS}"}]
    return [{"type": "function", "function": {"name": verb, "arguments": args}}]


def _playwright_chromium() -> bool:
    """Playwright's own Chromium is installed (`playwright install chromium`)."""
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            return os.path.exists(p.chromium.executable_path)
    except Exception:  # noqa: BLE001 - none to be had
        return False
