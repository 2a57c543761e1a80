"""The seccomp filter of a snippet's process: a deny list, compiled to BPF once per worker.

Part of the sandbox worker (``worker.py`` loads this file by path, next to itself, and the
backends mount it read-only beside it): standard library plus the optional ``pyseccomp``.
"""

from __future__ import annotations

import ctypes
import errno
import os

_DENY_SYSCALLS = (
    # networking: no sockets at all (the protocol uses pipes)
    "socket",
    "socketpair",
    "connect",
    "bind",
    "listen",
    "accept",
    "accept4",
    # debugging / reading other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # mounts, namespaces, root changes
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "fsopen",
    "fsmount",
    "fsconfig",
    "move_mount",
    "open_tree",
    "mount_setattr",
    # session / process-group escapes (the per-call kill targets the process group)
    "setsid",
    "setpgid",
    # kernel surface
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "quotactl",
    "lookup_dcookie",
    "open_by_handle_at",
    "name_to_handle_at",
    "personality",
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setgroups",
    "setfsuid",
    "setfsgid",
    "capset",
    "ioperm",
    "iopl",
    "vhangup",
)
# namespace flags that clone() must not carry
_CLONE_NS_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
    0x00000080,
)  # NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET NEWTIME


def build_seccomp_filter():
    """A deny-list filter (EPERM) for the syscalls above; clone3 answers ENOSYS so glibc falls
    back to clone(), whose flags can be inspected. Returns None when pyseccomp is missing."""
    try:
        import pyseccomp as sc
    except Exception:  # noqa: BLE001 - pyseccomp or libseccomp missing
        return None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in _DENY_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except Exception:  # noqa: BLE001 - syscall unknown on this arch
            pass
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    return f


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class CompiledFilter:
    """The seccomp filter compiled to BPF once in the worker; a child installs it with two
    prctl calls (microseconds) instead of recompiling it with libseccomp at every fork."""

    PR_SET_NO_NEW_PRIVS = 38
    PR_SET_SECCOMP = 22
    SECCOMP_MODE_FILTER = 2

    def __init__(self, libc: ctypes.CDLL) -> None:
        f = build_seccomp_filter()
        if f is None:
            raise RuntimeError("pyseccomp is not available")
        r, w = os.pipe()
        try:
            with os.fdopen(w, "wb", closefd=True) as wf:
                f.export_bpf(wf)
            chunks = []
            while True:
                b = os.read(r, 65536)
                if not b:
                    break
                chunks.append(b)
        finally:
            os.close(r)
        bpf = b"".join(chunks)
        if not bpf or len(bpf) % 8:
            raise RuntimeError(f"unexpected BPF program size {len(bpf)}")
        self.libc = libc
        self.buf = ctypes.create_string_buffer(bpf, len(bpf))
        self.prog = _SockFprog(len(bpf) // 8, ctypes.addressof(self.buf))
        self.n_instructions = len(bpf) // 8
        self.prog_addr = ctypes.addressof(self.prog)
        self.prctl = libc.prctl  # argtypes set by the Worker (c_int + 4 x c_ulong)

    def load(self) -> None:
        prctl = self.prctl
        if prctl(self.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if prctl(self.PR_SET_SECCOMP, self.SECCOMP_MODE_FILTER, self.prog_addr, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
