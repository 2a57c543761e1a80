"""The built-in CPU default policy, what ``python recipes/train_tir_math.py`` trains when no
``--model`` is given; nothing is downloaded:

* :mod:`otb_tir.defaults.tiny` — the tiny Qwen3-shaped policy, its tokenizer and chat template
  (``chat_template.jinja``), built locally and cached;
* :mod:`otb_tir.defaults.traces` — the tool-use traces of its warm start;
* :mod:`otb_tir.defaults.warm_start` — its SFT warm start on those traces (cached per setting);
* :mod:`otb_tir.defaults.check` — ``python -m otb_tir.defaults.check --check N``, the report of how
  it uses its tools (the tool-use evaluation's episodes).

The shipped configs are in ``otb_tir/configs/``.
"""
