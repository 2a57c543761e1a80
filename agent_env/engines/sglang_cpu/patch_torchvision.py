"""Make PyPI's torchvision importable next to the CPU build of torch (``.venv-sglang`` only).

    python -m agent_env.engines.sglang_cpu.patch_torchvision   # idempotent

Why: sglang imports torchvision at start (``sglang/srt/multimodal/internvl_utils.py``), and the
torchvision wheel on PyPI is a CUDA build whose compiled operators do not load against the CPU
torch. Two decorators in ``torchvision/_meta_registrations.py`` register fake kernels for
``torchvision::nms`` / ``torchvision::qnms`` unconditionally, so ``import torchvision`` dies with
"operator torchvision::nms does not exist". This guards those two decorators (the rest of the file
already checks that an operator exists). Nothing the text models use needs torchvision's operators.
Upstream fix that would remove it: a CPU torchvision on PyPI, or torchvision guarding them itself.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARK = "# otb-tir: guarded (agent_env/engines/sglang_cpu/patch_torchvision.py)"
GUARD = '''
def _otb_fake_if_defined(name):  {mark}
    def wrap(fn):
        try:
            return torch.library.register_fake(name)(fn)
        except RuntimeError:  # the CUDA build's operators did not load against the CPU torch
            return fn
    return wrap

'''.format(mark=MARK)


def patch(path: Path) -> str:
    text = path.read_text()
    if MARK in text:
        return "already guarded"
    targets = ('@torch.library.register_fake("torchvision::nms")', '@torch.library.register_fake("torchvision::qnms")')
    for t in targets:
        if text.count(t) != 1:
            raise SystemExit(f"{path}: expected one {t!r}; this torchvision is not the one the patch was written for")
    for t in targets:
        text = text.replace(t, t.replace("torch.library.register_fake", "_otb_fake_if_defined"))
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    if anchor not in text:
        raise SystemExit(f"{path}: no get_meta_lib() to put the guard before")
    path.write_text(text.replace(anchor, GUARD.lstrip("\n") + anchor, 1))
    return "guarded nms and qnms"


def main() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torchvision is not installed in this environment")
    path = Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
    print(f"{path}: {patch(path)}")


if __name__ == "__main__":
    sys.exit(main())
