"""The config section of the warm start: `warmup`, supervised fine-tuning (SFT) on demonstrations before RL's
iteration 1 (tasks/sft.py), whose result is the run's starting policy v0.

Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/sft.py): the formats read, the masks, checkpoints and resume.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tasks.core.config_base import HOW_NOT_WHAT, Section
from tasks.core.config_inputs import dataset_name


class WarmupConfig(Section):
    """The warm start: SFT on demonstrations before RL's iteration 1 (tasks/sft.py). As TRL's SFTTrainer and
    prime-rl's sft trainer do it: demonstrations in one of TRL's SFT formats (`messages`; `prompt`/`completion`,
    strings or message lists; whole multi-turn episodes as messages, with a `tools` column where they call tools),
    read unchanged. The engine, LoRA (train.lora_r), dtype and AdamW's settings are the train section's; the
    result, merged when LoRA, is published as `<run>/policy/v000000` and every iteration starts from it (its KL
    reference too)."""

    path: str = Field(..., min_length=1, description="The demonstrations: a .json/.jsonl/.csv/.parquet file or a "
                      "hub dataset id (`rlflow record` writes one from a scripted policy or a model run through "
                      "the run's environment).")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    split: str = Field("train", description="Split to train on.")
    format: Literal["auto", "messages", "prompt_completion", "text"] = Field(
        "auto", description="auto: `messages` if that column exists, else `prompt` and `completion` (TRL's rule), "
        "else `text` (every token learned, as TRL's language-modeling format).")
    assistant_only: bool = Field(True, description="Loss on the model's tokens only: the completion, or every "
                                 "assistant turn of a conversation (its text and EOS), as RL's masks have it; false: "
                                 "every token, as TRL's SFTTrainer tokenises the row (its default for `messages`).")
    epochs: int = Field(1, ge=1, le=100_000, description="Passes over the demonstrations (each reshuffled).")
    max_steps: int | None = Field(None, ge=1, le=100_000_000, description="Stop after this many optimizer steps "
                                  "(None: epochs decide).")
    batch_size: int = Field(8, ge=1, le=1_000_000, description="Demonstrations per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, le=1_000_000, description="Demonstrations per forward pass (the "
                                  "gradient is accumulated over the step's; the loss is normalised by the step's "
                                  "token count, so this changes memory, not the update, up to rounding; above "
                                  "batch_size: the whole step in one pass).")
    lr: float = Field(2.0e-5, gt=0, le=1.0, description="AdamW's learning rate (TRL's SFTConfig default).")
    lr_schedule: Literal["constant", "linear"] = Field("linear", description="linear: decays to 0 at the last "
                                                       "step (after lr_warmup_steps), as transformers' default.")
    lr_warmup_steps: int = Field(0, ge=0, le=1_000_000, description="Steps of linear warm-up from 0.")
    max_length: int | None = Field(None, ge=8, le=10_000_000, description="The longest demonstration in tokens; "
                                   "a longer one is refused with its row (None: the model's context). Never cut "
                                   "silently: a cut demonstration teaches a task without its end.")
    checkpoint_every: int = Field(50, ge=1, le=1_000_000, json_schema_extra=HOW_NOT_WHAT,
                                  description="Optimizer steps between checkpoints (<run>/sft/trainer/ckpt-S); a "
                                  "killed warm start resumes from the newest with the same weights as one never "
                                  "killed.")

    _a_name = field_validator("path", "name", "split")(dataset_name)

    @model_validator(mode="after")
    def _warm_up_within_the_steps(self):
        if self.max_steps is not None and self.lr_warmup_steps >= self.max_steps:
            raise ValueError(f"lr_warmup_steps {self.lr_warmup_steps} is not below max_steps {self.max_steps}: the "
                             f"lr would never reach warmup.lr; expected fewer warm-up steps than steps")
        return self
