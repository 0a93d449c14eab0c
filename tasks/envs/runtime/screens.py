"""Pictures of evaluated episodes: an environment that can picture its pages (a factory taking `screenshots`, the
browser's) keeps a frame per action in its state, {"action", "url", "jpeg" (base64)}; the evaluate stage turns
that on (`with_screenshots`, eval.screenshots) and `file_frames` takes the frames out of the records (they would
swell every record) into the evaluation's folder:

    <run>/eval/vN/screens/index.json            the pictured episodes: prompt, return, frames (file, action, url)
    <run>/eval/vN/screens/e00/s00.jpg ...       the page before each action, full size
    <run>/eval/vN/screens/e00.jpg               the episode's strip: its frames side by side, small

The flow logs the folder to MLflow (artifacts `screens/vN`) and shows the first strips in the Prefect report.
More: docs/internals.md (tasks/envs/runtime/screens.py).
"""

from __future__ import annotations

import base64
import inspect
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.paths import import_user
from tasks.envs.runtime.protocol import PICTURES

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Rollout

FOLDER = "screens"
INDEX = "index.json"
KEY = PICTURES                   # the environment's attribute, so its state's key (kept whatever its size)
THUMB_HEIGHT = 240               # a strip's frames, in pixels (half the browser's pictured 800 x 480)


def takes_screenshots(cfg: Config) -> bool:
    """env.factory accepts `screenshots`, and the stage makes the environments (env.where: stage; an environment
    server's are made with its own env.kwargs)."""
    from tasks.core.placement import placement_of

    if placement_of(cfg).env != "stage":
        return False
    try:
        made = import_user(cfg.env.factory, "env.factory", by_name=True)
        return all("screenshots" in inspect.signature(make).parameters
                   for make in (made.values() if isinstance(made, dict) else [made]))
    except Exception:  # noqa: BLE001 - a factory that cannot be inspected pictures nothing (preflight says why)
        return False


def with_screenshots(cfg: Config) -> Config:
    """The config an evaluation pass runs with to be pictured: env.kwargs.screenshots true."""
    env = cfg.env.model_copy(update={"kwargs": {**cfg.env.kwargs, "screenshots": True}})
    return cfg.model_copy(update={"env": env})


def file_frames(records: list[Rollout], folder: Path, limit: int) -> int:
    """Take every record's frames out of its env_state (the state keeps their count, `screens`); the first
    `limit` episodes that have any are written under folder/screens. Returns how many were."""
    index = []
    for r in records:
        state = r.env_state if isinstance(r.env_state, dict) else {}
        frames = state.pop(KEY, None) or []
        if frames:
            state[KEY] = len(frames)
        if not frames or len(index) >= limit:
            continue
        n = len(index)
        where = folder / FOLDER / f"e{n:02d}"
        where.mkdir(parents=True)
        shots, kept = [], []
        for i, f in enumerate(frames):
            jpeg = base64.b64decode(f["jpeg"])
            (where / f"s{i:02d}.jpg").write_bytes(jpeg)
            shots.append(jpeg)
            kept.append({"file": f"e{n:02d}/s{i:02d}.jpg", "action": f.get("action", ""), "url": f.get("url", "")})
        (folder / FOLDER / f"e{n:02d}.jpg").write_bytes(strip(shots))
        index.append({"episode": n, "row": r.row, "prompt": _prompt_text(r.prompt), "return": r.env_return,
                      "reward": r.reward, "strip": f"e{n:02d}.jpg", "frames": kept})
    if index:
        (folder / FOLDER / INDEX).write_text(json.dumps(index, indent=1))
    return len(index)


def strip(jpegs: list[bytes], height: int = THUMB_HEIGHT) -> bytes:
    """The frames side by side, each `height` pixels high, numbered from 1 in their corner (JPEG)."""
    from PIL import Image, ImageDraw

    thumbs = []
    for data in jpegs:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        thumbs.append(im.resize((max(1, round(im.width * height / im.height)), height)))
    gap = 6
    out = Image.new("RGB", (sum(t.width for t in thumbs) + gap * max(len(thumbs) - 1, 0) or 1, height), "white")
    x = 0
    draw = ImageDraw.Draw(out)
    for i, t in enumerate(thumbs, 1):
        out.paste(t, (x, 0))
        draw.rectangle((x, 0, x + t.width - 1, height - 1), outline="gray")
        draw.rectangle((x, height - 16, x + 18, height - 1), fill="black")
        draw.text((x + 4, height - 14), str(i), fill="white")
        x += t.width + gap
    buf = io.BytesIO()
    out.save(buf, "JPEG", quality=70)
    return buf.getvalue()


def load_index(folder: Path) -> list[dict]:
    """A folder's pictured episodes (index.json), [] when it has none."""
    path = Path(folder) / FOLDER / INDEX
    return json.loads(path.read_text()) if path.is_file() else []


def _prompt_text(prompt) -> str:
    """The task's words: a chat prompt's last user message, cut to a line's length."""
    if isinstance(prompt, list):
        prompt = next((m.get("content") for m in reversed(prompt) if m.get("role") == "user"), "")
    text = str(prompt or "")
    if "Task: " in text:                       # (the browser's first message: the actions, then the task)
        text = text.split("Task: ", 1)[1].split("\n", 1)[0]
    return text[:300]
