"""Agents as users write them (env.agent), for tests/test_agents.py: the plain openai client, sync and async, a
tool-using one, one that edits its history, and ones that fail in every way an agent can."""

from __future__ import annotations

import os
import time

import openai


async def say_letters(row, base_url, api_key):
    """The letters game as an agent: name a letter, the model says it back; one point per letter said."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": f"{row['prompt']} {row['letters'][0]}"}]
    score = 0.0
    for i, letter in enumerate(row["letters"]):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
        said = reply.choices[0].message.content or ""
        score += said.strip()[:1] == letter
        messages.append({"role": "assistant", "content": said})
        if i + 1 < len(row["letters"]):
            messages.append({"role": "user", "content": row["letters"][i + 1]})
    return score / len(row["letters"])


async def picky_letters(row, base_url, api_key):
    """The letters game asking each call for its own sampling settings (within env.endpoint's bounds): greedy,
    cooler and narrower, the run's, hotter."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": f"{row['prompt']} {row['letters'][0]}"}]
    asks = [{"temperature": 0.0}, {"temperature": 0.5, "top_p": 0.8}, {}, {"temperature": 1.4, "top_p": 0.6}]
    for i, letter in enumerate(row["letters"]):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                                     **asks[(i + row["seed"]) % len(asks)])
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": letter}]
    return 1.0


def sync_letters(row, base_url, api_key):
    """The same with the synchronous client, reporting its reward through /rl/set_reward."""
    import httpx

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    httpx.post(base_url.removesuffix("/v1") + "/rl/set_reward", json={"reward": 0.5, "info": {"by": "set_reward"}},
               headers={"Authorization": f"Bearer {api_key}"})


def editor(row, base_url, api_key):
    """Summarises its history after the first turn: the second call does not extend the first (step-wise)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": "Earlier you said: " + (first.choices[0].message.content or "")[:5]}])
    return 1.0, {"edited": True}




def unruly(row, base_url, api_key):
    """What the row's `mode` says, after one model call: return 1.0, raise, die, hang (blocking: `hang` in its
    coroutine, `sync_hang` in a plain function's thread; or awaiting, `async_hang`) or return garbage."""
    if row["mode"] == "sync_hang":
        openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        time.sleep(3600)
    return _unruly(row, base_url, api_key)


async def _unruly(row, base_url, api_key):
    import asyncio

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    mode = row["mode"]
    if mode == "raise":
        raise ValueError("the agent broke")
    if mode == "user_error":                # (the config's mistake, found by the agent: the run's one line)
        from tasks.core.errors import UserError

        raise UserError("env.agent: the agent needs a column 'level'")
    if mode == "exit":
        os._exit(3)
    if mode == "hang":
        time.sleep(3600)                    # blocks its process: killed
    if mode == "async_hang":
        await asyncio.sleep(3600)
    if mode == "garbage":
        return "not a reward"
    if mode == "huge":
        return 10 ** 400                    # (past a float's range)
    if mode == "tensor":                    # (refused as what it is; from a process: was "died (exit 0)")
        import torch

        return torch.tensor(0.5)
    if mode == "numpy":                     # (a real number: taken)
        import numpy

        return numpy.float32(0.5)
    if mode == "chatty_fd":                 # 4 MiB past print (os.write)
        for _ in range(4):
            os.write(1, b"x" * (1 << 20))
    if mode == "chdir":                     # (its own process's directory: fine; the stage's: refused)
        os.chdir("/")
    if mode == "no_path":                   # (the stage's sys.path: put back after its call)
        import sys

        sys.path[:] = []
    if mode == "child_exit":                # sys.exit() in a task it started, not in its own coroutine
        await asyncio.gather(asyncio.sleep(0), _exits())
    return 1.0


async def _exits():
    import sys

    sys.exit(4)


async def jittery(row, base_url, api_key):
    """say_letters with pauses of its own between calls that differ from run to run."""
    import asyncio
    import random

    await asyncio.sleep(random.random() * 0.05)
    # (closed as it ends: an ended episode's connection, left to the garbage collector, held two descriptors of the
    # stage's process, one per side, for as long as that took; near the process's descriptor limit a later
    # episode's connect failed with EMFILE, the episode ended early and the rounds after it were of other sizes)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(len(row["letters"])):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            await asyncio.sleep(random.random() * 0.05)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "next"}]
    return float(len(reply.choices[0].message.content or ""))


KEPT: list = []        # the clients kept_open's episodes left open (a test lets them go)


async def kept_open(row, base_url, api_key):
    """One call with a client it never closes (kept, as a cache of clients would keep it)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    KEPT.append(client)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


def calls_on(row, base_url, api_key):
    """Keeps calling the model, past the endpoint's refusals, a few hundred times, and returns nothing."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for _ in range(300):
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        except openai.BadRequestError:
            pass


def two_args(row, base_url):
    return 0.0
