"""The built-in task: math problems solved with tools, beside the generic multi-turn environment.

* :mod:`agent_env.math_task.data` — the problem generator (kinds, held-out split), verl-format
  parquet I/O and the prompt; the stepped tasks' generators (chain, multistep) are in
  :mod:`agent_env.math_task.chains`, one problem's record in :mod:`agent_env.math_task.problem`;
* :mod:`agent_env.math_task.reward` — the answer extraction and the math reward
  (:class:`~agent_env.math_task.reward.RewardConfig`, the one reward config);
* :mod:`agent_env.math_task.verify` — bounded grading (math-verify / sympy in a killable child).

The generic environment (:mod:`agent_env.episode`, :mod:`agent_env.rollout`, the parsers and the
engines) knows nothing of math except that its default reward is this task's.
"""
