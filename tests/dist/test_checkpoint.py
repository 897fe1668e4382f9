"""Checkpoints under the fpdt strategy: exact resume, resume on another split, incomplete saves (docs/design.md §5)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from tests.dist.training import LitLM, TokenDataset, full_state, trainer_kwargs


class AdamLM(LitLM):
    """AdamW and a step LR schedule: optimizer moments and scheduler state must survive the resume too."""

    def training_step(self, batch, batch_idx):
        self.draws.append(torch.rand(()).item())  # a random stream (as dropout would use) must continue exactly
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(dp: int, sp: int, max_steps: int, ckpt_in: str | None = None, ckpt_out: str | None = None,
         checkpoint_every: str | None = None, distributed: bool = True):
    torch.manual_seed(0)
    module = AdamLM("llama", seed=3, lr=0.01)
    module.draws = []
    callbacks = []
    if checkpoint_every:  # a checkpoint every 2 steps, during training (mid-epoch), as a real run writes them
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_every, every_n_train_steps=2, save_top_k=-1))
    kwargs = trainer_kwargs(enable_checkpointing=bool(checkpoint_every))
    strategy = FPDTStrategy(sequence_parallel_size=sp, data_parallel_size=dp, chunks=2,
                            save_distributed_checkpoint=distributed)
    trainer = L.Trainer(strategy=strategy, devices=dp * sp, max_steps=max_steps, callbacks=callbacks, **kwargs)
    # 16 samples, batch 2: 8 batches per data-parallel group at dp=1 — the interruption falls mid-epoch
    trainer.fit(module, DataLoader(TokenDataset(16, 16, seed=11), batch_size=2), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return module, trainer


def interrupted_equals_uninterrupted(folder: str, dp: int, sp: int, distributed: bool = True) -> None:
    folder = os.path.join(folder, f"{dp}x{sp}")
    # the uninterrupted run, saving at steps 2 and 4
    full, _ = _fit(dp, sp, max_steps=5, checkpoint_every=folder, distributed=distributed)
    # the interrupted run: a new process state restarts from the step-2 checkpoint
    resumed, trainer = _fit(dp, sp, max_steps=5, ckpt_in=os.path.join(folder, "epoch=0-step=2.ckpt"),
                            distributed=distributed)
    assert os.path.isdir(os.path.join(folder, "epoch=0-step=2.ckpt")) == distributed  # a folder of shards, or a file
    # fp32 and the same batches in the same order: the resumed run repeats the same arithmetic exactly
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[2:]), rtol=0, atol=0)
    assert resumed.draws == full.draws[2:]
    resumed_params = full_state(resumed)
    for name, value in full_state(full).items():
        torch.testing.assert_close(resumed_params[name], value, rtol=0, atol=0, msg=name)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 5


@pytest.mark.parametrize("dp,sp,distributed", [(1, 2, True), (2, 1, True), (1, 2, False)])
def test_interrupted_training_equals_uninterrupted(dist_pool, tmp_path, dp, sp, distributed):
    """Saved after 2 steps (mid-epoch) and resumed to 5: the same losses, parameters, LR schedule, data position and
    random draws as 5 steps in one go; distributed checkpoints and the single-file option."""
    dist_pool(2).run(interrupted_equals_uninterrupted, folder=str(tmp_path), dp=dp, sp=sp, distributed=distributed)


def save_at(folder: str, dp: int, sp: int) -> None:
    module, trainer = _fit(dp, sp, max_steps=2, ckpt_out=os.path.join(folder, "split.ckpt"))
    params = {k: v.cpu() for k, v in full_state(module).items()}  # gathering is collective: every rank takes part
    opt = trainer.optimizers[0]
    moments = {n: opt.state[p]["exp_avg"].full_tensor().cpu() for n, p in module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(params, os.path.join(folder, "params.pt"))
        torch.save(moments, os.path.join(folder, "moments.pt"))


def resume_on(folder: str, dp: int, sp: int) -> None:
    torch.manual_seed(0)
    module = AdamLM("llama", seed=99, lr=0.01)  # other initial weights: everything must come from the checkpoint
    module.draws = []
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=sp, data_parallel_size=dp, chunks=2),
                        devices=dp * sp, max_steps=2, **trainer_kwargs())
    # max_steps already reached: fit restores the checkpoint and stops, so the state is exactly the saved one
    trainer.fit(module, DataLoader(TokenDataset(16, 16, seed=11), batch_size=2),
                ckpt_path=os.path.join(folder, "split.ckpt"))
    saved = torch.load(os.path.join(folder, "params.pt"))
    for name, value in full_state(module).items():
        torch.testing.assert_close(value.cpu(), saved[name], rtol=0, atol=0, msg=name)
    moments = torch.load(os.path.join(folder, "moments.pt"))
    opt = trainer.optimizers[0]
    for n, p in module.named_parameters():
        torch.testing.assert_close(opt.state[p]["exp_avg"].full_tensor().cpu(), moments[n], rtol=0, atol=0, msg=n)


def test_resume_on_another_split(dist_pool, tmp_path):
    """Saved at dp 1 × sp 2; resumed at 2 × 1 and at 1 × 4: every parameter and AdamW moment restored exactly."""
    folder = str(tmp_path)
    dist_pool(2).run(save_at, folder=folder, dp=1, sp=2)
    dist_pool(2).run(resume_on, folder=folder, dp=2, sp=1)
    dist_pool(4).run(resume_on, folder=folder, dp=1, sp=4)


def incomplete_is_refused(folder: str) -> None:
    _fit(1, 2, max_steps=1, ckpt_out=os.path.join(folder, "partial.ckpt"))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(folder, "partial.ckpt", ".metadata"))  # as if a rank died before the index was written
    dist.barrier()
    with pytest.raises(ValueError, match=r"partial.ckpt is incomplete \(missing .metadata\)"):
        _fit(1, 2, max_steps=2, ckpt_in=os.path.join(folder, "partial.ckpt"))


def test_incomplete_checkpoint_is_refused(dist_pool, tmp_path):
    """A checkpoint folder without its DCP index (an interrupted save) raises instead of loading."""
    dist_pool(2).run(incomplete_is_refused, folder=str(tmp_path))


def _damage(path: str, how: str) -> None:
    """64 bytes overwritten inside the file's tensor data (its middle), or the file cut to half its size."""
    size = os.path.getsize(path)
    if how == "overwrite":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(bytes(range(64)))
    else:
        os.truncate(path, size // 2)


def damaged_is_refused(folder: str, name: str, how: str) -> None:
    _fit(1, 2, max_steps=1, ckpt_out=os.path.join(folder, "damaged.ckpt"))
    assert os.path.isfile(os.path.join(folder, "damaged.ckpt", "fpdt_checksums.json"))
    dist.barrier()
    if dist.get_rank() == 0:
        _damage(os.path.join(folder, "damaged.ckpt", name), how)
    dist.barrier()
    damage = "contents changed since the save" if how == "overwrite" else "truncated or overwritten"
    with pytest.raises(ValueError, match=rf"damaged.ckpt is damaged: {name} \(.*{damage}.*resume from an earlier"):
        _fit(1, 2, max_steps=2, ckpt_in=os.path.join(folder, "damaged.ckpt"))


@pytest.mark.parametrize("name,how", [("__1_0.distcp", "overwrite"), (".metadata", "truncate")])
def test_damaged_checkpoint_is_refused_by_file(dist_pool, tmp_path, name, how):
    """64 bytes overwritten in a rank's shard, or a truncated DCP index: every rank refuses to load, naming the
    file, instead of training on other weights (the checksums recorded at save time differ)."""
    dist_pool(2).run(damaged_is_refused, folder=str(tmp_path), name=name, how=how)



def unusable_folder_is_refused_at_setup(folder: str) -> None:
    blocker = os.path.join(folder, "not-a-folder")
    if dist.get_rank() == 0:
        with open(blocker, "w") as f:
            f.write("a file where the checkpoint folder would go")
    dist.barrier()
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=2,
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(blocker, "ckpts"), every_n_train_steps=1)],
                        default_root_dir=folder, **trainer_kwargs(enable_checkpointing=True))
    with pytest.raises(ValueError, match=r"checkpoints of this run could not be saved: .*not-a-folder/ckpts cannot be "
                                         r"made \(Not a directory\)\. Fix the folder, or save elsewhere"):
        trainer.fit(AdamLM("llama", seed=3, lr=0.01), DataLoader(TokenDataset(8, 16, seed=2), batch_size=2))
    assert trainer.global_step == 0


def test_unusable_checkpoint_folder_is_refused_before_training(dist_pool, tmp_path):
    """A ModelCheckpoint folder that cannot be made is refused at setup on every rank, before the first step, not
    at the first save."""
    dist_pool(2).run(unusable_folder_is_refused_at_setup, folder=str(tmp_path))


def full_disk_is_named(folder: str) -> None:
    target = os.path.join(folder, "manual.ckpt")
    if dist.get_rank() == 0:
        os.makedirs(target)
        os.symlink("/dev/full", os.path.join(target, "__1_0.distcp"))  # rank 1's shard lands on a full device
    dist.barrier()
    _, trainer = _fit(1, 2, max_steps=1)
    with pytest.raises(OSError, match=r"No space left on the device of .*manual.ckpt while saving the checkpoint .*: "
                                      r".* free now; one checkpoint needs about .* parameters × 4 bytes × \(1 weight "
                                      r"\+ 2 AdamW states\)\)\. This checkpoint is incomplete"):
        trainer.save_checkpoint(target)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_save_that_runs_out_of_space_says_so(dist_pool, tmp_path):
    """One rank's shard of a distributed save fails with the kernel's ENOSPC: every rank raises an OSError that
    names the lack of space, the folder and a checkpoint's size, not the writer's bare error."""
    dist_pool(2).run(full_disk_is_named, folder=str(tmp_path))
