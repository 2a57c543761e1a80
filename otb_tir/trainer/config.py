"""Training configuration: dataclasses (the schema) + YAML + dotted command-line overrides.

Names follow verl where the concept is the same (``rollout.n``, ``actor.optim.lr``,
``algorithm.adv_estimator``, ``multi_turn.max_assistant_turns``), end to end: agent_env's
``EpisodeConfig`` uses them too. Loaded by the one loader, :func:`otb_tir.config.load_structured`:
an unknown or ill-typed key fails at start with :class:`~otb_tir.ConfigError` naming the key and
the valid choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from agent_env.math_task.reward import RewardConfig  # the one reward config: the trainer's `reward` section
from otb_tir import ConfigError
from otb_tir.config import load_structured, take_passthrough


@dataclass
class ModelConfig:
    path: str | None = None  # local HF causal LM folder; None → the built-in warm-started tiny policy
    # the actor's compute: float32 | bfloat16 | float16 (training params stay float32; bf16 = autocast).
    # auto: bfloat16 autocast on a CPU with native bfloat16 (avx512_bf16 / AMX) for a policy of >= 100M
    # parameters (an update measured 1.44x faster at 151M, 0.86x at 30M), else float32; logged at start
    dtype: str = "auto"
    # recompute each decoder layer's activations in the backward instead of keeping them (verl's name;
    # transformers' gradient_checkpointing_enable, non-reentrant): an update's activations fall from
    # ~6.5 to ~0.3 GiB at Qwen3-0.6B's shape (micro-batch of 8 × ~230 tokens), for one more forward.
    # null: the trainer's default (local: off; trainer=verl: verl's own, on; off in the CPU profile)
    enable_gradient_checkpointing: bool | None = None
    warm_start_steps: int = 400  # SFT steps of the built-in tiny policy on all traces (cached per settings)
    warm_start_copy_steps: int = 800  # first SFT phase, on the tool-call traces only (learns to copy)
    warm_start_shipped: bool = (
        True  # default warm start copied from the package (same on every machine); false: trained here
    )


@dataclass
class DataConfig:
    # built-in task (generator, held-out split, warm start) when no files are given: arith (one
    # computation per problem) | chain (two dependent computations: a tool call whose result feeds the next)
    # | multistep (three or four; brings its own turns and token budget unless you set them).
    task: str = "arith"  # or a task plugin: an `otb_tir.tasks` entry point, pkg.mod:task or file.py:task
    train_files: list[str] = field(default_factory=list)  # verl-format parquet; empty → built-in generator
    # verl-format parquet of held-out problems; empty → built-in held-out split
    val_files: list[str] = field(default_factory=list)
    train_size: int = 4000  # built-in generator only
    val_size: int = 100  # built-in generator only: held-out problems generated
    train_batch_size: int = 8  # prompts per step (each sampled rollout.n times)
    shuffle: bool = True  # shuffle the training prompts each epoch


@dataclass
class RolloutConfig:
    name: str = "auto"  # auto (hf for trainer=local, vllm for trainer=verl) | hf | vllm | sglang (each on both)
    n: int = 8  # samples per prompt (the group size of the baselines)
    temperature: float = 1.0  # sampling temperature (0 = greedy)
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = -1  # top-k sampling (-1 = off)
    # the rollout engine's weights (verl's name): float32 | bfloat16 | float16. Not float32: the hf engine
    # keeps a copy in that dtype, refreshed after each update (the actor stays float32). auto: bfloat16 on a
    # CPU with native bfloat16 (avx512_bf16 / AMX) for a policy of >= 20M parameters (measured faster
    # there), else float32; decided at start and logged. trainer=verl passes a value to
    # actor_rollout_ref.rollout.dtype (auto: verl's own; the CPU profile's float32)
    dtype: str = "auto"
    response_length: int = 192  # R: the whole multi-turn response budget, tool tokens included
    max_tokens_per_turn: int = 96  # cap on one assistant turn (within what is left of R)
    max_batch_size: int = 64  # hf engine: requests decoded together
    # hf engine on the CPU: torch threads for its steps (null: adaptive, half of torch's, at least 1, while a
    # tool call is under way, leaving the other cores to the tools' sandboxes that run beside generation, all
    # of them while none is; N: always N; 0: torch's own setting)
    cpu_threads: int | None = None
    # hf engine: a decode step through auto (fused where the model is a Qwen2/Qwen3/Llama one, else model) |
    # model (its own forward) | fused (the step written out from its weights) | compiled (fused, torch.compile'd:
    # the first compile takes seconds to tens of seconds)
    decode_step: str = "auto"
    # keep a finished turn's keys/values for the episode's next turn, so only the tool's answer is prefilled
    # (hf engine: up to 256 MiB, dropped when the weights change; vllm/sglang: their own prefix caching)
    enable_prefix_caching: bool = True
    # vllm / sglang engine (trainer=local): keyword arguments for VLLMEngine / SGLangEngine (vLLM's LLM,
    # sglang's ServerArgs: max_model_len, context_length ...); the engine gets the new weights after each update
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class MultiTurnConfig:
    # tool-call format: hermes | code_block | llama3_json | mistral | qwen3_coder | harmony, an `otb_tir.parsers`
    # entry point, or a parser class by path (pkg.mod:Parser / file.py:Parser)
    format: str = "hermes"
    max_assistant_turns: int = 3  # assistant turns per episode; calls on the last turn are not executed
    max_tool_response_length: int = 48  # tokens
    tool_response_truncate_side: str = "middle"  # head | tail | middle
    max_parallel_calls: int = 4  # tool calls of one turn run concurrently, at most this many at once
    # The tool set (one assembly for training, eval and verl: tools.build_tool_set). `tools`: names for
    # tools.get_tool (built-ins, @tool/register_tool, `otb_tir.tools` entry points); null = [python,
    # calculator] unless a tools YAML is given. `tool_config`: keyword settings per name, e.g.
    # {python: {timeout: 5}}. `tool_config_path`: a verl-style tools YAML whose tools are added to `tools`.
    tools: list[str] | None = None
    # keyword settings per tool name, e.g. {python: {timeout: 5}}
    tool_config: dict[str, Any] = field(default_factory=dict)
    tool_config_path: str | None = None  # a verl-style tools YAML; its tools are added to `tools`
    tool_timeout: float = 5.0  # s a tool call may run before a timeout error (python: from when a worker runs it)
    # an `mcpServers` JSON/YAML file (stdio: command/args/env, streamable HTTP: url/headers): each server is
    # started at build and its tools join the set (all of them when `tools` is null, else those `tools` names);
    # stdio servers run under bubblewrap unless the server sets "unsandboxed": true. See docs/extending.md
    mcp_servers: str | None = None


@dataclass
class OptimConfig:
    lr: float = 2e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    warmup_steps: int = 0  # linear warmup steps
    lr_scheduler: str = "constant"  # constant | cosine


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (× rollout.n trajectories), as verl
    ppo_micro_batch_size: int = 16  # trajectories per forward/backward
    ppo_epochs: int = 1  # passes over each batch
    clip_ratio_low: float = 0.2  # PPO clip: ratio >= 1 - clip_ratio_low
    clip_ratio_high: float = 0.28  # PPO clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    grad_clip: float = 1.0  # max gradient norm (0 = off)
    use_kl_loss: bool = False  # KL to a frozen reference copy of the initial policy
    kl_loss_coef: float = 0.001  # weight of the KL loss
    entropy_coeff: float = 0.0  # entropy bonus weight
    fused_token_stats: bool = True  # Σπ² / log-probs from hidden states, never the [T, V] logits
    token_stats_chunk: int = 512  # tokens per chunk of log-probs / entropy / Σπ², at most ([chunk, V] fp32 ≤ 64 MiB)
    # local trainer: when a step is exactly on-policy (ppo_epochs 1, one mini-batch) and each micro-batch
    # holds all of a rank's rows or whole groups (a group-local estimator: every built-in), take the old
    # log-probs and Σπ² from the update's own forwards instead of a second pass
    reuse_update_forward: bool = True
    # local trainer: the rows' tokens go through the actor's forward packed into as few rows as fit (no
    # padding), not each padded to the longest, a group's shared prompt once (sdpa or eager attention);
    # checked once per model against the padded forward
    pack_rows: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class FilterConfig:
    void_turns: bool = False  # mask trajectories with a void turn (SimpleTIR)
    overlong: bool = False  # mask trajectories cut by the response budget
    all_equal_reward_groups: bool = False  # drop groups whose rewards are all equal (no signal)


@dataclass
class AlgorithmConfig:
    # tir_optimal_token_baseline | optimal_token_baseline | grpo | rloo, one registered with
    # otb_tir.advantage.register_estimator, an `otb_tir.estimators` entry point, or pkg.mod:fn / file.py:fn
    adv_estimator: str = "tir_optimal_token_baseline"
    handle_zero_tail: bool = True  # OTB, as verl's: baseline 0 on a group's unique longest row past its runner-up
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group's reward std
    # truncated token-level IS weights π_old/π_rollout passed to the estimator and the loss; null = auto:
    # on where samples are off-policy (verl's asynchronous trainer modes, trainer.one_step_off_policy)
    rollout_is: bool | None = None
    rollout_is_threshold: float = 2.0  # truncation of the IS weights
    filter: FilterConfig = field(default_factory=FilterConfig)


@dataclass
class HeldOutConfig:  # the held-out evaluation before and after training (the `eval` section)
    size: int = 100  # held-out problems
    n: int = 1  # samples per held-out problem
    temperature: float = 0.0  # held-out sampling temperature (0 = greedy)
    before: bool = True  # evaluate before training (summary.json 'before')
    after: bool = True  # evaluate after training (summary.json 'after')
    every: int = 0  # also every N steps during training, logged as val/* in metrics.jsonl (0 = never)


@dataclass
class TrainerConfig:
    name: str = "local"  # local | verl
    total_steps: int = 20  # RL steps
    seed: int = 0  # seed of sampling, data order and initialisation
    device: str = "auto"  # auto | cpu | cuda
    # run folder: summary.json, metrics.jsonl, tensorboard/, curves.png, checkpoints/, final/
    output_dir: str = "runs/tir_math"
    save_every: int = 5  # checkpoint every N steps and at the end (0 = never)
    keep_checkpoints: int = 2  # checkpoints kept (older ones are pruned)
    resume: bool = False  # continue from the run folder's last checkpoint (--resume)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])  # + wandb
    project_name: str = "otb-tir"  # wandb / verl project name
    experiment_name: str = "tir_math"  # wandb / verl experiment name
    n_gpus_per_node: int = 1  # verl path
    nnodes: int = 1  # verl path
    # under `torchrun --nproc_per_node N` (FSDP2, see otb_tir/trainer/distributed.py):
    dist_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    fsdp_reshard_after_forward: bool = True  # free gathered layer weights after each forward (ZeRO-3)
    # local trainer: the next step's rollout runs beside this step's update, with the weights before it
    # (its samples are one update old: off-policy; algorithm.rollout_is is on unless set false). The
    # engine keeps its own copy of the weights. Off: every step rolls out with the weights it trains.
    one_step_off_policy: bool = False


@dataclass
class VerlConfig:  # trainer=verl only: verl settings this recipe does not model
    # hydra-style overrides of verl's ppo_trainer config, applied last: "key=value" for a key verl has,
    # "+key=value" for a new one. `verl.<verl key>=value` on the command line (or nested keys under
    # `verl:` in YAML) append to this list.
    overrides: list[str] = field(default_factory=list)
    # The launcher (ours, not verl's keys): print the exact command and verl config, run nothing.
    dry_run: bool = False
    # Watchdog: a phase of verl's trainer (start-up, generation, old log-prob, update, weight sync,
    # validation...) that runs longer than this is stopped, the run killed and exited non-zero.
    phase_timeout_s: float = 1800.0
    # After a traceback in verl's output, the current phase gets this long to finish before the run
    # is stopped with that traceback (verl can hang after a worker failed, e.g. a failed weight sync).
    error_grace_s: float = 120.0
    # Which verl trainer runs: verl's default V1 trainer in its `sync`, `colocate_async` or
    # `separate_async` mode (our otb_<mode> classes, otb_tir.verl.v1), or its `legacy` RayPPOTrainer.
    trainer_mode: str = "sync"
    # verl other than the tested pin (otb_tir.verl.VERL_VERSION) stops the run at start unless this is set.
    allow_untested_version: bool = False
    # Join this Ray cluster (host:port, or auto) instead of starting one: several nodes. The run's environment
    # reaches every node's workers through Ray's runtime_env; the nodes declare their own CPUs and GPUs.
    ray_address: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    verl: VerlConfig = field(default_factory=VerlConfig)


# Fixed choices. The extension points (data.task, multi_turn.format, algorithm.adv_estimator, the
# reward section's functions, the tools) take any name their registry resolves (otb_tir.builders.check_plugins).
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "rollout.dtype": ("float32", "bfloat16", "float16", "auto"),
    "rollout.name": ("auto", "hf", "vllm", "sglang"),
    "rollout.decode_step": ("auto", "model", "fused", "compiled"),
    "multi_turn.tool_response_truncate_side": ("head", "tail", "middle"),
    "actor.optim.lr_scheduler": ("constant", "cosine"),
    "trainer.name": ("local", "verl"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.dist_backend": ("auto", "gloo", "nccl"),
    "verl.trainer_mode": ("sync", "colocate_async", "separate_async", "legacy"),
}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """The training config: :class:`Config`'s defaults ← YAML file ← ``key=value`` overrides,
    validated (unknown keys, types, ``CHOICES``, ranges) by :func:`otb_tir.config.load_structured`.

    ``trainer=verl`` is shorthand for ``trainer.name=verl``. The ``verl`` section's keys other than
    :class:`VerlConfig`'s (``verl.<verl key>=value`` on the command line, ``+verl.<key>=value`` for a
    key verl lacks, nested keys under ``verl:`` in YAML) pass through to verl: they join
    ``verl.overrides`` (:func:`otb_tir.config.take_passthrough`; no verl import: the loader runs
    without verl installed).
    """
    verl_items: list[str] = []

    def split(sources: list[tuple[str, Any]], items: list[str]) -> list[str]:
        ours, verl = take_passthrough(sources, items, "verl", VerlConfig)
        verl_items.extend(verl)
        # `trainer=verl` is shorthand for `trainer.name=verl` (the README's verl command)
        return [f"trainer.name={o.split('=', 1)[1]}" if o.split("=", 1)[0] == "trainer" else o for o in ours]

    def check(cfg: DictConfig, given: frozenset[str]) -> None:
        _add_verl_overrides(cfg, verl_items)
        _follow_defaults(cfg, given)
        _check_ranges(cfg)

    return load_structured(Config, path, overrides, choices=CHOICES, check=check, sources_hook=split)


def _add_verl_overrides(cfg: DictConfig, items: list[str]) -> None:
    """Append the passed-through verl settings to ``verl.overrides`` and check them."""
    cfg.verl.overrides = [*cfg.verl.overrides, *items]
    bad = [o for o in cfg.verl.overrides if "=" not in o]
    if bad:
        raise ConfigError(
            f"verl.overrides entries must look like key=value (a key of verl's ppo_trainer config), got: {bad}"
        )
    if cfg.verl.overrides and cfg.trainer.name != "verl":
        raise ConfigError(
            f"verl settings {list(cfg.verl.overrides)} only apply to trainer=verl; add trainer=verl "
            "or drop them (the local trainer is configured by this recipe's own keys)"
        )


def _follow_defaults(cfg: DictConfig, given: frozenset[str]) -> None:
    """A default that depends on another key follows it unless the user set it: the task's settings
    (``data.task``'s turns and budget), and the PPO mini-batch (prompts per optimizer step) is at
    most the batch and divides it."""
    from otb_tir.builders import apply_task_settings

    apply_task_settings(cfg, given)
    batch, mini = int(cfg.data.train_batch_size), int(cfg.actor.ppo_mini_batch_size)
    if "actor.ppo_mini_batch_size" not in given and batch > 0 and mini > 0 and batch % mini:
        cfg.actor.ppo_mini_batch_size = max(d for d in range(1, min(mini, batch) + 1) if batch % d == 0)


def truncated_sampling(top_p: Any, top_k: Any) -> str | None:
    """``"rollout.top_p=0.9"`` / ``"rollout.top_k=20"`` where sampling is truncated, else ``None``: the
    one test both trainers refuse (here and :func:`otb_tir.verl.compose.check_untruncated_sampling`)."""
    top_p, top_k = float(top_p), int(top_k)
    if top_p < 1.0:
        return f"rollout.top_p={top_p:g}"
    return f"rollout.top_k={top_k}" if top_k > 0 else None


def _check_untruncated_sampling(cfg: DictConfig) -> None:
    """Refuse nucleus / top-k sampling in the local trainer's rollouts: the HF engine samples from the
    truncated distribution but reports the full softmax's log-probs, so the IS ratio's denominator is
    not the distribution the tokens were drawn from and the update is biased (the verl path refuses
    it the same way, :func:`otb_tir.verl.compose.check_untruncated_sampling`). Eval trains nothing
    and may truncate."""
    which = truncated_sampling(cfg.rollout.top_p, cfg.rollout.top_k)
    if which:
        raise ConfigError(
            f"{which} with the local trainer: its engine samples from the truncated distribution but "
            "reports full-softmax log-probs, so the importance ratio's denominator is not the sampling "
            "distribution and the update is biased. Sample with rollout.top_p=1 rollout.top_k=-1 "
            "(temperature still applies)"
        )


def _check_ranges(cfg: DictConfig) -> None:
    from otb_tir.builders import check_sections

    if cfg.rollout.name == "auto":  # the local trainer generates with HF; verl serves the policy with vLLM
        cfg.rollout.name = "vllm" if cfg.trainer.name == "verl" else "hf"
    check_sections(cfg)  # the plugins and the keys eval shares (rollout.*, multi_turn.*, reward.*)
    positive = [
        "data.train_batch_size",
        "actor.ppo_mini_batch_size",
        "actor.ppo_micro_batch_size",
        "actor.ppo_epochs",
        "actor.token_stats_chunk",
    ]
    for key in positive:
        if OmegaConf.select(cfg, key) <= 0:
            raise ConfigError(f"'{key}' must be > 0; got {OmegaConf.select(cfg, key)}")
    if cfg.trainer.total_steps < 0:
        raise ConfigError("'trainer.total_steps' must be >= 0")
    if cfg.trainer.name == "local":
        _check_untruncated_sampling(cfg)
    group_baselines = ("grpo", "rloo", "optimal_token_baseline", "tir_optimal_token_baseline")
    if cfg.rollout.n == 1 and cfg.algorithm.adv_estimator in group_baselines:
        # each group is one sample: its baseline is its own reward, every advantage is 0
        raise ConfigError(
            f"rollout.n=1 with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: its baseline comes from "
            "the other samples of the same prompt, so with one sample every advantage is 0 and nothing is "
            "learned; use rollout.n >= 2 (the default is 4)"
        )
    if cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size:
        raise ConfigError(
            f"'data.train_batch_size' ({cfg.data.train_batch_size}) must be a multiple of "
            f"'actor.ppo_mini_batch_size' ({cfg.actor.ppo_mini_batch_size}), as in verl"
        )
