"""The house rules, checked by reading the code: which module may import what, engines that keep their
contracts, one rule for finding the sibling virtualenvs, and docs that cite only files that exist."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

STAGES = ("generate", "reward", "train", "publish", "evaluate")
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _imports(path: Path, type_checking: bool = False) -> list[str]:
    """Every module `path` imports, at any depth (lazy imports in functions count), except inside
    `if TYPE_CHECKING:` blocks (annotations only, never run) unless `type_checking`: an annotation-only import is
    still a dependency a reader follows, and a cycle through one is a cycle. `from a import b` yields `a.b` as
    well as `a`."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("tasks", "flows")


def _violations(paths: list[Path], allowed) -> list[str]:
    return [f"{_module_name(p)} imports {m}" for p in paths for m in _imports(p) if not allowed(m)]


def test_a_stage_never_imports_another_stage():
    stages = {f"tasks.{s}" for s in STAGES}
    assert _violations([ROOT / "tasks" / f"{s}.py" for s in STAGES], lambda m: m not in stages) == []


def test_no_engine_starts_a_stage():
    """Issue 41: the engines' and trainers' processes run their own modules (the trainer's group runs
    tasks.engines.trainer_server), never a stage's command: the launchers (flows/) start stages."""
    stages = {f"tasks.{s}" for s in STAGES}
    found = [f"{_module_name(p)} names {node.value}" for p in _modules("tasks/engines") + _modules("tasks/core")
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Constant)
             and isinstance(node.value, str) and node.value in stages]
    assert found == []


def test_algorithms_import_only_torch_the_standard_library_and_the_contracts():
    def allowed(m: str) -> bool:
        top = m.split(".")[0]
        return top in STDLIB or top == "torch" or m.startswith(("tasks.algorithms", "tasks.core.contracts"))
    assert _violations(_modules("tasks/algorithms"), allowed) == []


def test_nothing_under_tasks_imports_flows():
    assert _violations(_modules("tasks"), lambda m: m.split(".")[0] != "flows") == []


@pytest.mark.parametrize("folder, may_use", [
    ("tasks/core", ("tasks.core",)),                               # the bottom layer
    ("tasks/engines", ("tasks.core", "tasks.algorithms", "tasks.engines")),
    ("tasks/scoring", ("tasks.core", "tasks.scoring")),
    ("tasks/envs", ("tasks.core", "tasks.engines", "tasks.envs")),
    ("tasks/envs/adapters", ("tasks.core", "tasks.envs.runtime", "tasks.envs.adapters")),
    ("tasks/envs/builtin", ("tasks.core", "tasks.envs.runtime", "tasks.envs.builtin")),  # written as users' are
    ("tasks/rewards", ("tasks.core", "tasks.scoring", "tasks.rewards")),
])
def test_layers_import_only_what_is_below_them(folder, may_use):
    def allowed(m: str) -> bool:
        return not m.startswith("tasks") or m == "tasks" or m.startswith(may_use)
    assert _violations(_modules(folder), allowed) == []


@pytest.mark.parametrize("path, also", [
    ("tasks/core/errors.py", ()),                          # the SkyPilot bridge imports it in .venv-sky
    ("tasks/core/processes.py", ()),
    ("tasks/core/daemon.py", ()),                          # the vLLM watchdog imports it in .venv-vllm
    ("tasks/core/process_wide.py", ("torch",)),            # processes.py imports it; torch lazily, for the RNG only
    # inside the sandbox, on any Python 3.8+: values.py's, wire.py's and harness.py's texts as one program (each
    # imports the ones before it only on the host)
    ("tasks/scoring/harness.py", ("tasks.scoring.wire", "tasks.scoring.values")),
    ("tasks/scoring/wire.py", ("tasks.scoring.values",)),
    ("tasks/scoring/values.py", ()),
    ("tasks/scoring/worker.py", ("tasks.scoring.sandbox", "tasks.core.config")),   # lazily, only for code rewards
    ("tasks/engines/vllm_worker.py", ("vllm",)),            # runs in .venv-vllm
    ("tasks/engines/vllm_watchdog.py", ()),                 # runs in .venv-vllm, for the server's whole life
    ("flows/sky_bridge.py", ("sky", "yaml")),               # runs in .venv-sky
    ("tasks/envs/adapters/openenv_bridge.py", ("openenv",)),  # runs in .venv-openenv, by path
    ("tasks/scoring/syscall_filter.py", ("seccomp",)),      # runs under the system Python (python3-seccomp)
])
def test_modules_that_run_in_other_environments_stay_light(path, also):
    light = ("tasks.core.errors", "tasks.core.paths", "tasks.core.processes", "tasks.core.daemon",
             "tasks.core.process_wide")

    def allowed(m: str) -> bool:
        package = any(a.startswith(m + ".") for a in (*light, *also))      # tasks, tasks.core: empty __init__s
        return m.split(".")[0] in STDLIB or package or m.startswith(light) or m.startswith(also)
    assert _violations([ROOT / path], allowed) == []


def _protocol_methods(protocol) -> dict[str, inspect.Signature]:
    out = {}
    for name, value in vars(protocol).items():
        if name.startswith("_") and name != "__init__":
            continue
        fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if callable(fn) and fn.__name__ != "_no_init_or_replace_init":     # (typing's stand-in __init__)
            out[name] = (type(value), inspect.signature(fn))
    return out


@pytest.mark.parametrize("protocol, engines", [
    ("SamplingEngine",
     ["tasks.engines.hf:HFEngine", "tasks.engines.vllm_offline:VLLMOffline", "tasks.engines.vllm_server:VLLMServer"]),
    ("SamplingSession",
     ["tasks.engines.hf:HFSession", "tasks.engines.vllm_offline:OfflineSession",
      "tasks.engines.vllm_server:ServerSession"]),
    ("EnvironmentHandle",
     ["tasks.envs.runtime.isolation:ThreadEnvironment", "tasks.envs.runtime.isolation:ProcessEnvironment",
      "tasks.envs.runtime.server:RemoteEnvironment"]),
    ("TrainingEngine",
     ["tasks.engines.torch_engine:TorchEngine", "tasks.engines.deepspeed_engine:DeepSpeedEngine"]),
    ("TrainerHandle",
     ["tasks.engines.trainer:InProcessTrainer", "tasks.engines.detached:DetachedTrainer"]),
    ("Learner",
     ["tasks.algorithms.learners.grpo:Grpo", "tasks.algorithms.learners.ppo:Ppo",
      "tasks.algorithms.learners.vtrace_awr:VtraceAwr"]),
    ("ArtifactStore", ["tasks.core.store:FileStore", "tasks.core.store:S3Store"]),
])
def test_every_engine_keeps_its_family_contract(protocol, engines):
    def load(spec: str):
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)

    wanted = _protocol_methods(load(f"tasks.core.contracts:{protocol}"))
    assert wanted, protocol
    for spec in engines:
        engine = load(spec)
        for name, (kind, signature) in wanted.items():
            raw = inspect.getattr_static(engine, name, None)
            assert raw is not None, f"{spec} lacks {name}"
            if kind in (classmethod, staticmethod):
                assert isinstance(raw, kind), f"{spec}.{name} must be a {kind.__name__}"
            fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            assert list(inspect.signature(fn).parameters) == list(signature.parameters), f"{spec}.{name}"


def test_the_factories_pick_the_configured_engine(tmp_path):
    from tasks.core.config import load_config
    from tasks.engines.sampling import sampling_engine
    from tasks.engines.training import training_engine
    from tests.conftest import TINY

    def cfg(*overrides):
        return load_config(TINY, [f"store.uri={tmp_path}", *overrides])

    assert type(sampling_engine(cfg())).__name__ == "HFEngine"
    assert type(sampling_engine(cfg("generate.engine=vllm"))).__name__ == "VLLMOffline"
    assert type(sampling_engine(cfg("generate.engine=vllm", "generate.mode=resident"))).__name__ == "VLLMServer"
    assert training_engine(cfg()).__name__ == "TorchEngine"
    assert training_engine(cfg("train.engine=deepspeed")).__name__ == "DeepSpeedEngine"


def test_sibling_virtualenvs_are_found_by_one_rule(tmp_path, monkeypatch):
    """The working directory first, then the checkout; the vLLM engine and the sky launcher both use it."""
    from flows.launch import Sky
    from tasks.core import paths
    from tasks.core.config import load_config
    from tasks.engines.vllm_offline import vllm_python
    from tests.conftest import TINY

    checkout = tmp_path / "checkout"
    monkeypatch.setattr(paths, "REPO_ROOT", checkout)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store"])
    assert vllm_python(cfg) == sys.executable and Sky(cfg).python == "python3"      # none anywhere
    for venv in (".venv-vllm", ".venv-sky"):
        (checkout / venv / "bin").mkdir(parents=True)
        (checkout / venv / "bin" / "python").touch()
    assert vllm_python(cfg) == str(checkout / ".venv-vllm/bin/python")
    assert Sky(cfg).python == str(checkout / ".venv-sky/bin/python")
    for venv in (".venv-vllm", ".venv-sky"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / "python").touch()
    assert vllm_python(cfg) == str(tmp_path / ".venv-vllm/bin/python")               # the working directory wins
    assert Sky(cfg).python == str(tmp_path / ".venv-sky/bin/python")
    explicit = load_config(TINY, [f"store.uri={tmp_path}/store", "generate.vllm_python=/opt/v/bin/python"])
    assert vllm_python(explicit) == "/opt/v/bin/python"


# ---------------------------------------------------------------------------------------------- docs

CITED_PATH = re.compile(r"(?<![\w/.-])((?:tasks|flows|tests|bench|configs|sky|docs)/[\w./-]*\w"
                        r"\.(?:py|ya?ml|md|jsonl|json))(?!\w)")
CITED_MODULE = re.compile(r"python -m ((?:tasks|flows)(?:\.\w+)+)")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if f.endswith((".py", ".md", ".yaml", ".yml", ".toml")) or f == "Makefile"]


def test_docs_and_code_cite_only_files_and_modules_that_exist():
    missing = []
    for path in _tracked_text_files():
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        for cited in set(CITED_PATH.findall(text)):
            if not (ROOT / cited).exists():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
        for module in set(CITED_MODULE.findall(text)):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{path.relative_to(ROOT)}: python -m {module}")
    assert missing == []


DOCSTRING_LINES = 15
INTERNALS_POINTER = re.compile(r"docs/internals\.md \(((?:tasks|flows)/[\w/]+\.py)\)")


def test_module_docstrings_are_short():
    """A module's docstring says what the module is for and how it is called, in at most 15 lines; how it works
    and why is in docs/internals.md, under the module's path (issue 41)."""
    long = {}
    for folder in ("tasks", "flows"):
        for p in _modules(folder):
            doc = ast.get_docstring(ast.parse(p.read_text(), str(p)), clean=False) or ""
            if len(doc.splitlines()) > DOCSTRING_LINES:
                long[str(p.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over {DOCSTRING_LINES} lines (the rest goes to docs/internals.md): {long}"


MODULE_LINES = 600


def test_no_module_over_600_lines_unless_it_is_one_concept():
    """A file a reader opens holds one idea: over MODULE_LINES lines only where the module is one concept, said in
    its docstring on a line "One concept: <why>" (issue 41)."""
    big = {}
    for folder in ("tasks", "flows"):
        for p in _modules(folder):
            text = p.read_text()
            doc = ast.get_docstring(ast.parse(text, str(p)), clean=False) or ""
            if len(text.splitlines()) > MODULE_LINES and "One concept:" not in doc:
                big[str(p.relative_to(ROOT))] = len(text.splitlines())
    assert not big, f"modules over {MODULE_LINES} lines whose docstring does not say 'One concept: <why>': {big}"


def test_docstrings_point_at_sections_of_internals_that_exist():
    """`More: docs/internals.md (<its path>)` in a module's docstring names a section `## <its path>` there."""
    sections = set(re.findall(r"^## (\S+)$", (ROOT / "docs" / "internals.md").read_text(), re.MULTILINE))
    missing = [f"{p.relative_to(ROOT)}: {cited}" for folder in ("tasks", "flows") for p in _modules(folder)
               for cited in INTERNALS_POINTER.findall(p.read_text()) if cited not in sections]
    assert missing == []


def test_the_readme_layout_is_the_tree():
    """The README's layout section lists every folder and module of tasks/ and flows/, and nothing else."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    shown = set(re.findall(r"[\w.-]+\.py|[\w-]+/", section))
    actual = {p.name for folder in ("tasks", "flows") for p in (ROOT / folder).rglob("*.py")
              if p.name != "__init__.py"}
    actual |= {f"{p.name}/" for p in (ROOT / "tasks").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert actual - shown == set(), "missing from the README's layout"


def test_environments_named_by_their_paths_before_the_rooms_still_load(monkeypatch, capsys):
    """tasks/envs/ split into runtime/, adapters/ and builtin/ (issue 41): a config that names a built-in
    environment or an adapter by its old path loads, says so in one warning line (once), resolves to the class at
    the new path, and is fingerprinted as before (stored runs resume); nothing is left at the old paths."""
    from tasks.core import config_base
    from tasks.core.config import MOVED_ENV_MODULES, load_config
    from tasks.envs.builtin.games import SayTheLetters, letters_agent

    def resolved(spec: str):
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)

    monkeypatch.setattr(config_base, "_SAID", set())            # (said once per process: perhaps already said)
    letters, agent = ROOT / "configs" / "letters.yaml", ROOT / "configs" / "agent.yaml"
    old = [load_config(letters, ["env.factory=tasks.envs.games:SayTheLetters"]) for _ in range(2)][-1]
    old_agent = load_config(agent, ["env.agent=tasks.envs.games:letters_agent"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: config: env.factory tasks.envs.games:SayTheLetters is now "
                   "tasks.envs.builtin.games:SayTheLetters (read as that; write the new path)",
                   "warning: config: env.agent tasks.envs.games:letters_agent is now "
                   "tasks.envs.builtin.games:letters_agent (read as that; write the new path)"]
    assert old.env.factory == "tasks.envs.builtin.games:SayTheLetters" and resolved(old.env.factory) is SayTheLetters
    assert old_agent.env.agent == "tasks.envs.builtin.games:letters_agent"
    assert resolved(old_agent.env.agent) is letters_agent
    new = load_config(letters)                                       # the shipped config: the new path, no warning
    assert capsys.readouterr().err == "" and new.env.factory == old.env.factory
    assert new.section_hash("env") == old.section_hash("env")
    assert new.section_values("env")["env"]["factory"] == "tasks.envs.games:SayTheLetters"
    for before, after in MOVED_ENV_MODULES.items():
        assert importlib.util.find_spec(after) is not None, after
        if before != "tasks.envs.adapters":                           # (now the adapters' room, a package)
            assert importlib.util.find_spec(before) is None, f"{before}: a module left at the old path"


def test_no_import_cycles():
    """No module of ours reaches itself through imports of any kind (module level, lazy, TYPE_CHECKING): a
    contract lives in tasks/core/contracts.py, so a factory may import its implementations and they it, never
    each other. Packages' __init__ files hold no imports and are left out."""
    modules = {_module_name(p): p for folder in ("tasks", "flows") for p in _modules(folder) if p.name != "__init__.py"}
    graph = {m: {i for i in _imports(p, type_checking=True) if i in modules and i != m} for m, p in modules.items()}
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for nxt in sorted(graph[module]):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert cycles == []


def test_the_contracts_import_nothing_of_their_implementations():
    """tasks/core/contracts.py names the config in annotations and nothing else of ours."""
    ours = {m for m in _imports(ROOT / "tasks" / "core" / "contracts.py", type_checking=True) if _ours(m)}
    assert ours <= {"tasks.core.config", "tasks.core.config.Config"}, ours


# Starting a child process: every start goes through tasks/core/processes.py (spawn, run, stream, spawn_detached),
# which gives a child that runs rlflow's code the safe path (a user's own tasks/ never shadows rlflow's).
STARTS = {"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}
OS_STARTS = {"system", "popen", "spawnl", "spawnlp", "spawnv", "spawnvp", "posix_spawn", "posix_spawnp", "execv",
             "execvp", "execve", "execl", "execlp"}


# Every way to start a process, by its dotted name (a module imported under another name is followed).
STARTERS = ({f"subprocess.{n}" for n in STARTS} | {f"os.{n}" for n in OS_STARTS | {"fork", "forkpty"}}
            | {"asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell", "pty.spawn", "pty.fork",
               "multiprocessing.get_context", "multiprocessing.Process", "multiprocessing.Pool",
               "multiprocessing.pool.Pool", "concurrent.futures.ProcessPoolExecutor"})
# Where a process is started otherwise, and why that is safe: multiprocessing's forkserver (started by warm_up in
# the safe way, again if it ended; its children are forks); Prefect's own Popen of its temporary server, wrapped
# to start it in a session of its own (it runs prefect and uvicorn, nothing of rlflow's); the reward worker's
# wrapper of os.fork, which counts the children user functions fork (it starts none).
OTHER_STARTS = {"tasks.envs.runtime.isolation": {"multiprocessing.get_context"},
                "flows.cli": {"subprocess.Popen"},
                "tasks.scoring.worker": {"os.fork"}}


def _dotted(node: ast.AST, modules: dict[str, str]) -> str | None:
    """`a.b.c` for an attribute chain on a name, the name read through the module it was imported as."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([modules.get(node.id, node.id), *reversed(parts)])


def _process_starts(path: Path, module: str | None = None) -> list[str]:
    """Each place `path` names a way to start a process (STARTERS), by attribute or as an imported name, under
    any alias, called or not (`popen = subprocess.Popen`); a type hint is not one."""
    tree = ast.parse(path.read_text(), str(path))
    modules = {a.asname or a.name.split(".")[0]: (a.name if a.asname else a.name.split(".")[0])
               for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported = {a.asname or a.name: f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module for a in n.names if f"{n.module}.{a.name}" in STARTERS}
    hints = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.AnnAssign, ast.arg)) and n.annotation] + \
        [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns]
    in_hints = {id(n) for hint in hints for n in ast.walk(hint)}       # (a type named is not a start)
    out = []
    for node in ast.walk(tree):
        if id(node) in in_hints:
            continue
        if isinstance(node, ast.Attribute) and (name := _dotted(node, modules)) in STARTERS:
            out.append((node.lineno, name))
        elif isinstance(node, ast.Name) and node.id in imported and isinstance(node.ctx, ast.Load):
            out.append((node.lineno, imported[node.id]))
    module = module or _module_name(path)
    return [f"{module}:{line} {what}" for line, what in out if what not in OTHER_STARTS.get(module, set())]


def test_every_child_process_starts_through_the_one_spawn_function():
    found = [s for folder in ("tasks", "flows") for p in _modules(folder)
             if p != ROOT / "tasks" / "core" / "processes.py" for s in _process_starts(p)]
    # the harness runs inside the sandbox (the model's code: its own rules, docs/sandbox.md), not under rlflow
    assert [s for s in found if not s.startswith("tasks.scoring.harness:")] == []


def test_the_start_finder_sees_starts_by_any_name_and_not_type_hints(tmp_path):
    (tmp_path / "starts.py").write_text(
        "import asyncio, multiprocessing, os, subprocess\nfrom os import system as sh\n"
        "import subprocess as sp, multiprocessing.pool, concurrent.futures\nimport os as _os\n"
        "from concurrent.futures import ProcessPoolExecutor as PPE\n"
        "popen = subprocess.Popen\nsh('x')\nasyncio.create_subprocess_exec('x')\n"
        "ctx = multiprocessing.get_context('spawn')\nsp.run(['x'])\n_os.fork()\nmultiprocessing.pool.Pool()\n"
        "concurrent.futures.ProcessPoolExecutor()\nPPE()\n\n\ndef f(p: subprocess.Popen) -> subprocess.Popen:\n"
        "    q: subprocess.Popen | None = None\n    return p or q\n")
    found = sorted(s.split(" ", 1)[1] for s in _process_starts(tmp_path / "starts.py", "starts"))
    assert found == sorted(["subprocess.Popen", "os.system", "asyncio.create_subprocess_exec",
                            "multiprocessing.get_context", "subprocess.run", "os.fork", "multiprocessing.pool.Pool",
                            "concurrent.futures.ProcessPoolExecutor", "concurrent.futures.ProcessPoolExecutor"])


# Writing the process's environment: only tasks/core/process_wide.py does (set_default, set_variable, take, restore,
# environment_variables), so every variable rlflow sets, and what it puts back, is found in one place (issue 41).
ENVIRON_WRITES = {"setdefault", "pop", "update", "clear", "popitem"}
ENVIRON_WRITERS = {
    "tasks/core/process_wide.py",
    # imported first in every rlflow process, before anything else: it drops rlflow_first's PYTHONSAFEPATH with two
    # dictionary look-ups and imports nothing (process_wide would run first, with the safe path still set)
    "tasks/__init__.py",
    # run by path in .venv-verifiers (its folder taken off sys.path), never imported: rlflow's modules are not there
    "tasks/envs/adapters/verifiers_v04_bridge.py",
}


def _environ_writes(path: Path) -> list[str]:
    """Each place `path` writes os.environ (by any name it imported os or environ as): an item assigned, deleted
    or augmented, a write method called, os.putenv / os.unsetenv, or os.environ itself bound to another name."""
    tree = ast.parse(path.read_text(), str(path))
    os_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                if a.name == "os"}
    from_os = {a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module == "os" for a in n.names}

    def of_os(node, *names) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
                and node.value.id in os_names) or (isinstance(node, ast.Name) and from_os.get(node.id) in names)

    def flat(targets):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from flat(t.elts)
            else:
                yield t.value if isinstance(t, ast.Starred) else t

    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
            targets = [node.target]
        else:
            targets = []
        written = any(of_os(t, "environ") or (isinstance(t, ast.Subscript) and of_os(t.value, "environ"))
                      for t in flat(targets))
        alias = isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and of_os(node.value, "environ")
        called = isinstance(node, ast.Call) and (of_os(node.func, "putenv", "unsetenv") or (
            isinstance(node.func, ast.Attribute) and node.func.attr in ENVIRON_WRITES
            and of_os(node.func.value, "environ")))
        if written or alias or called:
            out.append((node.lineno, f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node).splitlines()[0]}"))
    return [w for _, w in sorted(out)]


def test_the_process_environment_is_written_in_one_module():
    writes = {str(p.relative_to(ROOT)): _environ_writes(p) for folder in ("tasks", "flows") for p in _modules(folder)}
    outside = [w for path, found in writes.items() if path not in ENVIRON_WRITERS for w in found]
    assert outside == [], "os.environ written outside tasks/core/process_wide.py (call its functions):\n" + \
        "\n".join(outside)
    assert [path for path in sorted(ENVIRON_WRITERS) if not writes.get(path)] == []    # (no stale exception)


def test_a_python_that_runs_rlflows_packages_gets_the_safe_path(tmp_path):
    """spawn: `-m tasks...` / `-m flows...` (also after torchrun's own `-m`) get rlflow_first's environment; any
    other child gets the environment it was given, unchanged."""
    from tasks.core.processes import SAFEPATH_MARK, runs_rlflow, spawn

    assert runs_rlflow([sys.executable, "-m", "tasks.engines.replica", "--port", "0"])
    assert runs_rlflow([sys.executable, "-m", "torch.distributed.run", "--standalone", "-m", "tasks.train"])
    assert not runs_rlflow([sys.executable, "-u", str(ROOT / "tasks" / "envs" / "adapters" / "openenv_bridge.py")])
    assert not runs_rlflow(["bash", "-c", "python -m tasks.train"]) and not runs_rlflow([sys.executable, "-m"])
    code = "import os; print(os.environ.get('PYTHONSAFEPATH'), os.environ.get('PYTHONPATH', '').split(os.pathsep)[0])"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONSAFEPATH", SAFEPATH_MARK)}
    plain = spawn([sys.executable, "-c", code], env, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    assert plain.communicate(timeout=60)[0].split()[0] == "None"
    told = spawn(["bash", "-c", f"{sys.executable} -c \"{code}\""], env, rlflow=True, stdout=subprocess.PIPE,
                 text=True, cwd=tmp_path)
    assert told.communicate(timeout=60)[0].split() == ["1", str(ROOT)]


def test_one_class_per_name_across_the_package():
    """A reader who meets a class name finds one class (issue 41: two Tracker, two Run, two Member before)."""
    seen: dict[str, list[str]] = {}
    for folder in ("tasks", "flows"):
        for p in _modules(folder):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(node, ast.ClassDef):
                    seen.setdefault(node.name, []).append(_module_name(p))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


# Where each stage and service runs is read from the config once, by tasks/core/placement.py (placement_of); plan,
# preflight, the launchers, the services and the loop ask the Placement it returns (issue 41). The keys: the
# launcher's (launcher.where, launcher.stages, where_of, remote_stages), generate.replicas, env.where, env.servers,
# env.remote(), a reward model's `where`, and env.url (env.where given as a URL) as a decision (given or not: its
# value, the server's address, may be read anywhere). Read as code (the syntax tree): prose in docstrings and
# comments names them freely.
PLACEMENT_KEYS = {"launcher": {"where", "stages", "where_of", "remote_stages"}, "generate": {"replicas"},
                  "env": {"where", "servers", "remote"}}
PLACEMENT_READERS = {           # (the config modules, tasks/core/config*.py, define and validate the keys)
    "tasks/core/placement.py": "placement_of: the one reader",
    "tasks/engines/replica_router.py": "the router, a process of its own, makes one member per generate.replicas",
    "tasks/envs/runtime/pool.py": "the pool's front started by hand, without --member: env.servers members",
}


def _placement_reads(path: Path) -> list[str]:
    """Each place `path` reads a placement key: `<...>.launcher.where`, `lc.stages` (lc bound to a `.launcher`),
    any `.where_of` / `.remote_stages`, a `.where` that is not called (Placement.where(stage) is), and the env
    section's `.url` tested (`is None`, `not`, a condition)."""
    tree = ast.parse(path.read_text(), str(path))

    def pairs(target, value):
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for t, v in zip(target.elts, value.elts, strict=False):
                yield from pairs(t, v)
        elif isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr in PLACEMENT_KEYS:
            yield target.id, value.attr
    sections = dict(p for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    for p in pairs(t, n.value))          # lc, gc = cfg.launcher, cfg.generate
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}

    def server_url(node) -> bool:          # <...>.env.url, or ec.url with ec = <...>.env
        if not (isinstance(node, ast.Attribute) and node.attr == "url"):
            return False
        v = node.value
        return (isinstance(v, ast.Attribute) and v.attr == "env") or (isinstance(v, ast.Name)
                                                                       and sections.get(v.id) == "env")
    tested = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)) for o in n.ops):
            tested |= {id(x) for x in (n.left, *n.comparators) if server_url(x)}
        elif isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert)) or (
                isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not)):
            tested |= {id(x) for x in [getattr(n, "test", getattr(n, "operand", None))] if server_url(x)}
        elif isinstance(n, ast.BoolOp):
            tested |= {id(x) for x in n.values if server_url(x)}
        elif isinstance(n, ast.comprehension):
            tested |= {id(x) for x in n.ifs if server_url(x)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        section = v.attr if isinstance(v, ast.Attribute) else sections.get(v.id) if isinstance(v, ast.Name) else None
        if (node.attr in PLACEMENT_KEYS.get(section, ()) or node.attr in ("where_of", "remote_stages")
                or (node.attr == "where" and id(node) not in called) or id(node) in tested):
            out.append((node.lineno, f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"))
    return [r for _, r in sorted(set(out))]


def test_placement_keys_are_read_only_by_the_placement_module():
    reads = {str(p.relative_to(ROOT)): _placement_reads(p) for folder in ("tasks", "flows") for p in _modules(folder)
             if not re.fullmatch(r"tasks/core/config\w*\.py", str(p.relative_to(ROOT)))}
    outside = [r for path, found in reads.items() if path not in PLACEMENT_READERS for r in found]
    assert outside == [], "placement keys read outside tasks/core/placement.py (ask placement_of(cfg)):\n" + \
        "\n".join(outside)
    assert [path for path in sorted(PLACEMENT_READERS) if not reads.get(path)] == []    # (no stale exception)


def test_every_test_file_with_tests_at_length_is_in_the_drills():
    """A test marked AT_LENGTH (or reading RLFLOW_DRILL_TRIALS) is skipped by make test for the CI budget; make
    drills must run its file, or nothing ever does (test_browser.py's and test_bad_input.py's were not listed)."""
    drills = re.search(r"^drills:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.S | re.M).group(0)
    listed = set(re.findall(r"tests/(test_\w+\.py)", drills))
    at_length = {p.name for p in (ROOT / "tests").glob("test_*.py")
                 if p.name != "test_layout.py" and re.search(r"AT_LENGTH|RLFLOW_DRILL_TRIALS", p.read_text())}
    assert not at_length - listed, sorted(at_length - listed)
