"""The value model of `train.algorithm: ppo` and `vtrace_awr` (train.learner.critic): a value head on the policy's
own last hidden state (`head`: the policy's forward gives both), or a trunk of its own with a head (`separate`:
the base model's weights, a forward of its own). The trainer holds it beside the policy: in the same optimizer (a
parameter group of its own, train.learner.critic_lr), saved in every full checkpoint (critic.safetensors) and
restored with it, so a resumed or replayed run continues it exactly. It never leaves the trainer: generation
needs no values.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from tasks.algorithms.ppo import ValueHead
from tasks.core import layout

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import MicroBatch


class Critic(torch.nn.Module):
    def __init__(self, head: ValueHead, trunk: torch.nn.Module | None = None, multiplier: float | None = None):
        super().__init__()
        self.head, self.trunk = head, trunk
        # vtrace_awr: the KL constraint's Lagrange multiplier η = softplus(eta), learned with the critic
        self.eta = (torch.nn.Parameter(torch.tensor(float(torch.log(torch.expm1(torch.tensor(multiplier))))))
                    if multiplier is not None else None)

    @classmethod
    def make(cls, cfg: Config, policy: torch.nn.Module, device) -> Critic:
        """A new value model (drawing its head's initial weights from the RNG: call it at a seeded point)."""
        from tasks.core.models import base_path, load_model

        hidden = policy.config.get_text_config().hidden_size
        trunk = None
        settings = cfg.train.learner            # (a value learner's: ppo, vtrace_awr)
        if settings.critic == "separate":
            trunk = load_model(base_path(cfg), cfg.model.dtype, device)
            trunk.train()
        multiplier = getattr(settings, "kl_multiplier_init", None)     # vtrace_awr's KL constraint
        return cls(ValueHead(hidden).to(device), trunk, multiplier).to(device)

    def encode(self, hidden: torch.Tensor | None, b: MicroBatch) -> torch.Tensor:
        """The head's input for each completion token (b, Lc, H): the policy's hidden states of those positions
        (head), or the last hidden states of the trunk's own forward (separate)."""
        if self.trunk is None:
            return hidden
        device = next(self.trunk.parameters()).device
        out = self.trunk(input_ids=b.ids.to(device), attention_mask=b.attention.to(device),
                         position_ids=b.positions.to(device), output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1][:, -(b.width + 1):-1]

    def values(self, hidden: torch.Tensor | None, b: MicroBatch, detach: bool = False) -> torch.Tensor:
        """V(s_t) for each completion token (b, Lc) (`detach`: the head alone learns from it)."""
        encoded = self.encode(hidden, b)
        return self.head(encoded.detach() if detach else encoded)

    def save(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        save_file(_contiguous(state if state is not None else self.state_dict()), folder / layout.CKPT_CRITIC)

    def load(self, folder: Path) -> None:
        device = next(self.parameters()).device
        self.load_state_dict(load_file(folder / layout.CKPT_CRITIC, device=str(device)))


def _contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (a trunk's tied embeddings): a copy of each."""
    return {k: v.detach().clone().contiguous() for k, v in state.items()}
