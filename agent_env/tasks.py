"""Tasks by name (``data.task``): a data source, a reward and, optionally, answer extraction.

A :class:`Task` is what a run needs to train and evaluate on a problem family without data
files: ``make_split(split, n, seed)`` returns ``n`` items of ``split`` (``"train"`` or ``"test"``)
in verl's RL-dataset format (``data_source``, ``prompt``, ``reward_model.ground_truth``,
``extra_info``); ``reward`` names its reward (a :data:`agent_env.rewards.REWARDS` name or path,
used unless the reward section names another); ``extract_answer(text) -> str | None`` decides
when a turn is an answer in the episode (a turn without tool calls ends the episode as ``answer``
when it finds one, else as a void turn; :meth:`Task.answer`) and gives the rewards
``extra_info["extracted_answer"]`` — the math extraction (:func:`math_answer`: ``\\boxed``,
"answer:") unless the task gives its own; ``tools`` are the tool names the task uses when the
run names none (``multi_turn.tools``); ``settings`` are config defaults the task needs (more turns,
a larger token budget), applied unless the user set those keys.

Names resolve through :data:`TASKS`, the one plugin mechanism (:class:`tools.plugins.Registry`):
the built-ins ``arith``, ``chain`` and ``multistep`` (registered the same way), entry points of group
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

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from agent_env.errors import EnvError
from agent_env.math_task.reward import extract_answer as _math_extract
from tools.plugins import Registry

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TASK", "TASKS", "Task", "get_task", "math_answer"]

#: the task of an episode that names none (its answer extraction and reward: the math ones)
DEFAULT_TASK = "arith"


def math_answer(text: str) -> str | None:
    """The math answer extraction (``\\boxed{...}``, then "The answer is …" phrasings): the built-in
    tasks' and the default of a :class:`Task`."""
    return _math_extract(text)[0]


@dataclass(frozen=True)
class Task:
    name: str
    data_source: str
    make_split: Callable[[str, int, int], list[dict[str, Any]]]  # (split, n, seed) -> verl items
    reward: str = "math"  # a reward name or path (agent_env.rewards.REWARDS)
    extract_answer: Callable[[str], str | None] = math_answer  # the final answer in a text, or None
    tools: tuple[str, ...] | None = None  # tool names used when the run names none; None: python, calculator
    warm_start: str = "arith"  # the built-in warm start of the default tiny policy (model.path unset)
    #: config defaults the task needs, by dotted key (e.g. ``{"multi_turn.max_assistant_turns": 5}``):
    #: a run applies each one unless the user set that key (otb_tir.builders.apply_task_settings)
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.extract_answer is None:  # None (as before a default existed): the math extraction
            object.__setattr__(self, "extract_answer", math_answer)

    def answer(self, text: str) -> str | None:
        """The final answer in ``text`` by :attr:`extract_answer`, or None. A user's extractor that
        raises (logged), returns a non-string or an empty string gives None; the math extraction's
        empty box (``\\boxed{}``) is an (empty) answer."""
        try:
            found = self.extract_answer(text)
        except Exception as exc:  # noqa: BLE001 - a user's extractor must not end the run
            logger.warning("the task's extract_answer raised %s: %s", type(exc).__name__, exc)
            return None
        if not isinstance(found, str) or not (found or self.extract_answer is math_answer):
            return None
        return found


def _builtin(task: str, settings: Mapping[str, Any] | None = None) -> Task:
    from agent_env.math_task.data import TASKS as GENERATORS
    from agent_env.math_task.data import make_split

    _, data_source = GENERATORS[task]

    def split(split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return make_split(split, n, seed=seed, task=task)

    return Task(
        name=task,
        data_source=data_source,
        make_split=split,
        reward="math",
        extract_answer=math_answer,
        warm_start=task,
        settings=dict(settings or {}),
    )


ARITH = _builtin("arith")
CHAIN = _builtin("chain")
#: three or four dependent calculator steps: five assistant turns for the longest (a call per step,
#: then the answer) and one spare, and a token budget that fits them
MULTISTEP = _builtin(
    "multistep",
    {"multi_turn.max_assistant_turns": 6, "rollout.response_length": 320, "rollout.max_tokens_per_turn": 96},
)


def _check_task(obj: Any, name: str) -> None:
    if not isinstance(obj, Task) and not callable(obj):
        raise EnvError(
            f"task {name!r} resolved to {obj!r}: expected an agent_env.tasks.Task or a function returning one"
        )


TASKS = Registry(
    "task",
    "otb_tir.tasks",
    {"arith": f"{__name__}:ARITH", "chain": f"{__name__}:CHAIN", "multistep": f"{__name__}:MULTISTEP"},
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
