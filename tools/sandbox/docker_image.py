"""Build the docker backend's image locally, from this machine's own interpreter: no registry.

The image is a root filesystem assembled from files already here — the Python interpreter that
runs otb-tir (at the same absolute path, so it finds its standard library as it does on the
host), the shared libraries it and the preloaded modules link against (``ldd``), the standard
library without its test suite, and the preloaded packages (numpy, sympy, mpmath, pyseccomp +
libseccomp) — and loaded with ``docker import``. The sandbox worker itself is not in the image:
the backend bind-mounts ``tools/sandbox/worker.py`` and its sibling modules
(``backends.WORKER_FILES``) read-only, so image and worker never drift.

    python -m tools.sandbox.docker_image              # build otb-tir/sandbox:py311 (if missing)
    python -m tools.sandbox.docker_image --force      # rebuild
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.util
import io
import logging
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "otb-tir/sandbox:py311"
PACKAGES = ("numpy", "numpy.libs", "sympy", "mpmath", "pyseccomp")
_SKIP_STDLIB = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "site-packages",
    "config-3.11-x86_64-linux-gnu",
    "pydoc_data",
}


def image_exists(tag: str = DEFAULT_IMAGE, docker: str = "docker") -> bool:
    r = subprocess.run([docker, "image", "inspect", tag], capture_output=True)
    return r.returncode == 0


def _ldd(path: str) -> list[str]:
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    libs = re.findall(r"=>\s*(/\S+)", out) + re.findall(r"^\s*(/\S+)\s+\(", out, re.M)
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    # system libraries only: a package's own bundled ones (numpy.libs via $ORIGIN) come with it
    return [
        os.path.normpath(lib)
        for lib in libs
        if os.path.exists(lib) and not os.path.realpath(lib).startswith(site + os.sep)
    ]


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _package_dirs() -> list[tuple[Path, str]]:
    """(source, name) of each preloaded package found in this environment."""
    out = []
    purelib = Path(sysconfig.get_paths()["purelib"])
    for name in PACKAGES:
        cand = purelib / name
        if cand.is_dir():
            out.append((cand, name))
            continue
        spec = importlib.util.find_spec(name) if "." not in name else None
        if spec is not None and spec.origin:
            origin = Path(spec.origin)
            out.append((origin.parent if origin.name == "__init__.py" else origin, name))
    return out


def rootfs_members() -> dict[str, Path]:
    """Path inside the image → host file, for every file of the image."""
    base = Path(sys.base_prefix)
    exe = Path(os.path.realpath(sys.executable))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = stdlib / "site-packages"
    files: dict[str, Path] = {}

    def add(src: Path, dst: str | None = None) -> None:
        files[dst or str(src)] = src

    add(exe)
    for p in stdlib.iterdir():
        if p.name in _SKIP_STDLIB:
            continue
        if p.is_dir():
            for f in p.rglob("*"):
                if f.is_file() and "/test/" not in str(f) and "/tests/" not in str(f):
                    add(f)
        elif p.is_file():
            add(p)
    for src, _name in _package_dirs():
        if src.is_dir():
            for f in src.rglob("*"):
                if f.is_file() and "/tests/" not in str(f):
                    add(f, str(site / f.relative_to(src.parent)))
        else:
            add(src, str(site / src.name))
    libs = set(_ldd(str(exe)))
    for src in list(files.values()):
        if src.suffix == ".so" or ".so." in src.name:
            if _is_elf(src):
                libs.update(_ldd(str(src)))
    seccomp = ctypes.util.find_library("seccomp")
    if seccomp:
        for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib", "/lib"):
            if os.path.exists(os.path.join(d, seccomp)):
                libs.add(os.path.join(d, seccomp))
                libs.update(_ldd(os.path.join(d, seccomp)))
                break
    for lib in libs:
        add(Path(lib))
        real = Path(os.path.realpath(lib))
        if str(real) != lib:
            add(real)
    for extra in ("/etc/ld.so.cache", "/sbin/ldconfig"):  # ctypes.util.find_library needs them
        if os.path.exists(extra):
            add(Path(extra))
    if (base / "lib").is_dir():
        for f in (base / "lib").glob("libpython*.so*"):
            add(f)
    return files


def build_image(tag: str = DEFAULT_IMAGE, docker: str = "docker") -> str:
    """Assemble the root filesystem and ``docker import`` it as ``tag``; returns the tag."""
    files = rootfs_members()
    buf = io.BytesIO()
    python = os.path.realpath(sys.executable)
    dirs: set[str] = set()
    # the folders above the interpreter's prefix (e.g. /root/.pyenv/versions): traversable, not listable
    hidden = {str(p) for p in Path(sys.base_prefix).parents if str(p) != "/"}
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(d: str) -> None:
            if d in dirs or d in ("/", ""):
                return
            add_dir(os.path.dirname(d))
            info = tarfile.TarInfo(d.lstrip("/"))
            info.type = tarfile.DIRTYPE
            # traversable by the snippets' uid; not writable (docker copies the image directory's
            # mode onto the tmpfs it mounts on /tmp: the worker creates the snippets' scratch there)
            info.mode = 0o711 if d in hidden else 0o755
            tar.addfile(info)
            dirs.add(d)

        for d in ("/tmp", "/usr/local/bin", "/etc"):
            add_dir(d)
        for dst, src in sorted(files.items()):
            add_dir(os.path.dirname(dst))
            st = os.stat(src)
            info = tarfile.TarInfo(dst.lstrip("/"))
            info.size, info.mode = st.st_size, (0o755 if st.st_mode & 0o111 else 0o644)
            with open(src, "rb") as f:
                tar.addfile(info, f)
        link = tarfile.TarInfo("usr/local/bin/python")
        link.type, link.linkname = tarfile.SYMTYPE, python
        tar.addfile(link)
        passwd = b"root:x:0:0::/tmp:/bin/false\nnobody:x:65534:65534::/tmp:/bin/false\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    data = buf.getvalue()
    log.info("docker import %s (%d files, %.0f MB)", tag, len(files), len(data) / 1e6)
    r = subprocess.run(
        [
            docker,
            "import",
            "--change",
            "ENV PATH=/usr/local/bin:/usr/bin:/bin",
            "--change",
            "ENV LANG=C.UTF-8",
            "-",
            tag,
        ],
        input=data,
        capture_output=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"docker import failed: {r.stderr.decode(errors='replace')[-1000:]}")
    return tag


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default=DEFAULT_IMAGE)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.force and image_exists(args.tag):
        print(f"{args.tag} exists")
        return 0
    print(f"built {build_image(args.tag)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
