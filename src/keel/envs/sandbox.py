"""Running untrusted Python code: `run_python(code)` runs it in a child process with resource
limits, in a fresh temporary directory, with only the standard library, and with an audit hook
that refuses network access, process creation and file access outside that directory.

This guards a training run against a policy's accidental or naively hostile code: an infinite
loop, a fork bomb, a memory hog, a flood of output, `open('/etc/passwd')`, `import socket`,
`os.system(...)`. It is not a hardened container. Users who run untrusted code at scale should
run the whole tool (or the trainer) in a container or under gVisor / a VM as well.

What is enforced, and by what:

- by the kernel, always: a separate process in its own session and process group, killed as a
  group (SIGKILL) at the wall-time limit; rlimits on CPU time (whole seconds, rounded up), address
  space, file size, open files and core dumps; output read at most `max_output_bytes` per stream
  (the process is killed when it writes more). The working directory is a new temporary directory
  (removed afterwards), the environment is minimal, stdin is /dev/null, and the interpreter runs
  with `-I -S`: no PYTHON* variables, no site-packages, only the standard library importable.
- by the kernel, where the machine allows it (`isolation()` says what it gives): the code runs
  as uid/gid 65534 (nobody) when the caller is root, so it can write only where anyone may and
  cannot signal the caller's processes, with RLIMIT_NPROC bounding its processes; and in a new,
  empty network namespace (util-linux `unshare --net`; Python 3.11 has no `os.unshare`), so it
  has no network. An interpreter uid 65534 cannot read (a pyenv Python under /root) is started
  through a descriptor of its prefix directory. Without `unshare`, or where neither switch is
  permitted, the code runs as the caller (a warning is logged when that is root).
- by a `sys.addaudithook` hook installed before the code runs (hooks cannot be removed from
  Python): it raises `SandboxViolation` (a PermissionError) on sockets and on importing socket,
  ssl, ctypes, _posixsubprocess and a few native modules that open files behind its back; on
  ctypes calls; on process creation (fork, exec, spawn, system, posix_spawn, subprocess) and on
  signalling other processes; on opening, listing or changing any path outside the directory
  (read-only opens of the interpreter's standard library excepted, site-packages not); on symbolic
  links, on changing rlimits, and on tracing and gc introspection (which could reach the hook).
  The result's `error` then reads "blocked: <what>" when the violation ended the program.

What it does not guarantee. Audit hooks are not a security boundary (PEP 578 says so): they see
what Python-level APIs announce, not what the kernel does. A knowledgeable attacker can get past
them: C functions that raise no audit event exist (e.g. `_imp.create_builtin` re-creating
`_posixsubprocess` where it is built in, as on Debian's Python, gives an unaudited fork_exec;
`os.mknod`, sqlite's ATTACH, `os.pidfd_open`), and a file can be swapped between the hook's check
and the open. Past the hook, only the kernel layers remain: as uid 65534 in its own network
namespace that is a modest, unprivileged process; running as root without them (the case logged
as a warning) it is root. Total disk use is bounded only per file and by time; a process that
escapes its process group (setsid after a hook bypass) is not tracked. Linux only.
"""

from __future__ import annotations

import contextlib
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

logger = logging.getLogger(__name__)

NOBODY = 65534
"""The unprivileged uid and gid the code runs as when the caller is root."""
FILE_SIZE_LIMIT = 32 * 2**20
"""RLIMIT_FSIZE: the largest file the code may write, in bytes."""
OPEN_FILES_LIMIT = 64
"""RLIMIT_NOFILE: how many files the code may hold open at once."""
PROCESS_LIMIT = 256
"""RLIMIT_NPROC when the code runs as uid 65534: processes and threads of that uid, all sandboxes
together (the kernel counts per uid). Not set otherwise: for the caller's own uid it would count
the caller's threads, and root ignores it."""
CODE_FILE = "main.py"
"""The user code's file in the sandbox directory; tracebacks name it."""

_DRAIN_AFTER_KILL_S = 1.0  # how long output is still read after the process group was killed


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced.

    exit_code: the process's exit status (negative: killed by that signal), None when the sandbox
    killed it (wall time, output limit). timed_out: a time limit (wall or CPU) ended the run.
    output_truncated: a stream produced more than `max_output_bytes` (the kept part is its start).
    error: a short human reason when a limit or a blocked operation ended the program, None
    when it ran to its end (an ordinary exception is in stderr, with exit_code 1)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    error: str | None


@dataclass(frozen=True)
class Isolation:
    """How the sandbox starts an interpreter on this machine: the OS layers it gets.

    uid: the unprivileged uid the code runs as, None when it runs as the caller.
    network_namespace: the code runs in a new network namespace without interfaces.
    command: the argv up to the interpreter's isolation flags (an `unshare` prefix, the
    interpreter, `-I -S` or equivalent); env, pass_fds: what else the start needs; popen_user:
    the uid subprocess.Popen switches to itself (None when unshare does it, or nobody does)."""

    uid: int | None
    network_namespace: bool
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    pass_fds: tuple[int, ...] = ()
    popen_user: int | None = None


_isolation_cache: dict[str, Isolation] = {}
_isolation_lock = threading.Lock()


def isolation(python: str = sys.executable) -> Isolation:
    """The strongest isolation that starts `python` here, probed once per interpreter (each
    candidate starts `python -c pass`), best first: as uid 65534 in a new network namespace, as
    uid 65534, in a new network namespace, as the caller. An interpreter that uid 65534 cannot
    reach (under /root, say) is started through a descriptor of its prefix directory
    (/proc/self/fd/N/bin/python with PYTHONHOME there): permissions of the directories above
    the prefix are then not checked. Logs a warning when the code will run as root."""
    _require_linux()
    with _isolation_lock:
        if python not in _isolation_cache:
            _isolation_cache[python] = _probe_isolation(python)
        return _isolation_cache[python]


_ISOLATED = ("-I", "-S")  # no PYTHON* variables, no user or system site-packages, no script dir


def _candidates(python: str, prefix_fd: list[int]):
    """Isolation candidates, best first; the descriptor route opens its directory lazily and
    appends the descriptor to `prefix_fd`."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    direct = (python, *_ISOLATED)
    if os.geteuid() != 0:
        if unshare:
            yield Isolation(None, True, (unshare, "--user", "--map-current-user", "--net", "--",
                                         *direct))  # fmt: skip
        yield Isolation(None, False, direct)
        return
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
    if unshare:
        yield Isolation(None, True, (unshare, "--net", "--", *direct))
    yield Isolation(None, False, direct)


def _through_descriptor(
    python: str, prefix_fd: list[int]
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None:
    """The command and environment that start `python` as /proc/self/fd/N/<path in its prefix>,
    N an O_PATH descriptor of its prefix kept open for the life of this process; None when the
    interpreter does not live in its prefix."""
    query = (
        "import json, os, sys; print(json.dumps([sys.base_prefix, sys.base_exec_prefix, "
        "os.path.realpath(sys.executable)]))"
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
        base_prefix, exec_prefix, executable = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if base_prefix != exec_prefix or not executable.startswith(base_prefix.rstrip("/") + "/"):
        return None
    fd = os.open(base_prefix, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    prefix_fd.append(fd)
    home = f"/proc/self/fd/{fd}"
    inside = os.path.relpath(executable, base_prefix)
    # -s -P -S: -I without -E, which would ignore PYTHONHOME; the environment is ours anyway
    command = (f"{home}/{inside}", "-s", "-P", "-S")
    return command, (("PYTHONHOME", home), ("LD_LIBRARY_PATH", f"{home}/lib"))


def _probe_isolation(python: str) -> Isolation:
    prefix_fd: list[int] = []
    chosen = Isolation(None, False, (python, *_ISOLATED))
    for candidate in _candidates(python, prefix_fd):
        if _starts(candidate):
            chosen = candidate
            break
    for fd in prefix_fd:
        if fd not in chosen.pass_fds:
            os.close(fd)
    if os.geteuid() == 0 and chosen.uid is None:
        logger.warning(
            "sandbox: code runs as root: uid %d cannot start %s; only the audit hook guards "
            "files and processes. Use an interpreter that uid %d can read, run as non-root, "
            "or run in a container.",
            NOBODY,
            python,
            NOBODY,
        )
    return chosen


def _popen_options(layers: Isolation, home: str) -> dict:
    """subprocess.Popen keywords for the isolation: environment, descriptors, user."""
    options: dict = {"env": {**_environment(home), **dict(layers.env)}, "pass_fds": layers.pass_fds}
    if layers.popen_user is not None:
        options.update(user=layers.popen_user, group=layers.popen_user, extra_groups=[])
    return options


def _starts(candidate: Isolation) -> bool:
    try:
        done = subprocess.run(
            [*candidate.command, "-c", "pass"],
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            **_popen_options(candidate, "/"),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def run_python(
    code: str,
    *,
    cpu_s: float = 2.0,
    wall_s: float = 5.0,
    memory_mb: int = 256,
    max_output_bytes: int = 8192,
    python: str = sys.executable,
) -> SandboxResult:
    """Run `code` with `python` in a sandbox (see the module docstring) and return its output.

    cpu_s: CPU seconds (rounded up to whole seconds), wall_s: seconds of wall time from the
    start, memory_mb: address space, max_output_bytes: bytes kept per stream (stdout, stderr);
    the process is killed when a stream exceeds it. Never raises for anything the code does;
    raises RuntimeError off Linux, ValueError for a bad limit, OSError when the interpreter
    cannot be started at all."""
    _require_linux()
    if cpu_s <= 0 or wall_s <= 0 or memory_mb <= 0 or max_output_bytes < 0:
        raise ValueError(
            "run_python: cpu_s, wall_s and memory_mb must be > 0 and max_output_bytes >= 0 "
            f"(got {cpu_s}, {wall_s}, {memory_mb}, {max_output_bytes})"
        )
    layers = isolation(python)
    home = os.path.realpath(tempfile.mkdtemp(prefix="keel-sandbox-"))
    try:
        with open(os.path.join(home, CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        if layers.uid is not None:
            for path in (home, os.path.join(home, CODE_FILE)):
                os.chown(path, layers.uid, layers.uid)
        config = {
            "code": CODE_FILE,
            "cpu_s": max(1, math.ceil(cpu_s)),
            "memory_bytes": int(memory_mb) * 2**20,
            "file_bytes": FILE_SIZE_LIMIT,
            "open_files": OPEN_FILES_LIMIT,
            "processes": PROCESS_LIMIT if layers.uid is not None else None,
        }
        proc = subprocess.Popen(
            [*layers.command, "-B", "-u", "-X", "utf8", "-c", _BOOTSTRAP, json.dumps(config)],
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            umask=0o077,
            **_popen_options(layers, home),
        )
        return _supervise(proc, wall_s=wall_s, max_output_bytes=max_output_bytes)
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


def _supervise(proc: subprocess.Popen, *, wall_s: float, max_output_bytes: int) -> SandboxResult:
    """Read both pipes (at most the cap each) until they close, wait for the exit without reaping,
    kill the process group (wall time, output flood, or leftovers), then reap."""
    deadline = time.monotonic() + wall_s
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = timed_out = False
    selector = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)

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
                _kill_group(proc.pid)  # nothing more of it would be kept: stop it now

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
    _kill_group(proc.pid)  # the leader is not reaped yet: its group id cannot have been reused
    drain_until = time.monotonic() + _DRAIN_AFTER_KILL_S
    while selector.get_map() and time.monotonic() < drain_until:
        read_ready(max(0.0, drain_until - time.monotonic()))
    selector.close()
    proc.stdout.close()
    proc.stderr.close()
    returncode = proc.wait()
    stderr = bytes(buffers[err_fd])
    killed = timed_out or truncated
    return SandboxResult(
        stdout=buffers[out_fd].decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        exit_code=None if killed else returncode,
        timed_out=timed_out or returncode == -signal.SIGXCPU,
        output_truncated=truncated,
        error=_error(returncode, stderr, wall_s, max_output_bytes, timed_out, truncated),
    )


def _exited(pid: int) -> bool:
    """Whether the child has exited, leaving it unreaped (a zombie keeps its process group)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    return os.waitid(os.P_PID, pid, flags) is not None


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


# The child's first code, run with `python -I -S -B -u -X utf8 -c _BOOTSTRAP CONFIG_JSON` in the
# sandbox directory: set the rlimits, install the audit hook, then run main.py as __main__.
# The rlimits are set here, before any of the user's code, not in a Popen preexec_fn: that runs
# Python between fork and exec, which can deadlock when the parent has threads (tool calls run
# on threads, the trainer has many); everything Popen itself does (session, uid, umask) is C.
# Everything the hook uses is bound as a keyword default when it is defined: the user's code can
# rebind builtins and module globals (e.g. builtins.isinstance, posixpath.normpath), not these.
# The hook is referenced only by the interpreter's hook list and calls no Python function of
# its own, so its state cannot be reached and changed from the user's code without the gc and
# tracing functions it blocks.
_BOOTSTRAP = r'''
import sys


def _limits(config):
    import resource

    def limit(kind, soft, hard=None):
        hard = soft if hard is None else hard
        current = resource.getrlimit(kind)[1]
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(kind, (soft, hard))

    # CPU: SIGXCPU at the limit, SIGKILL a second later should the code ignore SIGXCPU
    limit(resource.RLIMIT_CPU, config["cpu_s"], config["cpu_s"] + 1)
    limit(resource.RLIMIT_AS, config["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, config["file_bytes"])
    limit(resource.RLIMIT_NOFILE, config["open_files"])
    limit(resource.RLIMIT_CORE, 0)
    if config["processes"] is not None:
        limit(resource.RLIMIT_NPROC, config["processes"])


class SandboxViolation(PermissionError):
    """An operation the Keel sandbox does not allow."""


def _install_hook(home, roots):
    import os
    import posix
    import stat

    network = "network access"
    process = "process creation"
    native = "native code"
    files = "file access outside the sandbox"
    # (event, reason): refused whatever the arguments
    refused = (
        ("os.fork", process), ("os.forkpty", process), ("os.posix_spawn", process),
        ("os.exec", process), ("os.spawn", process), ("os.system", process),
        ("subprocess.Popen", process), ("pty.spawn", process),
        ("os.kill", "sending signals"), ("os.killpg", "sending signals"),
        ("os.symlink", "symbolic links"),
        ("resource.setrlimit", "changing resource limits"),
        ("resource.prlimit", "changing resource limits"),
        ("sys.settrace", "tracing"), ("sys.setprofile", "tracing"),
        ("gc.get_objects", "gc introspection"), ("gc.get_referrers", "gc introspection"),
        ("gc.get_referents", "gc introspection"),
        ("sqlite3.enable_load_extension", native), ("sqlite3.load_extension", native),
    )
    # events whose name starts with one of these
    refused_prefixes = (("socket.", network), ("syslog.", network), ("ctypes.", native))
    # import of a module with one of these names as a dotted component
    refused_modules = (
        ("socket", network), ("_socket", network), ("ssl", network), ("_ssl", network),
        ("ctypes", native), ("_ctypes", native), ("_posixsubprocess", process),
        ("readline", files), ("_dbm", files), ("_gdbm", files), ("ossaudiodev", files),
    )
    # (event, ((argument index, dir_fd argument index or -1, access), ...)); access "r": read,
    # "w": write, "cd": the new working directory
    path_events = (
        ("os.listdir", ((0, -1, "r"),)), ("os.scandir", ((0, -1, "r"),)),
        ("os.chdir", ((0, -1, "cd"),)),
        ("os.mkdir", ((0, 2, "w"),)), ("os.rmdir", ((0, 1, "w"),)),
        ("os.remove", ((0, 1, "w"),)), ("os.rename", ((0, 2, "w"), (1, 3, "w"))),
        ("os.link", ((0, 2, "w"), (1, 3, "w"))), ("os.chmod", ((0, 2, "w"),)),
        ("os.chown", ((0, 3, "w"),)), ("os.utime", ((0, 3, "w"),)),
        ("os.truncate", ((0, -1, "w"),)), ("os.chflags", ((0, -1, "w"),)),
        ("os.lchflags", ((0, -1, "w"),)), ("os.setxattr", ((0, -1, "w"),)),
        ("os.removexattr", ((0, -1, "w"),)), ("os.getxattr", ((0, -1, "r"),)),
        ("os.listxattr", ((0, -1, "r"),)), ("sqlite3.connect", ((0, -1, "db"),)),
    )
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def hook(
        event, args, *,
        _home=home, _home_slash=home + "/", _roots=roots,
        _roots_slash=tuple(root + "/" for root in roots),
        _devices_rw=("/dev/null",), _devices_r=("/dev/null", "/dev/zero", "/dev/urandom",
                                                 "/dev/random"),
        _refused=refused, _refused_names=frozenset(name for name, _ in refused),
        _refused_prefixes=refused_prefixes,
        _refused_prefix_tuple=tuple(prefix for prefix, _ in refused_prefixes),
        _refused_modules=refused_modules,
        _refused_module_names=frozenset(name for name, _ in refused_modules),
        _path_events=path_events, _path_event_names=frozenset(name for name, _ in path_events),
        _write_flags=write_flags, _violation=SandboxViolation,
        _type=type, _str=str, _bytes=bytes, _int=int, _tuple=tuple,
        _fspath=posix.fspath, _getcwd=posix.getcwd, _readlink=posix.readlink,
        _stat=posix.stat, _isdir=stat.S_ISDIR, _ischr=stat.S_ISCHR, _isblk=stat.S_ISBLK,
        _decode=bytes.decode, _startswith=str.startswith, _split=str.split,
        _join="/".join,
    ):
        if event in _refused_names:
            for name, reason in _refused:
                if name == event:
                    raise _violation(f"blocked: {reason} ({event})")
        if _startswith(event, _refused_prefix_tuple):
            for prefix, reason in _refused_prefixes:
                if _startswith(event, prefix):
                    raise _violation(f"blocked: {reason} ({event})")
        if event == "import":
            for part in _split(args[0], "."):
                if part in _refused_module_names:
                    for name, reason in _refused_modules:
                        if name == part:
                            raise _violation(f"blocked: {reason} (import {args[0]})")
            return
        if event == "open":
            if _type(args[0]) is _int:
                return  # wraps a descriptor that was checked when it was opened
            checks = ((args[0], -1, "w" if (args[2] or 0) & _write_flags else "r"),)
        elif event in _path_event_names:
            checks = ()
            for name, specs in _path_events:
                if name == event:
                    checks = _tuple((args[i], args[d] if d >= 0 else -1, a) for i, d, a in specs)
        else:
            return
        for path, dir_fd, access in checks:
            # the path as the exact str the kernel will see (a str subclass could lie in __eq__)
            if path is None:
                path = "."
            if _type(path) not in (_str, _bytes, _int):
                path = _fspath(path)
            if _type(path) is _int:
                path = _readlink("/proc/self/fd/" + _str(path))
            elif _type(path) is _bytes:
                path = _decode(path, "utf-8", "surrogateescape")
            elif _type(path) is not _str:
                raise _violation(f"blocked: {files} ({event} with a {_type(path)!r} path)")
            if access == "db":  # sqlite3.connect: an in-memory database, or a file
                if _startswith(path, "file:"):
                    path = _split(_split(path, "?")[0], "file:", 1)[1]
                if path == ":memory:" or path == "":
                    continue
                access = "w"
            if not _startswith(path, "/"):
                base = _getcwd() if _type(dir_fd) is not _int or dir_fd < 0 else (
                    _readlink("/proc/self/fd/" + _str(dir_fd)))
                path = base + "/" + path
            # lexically normalized: the code cannot create symbolic links
            parts = []
            for part in _split(path, "/"):
                if part == "..":
                    if parts:
                        parts.pop()
                elif part and part != ".":
                    parts.append(part)
            path = "/" + _join(parts)
            inside = path == _home or _startswith(path, _home_slash)
            if inside:
                if event == "open":
                    try:
                        mode = _stat(path).st_mode
                    except OSError:
                        continue
                    if _ischr(mode) or _isblk(mode):
                        raise _violation(f"blocked: device files ({path!r})")
                continue
            if access == "w" and path in _devices_rw or access == "r" and path in _devices_r:
                continue
            readable = access == "r" and (path in _roots or _startswith(path, _roots_slash))
            if readable and "/site-packages" not in path and "/dist-packages" not in path:
                if event != "open":
                    continue
                try:  # no descriptor of a directory outside: dir_fd tricks need one
                    if not _isdir(_stat(path).st_mode):
                        continue
                except OSError:
                    continue
            verb = {"r": "reading", "w": "writing", "cd": "changing into"}[access]
            raise _violation(f"blocked: {files} ({event} {path!r} for {verb})")

    sys.addaudithook(hook)


def _run(config):
    import builtins
    import os
    import posix
    import types

    _limits(config)
    with open(config["code"], "rb") as f:
        source = f.read()
    home = posix.getcwd()
    roots = []
    for entry in sys.path:
        # lexical, as imports name them (/proc/self/fd/N/lib/... when started through one)
        entry = os.path.normpath(os.path.abspath(entry)) if entry else entry
        if entry and "site-packages" not in entry and "dist-packages" not in entry:
            roots.append(entry)
    _install_hook(home, tuple(roots))
    main = types.ModuleType("__main__")
    main.__file__ = config["code"]
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [config["code"]]
    mine = globals()
    try:
        exec(compile(source, config["code"], "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        # show the user's frames only: not this bootstrap's, not the hook's, not importlib's
        kept = []
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            name = frame.f_code.co_filename
            if frame.f_globals is not mine and not name.startswith("<frozen importlib"):
                kept.append(tb)
            tb = tb.tb_next
        for tb, after in zip(kept, [*kept[1:], None]):
            tb.tb_next = after
        exc.__traceback__ = kept[0] if kept else None
        sys.excepthook(exc.__class__, exc, exc.__traceback__)
        raise SystemExit(1) from None  # not sys.exit: the code may have rebound it


_run(__import__("json").loads(sys.argv[1]))
'''
