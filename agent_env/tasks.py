"""Tasks by name (``data.task``): a data source, a reward and, optionally, answer extraction.

A :class:`Task` is what a run needs to train and evaluate on a problem family without data
files: ``make_split(split, n, seed)`` returns ``n`` items of ``split`` (``"train"`` or ``"test"``)
in verl's RL-dataset format (``data_source``, ``prompt``, ``reward_model.ground_truth``,
``extra_info``); ``reward`` names its reward (a :data:`agent_env.rewards.REWARDS` name or path,
used unless the reward section names another); ``extract_answer(text) -> str | None``, when
given, replaces the math answer extraction in the episode (a turn without tool calls ends the
episode as ``answer`` when it finds one, else as a void turn) and gives the rewards
``extra_info["extracted_answer"]``; ``tools`` are the tool names the task uses when the run names
none (``multi_turn.tools``).

Names resolve through :data:`TASKS`, the one plugin mechanism (:class:`tools.plugins.Registry`):
the built-ins ``arith`` and ``chain`` (registered the same way), entry points of group
``otb_tir.tasks``, and paths ``package.module:task`` / ``path/to/file.py:task`` (a :class:`Task`,
or a function returning one)::

    # my_task.py
    from agent_env.tasks import Task

    def make_split(split, n, seed):
        return [{"data_source": "capitals", "prompt": [{"role": "user", "content": "Capital of France?"}],
                 "reward_model": {"ground_truth": "Paris"}, "extra_info": {}}] * n

    task = Task(name="capitals", data_source="capitals", make_split=make_split, reward="exact_match")

    # python recipes/train_tir_math.py data.task=my_task.py:task
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from agent_env import EnvError
from tools.plugins import Registry

__all__ = ["TASKS", "Task", "get_task"]


@dataclass(frozen=True)
class Task:
    name: str
    data_source: str
    make_split: Callable[[str, int, int], list[dict[str, Any]]]  # (split, n, seed) -> verl items
    reward: str = "math"  # a reward name or path (agent_env.rewards.REWARDS)
    extract_answer: Callable[[str], str | None] | None = None  # None: the math extraction (\boxed, "answer:")
    tools: tuple[str, ...] | None = None  # tool names used when the run names none; None: python, calculator
    warm_start: str = "arith"  # the built-in warm start of the default tiny policy (model.path unset)


def _builtin(task: str) -> Task:
    from agent_env.math_task.data import TASKS as GENERATORS
    from agent_env.math_task.data import make_split

    _, data_source = GENERATORS[task]

    def split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return make_split(split, n, seed=seed, task=task)

    return Task(name=task, data_source=data_source, make_split=split, reward="math", warm_start=task)


ARITH = _builtin("arith")
CHAIN = _builtin("chain")


def _check_task(obj: Any, name: str) -> None:
    if not isinstance(obj, Task) and not callable(obj):
        raise EnvError(
            f"task {name!r} resolved to {obj!r}: expected an agent_env.tasks.Task or a function returning one"
        )


TASKS = Registry(
    "task",
    "otb_tir.tasks",
    {"arith": f"{__name__}:ARITH", "chain": f"{__name__}:CHAIN"},
    error=EnvError,
    check=_check_task,
)


def get_task(name: str) -> Task:
    """The task called ``name`` (``data.task``; see :data:`TASKS`)."""
    target = TASKS.resolve(name)
    if not isinstance(target, Task):
        try:
            target = target()
        except Exception as exc:  # noqa: BLE001 - a user's factory, named
            raise EnvError(f"task {name!r}: calling {target!r}() failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(target, Task):
            raise EnvError(f"task {name!r}: its factory returned {type(target).__name__}, not an agent_env.tasks.Task")
    return target
