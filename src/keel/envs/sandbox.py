"""Running untrusted Python code: `run_python(code)` runs it in a child process, in layers.

This guards a training run against a policy's accidental or hostile code: an infinite loop, a
fork bomb, a memory hog, a flood of output, `open('/etc/passwd')`, `import socket`,
`os.system(...)`, and code that gets past the audit hook. The layers are independent guards,
outer to inner; `isolation()` says which this machine gives, `SandboxResult.layers` which ran
(tests/envs/test_sandbox_hostile.py measures what each stops; docs/tools.md has the table):

- `bwrap` (user, mount, PID, network, IPC and UTS namespaces), where bubblewrap is installed
  and passes its self-check: the interpreter runs as uid 65534 in new namespaces (`bwrap
  --unshare-all`), unable to create further user namespaces. Its file system holds `/usr` and
  the interpreter's prefix read-only (their site-packages hidden; a hard-linked copy of the
  prefix's runtime where uid 65534 cannot reach it, `_runtime_copy`), a fresh /proc read-only
  as a whole (/proc/sys included), /dev read-only with a `SHM_LIMIT` tmpfs on /dev/shm, and a
  tmpfs work folder (`BWRAP_WORK_DIR`, at most `WORK_SPACE_LIMIT` bytes): nothing else of the
  machine. Loopback only, with nothing listening; the caller's processes are not visible. As
  root, bubblewrap itself is started as uid 65534, so the user namespace maps the sandbox's
  uid to host uid 65534 (started as root it would be host root): never as root.
- `uid65534`: the code is host uid/gid 65534 (nobody), without supplementary groups, when the
  caller is root (under bubblewrap or not), with RLIMIT_NPROC bounding its processes and
  threads; as non-root it is the caller's own unprivileged uid. As root nothing runs the code
  as uid 0: where no way starts it as uid 65534, run_python raises SandboxUnavailable.
- `netns`, without bubblewrap (which has its own): a new, empty network namespace (util-linux
  `unshare --net`, as root; `unshare --user --net` otherwise).
- `landlock`, where the kernel has Landlock (Linux 5.13+): the child restricts itself before
  the hook (keel.envs.sandbox_child.install_landlock) to reading the standard library, /usr and
  its own /proc/PID, the work folder, and /dev/null, /dev/zero, /dev/urandom, /dev/random; the
  kernel refuses every other path (reading, writing, creating, executing, ...). A ruleset that
  cannot be set up ends the run before the code.
- `seccomp`, always on x86_64 and aarch64: a classic-BPF filter the child installs before the
  hook (keel.envs.sandbox_child.seccomp_program; no_new_privs set): no fork, vfork or exec
  (threads only: clone with CLONE_THREAD and no namespace flag), no sockets of any family, no
  ptrace, process_vm_*, pidfd_*, kcmp, mount or new-mount API, unshare, setns, keyrings, bpf,
  perf_event_open, userfaultfd, io_uring, kexec, modules, swap, reboot, clock setting, mknod,
  setsid/setpgid, System V IPC; signals only to itself (kill also to its own group); another
  architecture's system calls (x32) kill the process. A filter that cannot be installed ends
  the run before the code ("keel sandbox setup failed: ...").
- `audit_hook`, always: a `sys.addaudithook` hook installed before the code runs (hooks cannot
  be removed from Python; keel.envs.sandbox_child): it raises `SandboxViolation` (a
  PermissionError) on sockets and on importing socket, ssl, ctypes, _posixsubprocess, the
  subinterpreter modules (_xxsubinterpreters, _interpreters, ...), CPython's test modules
  (_testcapi, ...) and a few native modules that open files behind its back; on creating a
  subinterpreter (`cpython.PyInterpreterState_New`: one would run without the hook); on ctypes
  calls; on process creation and on signalling; on opening, listing or changing any path
  outside the work directory (read-only opens of the interpreter's standard library excepted,
  site-packages not), resolving paths against the working directory or the `dir_fd` the kernel
  will use; on symbolic links, on changing rlimits, and on tracing and gc introspection (which
  could reach the hook). The result's `error` then reads "blocked: <what>".
- `rlimits`, always, with the process handling: a separate process in its own session and
  process group, killed as a group (SIGKILL) at the wall-time limit; rlimits on CPU time (whole
  seconds, rounded up), address space, file size, open files and core dumps (and processes as
  uid 65534); output read at most `max_output_bytes` per stream (the process is killed when it
  writes more). The environment is minimal, stdin is /dev/null, and the interpreter runs with
  `-I -S`: no PYTHON* variables, no site-packages, only the standard library importable.

What it does not guarantee. Audit hooks are not a security boundary (PEP 578 says so): C
functions that raise no audit event exist (`os.stat`, `os.readlink`, `os.mkfifo`,
`_imp.create_builtin` re-creating a built-in `_posixsubprocess`), and a file can be swapped
between the hook's check and the open (the cwd race: another thread changes the working
directory). Past the hook, under bubblewrap the code still sees only the sandbox's file system,
no other process and no network, and seccomp keeps it from new processes, sockets and the
kernel's rarer doors; without bubblewrap it is an unprivileged uid 65534 process without
network or new processes that Landlock keeps to the work folder, the standard library and
/usr, and, on a kernel without Landlock, can read and write what anyone may (world-readable
files, /tmp, the host's /dev/shm, other uid 65534 processes' /proc files; `os.stat` of any path
in any case). Total disk use is bounded only
under bubblewrap (elsewhere per file and by time). Syscalls seccomp allows reach the kernel: a
kernel bug is still an escape. Linux only.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from keel.envs.sandbox_child import AUDIT_ARCHES, SETUP_FAILED, landlock_abi

logger = logging.getLogger(__name__)

NOBODY = 65534
"""The unprivileged uid and gid the code runs as: on the host whenever the caller is root (with
bubblewrap or without; nothing runs it as root), inside bubblewrap's user namespace always."""
FILE_SIZE_LIMIT = 32 * 2**20
"""RLIMIT_FSIZE: the largest file the code may write, in bytes."""
OPEN_FILES_LIMIT = 64
"""RLIMIT_NOFILE: how many files the code may hold open at once."""
PROCESS_LIMIT = 256
"""RLIMIT_NPROC when the code runs as uid 65534 on the host: processes and threads of that uid,
all sandboxes together (the kernel counts per uid). Not set otherwise: for the caller's own uid
it would count the caller's threads (the seccomp filter lets the code start threads only)."""
CODE_FILE = "main.py"
"""The user code's file in the sandbox directory; tracebacks name it."""
CHILD_FILE = "keel_sandbox_child.py"
"""keel.envs.sandbox_child's copy in the sandbox directory, which the interpreter runs by path;
the child removes it before the code runs."""
BWRAP_WORK_DIR = "/sandbox"
"""Under bubblewrap: the work directory (a tmpfs; also HOME and TMPDIR)."""
WORK_SPACE_LIMIT = 64 * 2**20
"""Under bubblewrap: the size of the work directory's tmpfs, in bytes (all files together)."""
SHM_LIMIT = 64 * 2**20
"""Under bubblewrap: the size of /dev/shm's tmpfs, in bytes."""

LAYERS = ("bwrap", "uid65534", "netns", "landlock", "seccomp", "audit_hook", "rlimits")
"""Every layer's name, outer to inner (the module docstring says what each is)."""

_DRAIN_AFTER_KILL_S = 1.0  # how long output is still read after the process group was killed
CHILD_MODULE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
"""keel.envs.sandbox_child's file, copied into every sandbox."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced.

    exit_code: the process's exit status (negative: killed by that signal), None when the sandbox
    killed it (wall time, output limit). timed_out: a time limit (wall or CPU) ended the run.
    output_truncated: a stream produced more than `max_output_bytes` (the kept part is its start).
    error: a short human reason when a limit or a blocked operation ended the program, None
    when it ran to its end (an ordinary exception is in stderr, with exit_code 1).
    layers: the isolation layers the run had, outer to inner (names from LAYERS, e.g.
    ("bwrap", "uid65534", "seccomp", "audit_hook", "rlimits")); "bwrap" missing means
    bubblewrap did not run."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    error: str | None
    layers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Isolation:
    """How the sandbox starts an interpreter on this machine: the OS layers it gets.

    uid: the uid the code sees itself run as, None when it runs as the caller.
    network_namespace: the code runs in a new network namespace without a way out.
    command: the argv of the interpreter with its isolation flags, after the `bwrap` or
    `unshare` prefix if any (an `unshare` prefix is part of it, a `bwrap` one is not); env,
    pass_fds: what else the start needs; popen_user: the uid subprocess.Popen switches to before
    it executes the command (None when unshare does it, or nobody does).
    bwrap: bubblewrap's argv up to its per-run options, () without bubblewrap.
    note: why bubblewrap is not used ("" when it is). An empty `command` means nothing here
    starts the code without making it host root: run_python refuses (SandboxUnavailable), and
    note says why."""

    uid: int | None
    network_namespace: bool
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    pass_fds: tuple[int, ...] = ()
    popen_user: int | None = None
    bwrap: tuple[str, ...] = ()
    note: str = ""

    @property
    def host_uid(self) -> int:
        """The uid the code runs as on the host (outside any user namespace)."""
        if self.bwrap:  # bubblewrap maps the sandbox's uid to the uid it was started as
            return os.geteuid() if self.popen_user is None else self.popen_user
        return os.geteuid() if self.uid is None else self.uid

    @property
    def layers(self) -> tuple[str, ...]:
        """The layers a run gets, outer to inner (LAYERS' names); () when it is refused."""
        if not self.command:
            return ()
        return (
            *(("bwrap",) if self.bwrap else ()),
            *(("uid65534",) if self.host_uid == NOBODY else ()),
            *(("netns",) if self.network_namespace and not self.bwrap else ()),
            *(("landlock",) if _landlock_version() else ()),
            *(("seccomp",) if _seccomp_machine() else ()),
            "audit_hook",
            "rlimits",
        )

    @property
    def work_dir(self) -> str | None:
        """The work directory as the code sees it: BWRAP_WORK_DIR under bubblewrap, None when
        it is a new temporary directory of the host's."""
        return BWRAP_WORK_DIR if self.bwrap else None


_isolation_cache: dict[tuple[str, bool], Isolation] = {}
_isolation_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """Nothing on this machine starts the code without it being host root (the caller is root
    and uid 65534 can neither run bubblewrap nor the interpreter), or bubblewrap is required and
    does not work here."""


def isolation(python: str = sys.executable, *, bubblewrap: bool = True) -> Isolation:
    """The strongest isolation that starts `python` here, probed once per interpreter (each
    candidate starts `python` once), best first: in bubblewrap, started as uid 65534 when the
    caller is root (so that the sandbox's uid 65534 is host uid 65534, never root) and as the
    caller otherwise; it must pass a self-check inside (its own PID, mount and network
    namespaces, uid 65534, no /etc/passwd). An interpreter that uid 65534
    cannot reach (under /root, say) is then given to bubblewrap as a copy of its runtime
    (`_runtime_copy`: the executable, its libraries and standard library, hard-linked where the
    file system allows) bound at its real path. Without bubblewrap (bubblewrap=False, or it
    fails): as uid 65534 in a new network namespace, as uid 65534 (when the caller is root;
    through a descriptor of its prefix directory where uid 65534 cannot reach the interpreter),
    or, as non-root, in a new user and network namespace, as the caller. As root nothing runs
    the code as root: when no candidate works, the Isolation has no command (run_python raises
    SandboxUnavailable, naming why). Logs a warning when bubblewrap is missing or fails, and an
    error when the code cannot run at all."""
    _require_linux()
    with _isolation_lock:
        key = (python, bubblewrap)
        if key not in _isolation_cache:
            _isolation_cache[key] = _probe_isolation(python, bubblewrap)
        return _isolation_cache[key]


_ISOLATED = ("-I", "-S")  # no PYTHON* variables, no user or system site-packages, no script dir
_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _find_bwrap() -> str | None:
    return shutil.which("bwrap") or shutil.which("bwrap", path=_SYSTEM_PATH)


def _describe(python: str) -> dict | None:
    """Where `python` lives: its base prefixes, its real executable and its site directories
    (all real paths); None when it cannot be asked."""
    query = (
        "import json, os, site, sys\n"
        "prefixes = [sys.base_prefix, sys.base_exec_prefix]\n"
        "print(json.dumps({'base_prefix': sys.base_prefix, 'base_exec_prefix': "
        "sys.base_exec_prefix, 'executable': os.path.realpath(sys.executable), 'real': "
        "[os.path.realpath(p) for p in prefixes], 'site': [os.path.realpath(p) for p in "
        "site.getsitepackages(prefixes)]}))"
    )
    try:
        done = subprocess.run(
            [python, *_ISOLATED, "-c", query],
            env=_environment("/"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=True,
        )
        return json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _bwrap_prefix(bwrap: str, described: dict, copy: str | None = None) -> tuple[str, ...]:
    """bubblewrap's argv up to its per-run options: namespaces, uid 65534, /usr and the
    interpreter's prefix read-only with their site directories hidden (copy: a directory that
    holds the prefix's runtime, bound at the prefix's path instead), /proc and /dev read-only,
    a bounded /dev/shm, the work directory's tmpfs."""
    # --as-pid-1: the interpreter is the PID namespace's init, bubblewrap's own child, which
    # bubblewrap reaps before it exits (its init would be left to the machine's init to reap,
    # which a container's may never do); the child handles SIGXCPU itself (an init ignores it)
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    args += ["--as-pid-1"]
    args += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "keel-sandbox"]
    bound = ["/usr"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
            bound.append(host)

    def covered(path: str) -> bool:
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in bound)

    if copy is not None:  # a copy holds no site directory: nothing to hide
        args += ["--ro-bind", copy, described["base_prefix"]]
        bound.append(described["base_prefix"])
    for path in [*described["real"], os.path.dirname(described["executable"])]:
        if not covered(path):
            args += ["--ro-bind", path, path]
            bound.append(path)
    for path in described["site"] if copy is None else ():
        if covered(path) and os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]  # an empty, read-only folder
    # a fresh /proc, read-only as a whole (bubblewrap itself covers only some of /proc/sys);
    # /dev with the null, zero, random and tty devices, read-only but for a bounded /dev/shm
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(SHM_LIMIT), "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/proc", "--remount-ro", "/dev"]
    args += ["--size", str(WORK_SPACE_LIMIT), "--tmpfs", BWRAP_WORK_DIR, "--chdir", BWRAP_WORK_DIR]
    return tuple(args)


def _bwrap_argv(layers: Isolation, files: dict[str, int]) -> list[str]:
    """The whole bubblewrap argv up to the interpreter: `files` (name in the work directory:
    descriptor to copy it from) put there, the root made read-only."""
    argv = list(layers.bwrap)
    for name, fd in files.items():
        argv += ["--file", str(fd), f"{BWRAP_WORK_DIR}/{name}"]
    return [*argv, "--remount-ro", "/", "--", *layers.command]


# Run inside bubblewrap without the hook, by the self-check: prints "ok" or what is wrong.
_BWRAP_CHECK = f"""
import os
wrong = []
if os.getuid() != {NOBODY}:
    wrong.append(f"uid {{os.getuid()}}")
if os.getpid() > 16:
    wrong.append(f"pid {{os.getpid()}}: no PID namespace")
if os.path.exists("/etc/passwd"):
    wrong.append("/etc/passwd is visible")
if os.getcwd() != {BWRAP_WORK_DIR!r}:
    wrong.append(f"working directory {{os.getcwd()}}")
with open("/proc/net/dev") as f:
    interfaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
if interfaces not in ([], ["lo"]):
    wrong.append(f"network interfaces {{interfaces}}")
print("; ".join(wrong) or "ok")
"""


def _candidates(python: str, prefix_fd: list[int], bwrap: str | None, notes: list[str]):
    """Isolation candidates, best first; the descriptor route opens its directory lazily and
    appends the descriptor to `prefix_fd`."""
    root = os.geteuid() == 0
    if bwrap is not None:
        described = _describe(python)
        if described is None:
            notes.append(f"{python} did not say where it lives")
        else:
            inside = (described["executable"], *_ISOLATED)
            # as root, bubblewrap runs as uid 65534: its user namespace maps the sandbox's uid
            # 65534 to host uid 65534 (started as root, it would map it to host root)
            user = NOBODY if root else None
            yield Isolation(
                NOBODY, True, inside, popen_user=user, bwrap=_bwrap_prefix(bwrap, described)
            )
            if root:
                copy = _runtime_copy(described)
                if copy is None:
                    notes.append("no copy of the interpreter's runtime that uid 65534 can read")
                else:
                    prefix = _bwrap_prefix(bwrap, described, copy)
                    yield Isolation(NOBODY, True, inside, popen_user=user, bwrap=prefix)
    unshare = shutil.which("unshare", path=_SYSTEM_PATH)
    direct = (python, *_ISOLATED)
    if not root:
        if unshare:
            yield Isolation(None, True, (unshare, "--user", "--map-current-user", "--net", "--",
                                         *direct))  # fmt: skip
        yield Isolation(None, False, direct)
        return
    # as root: uid 65534 or nothing (never the caller's uid 0)
    drop = (f"--setgid={NOBODY}", f"--setuid={NOBODY}")
    if unshare:
        yield Isolation(NOBODY, True, (unshare, "--net", *drop, "--", *direct))
    yield Isolation(NOBODY, False, direct, popen_user=NOBODY)
    via = _through_descriptor(python, prefix_fd)
    if via is not None:
        command, env = via
        fds = tuple(prefix_fd)
        if unshare:
            yield Isolation(NOBODY, True, (unshare, "--net", *drop, "--", *command), env, fds)
        yield Isolation(NOBODY, False, command, env, fds, popen_user=NOBODY)


def _through_descriptor(
    python: str, prefix_fd: list[int]
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None:
    """The command and environment that start `python` as /proc/self/fd/N/<path in its prefix>,
    N an O_PATH descriptor of its prefix kept open for the life of this process; None when the
    interpreter does not live in its prefix."""
    described = _describe(python)
    if described is None:
        return None
    base_prefix, exec_prefix = described["base_prefix"], described["base_exec_prefix"]
    executable = described["executable"]
    if base_prefix != exec_prefix or not executable.startswith(base_prefix.rstrip("/") + "/"):
        return None
    fd = os.open(base_prefix, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    prefix_fd.append(fd)
    home = f"/proc/self/fd/{fd}"
    inside = os.path.relpath(executable, base_prefix)
    # -s -P -S: -I without -E, which would ignore PYTHONHOME; the environment is ours anyway
    command = (f"{home}/{inside}", "-s", "-P", "-S")
    return command, (("PYTHONHOME", home), ("LD_LIBRARY_PATH", f"{home}/lib"))


def _probe_isolation(python: str, bubblewrap: bool) -> Isolation:
    prefix_fd: list[int] = []
    notes: list[str] = []
    bwrap = _find_bwrap() if bubblewrap else None
    if not bubblewrap:
        notes.append("bubblewrap=False")
    elif bwrap is None:
        notes.append("bwrap is not on PATH (Debian: apt-get install bubblewrap)")
    chosen = Isolation(None, False, ())
    for candidate in _candidates(python, prefix_fd, bwrap, notes):
        if candidate.host_uid == 0:
            continue  # never: the code would be host root
        if _starts(candidate, notes):
            chosen = candidate
            break
    for fd in prefix_fd:
        if fd not in chosen.pass_fds:
            os.close(fd)
    if not chosen.command:
        notes.append(
            f"uid {NOBODY} cannot start {python} and the code never runs as root: install "
            f"bubblewrap, use an interpreter that uid {NOBODY} can read, or run as non-root"
        )
        chosen = dataclasses.replace(chosen, note="; ".join(notes))
        logger.error("sandbox: refusing to run code with %s: %s", python, chosen.note)
        return chosen
    if not chosen.bwrap:
        chosen = dataclasses.replace(chosen, note="; ".join(notes))
        if bubblewrap:
            logger.warning(
                "sandbox: bubblewrap is not used for %s (%s); untrusted code runs with the "
                "inner layers only: %s",
                python,
                chosen.note,
                ", ".join(chosen.layers),
            )
    return chosen


_landlock: list[int] = []


def _landlock_version() -> int:
    """This kernel's Landlock ABI version (0: none), asked once per process."""
    if not _landlock:
        try:
            _landlock.append(landlock_abi())
        except (OSError, AttributeError):
            _landlock.append(0)
    return _landlock[0]


def _seccomp_machine() -> bool:
    """Whether the child installs its seccomp filter here (a machine the filter knows)."""
    return os.uname().machine in AUDIT_ARCHES


# what a copy of an interpreter's runtime leaves out, under lib/pythonX.Y
_COPY_SKIPPED = frozenset({"site-packages", "dist-packages", "test", "idlelib", "tkinter",
                           "turtledemo", "ensurepip", "__phello__"})  # fmt: skip
_copies: dict[str, str] = {}


def _reachable_by_nobody(path: str) -> bool:
    """Whether every directory from / down to `path` lets others search it (mode o+x)."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def _runtime_copy(described: dict) -> str | None:
    """A directory that uid 65534 can read holding what the interpreter needs from its prefix:
    the executable, lib/*.so* and lib/pythonX.Y (without site-packages, test and the GUI
    packages), hard-linked where the prefix's file system allows, copied otherwise; made once
    per process, removed at its exit. None where the interpreter does not live in its prefix or
    no temporary directory uid 65534 can reach exists."""
    prefix, executable = described["base_prefix"], described["executable"]
    if prefix in _copies:
        return _copies[prefix]
    if described["base_exec_prefix"] != prefix or not executable.startswith(prefix + "/"):
        return None
    parents = [d for d in ("/var/tmp", "/tmp", tempfile.gettempdir()) if _reachable_by_nobody(d)]
    if not parents:
        return None
    copy = tempfile.mkdtemp(prefix="keel-python-", dir=parents[0])
    atexit.register(shutil.rmtree, copy, True)

    def place(source: str, target: str) -> None:
        folder = os.path.dirname(target)
        if not os.path.isdir(folder):
            place_folder(folder)
        try:
            os.link(source, target, follow_symlinks=False)
        except OSError:
            shutil.copy2(source, target, follow_symlinks=False)

    def place_folder(folder: str) -> None:
        if not os.path.isdir(os.path.dirname(folder)):
            place_folder(os.path.dirname(folder))
        os.mkdir(folder)
        os.chmod(folder, 0o755)  # whatever the umask

    try:
        os.chmod(copy, 0o755)
        place(executable, copy + executable[len(prefix) :])
        lib = os.path.join(prefix, "lib")
        for name in os.listdir(lib):
            if ".so" in name and not os.path.isdir(os.path.join(lib, name)):
                place(os.path.join(lib, name), os.path.join(copy, "lib", name))
        # the standard library: the folder that holds its site-packages (lib/pythonX.Y)
        folders = [os.path.dirname(s) for s in described["site"] if s.startswith(lib + "/")]
        stdlib = (
            folders[0]
            if folders
            else os.path.join(lib, f"python{sys.version_info[0]}.{sys.version_info[1]}")
        )
        for top, dirs, files in os.walk(stdlib):
            if top == stdlib:
                dirs[:] = [d for d in dirs if d not in _COPY_SKIPPED]
            for name in files:
                source = os.path.join(top, name)
                place(source, copy + source[len(prefix) :])
    except OSError as exc:
        logger.warning("sandbox: could not copy %s's runtime to %s: %s", prefix, copy, exc)
        shutil.rmtree(copy, ignore_errors=True)
        return None
    _copies[prefix] = copy
    return copy


def _popen_options(layers: Isolation, home: str) -> dict:
    """subprocess.Popen keywords for the isolation: environment, descriptors, user."""
    options: dict = {"env": {**_environment(home), **dict(layers.env)}, "pass_fds": layers.pass_fds}
    if layers.popen_user is not None:
        options.update(user=layers.popen_user, group=layers.popen_user, extra_groups=[])
    elif os.geteuid() == 0:
        options.update(extra_groups=[])  # root's supplementary groups stay behind
    return options


def _starts(candidate: Isolation, notes: list[str]) -> bool:
    """Whether the candidate starts the interpreter (and, for bubblewrap, passes the self-check
    inside); what went wrong with a bubblewrap candidate is added to `notes`."""
    if candidate.bwrap:
        argv = [*_bwrap_argv(candidate, {}), "-c", _BWRAP_CHECK]
        home = BWRAP_WORK_DIR
    else:
        argv, home = [*candidate.command, "-c", "pass"], "/"
    try:
        done = subprocess.run(
            argv,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            **_popen_options(candidate, home),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        if candidate.bwrap:
            notes.append(f"bwrap failed to start: {exc}")
        return False
    if not candidate.bwrap:
        return done.returncode == 0
    said = (done.stdout + done.stderr).decode("utf-8", errors="replace").strip()
    if done.returncode == 0 and said == "ok":
        return True
    who = "as uid 65534" if candidate.popen_user == NOBODY else "as the caller"
    tail = said.splitlines()[-1] if said else f"exit status {done.returncode}"
    notes.append(f"bwrap {who} failed its self-check: {tail}")
    return False


def run_python(
    code: str,
    *,
    cpu_s: float = 2.0,
    wall_s: float = 5.0,
    memory_mb: int = 256,
    max_output_bytes: int = 8192,
    python: str = sys.executable,
    bubblewrap: bool = True,
    require_bubblewrap: bool = False,
    layers_off: tuple[str, ...] = (),
) -> SandboxResult:
    """Run `code` with `python` in a sandbox (see the module docstring) and return its output.

    cpu_s: CPU seconds (rounded up to whole seconds), wall_s: seconds of wall time from the
    start, memory_mb: address space, max_output_bytes: bytes kept per stream (stdout, stderr);
    the process is killed when a stream exceeds it. bubblewrap: use it where it works
    (isolation(python, bubblewrap=...)); require_bubblewrap: refuse to run without it.
    layers_off: "landlock", "seccomp" and/or "audit_hook", left out of this run (for the test that
    measures what each layer stops, tests/envs/test_sandbox_hostile.py; the python tool never
    passes it); the result's `layers` name the layers that ran. Never
    raises for anything the code does (a syntax error, NUL bytes and lone surrogates in it
    included: they are the program's SyntaxError); raises RuntimeError off Linux, ValueError for
    a bad limit, SandboxUnavailable when nothing here runs the code without it being host root
    (or bubblewrap is required and not used), OSError when the interpreter cannot be started
    at all."""
    _require_linux()
    if cpu_s <= 0 or wall_s <= 0 or memory_mb <= 0 or max_output_bytes < 0:
        raise ValueError(
            "run_python: cpu_s, wall_s and memory_mb must be > 0 and max_output_bytes >= 0 "
            f"(got {cpu_s}, {wall_s}, {memory_mb}, {max_output_bytes})"
        )
    unknown = set(layers_off) - {"landlock", "seccomp", "audit_hook"}
    if unknown:
        raise ValueError(
            f"run_python: layers_off may hold 'landlock', 'seccomp' and 'audit_hook', not {unknown}"
        )
    layers = isolation(python, bubblewrap=bubblewrap)
    ran = tuple(layer for layer in layers.layers if layer not in layers_off)
    if not layers.command:
        raise SandboxUnavailable(f"sandbox: refusing to run the code: {layers.note}")
    if require_bubblewrap and not layers.bwrap:
        raise SandboxUnavailable(
            f"sandbox: bubblewrap is required and not used ({layers.note or 'not asked for'})"
        )
    # a lone surrogate cannot be UTF-8: written as its bytes, it is the program's SyntaxError
    source = code.encode("utf-8", errors="surrogatepass")
    config = {
        "code": CODE_FILE,
        "cpu_s": max(1, math.ceil(cpu_s)),
        "memory_bytes": int(memory_mb) * 2**20,
        "file_bytes": FILE_SIZE_LIMIT,
        "open_files": OPEN_FILES_LIMIT,
        "processes": PROCESS_LIMIT if "uid65534" in layers.layers else None,
        "unchecked_fds": list(layers.pass_fds),
        "pid1": bool(layers.bwrap),
        "seccomp": "seccomp" in ran,
        "landlock": "landlock" in ran,
        "audit_hook": "audit_hook" in ran,
    }

    def child(work_dir: str) -> tuple[str, ...]:
        path = f"{work_dir}/{CHILD_FILE}"
        return ("-B", "-u", "-X", "utf8", path, json.dumps({**config, "child": path}))

    popen = {
        "stdin": subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "start_new_session": True,
        "umask": 0o077,
    }
    if layers.bwrap:
        # bubblewrap copies both into the tmpfs
        with tempfile.TemporaryFile() as code_file, open(CHILD_MODULE, "rb") as bootstrap:
            code_file.write(source)
            code_file.flush()
            code_file.seek(0)
            files = {CODE_FILE: code_file.fileno(), CHILD_FILE: bootstrap.fileno()}
            options = _popen_options(layers, BWRAP_WORK_DIR)
            options["pass_fds"] = (*options["pass_fds"], *files.values())
            argv = [*_bwrap_argv(layers, files), *child(BWRAP_WORK_DIR)]
            proc = subprocess.Popen(argv, cwd="/", **popen, **options)
        return _supervise(
            proc, wall_s=wall_s, max_output_bytes=max_output_bytes, layers=ran, bwrap=True
        )
    home = os.path.realpath(tempfile.mkdtemp(prefix="keel-sandbox-"))
    try:
        with open(os.path.join(home, CODE_FILE), "wb") as f:
            f.write(source)
        shutil.copyfile(CHILD_MODULE, os.path.join(home, CHILD_FILE))
        if layers.uid is not None:
            for path in (home, os.path.join(home, CODE_FILE), os.path.join(home, CHILD_FILE)):
                os.chown(path, layers.uid, layers.uid)
        proc = subprocess.Popen(
            [*layers.command, *child(home)], cwd=home, **popen, **_popen_options(layers, home)
        )
        return _supervise(proc, wall_s=wall_s, max_output_bytes=max_output_bytes, layers=ran)
    finally:
        _remove_tree(home)


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise RuntimeError(
            f"keel.envs.sandbox runs on Linux only (process groups, rlimits, namespaces); "
            f"this is {sys.platform}"
        )


def _environment(home: str) -> dict[str, str]:
    """The child's whole environment: nothing inherited (`-I` ignores PYTHON* anyway)."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def _supervise(
    proc: subprocess.Popen,
    *,
    wall_s: float,
    max_output_bytes: int,
    layers: tuple[str, ...],
    bwrap: bool = False,
) -> SandboxResult:
    """Read both pipes (at most the cap each) until they close, wait for the exit without reaping,
    kill the process group (wall time, output flood, or leftovers), then reap. bwrap: the
    process is bubblewrap, which exits with 128 + N when the code was killed by signal N."""
    deadline = time.monotonic() + wall_s
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = timed_out = False
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)

    def kill() -> None:
        if bwrap:
            _kill_bwrap_sandbox(proc.pid)
        _kill_group(proc.pid)

    def read_ready(timeout: float) -> None:
        nonlocal truncated
        for key, _ in selector.select(timeout):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                selector.unregister(key.fd)
                continue
            buffer = buffers[key.fd]
            room = max_output_bytes - len(buffer)
            buffer += chunk[:room]
            if len(chunk) > room and not truncated:
                truncated = True
                kill()  # nothing more of it would be kept: stop it now

    while selector.get_map() and not truncated:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        read_ready(remaining)
    while not timed_out and not truncated and not _exited(proc.pid):
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(0.005)
    kill()  # the leader is not reaped yet: its group id cannot have been reused
    drain_until = time.monotonic() + _DRAIN_AFTER_KILL_S
    while selector.get_map() and time.monotonic() < drain_until:
        read_ready(max(0.0, drain_until - time.monotonic()))
    selector.close()
    proc.stdout.close()
    proc.stderr.close()
    returncode = proc.wait()
    if bwrap and 128 < returncode <= 128 + signal.SIGRTMAX:
        returncode = -(returncode - 128)
    stderr = bytes(buffers[err_fd])
    killed = timed_out or truncated
    return SandboxResult(
        stdout=buffers[out_fd].decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        exit_code=None if killed else returncode,
        timed_out=timed_out or returncode == -signal.SIGXCPU,
        output_truncated=truncated,
        error=_error(returncode, stderr, wall_s, max_output_bytes, timed_out, truncated),
        layers=layers,
    )


def _exited(pid: int) -> bool:
    """Whether the child has exited, leaving it unreaped (a zombie keeps its process group)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    return os.waitid(os.P_PID, pid, flags) is not None


def _kill_bwrap_sandbox(pid: int) -> None:
    """Kill the sandbox under bubblewrap process `pid` (not reaped yet) from the inside out: its
    child, the PID namespace's init, first, so that the whole namespace dies and bubblewrap
    reaps the init and exits (killed together, the init would be left a zombie for the
    machine's init to reap, which a container's may never do). Waits up to a second for it."""
    if _exited(pid):
        return  # bubblewrap waited for its child: nothing is left inside
    for child in _children(pid):
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            continue  # gone
        try:
            if _parent(child) == pid:  # still bubblewrap's: the descriptor pins the process
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + 1.0
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.002)


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s children (single-threaded `pid`), [] once it has exited."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: look at every process
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _parent(int(entry)) == pid:
                found.append(int(entry))
        return found


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (from /proc/PID/stat: pid (comm) state ppid ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _error(
    returncode: int,
    stderr: bytes,
    wall_s: float,
    max_output_bytes: int,
    timed_out: bool,
    truncated: bool,
) -> str | None:
    """The short reason a run ended early, from what the supervisor did and the stderr tail."""
    if timed_out:
        return f"wall time limit ({wall_s:g} s) exceeded"
    if truncated:
        return f"output limit ({max_output_bytes} bytes per stream) exceeded"
    if returncode == -signal.SIGXCPU:
        return "CPU time limit exceeded"
    if returncode == -signal.SIGKILL:
        return "killed (SIGKILL): CPU time or memory limit"
    lines = stderr.decode("utf-8", errors="replace").strip().splitlines()
    last = lines[-1] if lines else ""
    if last.startswith(SETUP_FAILED):
        return last
    if last.startswith("SandboxViolation: blocked: "):
        return last.removeprefix("SandboxViolation: ").partition(" (")[0]
    if returncode != 0 and (last.startswith("MemoryError") or "Cannot allocate memory" in last):
        return "memory limit exceeded"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return None


def _remove_tree(path: str) -> None:
    """Remove the sandbox directory, even where the code took its own permissions away."""

    def retry(function, failed, _exc_info) -> None:
        for target in (os.path.dirname(failed), failed):
            with contextlib.suppress(OSError):
                os.chmod(target, 0o700, follow_symlinks=False)
        with contextlib.suppress(FileNotFoundError):
            function(failed)

    shutil.rmtree(path, onerror=retry)
