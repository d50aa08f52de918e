"""The kernel calls a student's process may not make, refused by the kernel itself (seccomp), not by Python.

The audit hook (``sandbox``) refuses what Python code asks for; code that reaches C another way (a package that
calls C functions without an audit event, a library of its own loaded by torch) calls the kernel directly. The
calls below reach past what the sandbox bounds: memory outside the address-space limit (memfd_create), the
kernel's keyrings that outlive the process (keyctl, add_key, request_key), other processes' memory and
descriptors (ptrace, process_vm_*, pidfd_*), new namespaces (unshare, setns, clone with a namespace flag) and
mounts, kernel modules, extended attributes (kernel memory too), new processes (each would have a memory limit of
its own), sockets and System V or POSIX shared memory (which hold memory past the limit too; nothing graded needs
them), and interfaces that have carried kernel exploits (bpf, userfaultfd, io_uring, perf_event_open).
:func:`refuse_escapes`, in the freshly forked process that runs the student's code, makes each fail with EPERM
for that process and its threads, for good. Linux on x86_64 and aarch64; elsewhere it does nothing and the
audit hook stands alone.
"""
from __future__ import annotations

import platform
import struct
import sys

__all__ = ["REFUSED", "refuse_escapes", "filter_program"]

# Each refused call and its numbers: (x86_64, aarch64)
_NUMBERS = {
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_open": (434, 434), "pidfd_getfd": (438, 438), "pidfd_send_signal": (424, 424),
    "process_madvise": (440, 440), "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "bpf": (321, 280), "userfaultfd": (323, 282),
    "perf_event_open": (298, 241), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "personality": (135, 92),
    # sockets, System V and POSIX shared memory and queues: nothing graded needs one, and each holds memory past the
    # address-space limit (a socket's buffers, a segment left in the kernel)
    "socket": (41, 198), "socketpair": (53, 199), "shmget": (29, 194), "shmat": (30, 196), "msgget": (68, 186),
    "semget": (64, 190), "mq_open": (240, 180),
    # extended attributes: up to 64 KB each, as many as a file system takes, in kernel memory (a tmpfs's) that no
    # limit of the process counts (1.5 GB under a 384 MB limit); nothing graded sets one
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7), "setxattrat": (463, 463),
    # a new process multiplies the address-space limit (each has its own); aarch64 makes processes by clone only
    "fork": (57, None), "vfork": (58, None),
}
# clone is how threads are made: allowed for a thread (CLONE_THREAD) without a namespace flag, refused otherwise
# (a new process multiplies the memory limit, a new user namespace is a way out); clone3 carries its flags where
# a filter cannot read them, so it is answered "not implemented" and the C library falls back to clone
_CLONE, _CLONE3 = (56, 220), (435, 435)
_NAMESPACE_FLAGS = 0x7E020000   # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_THREAD = 0x00010000
REFUSED = tuple(_NUMBERS)
# the architecture's audit number, and which column of _NUMBERS is its own
_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1), "arm64": (0xC00000B7, 1)}

_LOAD, _JUMP_IF_EQUAL, _JUMP_IF_AT_LEAST, _JUMP_IF_SET, _RETURN = 0x20, 0x15, 0x35, 0x45, 0x06   # BPF_LD|W|ABS, ...
_ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38   # SECCOMP_RET_ALLOW, RET_ERRNO | errno
_X32 = 0x40000000   # x86_64's x32 calls: the same calls under other numbers


def _instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def filter_program(machine: str) -> bytes | None:
    """The seccomp filter (classic BPF) for ``machine``: EPERM for REFUSED (and x32's numbers) and for clone but for
    a thread, ENOSYS for clone3, every other call allowed; a call from another architecture (a 32-bit one on a
    64-bit kernel) is refused outright."""
    known = _ARCHES.get(machine)
    if known is None:
        return None
    arch, column = known
    refused = sorted({numbers[column] for numbers in _NUMBERS.values() if numbers[column] is not None})
    program = [_instruction(_LOAD, 4),                              # seccomp_data.arch
               _instruction(_JUMP_IF_EQUAL, arch, 1, 0),
               _instruction(_RETURN, _EPERM),                       # another architecture's numbering
               _instruction(_LOAD, 0),                              # seccomp_data.nr
               _instruction(_JUMP_IF_EQUAL, _CLONE3[column], 0, 1),
               _instruction(_RETURN, _ENOSYS),
               _instruction(_JUMP_IF_EQUAL, _CLONE[column], 0, 5),   # not clone: on to the list below
               _instruction(_LOAD, 16),                             # seccomp_data.args[0], its low half: the flags
               _instruction(_JUMP_IF_SET, _NAMESPACE_FLAGS, 2, 0),  # a namespace: to the EPERM
               _instruction(_JUMP_IF_SET, _CLONE_THREAD, 0, 1),     # a thread: ALLOW; a process: EPERM
               _instruction(_RETURN, _ALLOW),
               _instruction(_RETURN, _EPERM)]
    if machine == "x86_64":
        program.append(_instruction(_JUMP_IF_AT_LEAST, _X32, len(refused) + 1, 0))   # to the EPERM below
    for index, number in enumerate(refused):   # a match jumps over the rest and the ALLOW, to the EPERM
        program.append(_instruction(_JUMP_IF_EQUAL, number, len(refused) - index, 0))
    program += [_instruction(_RETURN, _ALLOW), _instruction(_RETURN, _EPERM)]
    return b"".join(program)


def refuse_escapes() -> bool:
    """Install the filter in this process (inherited by its threads, never removed); False where it cannot."""
    program = filter_program(platform.machine())
    if program is None or not sys.platform.startswith("linux"):
        return False
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = Program(len(program) // 8, program)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) == 0


def not_dumpable() -> None:
    """This process (and every child it forks) not dumpable (Linux): its memory is not readable through
    /proc/<pid>/mem, not even by itself, and no other process of the same user may attach to it."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE, 0
        except Exception:  # noqa: BLE001 - best effort: the policy refuses /proc/self/mem as well
            pass
