"""A user's mistake ends with one line on stderr naming the field or row, exit code 2, and nothing written
to the store."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from tasks.config import load_config
from tasks.errors import UserError
from tests.conftest import TINY, run_cli, s3_overrides

pytestmark = pytest.mark.slow


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "unknown.yaml").write_text(TINY.read_text() + "\nbogus_section: {x: 1}\n")
    (tmp / "badyaml.yaml").write_text("run: [unclosed\n")
    (tmp / "nocol.jsonl").write_text(json.dumps({"question": "a=", "answer": "bbb"}) + "\n")
    (tmp / "badrow.jsonl").write_text(json.dumps({"prompt": 5, "answer": "bbb"}) + "\n")
    return {
        "missing config file": (["run", str(tmp / "nope.yaml")], "config: file not found"),
        "not yaml": (["run", str(tmp / "badyaml.yaml")], "not valid YAML"),
        "unknown section": (["run", str(tmp / "unknown.yaml")], "unknown key 'bogus_section'"),
        "unknown key by override": (["run", str(TINY), "-o", "train.learning_rate=1"], "unknown key 'train.learning_rate'"),
        "wrong type": (["run", str(TINY), "-o", "train.lr=fast"], "train.lr"),
        "out of bounds": (["run", str(TINY), "-o", "generate.num_generations=1"], "generate.num_generations"),
        "bad loss type": (["run", str(TINY), "-o", "train.loss_type=ppo"], "train.loss_type"),
        "override syntax": (["run", str(TINY), "-o", "train.lr"], "expected key=value"),
        "reward module missing": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "nosuchmod:f"}]'],
                                  "reward.functions[0].fn: cannot import module 'nosuchmod'"),
        "reward function missing": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "tasks.rewards.demo:nope"}]'],
                                    "reward.functions[0].fn: 'tasks.rewards.demo' has no function 'nope'"),
        "reward path syntax": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "no colon"}]'], "reward.functions.0.fn"),
        "missing data file": (["run", str(TINY), "-o", f"data.path={tmp}/missing.jsonl"], "data.path"),
        "missing prompt column": (["run", str(TINY), "-o", f"data.path={tmp}/nocol.jsonl"],
                                  "data.prompt_column: column 'prompt' not in"),
        "wrong prompt type": (["run", str(TINY), "-o", f"data.path={tmp}/badrow.jsonl"], "row 0 column 'prompt'"),
        "model folder missing": (["run", str(TINY), "-o", f"model.name_or_path={tmp}/nomodel"], "model.name_or_path"),
        "store scheme": (["run", str(TINY), "-o", "store.uri=gs://bucket"], "store.uri"),
    }


def test_each_mistake_is_one_line_exit_2_and_nothing_written(prefect_api, tmp_path):
    failures = []
    for name, (args, expected) in _cases(tmp_path).items():
        out = run_cli(args, tmp_path, prefect_api)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        ok = out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
        if not ok:
            failures.append(f"{name}: rc={out.returncode} stderr={out.stderr[-600:]!r}")
        assert not (tmp_path / "rlflow-store").exists(), name
    assert not failures, "\n".join(failures)


def test_missing_bucket_and_unreachable_endpoint(prefect_api, s3_endpoint, tmp_path):
    out = run_cli(["run", str(TINY), "-o", "store.uri=s3://no-such-bucket/x", "-o", f"store.endpoint_url={s3_endpoint}"],
                  tmp_path, prefect_api)
    assert out.returncode == 2 and out.stderr.strip() == f"error: store.uri: s3://no-such-bucket/x at {s3_endpoint}: bucket does not exist"
    out = run_cli(["run", str(TINY), "-o", "store.uri=s3://b", "-o", "store.endpoint_url=http://127.0.0.1:9"], tmp_path, prefect_api)
    assert out.returncode == 2 and out.stderr.strip().startswith("error: store.uri: cannot reach s3://b")


def test_bad_reward_leaves_bucket_empty(prefect_api, s3_endpoint, bucket, tmp_path):
    out = run_cli(["run", str(TINY), *s3_overrides(s3_endpoint, bucket), "-o", 'reward.functions=[{"fn": "x.y:z"}]'],
                  tmp_path, prefect_api)
    assert out.returncode == 2, out.stderr
    assert boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_a_reward_function_that_raises_is_named(prefect_api, tmp_path):
    (tmp_path / "broken.py").write_text("def boom(completions, **kw):\n    raise ValueError('bad answer format')\n")
    out = run_cli(["run", str(TINY), "-o", "run.iterations=1", "-o", 'reward.functions=[{"fn": "broken:boom"}]'],
                  tmp_path, prefect_api)
    assert out.returncode == 2                  # the user's code: one line, never retried
    assert out.stderr.strip().splitlines()[-1] == "error: reward function 'boom' raised ValueError: bad answer format"


def test_overrides_parse_as_yaml_values():
    cfg = load_config(TINY, ["run.iterations=7", "train.adam_betas=[0.9, 0.95]", "store.uri=s3://b/p",
                             'reward.functions=[{"fn": "m:f", "weight": 2}]', "run.name=x-1"])
    assert cfg.run.iterations == 7 and cfg.train.adam_betas == (0.9, 0.95) and cfg.reward.functions[0].weight == 2.0
    assert Path(cfg.data.path).is_absolute()                 # relative to the config file
    with pytest.raises(UserError, match="run.name"):
        load_config(TINY, ["run.name=../escape"])
