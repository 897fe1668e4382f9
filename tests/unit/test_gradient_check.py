"""GradientCheck: a parameter that requires grad and gets no gradient, or only zeros, stops the fit naming it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_fpdt import ActivationOffload, GradientCheck, TiledMLP
from lightning_fpdt.callbacks.gradient_check import NO_GRADIENT, TRAINED, ZERO_GRADIENT, gradient_states
from tests.dist.training import TokenDataset, trainer_kwargs

VOCAB = 64


class Blocks(nn.Module):
    """Embeddings, two MLP blocks, a head; ``unused`` is never called and ``scale`` only ever multiplied by zero."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)
        self.unused = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x + 0.0 * self.scale * x)


class BlocksLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Blocks()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(callbacks: list, steps: int = 3) -> L.Trainer:
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(BlocksLM(), DataLoader(TokenDataset(num_samples=8, seq_len=16, seed=1), batch_size=2))
    return trainer


def test_untrained_parameters_stop_the_fit_with_their_names():
    """Under the memory callbacks (which add the check), after the third step: the parameters never reached and the
    one that only had zero gradients are named, each with its likely cause and the option that allows them."""
    with pytest.raises(RuntimeError, match=r"3 of the 14 parameters that require grad did not train in the first 3 "
                                           r"optimizer steps .*No gradient at all for 2: model.unused.weight, "
                                           r"model.unused.bias\. .*Only zero gradients for 1: model.scale\. .*"
                                           r"GradientCheck\(allow="):
        fit([ActivationOffload(), TiledMLP(num_tiles=2)])


def test_allowed_parameters_and_steps_zero():
    """``allow`` patterns exempt named parameters; ``steps=0`` checks nothing; the user's own check is the one."""
    check = GradientCheck(allow=["model.unused.*", "model.scale"])
    trainer = fit([ActivationOffload(), check])
    assert sum(isinstance(c, GradientCheck) for c in trainer.callbacks) == 1
    fit([TiledMLP(), GradientCheck(steps=0)])


def test_the_check_stops_looking_once_everything_trained():
    """A fit in which every trainable parameter has a non-zero gradient at the first step is checked once."""
    module = BlocksLM()
    module.model.unused.requires_grad_(False)
    module.model.scale.requires_grad_(False)
    check = GradientCheck()
    trainer = L.Trainer(devices=1, max_steps=3, callbacks=[check], **trainer_kwargs())
    trainer.fit(module, DataLoader(TokenDataset(num_samples=8, seq_len=16, seed=1), batch_size=2))
    assert check._checked == 1 and check._done()


def test_gradient_states():
    """None is no gradient, all zeros is a zero gradient, any non-zero element trained."""
    grads = [None, torch.zeros(3), torch.tensor([0.0, 1e-30, 0.0])]
    assert gradient_states(grads, torch.device("cpu")).tolist() == [NO_GRADIENT, ZERO_GRADIENT, TRAINED]


@pytest.mark.parametrize("steps", [-1, 1.5, True])
def test_steps_must_be_a_count(steps):
    """``steps`` is a count of optimizer steps >= 0."""
    with pytest.raises(ValueError, match=r"GradientCheck\(steps=.*\): give a number of optimizer steps >= 0"):
        GradientCheck(steps=steps)
