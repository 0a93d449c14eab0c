"""The deepspeed training engine (`train.engine: deepspeed`): ZeRO stage 1, 2 or 3 over torch.distributed
processes, one per GPU (or CPU processes with gloo), on one node or several. The trainer drives it through
the same calls as the torch engine (TrainingEngine, tasks/core/contracts.py); the learners' math, batching and
metrics are tasks/algorithms/'s, the same on every engine.

Its processes are a torchrun group (`DeepSpeedEngine.torchrun`: the command line the trainer's handles start,
tasks/engines/detached.py, each process running tasks/engines/trainer_server.py); each process
opens the engine (`DeepSpeedEngine.open`: process group, model, deepspeed.initialize, the previous shards). The
gradient is the single-process whole-batch gradient on any process count (the caller owns accumulation and
scales the loss). A checkpoint is process 0's `<run>/trainer/ckpt-N` plus each node's ZeRO shards under
`<run>/trainer-state/`; a resume on another number of processes converts them first (`to_universal`).
More: docs/internals.md (tasks/engines/deepspeed_engine.py): what runs where, the gradient arithmetic, the
checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.algorithms.learners.registry import learner_class
from tasks.core import layout
from tasks.core.errors import UserError
from tasks.core.models import (
    DTYPES,
    add_lora,
    base_path,
    checkpointing,
    device_for,
    load_model,
    load_tokenizer,
    policy_dtype,
)
from tasks.core.process_wide import rng_state, seed_all, set_default, set_rng_state
from tasks.core.processes import run

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store

STATE, MODEL_DIR = layout.CKPT_STATE, layout.CKPT_MODEL


class DeepSpeedEngine:
    """One worker process of a ZeRO data-parallel group (see the module docstring; tasks/engines/training.py:
    TrainingEngine)."""

    lora = False   # train.lora_r > 0: the model is a peft model, only its adapter trained, saved and published

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError("train.engine: deepspeed is not installed here; pip install -e '.[deepspeed]'")

    # ------------------------------------------------------------------ the group's command line

    @classmethod
    def torchrun(cls, cfg: Config) -> tuple[list[str], dict[str, str]]:
        """The torchrun command line (up to the module it runs) and environment that start this node's part of
        the trainer's group, for one iteration or resident (tasks/engines/detached.py: GroupTrainer,
        DetachedTrainer; on several nodes one group across them, rendezvous at MASTER_ADDR:MASTER_PORT)."""
        cls.check_installed(cfg)
        device = device_for(cfg)
        nproc = cfg.train.num_processes or (torch.cuda.device_count() if device.type == "cuda" else 1)
        nnodes = int(os.environ.get("NNODES") or 1)
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        if nnodes > 1:       # sky/train.yaml exports these from SkyPilot's node variables
            missing = [v for v in ("NODE_RANK", "MASTER_ADDR") if not os.environ.get(v)]
            if missing:
                raise UserError(f"train.engine: deepspeed on NNODES={nnodes} nodes needs {' and '.join(missing)} "
                                f"in the environment (sky/train.yaml sets them)")
            argv += [f"--nnodes={nnodes}", f"--node_rank={os.environ['NODE_RANK']}",
                     f"--master_addr={os.environ['MASTER_ADDR']}",
                     f"--master_port={os.environ.get('MASTER_PORT') or 29500}"]
        else:
            argv.append("--standalone")      # one node: torchrun picks a free rendezvous port on localhost
        # (the workers run `-m tasks...` from the user's folder: spawn's safe path gives them rlflow's tasks)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}     # one bar per process per file is noise in a log
        if device.type == "cpu":
            env["DS_ACCELERATOR"] = "cpu"    # else DeepSpeed probes for GPUs
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        return argv, env

    # ------------------------------------------------------------------ one worker

    @classmethod
    def open(cls, cfg: Config, store: Store, previous: str | None) -> DeepSpeedEngine:
        return cls(cfg, store, previous)

    def __init__(self, cfg: Config, store: Store, prev: str | None):
        self.cfg, self.store, tc = cfg, store, cfg.train
        self.lora = tc.lora_r > 0
        if device_for(cfg).type == "cpu":
            set_default("DS_ACCELERATOR", "cpu")
        self.check_installed(cfg)
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)   # its INFO lines repeat the config for every process
        # DeepSpeed 0.19.8 calls torch.distributed functions that torch 2.13 deprecates, warning at every step.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK") or 0)
        if self.world_size > 1 and not os.environ.get("LOCAL_WORLD_SIZE"):
            raise UserError("train.engine: deepspeed workers need torchrun's variables (LOCAL_WORLD_SIZE is "
                            "missing); start them with torchrun, or let the stage start them")
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        self.node = int(os.environ.get("GROUP_RANK") or self.rank // per_node)
        self.nodes = self.world_size // per_node
        self.device = device = join_group(cfg)
        self.attempt = self._broadcast(uuid.uuid4().hex[:8])
        self.scratch = Path(tempfile.gettempdir()) / f"rlflow-ds-{self.attempt}-node{self.node:03d}"
        self.bf16 = tc.mixed_precision == "bf16" or (tc.mixed_precision == "auto" and device.type == "cuda")
        dtype = "bfloat16" if self.bf16 else "float32"
        self._hf_config = None
        try:
            state, universal = None, False
            if prev:
                resume = self.scratch / "resume"
                self._on_node_leader(lambda: self._download(prev, resume))
                state = json.loads((resume / "ckpt" / STATE).read_text())
                self._check_resumable(state, prev)
                universal = state["world_size"] != self.world_size     # its shards are cut for another count
                if universal:
                    self._on_node_leader(lambda: to_universal(resume / "engine", state["tag"]))
            if prev and not self.lora:
                model_path = str(resume / "ckpt" / MODEL_DIR)
            else:       # (with LoRA the checkpoint's model folder is the adapter alone: the base is built, as first)
                self._on_node_leader(lambda: base_path(cfg))   # one download/build per node, then cached
                model_path = base_path(cfg)
            self.tokenizer = load_tokenizer(model_path)
            config = self._ds_config(universal)
            if tc.zero_stage == 3:   # from_pretrained then creates each weight already partitioned (zero.Init)
                from transformers.integrations import HfDeepSpeedConfig
                self._hf_config = HfDeepSpeedConfig(config)
            if state is None:
                seed_all(cfg.run.seed)
            # Weights load in the compute dtype (DeepSpeed keeps fp32 master copies in the optimizer); on resume
            # load_checkpoint below replaces them with the checkpoint's exact fp32 state.
            model = load_model(model_path, dtype, device)
            if self.lora:   # fresh adapters (B = 0), as the torch engine makes them; a resume loads their state below
                model = add_lora(model, tc)
            checkpointing(model, tc)
            params = [p for p in model.parameters() if p.requires_grad]
            if tc.offload_optimizer:
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                optimizer = DeepSpeedCPUAdam(params, lr=tc.lr, betas=tuple(tc.adam_betas),
                                             weight_decay=tc.weight_decay, adamw_mode=True)
            else:                   # the torch engine's optimizer: same update, ZeRO shards its state
                optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.adam_betas),
                                              weight_decay=tc.weight_decay)
            # ppo, vtrace_awr: the value model (a head on the policy's trunk, or a trunk of its own: critic
            # separate) outside the policy's ZeRO engine: the same weights on every process, its gradients summed
            # over them in step(), its AdamW's states sharded over the processes (ZeRO-1: ZeroRedundancyOptimizer;
            # each process steps its share and broadcasts it).
            self.critic = self.critic_optimizer = None
            if "critic" in learner_class(cfg).trains:
                self._make_critic(model, resume / "ckpt" if state is not None else None)
            self.model = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
            self.model.train()
            self.ref_model = None
            if tc.beta > 0 and not self.lora:     # the starting weights; ZeRO-3 keeps them sharded too (a second
                # engine). With LoRA the reference is the same model with its adapter disabled (update.py).
                self._on_node_leader(lambda: base_path(cfg))
                ref = load_model(base_path(cfg), dtype, device).eval().requires_grad_(False)
                if tc.zero_stage == 3:
                    ref = deepspeed.initialize(model=ref, config={k: config[k] for k in (
                        "train_micro_batch_size_per_gpu", "bf16", "zero_optimization")})[0]
                    ref.eval()
                self.ref_model = ref
            self.global_step = 0
            if state is not None:
                tag = universal_tag(state["tag"]) if universal else state["tag"]
                self.model.load_checkpoint(str(resume / "engine"), tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=False, load_module_strict=not self.lora)
                rng = resume / "engine" / layout.CKPT_RNG_RANK.format(rank=self.rank)
                if rng.exists():
                    set_rng_state(torch.load(rng, weights_only=True))
                else:                # a process the checkpoint did not have (more processes than before)
                    seed_all(cfg.run.seed * 1_000_003 + state["step"] * 1024 + self.rank)
                self.global_step = state["step"]
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def loading_whole(self) -> Iterator[None]:
        """Models loaded in the body are whole, not partitioned as ZeRO-3 has from_pretrained make this engine's
        (a critic's separate trunk; v0's LoRA merge, which met size-0 weights: tasks/sft.py)."""
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        if self._hf_config is not None:
            unset_hf_deepspeed_config()
        try:
            yield
        finally:
            if self._hf_config is not None:
                set_hf_deepspeed_config(self._hf_config)

    def _make_critic(self, model, ckpt: Path | None) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from tasks.engines.critic import Critic

        tc = self.cfg.train
        with self.loading_whole():           # (a separate trunk: not ZeRO's)
            self.critic = Critic.make(self.cfg, model, self.device)
        self.critic_optimizer = ZeroRedundancyOptimizer(
            self.critic.parameters(), optimizer_class=torch.optim.AdamW, lr=tc.learner.critic_lr or tc.lr,
            betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
        if ckpt is not None:           # (the whole state, consolidated when saved: any process count loads it)
            self.critic.load(ckpt)
            self.critic_optimizer.load_state_dict(torch.load(ckpt / layout.CKPT_CRITIC_OPTIMIZER,
                                                             map_location=self.device, weights_only=True))

    def _ds_config(self, universal: bool) -> dict:
        tc = self.cfg.train
        zero: dict = {"stage": tc.zero_stage}
        if tc.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.device.type == "cuda"}
        return {
            "checkpoint": {"load_universal": universal},   # resuming from another process count (to_universal)
            "train_micro_batch_size_per_gpu": tc.micro_batch_size,
            "gradient_accumulation_steps": 1,          # bookkeeping only: accumulation is ours (see below)
            "managed_gradient_accumulation": False,    # backward() per micro-batch, step() once per pass
            "gradient_clipping": tc.max_grad_norm,
            "bf16": {"enabled": self.bf16},
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,     # torch.optim.AdamW: not one of DeepSpeed's own
            "steps_per_print": 1 << 62,
            "wall_clock_breakdown": False,
        }

    def _check_resumable(self, state: dict, prev: str) -> None:
        where, tc = self.store.uri(prev), self.cfg.train
        if state.get("engine", "torch") != "deepspeed":
            raise UserError(f"train.engine: {where} was written by the {state.get('engine', 'torch')} engine; "
                            f"keep one engine for a whole run, or start a new run.name")
        if state["zero_stage"] != tc.zero_stage:
            raise UserError(f"train.zero_stage: {where} was written at ZeRO stage {state['zero_stage']}; "
                            f"resume with train.zero_stage={state['zero_stage']}")

    def _download(self, prev: str, dest: Path) -> None:
        self.store.get_folder(prev, dest / "ckpt")
        state = json.loads((dest / "ckpt" / STATE).read_text())
        for part in state.get("engine_state", []):      # every node's shards, into one tree
            self.store.get_folder(part, dest / "engine")

    @staticmethod
    def clean(store: Store, run: str) -> int:
        """Remove the deepspeed node folders that no committed checkpoint names: those of attempts killed (or beaten
        by another attempt) before their ckpt-N was committed. Folders of iteration N go only once ckpt-N is
        complete: a committed checkpoint is immutable, so an attempt it does not name can never be needed, while
        before that a running attempt may still be writing its own. An iteration with one attempt has nothing to
        remove (its checkpoint, if committed, names it), so only iterations with several cost a read: the flow runs
        this at every start without reading every checkpoint of a long run. Returns how many attempt folders went."""
        base, removed, attempts = f"{run}/trainer-state", 0, {}
        for name in store.list_folders(base):                       # ckpt-000042-<attempt>
            head, _, attempt = name.partition("-")[2].partition("-")
            if head.isdigit() and attempt:
                attempts.setdefault(int(head), []).append(f"{base}/{name}")
        for iteration, folders in attempts.items():
            # The checkpoint that names an attempt: ckpt-N (process mode) or full-N (a resident trainer's; its
            # ckpt-N is lean and names none). Until it is committed a trainer may still be writing it.
            named = None
            for ckpt in (layout.full_checkpoint(run, iteration), layout.checkpoint(run, iteration)):
                manifest = store.manifest(ckpt) if len(folders) > 1 else None
                if manifest is not None and manifest["meta"].get("kind", "full") == "full":
                    named = {p.rsplit("/", 1)[0] for p in store.get_json(ckpt, STATE).get("engine_state", [])}
                    break
            if named is None:
                continue
            for folder in folders:
                if folder not in named:
                    for node in store.list_folders(folder):
                        store.delete_folder(f"{folder}/{node}")
                    removed += 1
        return removed

    # ------------------------------------------------------------------ the calls tasks/train.py makes

    def zero_grad(self) -> None:
        pass     # DeepSpeed zeroes its (partitioned) gradients itself after every step

    def backward(self, loss) -> None:
        # x W undoes DeepSpeed's average over the data-parallel processes; no division by accumulation steps.
        self.model.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self) -> float:
        """Reduce the accumulated gradients, clip them to train.max_grad_norm, step AdamW; returns the
        gradient norm before clipping (over all processes). The value head (ppo) steps beside it, clipped on its
        own: the returned norm is the policy's."""
        self.model.step()
        norm = self.model.get_global_grad_norm()
        if self.critic is not None:
            self._step_critic()
        return float(norm) if norm is not None else math.nan

    def critic_step(self, loss) -> None:
        """A step of the value model alone (value pre-training on detached states): no ZeRO step, whose AdamW
        would move the policy on its old moments. (x W: what backward does, which _step_critic undoes.)"""
        (loss * self.world_size).backward()
        self._step_critic()

    def _step_critic(self) -> None:
        """Sum the head's gradients over the processes (each holds W·its share: backward scales by W, see
        there), clip, step, zero."""
        params = [p for p in self.critic.parameters() if p.grad is not None]
        if params:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if self.world_size > 1:
                torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
            flat /= self.world_size
            at = 0
            for p in params:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
                at += p.numel()
            torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
            self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)

    def sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, torch.distributed.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, torch.distributed.ReduceOp.MAX)

    def min(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, torch.distributed.ReduceOp.MIN)

    def barrier(self) -> None:
        torch.distributed.barrier()

    def save_policy(self, out: Path) -> None:
        """Every process takes part in the gather; process 0 writes the policy folder (publish.dtype)."""
        weights = self._gather_16bit()
        if self.rank == 0:
            self._write_model(out, weights)

    def snapshot(self, iteration: int):
        """A full checkpoint taken now (collective: ZeRO saves on every process), handed over later. On one node
        the shards wait on local disk with the model folder, and the returned function (process 0, the node's
        leader, on the resident trainer's writer thread) uploads them: training goes on meanwhile. On several
        nodes each node uploads its shards now (a collective), and only the model folder waits."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        held = Path(tempfile.mkdtemp(prefix="rlflow-ds-snapshot-", dir=self.scratch))
        shards = None
        if self.nodes > 1:
            extra = self.save(held, iteration)
        else:
            extra, local = self._save_here(held, iteration)
            if self.rank == 0:                  # moved aside: the next save writes `local` afresh
                shards = held.with_name(held.name + "-shards")
                os.replace(local, shards)

        def files(out: Path) -> dict:
            if shards is not None:
                self.store.put_folder(extra["engine_state"][0], shards, meta={"iteration": iteration, "node": 0})
                shutil.rmtree(shards, ignore_errors=True)
            for path in held.iterdir():
                shutil.move(str(path), out / path.name)
            shutil.rmtree(held, ignore_errors=True)
            return extra
        return files

    def save(self, out: Path, iteration: int) -> dict:
        """Every process: its shards to this node's disk, then to the store (one upload per node); process 0
        also writes the 16-bit model folder into `out`. Returns what state.json adds."""
        extra, local = self._save_here(out, iteration)
        if self.local_rank == 0:
            self.store.put_folder(extra["engine_state"][self.node], local, meta={"iteration": iteration,
                                                                                 "node": self.node})
        self.barrier()                                  # every node's folder is complete
        if self.rank == 0 and (missing := [p for p in extra["engine_state"] if self.store.manifest(p) is None]):
            raise RuntimeError(f"deepspeed checkpoint: node folders missing after upload: {missing}")
        return extra

    def _save_here(self, out: Path, iteration: int) -> tuple[dict, Path]:
        """Collective: every process's shards and RNG state into this node's folder (returned), the 16-bit model
        folder into `out` on process 0. Returns what state.json adds and that folder."""
        tag = f"global_step{self.global_step}"
        local = self.scratch / "save"
        if self.local_rank == 0:         # an engine that lives on (resident) saved an earlier tag here
            shutil.rmtree(local, ignore_errors=True)
        self.barrier()
        # LoRA: the frozen base is the base model's, rebuilt on resume: the shards keep the adapter's state alone
        self.model.save_checkpoint(str(local), tag=tag, exclude_frozen_parameters=self.lora)
        rng = local / layout.CKPT_RNG_RANK.format(rank=self.rank)
        rng.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), rng)
        weights = self._gather_16bit()
        if self.critic is not None:         # collective: the critic optimizer's shards, whole on process 0
            self.critic_optimizer.consolidate_state_dict(to=0)
        if self.rank == 0:
            self._write_model(out / MODEL_DIR, weights)
            if self.critic is not None:     # (its weights: the same on every process)
                self.critic.save(out)
                torch.save(self.critic_optimizer.state_dict(), out / layout.CKPT_CRITIC_OPTIMIZER)
        del weights
        run = self.cfg.run.name
        parts = [layout.engine_state(run, iteration, self.attempt, node) for node in range(self.nodes)]
        self.barrier()                                  # every process of this node has written its files
        return {"engine": "deepspeed", "zero_stage": self.cfg.train.zero_stage, "world_size": self.world_size,
                "nodes": self.nodes, "tag": tag, "engine_state": parts}, local

    def _gather_16bit(self) -> dict | None:
        """The full weights in publish.dtype (bf16 unless set) on process 0 (None elsewhere), gathered one
        module's parameters at a time: memory is that copy plus one module's full parameters, never a second
        fp32 model. ZeRO 1/2 keep
        whole weights on every process, and GatheredParameters is then a no-op. A parameter shared by two
        modules (tied embeddings) is kept once, under its first name, as save_pretrained does."""
        import deepspeed

        out, seen = ({} if self.rank == 0 else None), set()
        dtype = DTYPES[policy_dtype(self.cfg)]
        for prefix, module in self.model.module.named_modules():
            if self.lora and "lora_" not in prefix:
                continue                      # LoRA: the adapter's weights alone (the base stays the base model)
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in params)
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
                if out is not None:           # the other processes only take part in the gather
                    for name, p in params:
                        out[prefix + "." * bool(prefix) + name] = p.detach().to("cpu", dtype, copy=True)
            if out is not None:
                for name, b in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        b = b.detach().to("cpu", copy=True)
                        out[prefix + "." * bool(prefix) + name] = b.to(dtype) if b.is_floating_point() else b
        return out

    def _write_model(self, folder: Path, weights: dict) -> None:
        """What save_pretrained writes, in publish.dtype: safetensors (5 GB shards + index when larger), config,
        generation config, tokenizer."""
        from huggingface_hub import save_torch_state_dict

        folder.mkdir(parents=True, exist_ok=True)
        if self.lora:       # an adapter folder, as the torch engine's (peft writes adapter_config.json)
            self.model.module.save_pretrained(folder, state_dict=weights)
            self.tokenizer.save_pretrained(folder)
            return
        save_torch_state_dict(weights, folder, max_shard_size="5GB")
        module = self.model.module
        config = copy.deepcopy(module.config)
        config.dtype = DTYPES[policy_dtype(self.cfg)]
        config.save_pretrained(folder)
        if module.can_generate() and getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def close(self) -> None:
        """Release what this process holds (no collective: also runs after an error on one process)."""
        self._hf_config = None
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
        for engine in (getattr(self, "model", None), getattr(self, "ref_model", None)):
            if hasattr(engine, "destroy"):
                engine.destroy()
        if getattr(self, "local_rank", 1) == 0 and hasattr(self, "scratch"):
            shutil.rmtree(self.scratch, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def _all_reduce(self, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def _broadcast(self, value):
        box = [value if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def _on_node_leader(self, fn) -> None:
        """Run fn on this node's first process while the others wait (one download per node)."""
        if self.local_rank == 0:
            fn()
        self.barrier()


def join_group(cfg: Config) -> torch.device:
    """This torchrun worker's device, and the process group of all of them (nccl on CUDA, gloo on CPU), once."""
    device = device_for(cfg)
    if device.type == "cpu":
        set_default("DS_ACCELERATOR", "cpu")
        clear_stale_build_locks()
    import deepspeed

    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # On a CPU, DeepSpeed builds its shared-memory comm op (C++: 1-3 min on 2 cores, in every fresh
        # environment) as it makes the process group. Only inference_all_reduce (tensor-parallel inference)
        # uses it, never training, whose collectives are gloo's: marked incompatible, it is not built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    return device


BUILD_LOCK_STALE = 1800.0     # seconds: building one of DeepSpeed's C++ ops takes 1-3 min on 2 cores


def clear_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Remove torch extension build locks older than BUILD_LOCK_STALE. DeepSpeed builds its C++ ops on first use
    (DeepSpeedCPUAdam for train.offload_optimizer) under a lock file; a builder that was killed leaves the lock,
    and every later process waits on it forever (torch's FileBaton polls for its removal, with no timeout)."""
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root
        root = Path(get_default_build_root())
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            if time.time() - lock.stat().st_mtime > BUILD_LOCK_STALE:
                lock.unlink()
                removed.append(lock)
                print(f"removed a stale build lock left by a killed build: {lock}", file=sys.stderr, flush=True)
        except OSError:
            pass
    return removed


def universal_tag(tag: str) -> str:
    return f"{tag}-universal"


def to_universal(engine_dir: Path, tag: str) -> None:
    """Convert the ZeRO shards of checkpoint `tag` (saved by another number of processes) into DeepSpeed's
    universal checkpoint `universal_tag(tag)` beside it: one folder of fp32 weights and Adam moments per
    parameter, which any number of processes can load (`"checkpoint": {"load_universal": true}`). Runs
    DeepSpeed's own converter in a process of its own (it starts worker pools)."""
    out = universal_tag(tag)
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(engine_dir / tag),
            "--output_folder", str(engine_dir / out), "--inject_missing_state",
            "--num_extract_workers", str(max(1, min(8, os.cpu_count() or 1))), "--num_merge_workers", "2"]
    proc = run(argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL, capture_output=True,
               text=True)
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in (proc.stdout + proc.stderr).splitlines()[-15:] if line.strip())
        raise RuntimeError(f"deepspeed universal checkpoint conversion of {tag} failed: {tail[-1500:]}")
    print(f"train: the checkpoint's ZeRO shards were cut for another number of processes; converted {tag} to "
          f"DeepSpeed's universal checkpoint in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
