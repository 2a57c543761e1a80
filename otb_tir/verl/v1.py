"""TIR-OTB on verl's default trainer (V1): the trainer modes ``otb_sync``, ``otb_colocate_async``
and ``otb_separate_async``.

verl 0.9.1's V1 trainer (``verl/trainer/ppo/v1/trainer_base.py``, ``PPOTrainer``) never asks the
actor for Σπ²: ``_compute_old_log_prob`` does not set ``calculate_sum_pi_squared`` and
``_compute_advantage`` does not fetch ``sum_pi_squared``, so ``compute_advantage`` stops with
"Step-dependent optimal baseline requires sum_pi_squared from actor" for the OTB estimators. This
module supplies that step through verl's own extension point for trainers, ``register_trainer``:
:class:`OTBTrainerMixin` over verl's ``sync``, ``colocate_async`` and ``separate_async`` classes,
registered as ``otb_<mode>``. Select one with verl's own key ``trainer.v1.trainer_mode=otb_sync``
(the recipe's ``verl.trainer_mode=sync`` does it) and load this module in verl's processes with
``VERL_USE_EXTERNAL_MODULES=otb_tir.verl.v1``. It works with verl's own agent loops too.

What the mixin adds to verl's step (everything else is verl's code):

* **Σπ² in the old-log-prob pass only.** ``calculate_sum_pi_squared`` is put in that pass's
  request and taken out again, so the reference and update passes do not compute it. The actor's
  Σπ² (over prompt + response, like its log-probs) is cut to the response the way verl cuts the
  log-probs and stored in TransferQueue as ``sum_pi_squared_response``.
* **Σπ², old log-probs and IS weights reach the estimator.** While its ``_compute_advantage`` runs,
  verl's ``compute_advantage_for_multi_trajectories`` (the name ``trainer_base`` calls) is wrapped
  to add ``sum_pi_squared`` to the batch; verl's ``compute_advantage`` then passes it with
  ``old_log_probs`` and the ``rollout_is_weights`` that verl's rollout correction just computed.
  (The one place this module replaces a verl function: see :mod:`otb_tir.verl.glue`.)
* **Checks on every step's batch**: the multi-turn contract of :func:`otb_tir.verl.hooks.check_contract`
  (tool tokens masked with advantage 0, the reward on the last policy token, our estimator equal to
  verl's given the same IS weights, ``contract/adv_max_abs_diff_vs_verl``), the IS weights' mean,
  max and truncated fraction, how much they changed the advantages, a staleness histogram (samples
  per model-version lag), the rollout engine's probabilities against the actor's per lag (at lag 0
  they differ by numerics only when the weight sync took effect), the variance-proxy metrics
  (verl's ``compute_variance_proxy_metrics``, which its V1 trainer never gets to compute because it
  does not fetch Σπ²), and how long the trainer waited for rollouts and the rollouts for the trainer.
* **For the recipe** (``OTB_TIR_OUTPUT_DIR`` set by :func:`otb_tir.verl.launch.run_verl`):
  ``progress.json`` for the watchdog and the local trainer's metric files, as
  :mod:`otb_tir.verl.hooks` does for the legacy trainer (:mod:`otb_tir.verl.v1_record`, with the
  per-step batch figures).

OTB with ``algorithm.rollout_correction.bypass_mode=true`` is refused at start: bypass mode skips
the old-log-prob pass, the only pass that yields Σπ².
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from typing import Any, Callable

import torch

from otb_tir.verl.hooks import OTB_ESTIMATORS
from otb_tir.verl.v1_metrics import (
    is_weight_stats,
    lengths_mask,
    moe_counts_aside,
    pad_nested,
    prob_diff_by_lag,
    staleness_metrics,
)
from otb_tir.verl.v1_record import RecipeRun, batch_figures

logger = logging.getLogger(__name__)

__all__ = [
    "MODES",
    "OTBTrainerMixin",
    "SPI2_FIELD",
    "check_bypass",
    "is_weight_stats",
    "register",
    "prob_diff_by_lag",
    "staleness_metrics",
    "trainer_class",
]

#: our V1 trainer modes → the verl mode each one extends
MODES = {"otb_sync": "sync", "otb_colocate_async": "colocate_async", "otb_separate_async": "separate_async"}
#: the TransferQueue field holding Σπ² over the response (verl's actor writes it over prompt + response)
SPI2_FIELD = "sum_pi_squared_response"


def _estimator_name(config: Any) -> str:
    est = config.algorithm.adv_estimator
    return str(getattr(est, "value", est))


def wants_sum_pi_squared(config: Any) -> bool:
    """The OTB estimators need Σπ²; any estimator gets it when ``actor.calculate_sum_pi_squared`` asks."""
    return _estimator_name(config) in OTB_ESTIMATORS or bool(
        config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False)
    )


def check_bypass(config: Any) -> None:
    """OTB cannot run with rollout correction's bypass mode: it skips the pass that yields Σπ²."""
    rc = config.algorithm.get("rollout_correction", None)
    if rc is not None and rc.get("bypass_mode", False) and _estimator_name(config) in OTB_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={_estimator_name(config)} with algorithm.rollout_correction.bypass_mode=true: "
            "bypass mode uses the rollout's log-probs as the old policy and skips the actor's old-log-prob "
            "pass, the only pass that computes sum_pi_squared (Σπ²), which the Optimal Token Baseline needs; "
            "set algorithm.rollout_correction.bypass_mode=false"
        )


# --------------------------------------------------------------------------- the mixin
class OTBTrainerMixin:
    """Put before one of verl's V1 trainer classes (``class X(OTBTrainerMixin, PPOTrainerSync)``);
    ``verl_mode`` names the verl mode whose settings (``trainer.v1.<mode>``) and replay buffer it uses."""

    verl_mode: str = "sync"
    otb_mode: str = "otb_sync"

    # ---- start
    def __init__(self, config: Any) -> None:
        from omegaconf import open_dict

        from otb_tir.verl import check_verl_version

        check_verl_version()  # our classes reach verl's by name: another verl stops here, clearly
        check_bypass(config)
        # verl reads a mode's settings from trainer.v1.<its name> and picks the replay buffer by it
        # (ReplayBuffer for "sync", ReplayBufferAsync otherwise): it must see its own mode's name
        with open_dict(config):
            config.trainer.v1.trainer_mode = self.verl_mode
        from otb_tir.verl import plugin

        self._otb_verl_estimators = plugin.install()  # verl's originals, the oracle of the contract check
        with contextlib.suppress(ImportError):  # registers otb_tir_agent in this process (the recipe's loop)
            from otb_tir.verl import agent_loop  # noqa: F401
        self._otb_spi2 = wants_sum_pi_squared(config)
        self._otb_rollout_log_probs = bool(config.actor_rollout_ref.rollout.get("calculate_log_probs", False))
        self._otb_adv_metrics: dict[str, float] = {}
        self._otb_clock: dict[str, float] = {}
        self._otb_in_loop = False
        self._otb_run = RecipeRun.from_env()
        super().__init__(config)  # type: ignore[call-arg]
        logger.info(
            "otb_tir V1 trainer %s over verl's %s (Σπ² in the old-log-prob pass: %s)",
            self.otb_mode,
            self.verl_mode,
            self._otb_spi2,
        )

    def _otb_phase(self, name: str):
        return self._otb_run.progress.phase(name) if self._otb_run else contextlib.nullcontext()

    def init(self) -> Any:
        with self._otb_phase("init_workers"):
            return super().init()  # type: ignore[misc]

    def fit(self, agent_loop_manager: Any) -> Any:
        try:
            result = super().fit(agent_loop_manager)  # type: ignore[misc]
            if self._otb_run:
                self._otb_run.progress.write("finished")  # the watchdog gives the exit its teardown time from here
            return result
        finally:
            if self._otb_run:
                self._otb_run.sink.close()

    def _validate(self, *args: Any, **kwargs: Any) -> Any:
        with self._otb_phase("validate"):
            metrics = super()._validate(*args, **kwargs)  # type: ignore[misc]
        if self._otb_run and not self._otb_in_loop and metrics:  # before training: logged by verl's fit only
            from otb_tir.verl.hooks import translate_metrics

            self._otb_run.log(translate_metrics(metrics), int(self.global_steps), before_fit=True)  # type: ignore[attr-defined]
        return metrics

    def _save_checkpoint(self) -> Any:
        # verl saves step k (trainer_base.fit, "2. save checkpoint") before it computes and logs step k's
        # metrics ("5. record metrics"); a run killed in between would resume at k + 1 with step k's row
        # never written. So the step's row is logged first (from copies of the step's metrics), to
        # metrics.jsonl only, and replaced by the full one (save time, validation) when verl computes it
        # (MetricsLogger.log(provisional=True)). verl calls this inside its `save_checkpoint` and `step`
        # timers: the row's time is taken off them when the full row is computed (_compute_metrics).
        pending = getattr(self, "_otb_pending", None)
        if self._otb_run and pending is not None:
            t0 = time.perf_counter()
            batch, metrics, timing_raw = pending
            gs = int(self.global_steps)  # type: ignore[attr-defined]
            epoch = (gs - 1) // max(int(getattr(self, "steps_per_epoch", 1) or 1), 1)
            timing = dict(timing_raw)  # verl times the whole step after the save: its time so far here
            timing.setdefault("step", t0 - self._otb_clock.get("step_begin", t0))
            self._otb_provisional = True  # marked: a run killed before the full row keeps this one
            try:
                with moe_counts_aside(self):  # the full row feeds verl's MoE counts, this one a copy
                    self._compute_metrics(batch, dict(metrics), timing, gs, epoch)
            finally:
                self._otb_provisional = False
                self._otb_clock["provisional_row"] = time.perf_counter() - t0
        with self._otb_phase("save_checkpoint"):
            return super()._save_checkpoint()  # type: ignore[misc]

    # ---- the step, timed
    def on_train_begin(self) -> None:
        self._otb_in_loop = True
        super().on_train_begin()  # type: ignore[misc]

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        self._otb_clock = {"step_begin": time.perf_counter()}
        if self._otb_run:
            self._otb_run.progress.step = int(self.global_steps)  # type: ignore[attr-defined]
        with self._otb_phase("step"):
            batch = super().step(metrics, timing_raw)  # type: ignore[misc]
        self._otb_pending = (batch, metrics, timing_raw)  # for the row logged before a checkpoint
        return batch

    def on_sample_begin(self) -> None:
        self._otb_clock["sample_begin"] = time.perf_counter()
        if self._otb_run:
            self._otb_run.progress.enter("gen")
        super().on_sample_begin()  # type: ignore[misc]

    def on_sample_end(self) -> None:
        t = time.perf_counter()
        self._otb_clock["sample_end"] = t
        self._otb_clock["trainer_idle"] = self._otb_clock.get("trainer_idle", 0.0) + (
            t - self._otb_clock.get("sample_begin", t)
        )
        try:
            super().on_sample_end()  # type: ignore[misc]
        except BaseException as exc:  # sleeping a replica that died: the run failed in `gen`
            if self._otb_run:
                self._otb_run.progress.fail(exc, "gen")
            raise
        finally:
            if self._otb_run:
                self._otb_run.progress.leave("gen")

    def on_step_end(self) -> None:
        t0 = time.perf_counter()
        with self._otb_phase("update_weights"):
            super().on_step_end()  # type: ignore[misc]
        t1 = time.perf_counter()
        c = self._otb_clock
        c["weight_sync"] = t1 - t0
        # How long the rollout servers waited on the trainer this step. sync: they generate only while
        # the trainer samples (inside `gen`), so all the rest of the step. colocate_async: paused from
        # the end of sampling until the weights are synced and generation resumes. separate_async:
        # they keep generating on their own workers and pause for the weight sync only.
        if self.verl_mode == "separate_async":
            c["rollout_idle"] = c["weight_sync"]
        elif self.verl_mode == "colocate_async":
            c["rollout_idle"] = t1 - c.get("sample_end", t1)
        else:
            c["rollout_idle"] = (t1 - c.get("step_begin", t1)) - c.get("trainer_idle", 0.0)
        if self.verl_mode != "separate_async":  # the early row's time is no step time (_save_checkpoint)
            c["rollout_idle"] -= c.get("provisional_row", 0.0)

    # ---- Σπ² in the old-log-prob pass only
    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        with self._otb_phase("old_log_prob"):
            if not self._otb_spi2:
                return super()._compute_old_log_prob(batch, metrics)  # type: ignore[misc]
            import transfer_queue as tq
            from tensordict import TensorDict
            from verl.workers.utils.padding import response_from_nested

            batch.extra_info["calculate_sum_pi_squared"] = True
            try:
                out = super()._compute_old_log_prob(batch, metrics)  # type: ignore[misc]
            finally:  # not in the reference or update passes, which reuse this batch's extra_info
                batch.extra_info.pop("calculate_sum_pi_squared", None)
            getattr(out, "extra_info", {}).pop("calculate_sum_pi_squared", None)
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["sum_pi_squared", "response_mask"]
            )
            if "sum_pi_squared" not in data.keys():
                raise RuntimeError(
                    "verl's actor returned no sum_pi_squared from compute_log_prob although "
                    "calculate_sum_pi_squared was requested (use_fused_kernels=true cannot return it)"
                )
            spi2 = response_from_nested(data["sum_pi_squared"], data["response_mask"])
            tq.kv_batch_put(
                keys=batch.keys,
                partition_id=batch.partition_id,
                fields=TensorDict({SPI2_FIELD: spi2}, batch_size=len(batch.keys)),
            )
            return out

    # ---- the advantage, with Σπ² and the checks
    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        import transfer_queue as tq

        from otb_tir.verl.glue import wrapped_v1_advantage

        # the rows' response lengths (tool tokens vs padding for the contract check), and Σπ² when asked for
        fields = [SPI2_FIELD, "response_mask"] if self._otb_spi2 else ["response_mask"]
        extra = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        self._otb_adv_metrics = {}
        hook = functools.partial(self._otb_advantage, extra)
        with self._otb_phase("adv"), wrapped_v1_advantage(hook):
            out = super()._compute_advantage(batch, metrics)  # type: ignore[misc]
        metrics.update(self._otb_adv_metrics)
        return out

    def _otb_advantage(self, extra: Any, original: Callable[..., Any], data: Any, *args: Any, **kwargs: Any) -> Any:
        from otb_tir.verl.hooks import check_contract

        b = data.batch
        width = b["response_mask"].shape[-1]
        # verl's V1 stores the actor's log-probs in its compute dtype (bf16 under FSDP mixed precision),
        # where the legacy trainer casts them to float32; verl's OTB estimators write float32 advantages
        # from them and fail on bf16 ("Index put requires the source and destination dtypes match").
        # The estimator's inputs are float32 here, as on the legacy path; the stored log-probs are untouched.
        if "old_log_probs" in b.keys() and b["old_log_probs"].dtype != torch.float32:
            b["old_log_probs"] = b["old_log_probs"].float()
        if extra is not None and SPI2_FIELD in extra.keys():
            spi2 = pad_nested(extra[SPI2_FIELD], width).float()
            if spi2.shape != b["response_mask"].shape:  # pragma: no cover - verl keeps row order
                raise RuntimeError(
                    f"Σπ² {tuple(spi2.shape)} does not line up with the batch {tuple(b['response_mask'].shape)}"
                )
            b["sum_pi_squared"] = spi2
        data = original(data, *args, **kwargs)
        name = _estimator_name(self.config)  # type: ignore[attr-defined]
        lengths = extra["response_mask"].offsets().diff() if extra is not None else None
        inside = lengths_mask(lengths, width) if lengths is not None else b["response_mask"].bool()
        cfg = self.config.algorithm  # type: ignore[attr-defined]
        figures = check_contract(data, name, self._otb_verl_estimators.get(name), cfg, inside=inside)
        if "rollout_log_probs" in b.keys() and "old_log_probs" in b.keys():
            weights = b.get("rollout_is_weights", None)
            figures.update(is_weight_stats(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], weights))
            if weights is not None and name in OTB_ESTIMATORS and "sum_pi_squared" in b.keys():
                from otb_tir import advantage

                unweighted, _ = getattr(advantage, name)(
                    token_level_rewards=b["token_level_rewards"],
                    response_mask=b["response_mask"],
                    index=data.non_tensor_batch["uid"],
                    old_log_probs=b["old_log_probs"],
                    sum_pi_squared=b["sum_pi_squared"],
                    rollout_is_weights=None,
                )
                figures["is/adv_change_max_abs"] = float((b["advantages"] - unweighted).abs().max())
        self._otb_adv_metrics = figures
        return data

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        with self._otb_phase("update_actor"):
            return super()._update_actor(batch, metrics)  # type: ignore[misc]

    # ---- what gets logged
    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        provisional = getattr(self, "_otb_provisional", False)
        c = self._otb_clock
        if not provisional and "provisional_row" in c:
            # the early row was computed inside verl's `save_checkpoint` and `step` timers: not their time
            # (nor the throughput's, which divides by the step's); logged as timing/provisional_row_s
            for name in ("save_checkpoint", "step"):
                if name in timing_raw:
                    timing_raw[name] -= c["provisional_row"]
        out = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)  # type: ignore[misc]
        metrics.update(staleness_metrics(list(batch.tags), int(global_steps)))
        for key in ("trainer_idle", "rollout_idle", "weight_sync", "provisional_row"):
            if key in c:
                metrics[f"timing/{key}_s"] = float(c[key])
        metrics.update(self._otb_batch_metrics(batch, metrics.get("actor/grad_norm"), int(global_steps)))
        if self._otb_run:
            from otb_tir.verl.hooks import translate_metrics

            # provisional: logged before the checkpoint, with no save, weight-sync or rollout-idle time
            # yet, marked row/provisional; the full row replaces it, unless the run is killed in between
            # (then the resumed run keeps this one)
            self._otb_run.log(translate_metrics(metrics), int(global_steps), provisional=provisional)
        return out

    def _otb_batch_metrics(self, batch: Any, grad_norm: Any, global_steps: int) -> dict[str, float]:
        """The step's figures from its rows in TransferQueue (:func:`otb_tir.verl.v1_record.batch_figures`)."""
        spi2_field = SPI2_FIELD if self._otb_spi2 else None
        return batch_figures(
            batch, grad_norm, global_steps, spi2_field=spi2_field, rollout_log_probs=self._otb_rollout_log_probs
        )


# --------------------------------------------------------------------------- registration
_classes: dict[str, type] = {}


def trainer_class(otb_mode: str) -> type:
    """The V1 trainer class for ``otb_mode`` (one of :data:`MODES`), built on first use."""
    if otb_mode not in MODES:
        raise ValueError(f"unknown otb_tir V1 trainer mode {otb_mode!r}; known: {sorted(MODES)}")
    cls = _classes.get(otb_mode)
    if cls is None:
        from verl.trainer.ppo.v1 import get_trainer_cls

        base = get_trainer_cls(MODES[otb_mode])
        name = "OTB" + base.__name__
        cls = type(name, (OTBTrainerMixin, base), {"verl_mode": MODES[otb_mode], "otb_mode": otb_mode})
        cls.__module__ = __name__
        cls.__qualname__ = name
        _classes[otb_mode] = cls
        setattr(sys.modules[__name__], name, cls)  # picklable by reference
    return cls


def register(module: Any = None) -> list[str]:
    """Register :data:`MODES` in verl's V1 trainer registry (idempotent)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    for otb_mode in MODES:
        cls = trainer_class(otb_mode)
        if TRAINER_REGISTRY.get(otb_mode) is not cls:
            register_trainer(otb_mode)(cls)
    return list(MODES)


def _on_import() -> None:
    """Loaded on ``import verl`` (verl's plugin entry point): register the modes once verl's V1 package
    is imported (importing it here, inside ``import verl``, would be circular), and make π_old's saved
    copy a copy (glue row ``fsdp2_save_copy``)."""
    from otb_tir.verl.glue import after_import, install_fsdp2_save_copy

    after_import("verl.trainer.ppo.v1", register)
    install_fsdp2_save_copy()  # π_old in separate_async must be a copy wherever the parameters sit on the CPU


_on_import()
