"""The training loop's own knobs: small frozen records the trainer reads instead of the config.

Built from the config in one place, :func:`otb_tir.trainer.parts.trainer_settings`; the names are
the config's (``rollout.n`` → ``n``, ``trainer.save_every`` → ``save_every``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from otb_tir.trainer.actor import ActorSettings
from otb_tir.trainer.config import FilterConfig
from otb_tir.trainer.dumps import DumpSettings


@dataclass(frozen=True)
class TrainerSettings:
    """What :class:`~otb_tir.trainer.trainer.Trainer` needs besides its parts."""

    output_dir: Path = Path("runs/tir_math")  # metrics, checkpoints/
    n: int = 8  # rollout.n: samples per prompt (the group size of the baselines)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (× n trajectories), all ranks together
    ppo_epochs: int = 1
    total_steps: int = 20
    seed: int = 0  # sampling seeds of the steps and of the held-out episodes, mini-batch order
    save_every: int = 5  # checkpoint every N steps and at the end (0 = never)
    keep_checkpoints: int = 2
    resume: bool = False  # continue from output_dir's last checkpoint
    eval_every: int = 0  # held-out evaluation every N steps during fit (0 = never)
    eval_n: int = 1  # samples per held-out problem
    adv_estimator: str = "tir_optimal_token_baseline"  # the name, for the record (the estimator is a part)
    handle_zero_tail: bool = True
    norm_adv_by_std_in_grpo: bool = True
    rollout_is: bool = False  # truncated IS weights π_old / π_rollout for the estimator and the loss
    rollout_is_threshold: float = 2.0
    # the next step's rollout runs beside this step's update, with the weights before it: samples one
    # update old (off-policy; rollout_is corrects for it), steps shorter by up to the smaller of the two
    one_step_off_policy: bool = False
    filters: FilterConfig = field(default_factory=FilterConfig)  # algorithm.filter, the config's own record
    dumps: DumpSettings = field(default_factory=DumpSettings)  # trainer.rollout_data_* (default: none)
    actor: ActorSettings = field(default_factory=ActorSettings)
