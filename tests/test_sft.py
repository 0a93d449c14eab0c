"""The warm start (tasks/sft.py, `warmup:`): SFT's loss and tokens against TRL's SFTTrainer driven directly, the masks
of demonstrations recorded through the episode loop (tasks/envs/runtime/demonstrations.py) against the episodes' own,
resume after a kill to the same weights, LoRA merged into v0, bad input refused, and the letters game through the
whole flow: recorded, warm-started, then RL from v0."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.core import builtin_models, layout
from tasks.core.config import load_config
from tasks.core.models import base_path, load_tokenizer
from tasks.core.store import Store
from tasks.envs.runtime.demonstrations import as_row, record
from tasks.sft import batch, demonstrations, sft, token_loss
from tests.conftest import AT_LENGTH, CHATML, TINY, run_cli, run_cli_many

ROOT = Path(__file__).resolve().parents[1]
LETTERS = ROOT / "configs" / "letters.yaml"


def _cfg(tmp_path: Path, demos: list[dict] | Path, *more: str, config: Path = TINY):
    path = demos if isinstance(demos, Path) else tmp_path / "demos.jsonl"
    if not isinstance(demos, Path):
        path.write_text("".join(json.dumps(d) + "\n" for d in demos))
    return load_config(config, [f"warmup.path={path}", f"store.uri={tmp_path / 'store'}", "run.name=warm",
                                *more])


STRINGS = [{"prompt": "a=", "completion": "bbb"}, {"prompt": "c=", "completion": "ddd"},
           {"prompt": "x=", "completion": "yyy and more"}]
MESSAGES = [{"messages": [{"role": "user", "content": "a="}, {"role": "assistant", "content": "bbb"}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "c="},
                          {"role": "assistant", "content": "ddd"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "ddd"}]}]


# ------------------------------------------------------------------------------------------ TRL parity

def _trl(model, tok, rows: list[dict], tmp_path: Path, **config):
    """TRL's SFTTrainer on `rows`: its tokenised dataset and its loss on the whole collated batch."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], max_length=None,
                     per_device_train_batch_size=len(rows), **config)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    data = [trainer.train_dataset[i] for i in range(len(rows))]
    inputs = trainer.data_collator(data)
    tokens = int((inputs["labels"][:, 1:] != -100).sum())
    model.train()
    loss = trainer.compute_loss(model, dict(inputs), num_items_in_batch=torch.tensor(tokens))
    return data, float(loss), tokens


@pytest.mark.parametrize("rows,assistant_only", [(STRINGS, True), (STRINGS, False), (MESSAGES, False)],
                         ids=["prompt-completion", "prompt-completion-every-token", "messages-every-token"])
def test_the_loss_and_tokens_are_trl_sfttrainers_on_the_same_batch(rows, assistant_only, tmp_path):
    """TRL's formats read unchanged give TRL's token ids and loss mask, and SFT's loss (the masked tokens' summed
    cross-entropy over their count) equals SFTTrainer.compute_loss on the same batch, in micro-batches too."""
    from tasks.core.models import load_model

    path = builtin_models.resolve("builtin:tiny-lm")
    tok, model = load_tokenizer(path), load_model(path)
    cfg = _cfg(tmp_path, rows, f"warmup.assistant_only={str(assistant_only).lower()}")
    demos = demonstrations(cfg, tok)
    data, trl_loss, tokens = _trl(model, tok, rows, tmp_path, completion_only_loss=assistant_only)
    for d, t in zip(demos, data):
        assert d.ids == t["input_ids"]
        assert d.mask == [int(label != -100) for label in t["labels"]]
    assert sum(sum(d.mask[1:]) for d in demos) == tokens
    ids, mask, attention = batch(demos, tok.pad_token_id, "cpu")
    ours, _ = token_loss(model, ids, mask, attention, tokens)
    assert float(ours) == pytest.approx(trl_loss, rel=1e-5)
    parts = [token_loss(model, *batch([d], tok.pad_token_id, "cpu"), tokens)[0] for d in demos]
    assert float(sum(parts)) == pytest.approx(trl_loss, rel=1e-5)


def test_a_conversation_is_the_episode_rendering_which_is_trls_less_what_follows_eos(chatml, tmp_path):
    """assistant_only (the default): a conversational prompt/completion is rendered as an episode of the same turns
    would be; TRL renders the same tokens with the template's end of turn after the EOS (which a model that
    stopped never writes) added, and masks the completion the same way up to there."""
    from tasks.core.models import load_model

    model = load_model(builtin_models.resolve("builtin:tiny-lm"))
    model.resize_token_embeddings(len(chatml))
    rows = [{"prompt": [{"role": "user", "content": "a="}], "completion": [{"role": "assistant", "content": "bbb"}]}]
    demo = demonstrations(_cfg(tmp_path, rows), chatml)[0]
    data, _, _ = _trl(model, chatml, rows, tmp_path)
    trl_ids, trl_mask = data[0]["input_ids"], [int(label != -100) for label in data[0]["labels"]]
    assert trl_ids[:len(demo.ids)] == demo.ids and trl_mask[:len(demo.ids)] == demo.mask
    assert demo.ids[-1] == chatml.eos_token_id and chatml.decode(trl_ids[len(demo.ids):]) == "\n"


def test_text_parts_are_their_text_to_a_text_models_template(chatml, tmp_path):
    """Content as a list of text parts (OpenAI's form) is, to a template that would write the list out as Python
    text (a text model's), the one string of their texts: the same tokens as the string (was: the model trained on
    "[{'type': 'text', ...}]"). Prompts alike (models.encode_prompt)."""
    from tasks.core.models import encode_prompt

    def row(content):
        return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "bbb"}]}

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "="}]
    as_parts, as_text = demonstrations(_cfg(tmp_path, [row(parts), row("a=")]), chatml)
    assert as_parts.ids == as_text.ids and as_parts.mask == as_text.mask
    assert "'type'" not in chatml.decode(as_parts.ids)
    prompt = [{"role": "user", "content": parts}]
    assert encode_prompt(chatml, prompt, 512) == encode_prompt(chatml, [{"role": "user", "content": "a="}], 512)


# ------------------------------------------------------------------------------------------ recorded demonstrations

def _model_with(tmp_path: Path, tok) -> Path:
    """The tiny model's folder with `tok` as its tokenizer (what a config names)."""
    dest = tmp_path / "model"
    shutil.copytree(builtin_models.resolve("builtin:tiny-lm"), dest)
    tok.save_pretrained(dest)
    return dest


def counter_policy(context: str) -> str:
    """tests/env_classes.py's Counter solved: increment by tool calls up to the target the prompt names."""
    done, target = context.count("counter is"), int(re.search(r"Reach (\d+)", context).group(1))
    return '<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call>' if done < target else "done"


@pytest.mark.parametrize("game", ["letters", "tools"])
def test_recorded_demonstrations_have_the_tokens_and_masks_of_the_episodes_rl_samples(game, chatml, tmp_path):
    """Episodes of a scripted policy through the episode loop, written as TRL `messages` rows (with `tools` where the
    environment declares them) and read back through datasets by the warm start: each row's ids and mask are the
    episode's own (the model's turns 1, the observations 0), as RL's train stage sees it."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "Say each letter I name.", "letters": s, "seed": i}) + "\n"
                            for i, s in enumerate(["abc", "dba", "cc"])))
    more = [f"data.path={rows}", "env.isolation=thread"]
    if game == "tools":
        more += [f"model.name_or_path={_model_with(tmp_path, chatml)}", "env.factory=tests.env_classes:Counter",
                 "env.max_turns=5", "generate.max_completion_length=80", "env.max_tokens=2000"]
    cfg = load_config(LETTERS, more)
    policy = "tests.test_sft:counter_policy" if game == "tools" else "tasks.envs.builtin.games:reference_action"
    kept, episodes, unrendered = record(cfg, policy)
    assert len(kept) == len(episodes) == 3 and unrendered == 0
    assert all(e.env_return == 1.0 for e in episodes)
    if game == "tools":
        assert json.loads(kept[0]["tools"])[0]["function"]["name"] == "increment"
        assert [m["role"] for m in kept[0]["messages"]] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tok = load_tokenizer(base_path(cfg))
    demos = demonstrations(cfg.model_copy(update={"warmup": _cfg(tmp_path, path).warmup}), tok)
    for d, e in zip(demos, episodes):
        assert d.ids == e.prompt_ids + e.completion_ids
        assert d.mask == [0] * len(e.prompt_ids) + e.mask
    assert as_row(episodes[0], tok, None)["messages"][-1]["role"] == "assistant"


# ------------------------------------------------------------------------------------------ training, resume, LoRA

def _letter_demos(tmp_path: Path) -> Path:
    cfg = load_config(LETTERS, ["env.isolation=thread"])
    kept, _, _ = record(cfg, "tasks.envs.builtin.games:reference_action", rows=list(range(16)))
    path = tmp_path / "letters-demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return path


def _weights(store_root: Path, run: str = "warm") -> dict[str, torch.Tensor]:
    return load_file(store_root / run / "policy" / "v000000" / "model.safetensors")


def test_a_warm_start_killed_mid_way_resumes_to_the_weights_of_one_never_killed(tmp_path):
    """SIGKILL after step 7 (its checkpoint is step 6's): the rerun restores model, AdamW and RNG from ckpt-6 and
    publishes the v0 a run never killed publishes, bit for bit; the warm start's checkpoints are gone after."""
    demos = _letter_demos(tmp_path)
    args = [f"warmup.path={demos}", "warmup.epochs=3", "warmup.batch_size=4", "warmup.micro_batch_size=2",
            "warmup.lr=1.0e-3", "warmup.checkpoint_every=3", "run.name=warm", "env.isolation=thread"]
    whole = tmp_path / "whole"
    sft(load_config(LETTERS, [*args, f"store.uri={whole}"]))
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "tasks.sft", "--config", str(LETTERS), "--iteration", "0",
           *(a for o in [*args, f"store.uri={killed}"] for a in ("-o", o))]
    env = {**os.environ, "RLFLOW_DRILL": "sft-step:7", "RLFLOW_DRILL_ONCE": str(tmp_path / "once")}
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    store = Store.open(str(killed))
    assert store.get_pointer(layout.latest("warm/sft", "trainer")) == layout.checkpoint("warm/sft", 6)
    assert store.manifest(layout.policy("warm", 0)) is None
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert store.list_folders("warm/sft/trainer") == []
    history = store.manifest(layout.policy("warm", 0))["meta"]["history"]
    assert [h["step"] for h in history] == list(range(1, 13)) and history[-1]["loss"] < history[0]["loss"]


def test_with_lora_the_adapter_is_merged_into_a_whole_v0(tmp_path):
    cfg = _cfg(tmp_path, MESSAGES, "train.lora_r=4", "warmup.lr=0.05", "warmup.epochs=3")
    out = sft(cfg)
    folder = tmp_path / "store" / "warm" / "policy" / "v000000"
    assert not (folder / "adapter_config.json").exists() and (folder / "model.safetensors").exists()
    base = load_file(Path(builtin_models.resolve("builtin:tiny-lm")) / "model.safetensors")
    v0 = _weights(tmp_path / "store")
    assert v0.keys() == base.keys() and any(not torch.equal(v0[k], base[k]) for k in base)
    assert out["metrics"]["sft/steps"] == 3


# ------------------------------------------------------------------------------------------ bad input

@pytest.mark.slow
def test_bad_demonstrations_are_one_line_exit_2_and_nothing_written(tmp_path, prefect_api):
    """Columns missing (or not those warmup.format names), roles that do not alternate (two assistant turns; a
    template that refuses them), a demonstration longer than the model's context, this run's own policy as the
    base, tools that are not schemas, a file that is not UTF-8 or is empty: one line each, naming the row or
    field, exit 2, no store."""
    strict = tmp_path / "strict"
    shutil.copytree(builtin_models.resolve("builtin:tiny-lm"), strict)
    tok_cfg = json.loads((strict / "tokenizer_config.json").read_text())
    (strict / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
        + CHATML.split("{% for m in messages %}", 1)[1].split("{% endfor %}", 1)[0] + "{% endfor %}")
    (strict / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok_cfg.items()
                                                              if k != "chat_template"}))
    user, bot = {"role": "user", "content": "a="}, {"role": "assistant", "content": "bbb"}
    cases = {
        "columns": ([{"question": "a=", "answer": "bbb"}], [], "expected a `messages` column, or `prompt` and "),
        "two_assistants": ([{"messages": [user, bot, bot]}], [], "row 1: two assistant messages in a row"),
        "template": ([{"messages": [user, user, bot]}], [f"model.name_or_path={strict}"],
                     "row 1: the chat template refused it: Conversation roles must alternate"),
        "two_assistants_not_learned": ([{"messages": [user, bot, bot, user, bot]}], ["warmup.assistant_only=false"],
                                       "row 1: two assistant messages in a row (messages 1 and 2)"),
        "tool_answering_nothing": ([{"messages": [user, {"role": "tool", "content": "42"}, bot]}], [],
                                   "row 1: message 1 (role tool) answers no tool call: it follows a user message"),
        "tool_first": ([{"prompt": [{"role": "tool", "content": "42"}], "completion": [bot]}], [],
                       "row 1: message 0 (role tool) answers no tool call: it follows nothing"),
        "too_long": ([{"messages": [user, {"role": "assistant", "content": "b" * 400}]}], [],
                     "tokens, above the model's context (max_position_embeddings) 256; a demonstration is never cut "
                     "(its end is what it teaches): shorten it"),
        "empty_completion": ([{"prompt": "a=", "completion": " "}], [],
                             "row 1: an empty completion (nothing to learn but the end of the text)"),
        "empty_assistant": ([{"messages": [user, {"role": "assistant", "content": ""}]}], [],
                            "row 1: every assistant message is empty or blank (nothing to learn but the end of a "
                            "turn)"),
        "max_length_above_context": ([{"messages": [user, bot]}], ["warmup.max_length=2000"],
                                     "warmup.max_length: 2000 tokens is above the model's context "
                                     "(max_position_embeddings) 256; expected at most 256"),
        "own_policy": ([{"messages": [user, bot]}], ["model.name_or_path={store}/warm/policy/v000003"],
                       "is a policy of this run (warm), not the base"),
        "own_policy_path": ([{"messages": [user, bot]}], ["model.name_or_path={path}/warm/policy/v000003/"],
                            "is a policy of this run (warm), not the base"),
        "own_policy_relative": ([{"messages": [user, bot]}], ["model.name_or_path=./store/warm/policy/v000003"],
                                "is a policy of this run (warm), not the base"),
        "tool_calls": ([{"messages": [user, {"role": "assistant", "content": "", "tool_calls": [{"foo": 1}]}]}], [],
                       "row 1: column 'messages' message 1: tool_calls[0] {\"foo\": 1}, expected a list of"),
        "tool_calls_text": ([{"messages": [user, {"role": "assistant", "tool_calls": "oops"}]}], [],
                            "message 1: tool_calls \"oops\", expected a list of"),
        "tool_calls_unwritten": ([{"messages": [user, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "click", "arguments": {"id": 3}}}]},
            {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}]}], [],
            "row 1: the model's chat template does not write tool_calls (a call would be learned as an empty turn)"),
        "image_part": ([{"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, bot]}], [],
                       "row 1: message 0: content parts of kinds ['image']; this model's chat template takes text"),
        "message_not_a_mapping": ([{"messages": [user, "bbb"]}], [],     # (said "got list": the list it is in)
                                  "row 1: column 'messages' message 1: expected a chat message ({role, content}), "
                                  "got str"),
        "number_prompt": ([{"prompt": "a=", "completion": "bbb"}, {"prompt": 5, "completion": "bbb"}], [],
                          "row 2: column 'prompt': expected a string or a list of chat messages, got int"),
        "row_not_object": (b'[1, 2, 3]\n{"prompt": "a=", "completion": "bbb"}\n', [],
                           "demos.jsonl: line 1: expected a JSON object (one row), got list"),
        "huge_number": (b'{"prompt": "a=", "completion": "bbb"}\n{"prompt": 1e400, "completion": "bbb"}\n', [],
                        "demos.jsonl: line 2: the number 1e400 is past a float's range (write it as a string)"),
        "huge_int": (b'{"prompt": "a=", "completion": "bbb"}\n{"prompt": 123456789012345678901234567890, '
                     b'"completion": "bbb"}\n', [], "demos.jsonl: line 2: the integer 123456789012345678901234... "
                                                    "does not fit in 64 bits"),
        "tools": ([{"messages": [user, bot], "tools": "not a list"}], [],
                  "row 1: column 'tools': expected a list of tool schemas (JSON objects naming a function"),
        "tools_unnamed": ([{"messages": [user, bot], "tools": [{"foo": 1}]}], [],
                          "row 1: column 'tools': expected a list of tool schemas (JSON objects naming a function"),
        "completion_no_assistant": ([{"prompt": [user], "completion": [{"role": "user", "content": "again"}]}], [],
                                    "row 1: the completion has no assistant message (nothing to learn)"),
        "format": ([{"messages": [user, bot]}], ["warmup.format=prompt_completion"],
                   "warmup.format: prompt_completion reads the columns `prompt` and `completion`, which "),
        "not_utf8": (b'{"messages": [{"role": "user", "content": "a\xff="}, {"role": "assistant", "content": "b"}]}\n',
                     [], "demos.jsonl: line 1: not UTF-8 text (invalid start byte at byte 44)"),
        "empty": (b"", [], "demos.jsonl: no rows (the file is empty)"),
        "blank_assistant": ([{"messages": [user, {"role": "assistant", "content": "   "}]}], [],
                            "row 1: every assistant message is empty or blank"),
        "blank_assistant_parts": ([{"messages": [user, {"role": "assistant", "content": [
            {"type": "text", "text": " \n"}]}]}], [], "row 1: every assistant message is empty or blank"),
        "key_twice": (b'{"messages": [], "messages": [{"role": "user", "content": "a="}, {"role": "assistant", '
                      b'"content": "b"}]}\n', [], "demos.jsonl: line 1: key 'messages' appears twice in one object"),
        "part_not_a_mapping": ([{"messages": [user, {"role": "assistant", "content": [1, "bbb"]}]}], [],
                               "row 1: column 'messages' message 1: content part 0 1, expected a mapping with a "
                               "\"type\""),
        "assistant_no_tokens": ([{"messages": [user, {"role": "assistant", "content": "\u65e5\u672c"}]}], [],
                                "row 1: no token to learn but the end of a turn: its completion or assistant turns "
                                "are empty, or no tokens of this model's vocabulary"),
        "eos_in_a_turn": ([{"messages": [user, {"role": "assistant", "content": "bb</s>b"}]}], [],
                          "row 1: column 'messages' message 1: holds '</s>', this model's special token"),
        "a_turn_made_up": ([{"prompt": [user], "completion": [{"role": "assistant", "content": "b</s><s>user: hi"}]}],
                           [], "row 1: column 'completion' message 0: holds '</s>', this model's special token"),
    }
    calls = []
    for name, (rows, more, _) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "demos.jsonl").write_bytes(rows if isinstance(rows, bytes) else
                                             "".join(json.dumps(r) + "\n" for r in rows).encode())
        more = [m.replace("{store}", f"file://{folder / 'store'}").replace("{path}", str(folder / "store"))
                for m in more]
        calls.append((["sft", str(TINY), "-o", f"warmup.path={folder / 'demos.jsonl'}", "-o",
                       f"store.uri={folder / 'store'}", "-o", "run.name=warm", *(a for m in more for a in ("-o", m))],
                      folder))
    for (name, (_, _, want)), out in zip(cases.items(), run_cli_many(calls, prefect_api)):   # forks of one import
        store = tmp_path / name / "store"
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and want in lines[0], (name, out.stderr[-2000:])
        assert lines[0].startswith("error: warmup.") or lines[0].startswith("error: model.name_or_path")
        assert not store.exists(), name


def test_a_warm_start_that_cannot_come_first_or_resume_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The preflight (what `rlflow run` and `rlflow plan` ask) refuses a warm start that the stage would refuse only
    once under way: a run that has iterations already (v0 would come after them), a checkpoint of the warm start
    made with other settings (naming them). Once v0 is made its demonstrations may go (RL needs them no more), not
    change; a kill between v0's commit and the checkpoints' deletion leaves none for good."""
    from flows.preflight import check_warmup
    from tasks.core.errors import UserError

    cfg = _cfg(tmp_path, MESSAGES, "warmup.epochs=3", "warmup.batch_size=1", "warmup.checkpoint_every=1")
    store = Store.open(str(tmp_path / "store"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "rollouts.parquet").write_bytes(b"x")
    store.put_folder(layout.rollouts("warm", 1), tmp_path / "out", meta={})
    with pytest.raises(UserError, match=r"^warmup: run warm has iterations already, trained from builtin:tiny-lm "
                                        r"without a warm start"):
        check_warmup(cfg)
    store.delete_folder(layout.rollouts("warm", 1))

    def killed(point: str, step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr("tasks.sft.drill", killed)
    with pytest.raises(KeyboardInterrupt):
        sft(cfg)
    monkeypatch.undo()
    other = _cfg(tmp_path, MESSAGES, "warmup.epochs=3", "warmup.batch_size=1", "warmup.checkpoint_every=1",
                 "warmup.lr=1e-3")
    with pytest.raises(UserError, match=r"^warmup: .*ckpt-000001 \(a checkpoint of this run's warm start\) was made "
                                        r"from other demonstrations or settings: warmup.lr "):
        check_warmup(other)
    check_warmup(cfg)
    sft(cfg)
    (tmp_path / "left").mkdir()
    (tmp_path / "left" / "state.json").write_text("{}")
    store.put_folder(layout.checkpoint("warm/sft", 2), tmp_path / "left", meta={})
    demos = tmp_path / "demos.jsonl"
    demos.rename(tmp_path / "away.jsonl")
    check_warmup(cfg)                                       # gone: v0 stands
    assert sft(cfg)["key"] == layout.policy("warm", 0) and store.list_folders("warm/sft/trainer") == []
    demos.write_text((tmp_path / "away.jsonl").read_text() + json.dumps(MESSAGES[0]) + "\n")
    with pytest.raises(UserError, match=r"^warmup.path: .*demos.jsonl changed since the run's v0 was made from it"):
        check_warmup(cfg)


# ------------------------------------------------------------------------------------------ the flow

@AT_LENGTH               # (~60 s; tests/test_browser.py's small shop run is CI's record -> SFT -> RL)
@pytest.mark.slow
@pytest.mark.drill
def test_the_letters_game_recorded_warm_started_then_rl_from_v0_through_the_flow(tmp_path, prefect_api):
    """`rlflow record` writes the reference policy's episodes; `rlflow run` with warmup: trains v0 on them first
    (sft metrics in MLflow at their steps), then every iteration starts from it; a second run reuses v0 and its
    held-out baseline is v0's: the warm start alone solves most of the game the base model cannot."""
    demos = tmp_path / "demos.jsonl"
    out = run_cli(["record", str(LETTERS), "--policy", "tasks.envs.builtin.games:reference_action", "--out",
                   str(demos), "--rows", "0-39", "-o", "env.isolation=thread"], tmp_path, prefect_api)
    assert out.returncode == 0 and "40 demonstrations of 40 episodes" in out.stderr, out.stderr[-2000:]
    args = ["run", str(LETTERS), "-o", "run.iterations=2", "-o", "generate.prompts_per_iteration=4",
            "-o", "env.isolation=thread", "-o", f"warmup={{path: {demos}, epochs: 16, batch_size: 8, "
            "micro_batch_size: 8, lr: 3.0e-3, lr_schedule: constant}", "-o", "eval.every=2",
            "-o", "eval.baseline=true", "-o", "eval.split=train", "--summary-json", str(tmp_path / "summary.json")]
    first = run_cli(args, tmp_path, prefect_api, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "sft step    80/80" in first.stderr
    store = Store.open(str(tmp_path / "rlflow-store"))
    v0 = store.manifest(layout.policy("letters-demo", 0))
    assert v0["meta"]["metrics"]["sft/steps"] == 80 and v0["meta"]["metrics"]["sft/token_accuracy"] > 0.9
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iterations_completed"] == 2 and summary["held_out"]["0"] > 0.6     # v0's: warm started
    assert "starting policy: " in first.stdout and "base model" not in first.stdout    # (v0 is no base model)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(summary["mlflow_run_id"], "sft/loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, 81))
    again = run_cli(args, tmp_path, prefect_api, timeout=600)
    assert again.returncode == 0 and "sft step" not in again.stderr, again.stderr[-3000:]
    assert len(client.get_metric_history(summary["mlflow_run_id"], "sft/loss")) == 80


@pytest.mark.slow
def test_the_deepspeed_group_warm_starts_to_the_torch_engines_weights(tmp_path, monkeypatch):
    """train.engine deepspeed (two processes, ZeRO 2, a checkpoint every 2 steps): the demonstrations split over the
    processes, the loss normalised by the whole step's token count, give the torch engine's v0 (fp32 on CPU, up to
    summation order), the last step's one demonstration too (process 1 joins it with a weightless pass); nothing of
    its checkpoints (nor their shards) is left once v0 is published."""
    demos = _letter_demos(tmp_path)
    # warmup.path relative to the working directory, and a decoy of its name in $TMPDIR (where the group's config
    # once went: load_config looks beside the config file first)
    monkeypatch.chdir(demos.parent)
    decoy = tmp_path / "tmpdir"
    decoy.mkdir()
    (decoy / demos.name).write_text(demos.read_text().splitlines(keepends=True)[0])
    monkeypatch.setenv("TMPDIR", str(decoy))
    monkeypatch.setattr("tempfile.tempdir", None)
    args = [f"warmup.path={demos.name}", "warmup.epochs=1", "warmup.batch_size=3", "warmup.micro_batch_size=2",
            "warmup.lr=1.0e-3", "warmup.checkpoint_every=2", "run.name=warm", "env.isolation=thread"]
    sft(load_config(LETTERS, [*args, f"store.uri={tmp_path / 'torch'}"]))
    out = sft(load_config(LETTERS, [*args, f"store.uri={tmp_path / 'ds'}", "train.engine=deepspeed",
                                    "train.num_processes=2", "train.zero_stage=2"]))
    assert out["metrics"]["sft/steps"] == 6          # 16 demonstrations: 5 steps of 3, then one of 1
    a, b = _weights(tmp_path / "torch"), _weights(tmp_path / "ds")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
    store = Store.open(str(tmp_path / "ds"))
    assert store.list_folders("warm/sft/trainer") == [] and all(
        store.list_folders(f"warm/sft/trainer-state/{f}") == [] for f in store.list_folders("warm/sft/trainer-state"))


def test_rlflow_sft_alone_publishes_v0_and_finishes_its_mlflow_run_with_the_steps(tmp_path, monkeypatch, capsys):
    """`rlflow sft` (flows/warmup.py: sft_command): v0 under the lease, every step's sft/* metric at its step, the
    MLflow run then FINISHED; a second call reuses v0 and logs nothing twice."""
    from mlflow.tracking import MlflowClient

    from flows.warmup import sft_command
    from tasks.core.tracking import TAG_RUN

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, MESSAGES, "warmup.epochs=3", "warmup.batch_size=1", f"tracking.uri=sqlite:///{tmp_path}/m.db")
    assert sft_command(cfg) == 0 and sft_command(cfg) == 0
    assert "v0: file://" in capsys.readouterr().out
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             filter_string=f"tags.`{TAG_RUN}` = 'warm'")[0]
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")) == [1, 2, 3, 4, 5, 6]


def test_the_text_format_can_be_named_as_auto_finds_it(tmp_path):
    """warmup.format text (TRL's language-modeling rows): every token learned; auto finds the column too."""
    rows = [{"text": "a=bbb"}, {"text": "c=ddd"}]
    named = _cfg(tmp_path, rows, "warmup.format=text")
    demos = demonstrations(named, load_tokenizer(base_path(named)))
    auto = demonstrations(_cfg(tmp_path, rows), load_tokenizer(base_path(named)))
    assert [d.ids for d in demos] == [d.ids for d in auto] and all(all(d.mask) for d in demos)


def test_the_turn_limit_that_cuts_demonstrations_is_part_of_v0s_inputs(tmp_path, monkeypatch):
    """With an environment the demonstrations' model turns are cut at generate.max_completion_length (where an
    episode's are): v0 made under one limit is not taken under another (one line), and a v0 made before the limit
    was fingerprinted (legacy) is still taken."""
    import tasks.sft as sft_module
    from tasks.core.errors import UserError
    from tasks.sft import made_v0

    demos = _letter_demos(tmp_path)
    args = [f"warmup.path={demos}", "warmup.epochs=1", "warmup.batch_size=8", "run.name=warm",
            "env.isolation=thread"]
    cfg = load_config(LETTERS, [*args, f"store.uri={tmp_path / 'store'}"])
    sft(cfg)
    store = Store.open(str(tmp_path / "store"))
    assert made_v0(cfg, store) is not None
    other = load_config(LETTERS, [*args, f"store.uri={tmp_path / 'store'}", "generate.max_completion_length=4"])
    with pytest.raises(UserError, match=r"made from a different config or input: the same config, other inputs "
                                        r"\(turn_limit\)"):
        made_v0(other, store)
    original = sft_module.v0_fingerprint
    monkeypatch.setattr(sft_module, "v0_fingerprint", lambda c, s=None, legacy=False: original(c, s, legacy=True))
    old = load_config(LETTERS, [*args, f"store.uri={tmp_path / 'legacy'}"])
    sft(old)
    monkeypatch.undo()
    assert made_v0(old, Store.open(str(tmp_path / "legacy"))) is not None


def test_an_empty_warmup_path_in_a_config_file_is_refused_as_empty(tmp_path):
    """`path: ''` written in a config file was resolved against the file's folder (which exists): the warm start
    then named that folder as its data file, after the model loaded."""
    from tasks.core.errors import UserError

    config = tmp_path / "c.yaml"
    config.write_text(TINY.read_text() + "\nwarmup: {path: ''}\n")
    with pytest.raises(UserError, match=r"warmup.path: string should have at least 1 character"):
        load_config(config, [])


def test_a_warm_up_as_long_as_the_steps_is_refused():
    """warmup.lr_warmup_steps at or past warmup.max_steps: the lr would never reach warmup.lr (was accepted)."""
    from tasks.core.errors import UserError

    with pytest.raises(UserError, match=r"warmup: lr_warmup_steps 5 is not below max_steps 5"):
        load_config(TINY, ["warmup={path: x.jsonl, lr_warmup_steps: 5, max_steps: 5}"])
    assert load_config(TINY, ["warmup={path: x.jsonl, lr_warmup_steps: 4, max_steps: 5}"]).warmup.max_steps == 5


def test_demonstrations_of_held_out_eval_prompts_are_refused_before_anything_is_written(tmp_path):
    """A warm start trained on demonstrations of the held-out eval prompts (`rlflow record --split eval`, then SFT),
    and the held-out score became a training score: such a file is refused by the preflight (one line: warmup.path,
    the first such row, how many), whatever case, spacing or chat form its prompts take; demonstrations of training
    prompts are taken; without a held-out evaluation nothing is compared."""
    from flows.preflight import check_warmup
    from tasks.core.errors import UserError

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in "abc"))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"prompt": f"{p} =", "answer": "x"}) + "\n" for p in "de"))
    held = ("eval.every=1", f"data.path={tmp_path}/train.jsonl", f"eval.path={tmp_path}/held.jsonl")
    demos = [{"prompt": "a", "completion": "bbb"}, {"prompt": "D  =", "completion": "eee"},
             {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " e ="}],
              "completion": [{"role": "assistant", "content": "fff"}]}]
    cfg = _cfg(tmp_path, demos, *held)
    with pytest.raises(UserError) as e:
        check_warmup(cfg)
    assert str(e.value) == (f"warmup.path: {tmp_path}/demos.jsonl row 2: a demonstration of a held-out eval prompt "
                            f"(eval.path {tmp_path}/held.jsonl), as 2 of its 3 are; the warm start would train on "
                            f"what the held-out score measures: expected demonstrations of training prompts (rlflow "
                            f"record --split train), or those rows left out")
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.json"))
    (tmp_path / "train_demos.jsonl").write_text(json.dumps(demos[0]) + "\n")
    check_warmup(_cfg(tmp_path, tmp_path / "train_demos.jsonl", *held))             # training prompts: taken
    check_warmup(_cfg(tmp_path, demos, f"data.path={tmp_path}/train.jsonl"))          # eval on the training set


def test_sft_metrics_cut_short_by_a_kill_are_completed_on_the_next_call(tmp_path, monkeypatch):
    """A kill after the first of log_metrics' batches (1000 metrics: 200 steps of 5 keys) left every later step
    unlogged for good: the next call saw sft/loss present and logged nothing. Now each key's missing steps are
    logged, none twice (the cut made here in MLflow's database: steps 3-6 of every key gone, as after the kill)."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from flows.warmup import sft_command
    from tasks.core.tracking import TAG_RUN

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, MESSAGES, "warmup.epochs=3", "warmup.batch_size=1", f"tracking.uri=sqlite:///{tmp_path}/m.db")
    assert sft_command(cfg) == 0
    with sqlite3.connect(tmp_path / "m.db") as db:
        assert db.execute("DELETE FROM metrics WHERE key LIKE 'sft/%' AND step > 2").rowcount > 0
    assert sft_command(cfg) == 0
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             filter_string=f"tags.`{TAG_RUN}` = 'warm'")[0]
    for key in ("sft/loss", "sft/lr", "sft/tokens"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3, 4, 5, 6], key


def test_recorded_rows_are_written_whole_or_not_at_all_under_a_temporary_name_of_their_own(tmp_path):
    from tasks.envs.runtime.demonstrations import write

    out = tmp_path / "demos.jsonl"
    write([{"messages": [{"role": "user", "content": "hi"}]}], out)
    before = out.read_bytes()
    theirs = tmp_path / "demos.jsonl.partial"          # (a name another writer, or the user, may hold)
    theirs.write_text("someone else's")
    with pytest.raises(TypeError):
        write([{"messages": []}, {"messages": object()}], out)       # (the second row cannot be written)
    assert out.read_bytes() == before, "a failed write left a changed file under the final name"
    assert theirs.read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demos.jsonl", "demos.jsonl.partial"]
    left = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    killed = tmp_path / f".demos.jsonl.tmp-{host}-{int(left.stdout)}-0123abcd"   # (a writer killed: its pid gone)
    killed.write_text('{"messages": []}\n{"mess')
    running = tmp_path / f".demos.jsonl.tmp-{host}-{os.getpid()}-4567cdef"       # (one that still writes)
    elsewhere = tmp_path / f".demos.jsonl.tmp-{host}x-{int(left.stdout)}-89abcdef"   # (another machine's)
    for f in (running, elsewhere):
        f.write_text("")
    write([{"messages": []}], out)
    assert out.read_text() == '{"messages": []}\n' and theirs.read_text() == "someone else's"
    assert not killed.exists() and running.exists() and elsewhere.exists()
    odd = tmp_path / "demos[1].jsonl"                  # (a name glob would read as a pattern: its own are swept)
    (tmp_path / f".demos[1].jsonl.tmp-{host}-{int(left.stdout)}-0123abcd").write_text("")
    write([{"messages": []}], odd)
    assert not (tmp_path / f".demos[1].jsonl.tmp-{host}-{int(left.stdout)}-0123abcd").exists() and odd.exists()


KILLS_ITSELF = '''import os, signal
from tasks.envs.builtin.games import reference_action
calls = 0


def policy(context):
    global calls
    calls += 1
    if calls == int(os.environ.get("KILL_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGKILL)        # (a kill mid-recording: nothing of its own runs)
    with open(os.environ["CALLS_LOG"], "a") as f:
        f.write("call\\n")
    return reference_action(context)
'''


def test_a_recording_killed_midway_goes_on_from_its_last_chunk_and_writes_what_a_whole_one_writes(tmp_path):
    """`rlflow record` SIGKILLed in its second chunk of episodes (CHUNK_EPISODES; rows named twice: each is
    recorded twice), then run again with the same arguments: it says it goes on, runs only the rows the kill
    left, and writes byte for byte what an uninterrupted recording writes; its progress is gone after. Was:
    everything recorded before the kill was lost (held in memory until the end). A recording with other arguments
    that fails leaves the first one's progress as it was; the same recording twice at once is refused in one line."""
    import fcntl

    from tasks.envs.runtime.demonstrations import CHUNK_EPISODES

    (tmp_path / "killer.py").write_text(KILLS_ITSELF)
    out, whole = tmp_path / "demos.jsonl", tmp_path / "whole.jsonl"

    def rec(dest: Path, *more: str, **env) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", "record", str(LETTERS), "--policy", "killer:policy",
                               "--out", str(dest), "--rows", "0-63,0-63", "-o", "env.isolation=thread", *more],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "CALLS_LOG": str(tmp_path / "log"),
                                   **env})

    assert CHUNK_EPISODES == 64                      # (the kill below falls in the second chunk: the rows again)
    killed = rec(out, KILL_AT_CALL=str(64 * 3 + 40))        # (3 turns an episode)
    assert killed.returncode == -signal.SIGKILL and not out.exists(), killed.stderr[-2000:]
    (progress,) = [p for p in tmp_path.iterdir() if p.name.endswith(".progress")]
    before = progress.read_bytes()
    other = rec(out, "--n", "2", "-o", "data.path=nosuch.jsonl")        # (another recording, refused)
    assert other.returncode == 2 and progress.read_bytes() == before, other.stderr[-2000:]
    with open(progress) as held:                     # (held as a recording holds it)
        fcntl.flock(held, fcntl.LOCK_EX)
        refused = rec(out)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        f"error: --out: {out}: this recording is being made already"), refused.stderr[-2000:]
    (tmp_path / "log").unlink()
    again = rec(out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "going on from an interrupted recording: 64 rows (64 episodes)" in again.stderr
    assert len((tmp_path / "log").read_text().split()) == 64 * 3     # (only the rest ran)
    assert "128 demonstrations of 128 episodes" in again.stderr
    assert rec(whole).returncode == 0
    assert out.read_bytes() == whole.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_recordings_progress_keeps_whole_lines_only(tmp_path):
    """A kill can cut the progress's last line anywhere, also just before its newline (the line then parses): only
    lines ended by their newline are taken, the rest cut away, and the next chunk starts a line of its own (was:
    the file grew a NUL byte and the next chunk was glued to it, lost at the following resume)."""
    import json as _json

    from tasks.envs.runtime.demonstrations import RecordingProgress

    out = tmp_path / "demos.jsonl"
    whole = _json.dumps({"done": 2, "kept": [{"messages": []}], "episodes": 2, "unrendered": 0})
    cut = _json.dumps({"done": 4, "kept": [], "episodes": 2, "unrendered": 0})
    path = tmp_path / ".demos.jsonl.job.progress"
    path.write_text(whole + "\n" + cut)                  # (a kill before the last newline)
    with pytest.raises(KeyboardInterrupt):
        with RecordingProgress(out, "job") as again:
            assert again.path == path and (again.done, again.episodes, len(again.kept)) == (2, 2, 1)
            again.add(4, [], 2, 0)
            lines = path.read_text().split("\n")
            assert [_json.loads(x)["done"] for x in lines[:-1]] == [2, 4] and lines[-1] == ""
            raise KeyboardInterrupt                         # (stopped: its progress kept)
    assert path.exists()


@pytest.mark.slow
def test_a_lora_warm_start_on_zero_3_merges_into_the_torch_engines_v0(tmp_path):
    """train.engine deepspeed, ZeRO 3, LoRA: the adapter is merged into a base loaded whole. It was loaded in the
    process where ZeRO-3 has from_pretrained partition every weight (size 0 here), and the merge failed with a
    traceback after the training was done."""
    args = ["train.lora_r=4", "warmup.lr=0.05", "warmup.epochs=2"]
    sft(_cfg(tmp_path, MESSAGES, *args, f"store.uri={tmp_path / 'torch'}"))
    sft(_cfg(tmp_path, MESSAGES, *args, f"store.uri={tmp_path / 'ds'}", "train.engine=deepspeed",
             "train.zero_stage=3"))
    a, b = _weights(tmp_path / "torch"), _weights(tmp_path / "ds")      # (fp32, up to summation order: 1.1e-5 seen)
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-4 for k in a)
