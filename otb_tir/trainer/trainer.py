"""The single-machine TIR trainer, one step top to bottom.

    prompts ─► agent_env.rollout (B prompts × n samples, multi-turn tool episodes)
            ─► actor forward: old log-probs, entropy, Σπ² (fused, no [T, V] logits)
            ─► optional filters and rollout IS weights
            ─► advantages by name (default TIR-OTB)
            ─► PPO over mini-batches ─► engine weight sync ─► metrics, checkpoint

Runs in one process on CPU or one GPU, and under ``torchrun`` with FSDP2 (see ``distributed.py``):
each rank rolls out a contiguous block of the global prompt batch (whole uid groups, so group
baselines never cross ranks; episode seeds offset by the block start, so the samples are those of
a one-process run), metrics are computed over all ranks' rows, checkpoints go through
``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from agent_env import AgentEnv, RolloutBatch, Trajectory, rollout_async
from agent_env.records import Prompt
from agent_env.rollout import run_sync
from otb_tir import ConfigError
from otb_tir.metrics import trajectory_metrics
from otb_tir.token_stats import TokenStats
from otb_tir.trainer.actor import on_policy_micro_batches, on_policy_update
from otb_tir.trainer.checkpoint import (
    load_distributed_state,
    load_latest,
    rng_state,
    save_checkpoint,
    save_distributed_checkpoint,
    set_rng_state,
)
from otb_tir.trainer.distributed import gather_objects, gather_tensors, shard_items
from otb_tir.trainer.dumps import StepDumper, token_tensors
from otb_tir.trainer.parts import Parts
from otb_tir.trainer.ppo import Advantages
from otb_tir.trainer.settings import TrainerSettings
from otb_tir.trainer.step import advantages, estimate, filter_loss_mask, score, step_metrics, update
from otb_tir.trainer.timing import AFTER_ROW_PHASES, STEP_PHASES, PhaseTimer, rollout_phases

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    metrics: dict[str, float]
    batch: RolloutBatch


@dataclass
class _Ahead:
    """The next step's rollout, run beside this step's update (``trainer.one_step_off_policy``)."""

    batch: RolloutBatch
    cursor_before: dict  # the data cursor before its prompts were drawn: what a checkpoint saves
    seconds: float  # its wall time (inside this step's update_s)


class Trainer:
    """Single-machine (or torchrun/FSDP2) PPO trainer with TIR-OTB advantages.

    ``settings``: the loop's knobs; ``parts``: what it trains with (see :mod:`otb_tir.trainer.parts`,
    which builds both from a config). ``parts.model`` is the policy being trained (possibly
    FSDP-sharded); ``parts.engine`` rolls out (an HFEngine sharing the model's weights, or any Engine
    whose ``update_weights`` gets ``parts.weights_fn()`` after each step). Each part is an attribute
    of the same name (``trainer.estimator``, ``trainer.engine``, ...): assigning one swaps it.
    """

    def __init__(self, settings: TrainerSettings, parts: Parts):
        s = self.settings = settings
        self.model, self.ref_model = parts.model, parts.ref_model
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.engine, self.weights_fn = parts.engine, parts.weights_fn
        self.env, self.eval_env = parts.env, parts.eval_env
        self.cursor, self.val_items = parts.cursor, list(parts.val_items)
        self.estimator, self.logger = parts.estimator, parts.logger
        self.rank, self.world = parts.info.rank, parts.info.world_size
        self.out = Path(s.output_dir)
        bs, world = self.cursor.batch_size, self.world
        if bs % world:
            raise ConfigError(f"data.train_batch_size ({bs}) must be divisible by the number of ranks ({world})")
        if (s.ppo_mini_batch_size * s.n) % world:
            raise ConfigError(
                f"actor.ppo_mini_batch_size × rollout.n ({s.ppo_mini_batch_size} × "
                f"{s.n}) trajectories must split evenly over {world} ranks"
            )
        self.step = 0
        self.batch: RolloutBatch | None = None  # the rollout of the step in progress (or of the last step)
        self.timing_totals: dict[str, float] = {}  # seconds per phase over this process's fit()
        self.steps_without_signal = 0  # steps whose groups all had equal rewards (train/zero_advantage_frac = 1)
        self._ahead: _Ahead | None = None  # the next step's rollout, done beside this step's update
        self._engine_behind = False  # the engine lacks the last update's weights (it was rolling out)
        # every rank takes part in a due step's gathers (the same decision everywhere); rank 0 writes
        self.dumper = StepDumper(s.dumps, s.total_steps, writer=self.rank == 0)
        if s.one_step_off_policy and self.world > 1:
            raise ConfigError(
                "trainer.one_step_off_policy runs in one process only (not under torchrun: the update's "
                "collectives beside a rollout are untested)"
            )
        if s.one_step_off_policy and self.weights_fn is None:
            raise ConfigError(
                "trainer.one_step_off_policy needs an engine with its own copy of the weights (the update "
                "changes the actor's while the engine rolls out the next step): build it with "
                "share_weights=False and pass weights_fn"
            )

    # ------------------------------------------------------------------ rollout

    def _rollout(
        self, items: Sequence[dict], n: int, seed: int, env: AgentEnv | None = None, offset: int = 0
    ) -> RolloutBatch:
        """Episodes of ``items``, the block of a global batch starting at index ``offset``: uids and
        episode seeds are those the same prompts get in a one-process rollout of the whole batch."""
        # one persistent event loop for the whole run: the tools' sandbox workers (bound to the loop
        # that started them) live across steps instead of being restarted by a new loop per step
        return run_sync(self._episodes(items, n, seed, env, offset))

    def _episodes(self, items: Sequence[dict], n: int, seed: int, env: AgentEnv | None = None, offset: int = 0):
        """The coroutine :meth:`_rollout` runs (awaited beside the update when one step off-policy)."""
        prompts = [Prompt.from_row(it, uid=f"{seed}-{offset + i}", index=offset + i) for i, it in enumerate(items)]
        return rollout_async(self.engine, env or self.env, prompts, n, seed=seed + offset * n, progress=self.rank == 0)

    def _step_seed(self, step: int) -> int:
        """The sampling seed of training step ``step`` (0-based)."""
        return self.settings.seed * 1_000_003 + step

    def evaluate(
        self, items: Sequence[dict] | None = None, tag: str = "val"
    ) -> tuple[dict[str, float], list[Trajectory]]:
        """Greedy (by default) episodes on the held-out items; returns metrics and trajectories."""
        items = self.val_items if items is None else list(items)
        items, offset = shard_items(items, self.rank, self.world)
        self.model.eval()
        seed = 10_000_019 + self.settings.seed
        local = (
            self._rollout(items, self.settings.eval_n, seed=seed, env=self.eval_env, offset=offset).trajectories
            if items
            else []
        )
        trajs = gather_objects(local, self.world)
        return trajectory_metrics(trajs, prefix=f"{tag}/"), trajs

    # ------------------------------------------------------------------ one step

    def train_step(self) -> StepResult:
        """rollout → (ref) → score → advantages → update → weight sync → metrics, each under one timer."""
        s, timer = self.settings, PhaseTimer()
        cpu0 = time.process_time()
        ahead, self._ahead = self._ahead, None
        with timer("rollout"):
            batch = self.batch = self._rollout_step() if ahead is None else ahead.batch
        # a rollout done ahead ran inside the previous step's update_s: its phases are none of this step's
        timer.seconds.update(rollout_phases(batch.stats if ahead is None else {}, timer.seconds["timing/rollout_s"]))
        if self._engine_behind:  # the engine still has the weights of before the last update
            with timer("weight_sync"):
                self._sync_weights()
            self._engine_behind = False
        # one step off-policy: the next step's rollout runs beside this step's update, with the
        # weights before it; not before a held-out evaluation (it needs the engine) nor at the end
        nxt = self.step + 1
        overlap = s.one_step_off_policy and nxt < s.total_steps and not (s.eval_every and nxt % s.eval_every == 0)
        with timer("ref"):
            ref = None
            if self.ref_model is not None and s.actor.kl_coef > 0:
                ref = score(self.ref_model, batch, s.actor).log_probs
        if overlap:
            (old, adv, actor_metrics), self._ahead, overlap_s = self._learn_beside_next_rollout(batch, ref, timer)
            own = timer.seconds.get("timing/old_log_prob_s", 0.0) + timer.seconds.get("timing/advantage_s", 0.0)
            timer.seconds["timing/update_own_s"] = timer.seconds["timing/update_s"]
            # the step waited on both: the wall of the two together goes under update_s
            timer.seconds["timing/update_s"] = max(overlap_s - own, 0.0)
            timer.seconds["timing/next_rollout_s"] = self._ahead.seconds
        else:
            old, adv, actor_metrics = self._learn(batch, ref, timer)
        actor_metrics["rollout/policy_lag"] = float(ahead is not None)
        lr_used = self.optimizer.param_groups[0]["lr"]  # this step's rate, before the scheduler moves it
        with timer("update"):
            if self.scheduler is not None:
                self.scheduler.step()
        if overlap:  # the engine is rolling out the next step: its weights go in when that is done
            self._engine_behind = True
            timer.seconds.setdefault("timing/weight_sync_s", 0.0)  # every row has every phase
        else:
            with timer("weight_sync"):
                self._sync_weights()
        with timer("metrics"):
            metrics = step_metrics(batch, old, adv, actor_metrics, timer.seconds, s, world=self.world, lr=lr_used)
        metrics["timing/metrics_s"] = timer.seconds["timing/metrics_s"]
        with timer("dump"):
            self._dump(batch, old, adv, lag=int(ahead is not None))
        metrics["timing/dump_s"] = timer.seconds["timing/dump_s"]
        metrics["timing/step_s"] = timer.elapsed()
        metrics.update(timer.memory)  # per phase: the process's peak resident set so far, and now
        # CPU seconds of this process's threads over the step (tool sandboxes are other processes): over
        # step_s, how many cores the step kept busy
        metrics["perf/process_cpu_s"] = time.process_time() - cpu0
        inner = [k for k in STEP_PHASES if k in metrics and k != "timing/eval_s"]
        metrics["timing/step_other_s"] = max(metrics["timing/step_s"] - sum(metrics[k] for k in inner), 0.0)
        return StepResult(metrics, batch)

    def _dump(self, batch: RolloutBatch, old: TokenStats, adv: Advantages, lag: int) -> None:
        """This step's trajectories into ``trainer.rollout_data_dir`` when due (all ranks' rows, rank 0
        writes); ``lag``: updates between the sampling weights and this step's (1 one step off-policy)."""
        step = self.step + 1
        if not self.dumper.due(step):
            return
        trajs = gather_objects(batch.trajectories, self.world)
        tensors = gather_tensors(token_tensors(batch, old, adv), self.world)
        if self.rank == 0:
            self.dumper.write(step, trajs, tensors, policy_version=self.step - lag)

    def _rollout_step(self) -> RolloutBatch:
        """This step's rollout, with the engine's current weights."""
        self.model.eval()
        items, offset = self._draw()
        return self._rollout(items, self.settings.n, seed=self._step_seed(self.step), offset=offset)

    def _learn(
        self, batch: RolloutBatch, ref: torch.Tensor | None, timer: PhaseTimer
    ) -> tuple[TokenStats, Advantages, dict[str, float]]:
        """score → advantages → update on ``batch``; on an exactly on-policy step the old statistics are
        the update's own forward (begin → advantages → finish)."""
        s = self.settings
        rows = batch["responses"].shape[0]
        group_local = bool(getattr(self.estimator, "group_local", False))
        micro = on_policy_micro_batches(
            s.actor, batch["uid"], rows, s.ppo_mini_batch_size * s.n // self.world, s.ppo_epochs, group_local
        )
        one_forward = micro is not None
        if one_forward:
            loss_mask, kept = filter_loss_mask(batch, s.filters)

            def estimate_rows(rows_: torch.Tensor, old_rows: TokenStats):
                with timer("advantage"):
                    return estimate(batch, old_rows, self.estimator, s, rows_)

            with timer("update"):
                old, a, is_w, metrics = on_policy_update(
                    self.model, self.optimizer, batch.tensors, s.actor, micro, loss_mask, estimate_rows, ref
                )
            # the estimator ran inside the update's timer: its seconds are advantage_s's only
            timer.seconds["timing/update_s"] -= timer.seconds.get("timing/advantage_s", 0.0)
            adv = Advantages(a, loss_mask, is_w, kept)
            timer.seconds["timing/old_log_prob_s"] = 0.0  # no separate pass (the key stays, for readers)
            metrics["actor/one_forward_micro_batches"] = float(len(micro))
        else:
            with timer("old_log_prob"):  # log-prob, entropy and Σπ², one pass
                old = score(self.model, batch, s.actor)
            with timer("advantage"):
                adv = advantages(batch, old, self.estimator, s)
            with timer("update"):
                metrics = update(
                    self.model, self.optimizer, batch, old, adv, s, step=self.step, world=self.world, ref_log_probs=ref
                )
        metrics["actor/one_forward"] = float(one_forward)
        return old, adv, metrics

    def _draw(self) -> tuple[list[dict], int]:
        """This rank's block of the next prompt batch, and the block's offset in it."""
        return shard_items(self.cursor.next_batch(), self.rank, self.world)

    def _learn_beside_next_rollout(
        self, batch: RolloutBatch, ref: torch.Tensor | None, timer: PhaseTimer
    ) -> tuple[tuple[TokenStats, Advantages, dict[str, float]], "_Ahead", float]:
        """:meth:`_learn` (this step's update) in a worker thread while the next step's rollout runs on
        this thread's event loop with the engine's weights of before the update. Returns what
        :meth:`_learn` returns, the next rollout and the wall seconds of the two together."""
        s = self.settings
        cursor_before = self.cursor.state()
        items, offset = self._draw()

        async def both():
            learning = asyncio.ensure_future(asyncio.to_thread(self._learn, batch, ref, timer))
            t0 = time.perf_counter()
            try:
                nxt = await self._episodes(items, s.n, self._step_seed(self.step + 1), offset=offset)
            except BaseException:
                await asyncio.gather(learning, return_exceptions=True)  # never leave the update running
                raise
            seconds = time.perf_counter() - t0
            return await learning, _Ahead(nxt, cursor_before, seconds)

        # the update takes the cores the engine leaves (on the CPU its steps hold cpu_threads of them;
        # torch's thread count is the process's): on 2 cores 1 and 1, as torch's 2 threads beside the
        # engine's made the update slower (docs/training.md)
        before = torch.get_num_threads()
        torch.set_num_threads(max(1, before - int(getattr(self.engine, "cpu_threads", 0) or 0)))
        t0 = time.perf_counter()
        try:
            learned, ahead = run_sync(both())
        finally:
            torch.set_num_threads(before)
        return learned, ahead, time.perf_counter() - t0

    def _sync_weights(self) -> None:
        if self.weights_fn is None:  # the engine shares the trainer's model
            run_sync(self.engine.update_weights({}))
            return
        run_sync(self.engine.update_weights(self.weights_fn()))

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """One process: everything in one dict (model, optimizer, scheduler, cursor, RNG, step)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "cursor": self._cursor_state(),
            "rng": rng_state(),
            "step": self.step,
        }

    def _small_state(self) -> dict[str, Any]:
        """Under FSDP: what is not sharded (model and optimizer go through DCP); RNG of every rank."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "cursor": self._cursor_state(),
            "rng_per_rank": gather_objects([rng_state()], self.world),
            "step": self.step,
            "world_size": self.world,
        }

    def _cursor_state(self) -> dict:
        """The cursor as of before a rollout done ahead: a resumed run draws those prompts again (and
        rolls them out with the checkpoint's weights; the rollout itself is not saved)."""
        return self._ahead.cursor_before if self._ahead is not None else self.cursor.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "model" in state:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state(state["cursor"])
        self._ahead, self._engine_behind = None, False
        rng = state["rng"] if "rng" in state else state["rng_per_rank"][self.rank % len(state["rng_per_rank"])]
        set_rng_state(rng)
        self.step = int(state["step"])

    def maybe_resume(self) -> bool:
        found = load_latest(self.out / "checkpoints") if self.settings.resume else None
        if found is None:
            return False
        step, state = found
        sharded = bool(state.get("distributed"))
        if sharded != (self.world > 1):
            raise ConfigError(
                f"the checkpoint {self.out / 'checkpoints' / f'step_{step}'} was written by a "
                f"{'torchrun/FSDP' if sharded else 'one-process'} run; resume it the same way "
                f"({'torchrun --nproc_per_node N' if sharded else 'without torchrun'})"
            )
        if sharded:
            load_distributed_state(self.out / "checkpoints" / f"step_{step}", self.model, self.optimizer)
        self.load_state_dict(state)
        self._sync_weights()
        if self.logger is not None:
            self.logger.truncate(step)
        log.info("resumed from %s at step %d", self.out / "checkpoints", step)
        return True

    # ------------------------------------------------------------------ the loop

    def fit(self, progress: bool = True) -> list[dict[str, float]]:
        from tqdm.auto import tqdm

        s, history = self.settings, []
        total, every = s.total_steps, s.eval_every
        bar = tqdm(total=total, initial=self.step, desc="train", unit="step", disable=not progress or self.rank != 0)
        # Writing a row and saving a checkpoint happen after the row is complete: their seconds go
        # into the next row (timing/prev_log_s, timing/prev_checkpoint_s) and into self.timing_totals.
        prev = {"timing/prev_log_s": 0.0, "timing/prev_checkpoint_s": 0.0}
        while self.step < total:
            res = self.train_step()
            self.step += 1
            if res.metrics.get("train/zero_advantage_frac") == 1.0:
                self.steps_without_signal += 1
                if self.rank == 0:
                    log.warning(
                        "step %d: every group's samples got the same reward (reward/mean %.2f): zero advantages, "
                        "this update changed nothing (train/zero_advantage_frac = 1)",
                        self.step,
                        res.metrics.get("reward/mean", float("nan")),
                    )
            timer = PhaseTimer()
            with timer("eval"):
                if every and self.step % every == 0 and self.step < total:  # the last step: run.py's `after`
                    res.metrics.update(self.evaluate(tag="val")[0])  # the held-out curve, val/* in this row
            res.metrics["timing/eval_s"] = timer.seconds["timing/eval_s"]
            res.metrics.update(prev)
            history.append(res.metrics)
            with timer("log"):
                if self.logger is not None:
                    self.logger.log(res.metrics, self.step)
                bar.set_postfix(
                    acc=f"{res.metrics.get('reward/accuracy', float('nan')):.2f}",
                    tools=f"{res.metrics.get('tools/call_rate', float('nan')):.2f}",
                )
                bar.update(1)
            with timer("checkpoint"):
                if s.save_every and (self.step % s.save_every == 0 or self.step == total):
                    self.save()
            prev = {f"timing/prev_{k}_s": timer.seconds[f"timing/{k}_s"] for k in ("log", "checkpoint")}
            self._add_timing(res.metrics, prev)
        bar.close()
        if self.steps_without_signal and self.steps_without_signal == len(history) and self.rank == 0:
            log.warning(
                "no step of this run had a group with different rewards: it learned nothing. The task is too "
                "hard or too easy for the policy at rollout.n=%d (every sample wrong, or every one right), or "
                "the reward is constant: check the reward on a few samples, or raise rollout.n",
                s.n,
            )
        return history

    def _add_timing(self, row: Mapping[str, Any], after: Mapping[str, float]) -> None:
        """Run totals of the step phases (a row's own phases, then its log and checkpoint)."""
        for key in STEP_PHASES:
            self.timing_totals[key] = self.timing_totals.get(key, 0.0) + float(row.get(key, 0.0))
        for key, src in zip(AFTER_ROW_PHASES, ("timing/prev_log_s", "timing/prev_checkpoint_s")):
            self.timing_totals[key] = self.timing_totals.get(key, 0.0) + after[src]

    def save(self) -> None:
        root, keep = self.out / "checkpoints", self.settings.keep_checkpoints
        if self.world > 1:
            save_distributed_checkpoint(
                root,
                self.step,
                self.model,
                self.optimizer,
                self._small_state(),
                rank=self.rank,
                world=self.world,
                keep=keep,
            )
            return
        save_checkpoint(root, self.step, self.state_dict(), keep=keep)
