"""Launch verl's PPO trainer with the TIR-OTB recipe: ``prepare_verl(cfg)`` composes verl's config
(:func:`otb_tir.verl.compose.compose_verl_config`), validates it with verl's ``validate_config`` and writes it to
``<output_dir>/verl_config.yaml``; without an accelerator it adds the CPU profile of
:mod:`otb_tir.verl.cpu`. ``run_verl(cfg)`` then runs ``python -m otb_tir.verl.launch
verl_config.yaml`` (:func:`main`: verl's ``run_ppo`` with
:class:`otb_tir.verl.task_runner.OTBTaskRunner`, which installs our estimators and
:mod:`otb_tir.verl.hooks` in the Ray actor that computes advantages) as a child process under
:mod:`otb_tir.verl.watchdog`, and writes ``summary.json``. ``verl.dry_run=true`` stops after
printing the command.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from otb_tir import ConfigError
from otb_tir.builders import held_out, resolved_plugins
from otb_tir.verl import require_verl
from otb_tir.verl.compose import (
    compose_verl_config,
    trainer_description,
    validate_verl_config,
    verl_device,
    with_v1_modes,
)
from otb_tir.verl.watchdog import VerlRunError

logger = logging.getLogger(__name__)


def _check_tools(cfg: DictConfig) -> list[dict[str, Any]]:
    """Build the tool set once on the driver, as each agent-loop worker will (same assembly): a tool
    that does not load stops the run here, not in a Ray worker minutes later. Writes the set in use
    to ``<output_dir>/tools.json``."""
    import json

    from agent_env.rollout import run_sync
    from otb_tir.builders import build_tools

    tools = build_tools(cfg)
    try:
        described = tools.describe()
    finally:
        run_sync(tools.close())
    out = Path(cfg.trainer.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tools.json").write_text(json.dumps(described, indent=2))
    return described


def prepare_verl(cfg: DictConfig, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Everything up to launching verl: the tools checked, verl's config composed and validated and
    written to ``<output_dir>/verl_config.yaml``; returns the command, its environment and facts."""
    import shlex
    import sys

    from otb_tir.verl import UNTESTED_ENV, check_verl_version

    check_verl_version(bool(cfg.verl.allow_untested_version))
    device = verl_device(cfg)
    if device == "gpu" and cfg.trainer.device == "cuda" and not cfg.verl.dry_run:
        from otb_tir.verl import has_accelerator

        if not has_accelerator():
            raise ConfigError(
                "trainer.device=cuda but torch sees no GPU here (trainer.device=auto runs verl's "
                "CPU profile on a machine without one; verl.dry_run=true prints the GPU command)"
            )
    if device == "cpu" and cfg.rollout.name == "sglang":
        raise ConfigError(
            "trainer=verl rollout.name=sglang does not run on a CPU from the project's files: verl 0.9.1's "
            "sglang rollout needs five fixes to sglang 0.5.23's CPU path (docs/verl.md, 'sglang as verl's "
            "rollout on this CPU'); on a CPU verl's rollout is vLLM-CPU (rollout.name=vllm, the default), "
            "the local trainer serves with sglang (rollout.name=sglang without trainer=verl), and "
            "verl.dry_run=true trainer.device=cuda prints the sglang command for a GPU machine"
        )
    _check_tools(cfg)
    from otb_tir.defaults.policy import resolve_policy

    resolve_policy(cfg)  # model.path, or the built-in tiny policy after its (cached) warm start
    vcfg = compose_verl_config(cfg, overrides, cpu=device == "cpu")
    env: dict[str, str] = {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true")}
    if cfg.verl.allow_untested_version:
        env[UNTESTED_ENV] = "1"
    # our V1 trainer modes in every verl process (the verl.plugins entry point does it too, once installed)
    env["VERL_USE_EXTERNAL_MODULES"] = with_v1_modes(os.environ.get("VERL_USE_EXTERNAL_MODULES"))
    if device == "cpu":
        from otb_tir.verl import cpu

        cpu_vars = cpu.cpu_env()
        cpu_vars["VERL_USE_EXTERNAL_MODULES"] = with_v1_modes(cpu_vars["VERL_USE_EXTERNAL_MODULES"])
        env.update(cpu_vars)
        with open_dict(vcfg):
            vcfg.ray_kwargs.ray_init.runtime_env.env_vars.update(env)
    else:
        from verl.utils.device import auto_set_device

        auto_set_device(vcfg)  # cuda, or npu on Ascend (verl's own detection)
        with open_dict(vcfg):
            vcfg.ray_kwargs.ray_init.runtime_env.env_vars.update(env)
    validate_verl_config(vcfg)
    out = Path(cfg.trainer.output_dir).expanduser().resolve()
    config_path = out / "verl_config.yaml"
    OmegaConf.save(vcfg, config_path)
    cmd = [sys.executable, "-m", "otb_tir.verl.launch", str(config_path)]
    info = {
        "device": device,
        "trainer": trainer_description(cfg.verl.trainer_mode),
        "trainer_mode": cfg.verl.trainer_mode,
        "adv_estimator": cfg.algorithm.adv_estimator,
        "rollout": vcfg.actor_rollout_ref.rollout.name,
        "n_gpus_per_node": int(vcfg.trainer.n_gpus_per_node),
        "nnodes": int(vcfg.trainer.nnodes),
        "verl_config": str(config_path),
        "env": env,
        "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, cmd)]),
        "argv": cmd,
    }
    (out / "verl_run.json").write_text(json.dumps(info, indent=2))
    return info


def run_verl(cfg: DictConfig, overrides: Sequence[str] = ()) -> dict[str, Any] | None:
    """Compose, validate and run verl's PPO trainer with our agent loop, estimators and hooks.

    verl runs in a child process (``python -m otb_tir.verl.launch <verl_config.yaml>``, its output
    in ``<output_dir>/verl.log`` and on this console) under a watchdog: a phase longer than
    ``verl.phase_timeout_s``, or not finished ``verl.error_grace_s`` after a traceback, stops the
    run with :class:`VerlRunError` naming the phase and the traceback. Returns ``summary.json``'s
    content; with ``verl.dry_run=true`` prints the command and config and returns None.
    """
    info = prepare_verl(cfg, overrides)
    out = Path(cfg.trainer.output_dir).expanduser().resolve()
    if cfg.verl.dry_run:
        print(
            f"# verl config: {info['verl_config']}\n# {info['trainer']}\n# device: {info['device']}, rollout: "
            f"{info['rollout']}, {info['nnodes']} node(s) x {info['n_gpus_per_node']} GPU(s)\n{info['command']}"
        )
        return None
    from otb_tir.verl.watchdog import run_watched

    t0 = time.time()
    run_watched(
        info["argv"],
        env={**os.environ, **info["env"]},
        log_path=out / "verl.log",
        progress_path=out / "progress.json",
        phase_timeout_s=float(cfg.verl.phase_timeout_s),
        error_grace_s=float(cfg.verl.error_grace_s),
    )
    summary = _summary(cfg, out, info, time.time() - t0)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _val_rows(out: Path) -> int | None:
    """The number of held-out problems verl validated on (its ``data.val_files``' rows)."""
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    path = out / "verl_config.yaml"
    if not path.is_file():
        return None
    files = OmegaConf.load(path).data.val_files
    return sum(pq.ParquetFile(str(f)).metadata.num_rows for f in files)


def _summary(cfg: DictConfig, out: Path, info: Mapping[str, Any], wall: float) -> dict[str, Any]:
    rows = (
        [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        if (out / "metrics.jsonl").is_file()
        else []
    )
    steps = [r for r in rows if "training/global_step" in r]
    if len(steps) < int(cfg.trainer.total_steps):
        raise VerlRunError(
            f"verl exited 0 after {len(steps)} of {cfg.trainer.total_steps} training steps (see {out / 'verl.log'})"
        )
    vals = [r for r in rows if "val/accuracy" in r]

    def figures(r: Mapping[str, Any] | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {
            "step": r["step"],
            "accuracy": r["val/accuracy"],
            **{
                k.split("/")[-2]: v
                for k, v in r.items()
                if k.startswith("val-aux/")
                and k.endswith("/mean@1")
                and k.split("/")[-2] in ("reward", "tool_calls", "assistant_turns")
            },
        }

    before = next((r for r in vals if r["step"] == 0), None)
    after = vals[-1] if vals and vals[-1]["step"] > 0 else None
    tools = json.loads((out / "tools.json").read_text()) if (out / "tools.json").is_file() else None
    return {
        "trainer": "verl",
        "verl": require_verl().__version__,
        "device": info["device"],
        "trainer_path": info["trainer"],
        "trainer_mode": info["trainer_mode"],
        "adv_estimator": info["adv_estimator"],
        "rollout": info["rollout"],
        "steps": len(steps),
        "tools": tools,
        "plugins": resolved_plugins(cfg),
        "held_out": held_out(cfg, _val_rows(out)),
        "before": figures(before),
        "after": figures(after),
        "last_step": {k: v for k, v in steps[-1].items() if not k.startswith(("val-", "errors/"))},
        "verl_config": info["verl_config"],
        "wall_time_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m otb_tir.verl.launch <verl_config.yaml>``: verl's ``run_ppo`` with our TaskRunner on a
    config written by :func:`prepare_verl` (what ``trainer=verl`` runs; also by hand)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m otb_tir.verl.launch", description=main.__doc__)
    p.add_argument("config", help="verl_config.yaml written by the recipe (trainer=verl)")
    args = p.parse_args(argv)
    vcfg = OmegaConf.load(args.config)
    from otb_tir.verl import check_verl_version

    check_verl_version()  # OTB_TIR_ALLOW_UNTESTED_VERL=1 (verl.allow_untested_version=true) lets another through
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

    if vcfg.trainer.use_v1:
        # verl's own TaskRunner: our trainer classes are registered in its process by otb_tir.verl.v1,
        # which VERL_USE_EXTERNAL_MODULES (in the run's Ray runtime env) loads on `import verl`
        run_ppo(vcfg, task_runner_class=TaskRunnerV1)
    else:
        from otb_tir.verl.task_runner import OTBTaskRunner

        run_ppo(vcfg, task_runner_class=OTBTaskRunner)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
