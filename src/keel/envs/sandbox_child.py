"""The sandbox's child: the first code the sandboxed interpreter runs (see keel.envs.sandbox).

keel.envs.sandbox copies this file into the sandbox's work directory (as CHILD_FILE there) and
runs it by path: `python -I -S -B -u -X utf8 WORK_DIR/CHILD_FILE CONFIG_JSON`, so that the child
needs no view of where Keel is installed (under bubblewrap it has none; as uid 65534 it may not
be able to read it). It reads its config (`parse_config`), removes its own copy, sets the
rlimits, installs the audit hook (`make_hook`), then runs main.py as __main__. Standard library
only, and nothing here may import Keel.

The rlimits are set here, before any of the user's code, not in a Popen preexec_fn: that runs
Python between fork and exec, which can deadlock when the parent has threads (tool calls run on
threads, the trainer has many); everything Popen itself does (session, uid, umask) is C.

Everything the hook uses is bound as a keyword default when it is defined: the user's code can
rebind builtins and module globals (e.g. builtins.isinstance, posixpath.normpath), not these.
The hook is referenced only by the interpreter's hook list and calls no Python function of its
own, so its state cannot be reached and changed from the user's code without the gc and tracing
functions it blocks.
"""

import sys

CONFIG_KEYS = {
    "code": str,  # the user code's file, relative to the work directory
    "cpu_s": int,
    "memory_bytes": int,
    "file_bytes": int,
    "open_files": int,
    "processes": (int, type(None)),  # RLIMIT_NPROC, None: not set
    "unchecked_fds": list,
    "pid1": bool,  # the interpreter is a PID namespace's init (under bubblewrap)
    "child": (str, type(None)),  # this file's copy, removed before the code runs; None: keep
}


def parse_config(text):
    """The child's config from its JSON argument; a missing key, an unknown one or a value of
    the wrong type is a ValueError naming it (a mismatch between keel.envs.sandbox and this
    file, never the user's code)."""
    import json

    config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError(f"sandbox child config: expected a JSON object, got {text[:80]!r}")
    for key, kind in CONFIG_KEYS.items():
        if key not in config:
            raise ValueError(f"sandbox child config: {key!r} is missing")
        if not isinstance(config[key], kind) or (kind is int and isinstance(config[key], bool)):
            raise ValueError(f"sandbox child config: {key!r} is {config[key]!r}")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"sandbox child config: unknown keys {unknown}")
    return config


def standard_library_roots(path_entries):
    """The directories of `path_entries` (sys.path) that read-only opens may reach: absolute,
    lexically normalized (as imports name them: /proc/self/fd/N/lib/... when the interpreter
    was started through a descriptor), without site-packages or dist-packages ones."""
    import os

    roots = []
    for entry in path_entries:
        entry = os.path.normpath(os.path.abspath(entry)) if entry else entry
        if entry and "site-packages" not in entry and "dist-packages" not in entry:
            roots.append(entry)
    return tuple(roots)


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
    if config["pid1"]:
        # A PID namespace's init ignores signals it has no handler for, SIGXCPU too: exit as
        # the signal would have (the hard limit's SIGKILL a second later still reaches it)
        import os
        import signal

        def on_cpu_limit(signum, frame, _exit=os._exit):
            _exit(128 + signum)

        signal.signal(signal.SIGXCPU, on_cpu_limit)


class SandboxViolation(PermissionError):
    """An operation the Keel sandbox does not allow."""


def make_hook(home, roots, fd_bound, unchecked_fds):
    """The audit hook, not installed (`_install_hook` installs it; tests call it directly).
    home: the work directory; roots: the standard library's directories (read-only opens
    allowed); fd_bound: no descriptor is >= this (RLIMIT_NOFILE, or higher when one was open
    before it was set); unchecked_fds: directory descriptors that the kernel keeps a climb out
    of (the interpreter's prefix on the descriptor route). The hook raises SandboxViolation for
    an event it refuses and returns None otherwise."""
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
    )  # fmt: skip
    # events whose name starts with one of these
    refused_prefixes = (("socket.", network), ("syslog.", network), ("ctypes.", native))
    # import of a module with one of these names as a dotted component
    refused_modules = (
        ("socket", network), ("_socket", network), ("ssl", network), ("_ssl", network),
        ("ctypes", native), ("_ctypes", native), ("_posixsubprocess", process),
        ("readline", files), ("_dbm", files), ("_gdbm", files), ("ossaudiodev", files),
    )  # fmt: skip
    # (event, ((argument index, dir_fd argument index or -1, access), ...)); access "r": read,
    # "w": write, "cd": the new working directory. A path argument may be a descriptor.
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
    )  # fmt: skip
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
        _descriptors=tuple(fd for fd in range(fd_bound) if fd not in unchecked_fds),
        _type=type, _str=str, _bytes=bytes, _int=int, _tuple=tuple,
        _fspath=posix.fspath, _getcwd=posix.getcwd, _readlink=posix.readlink,
        _stat=posix.stat, _fstat=posix.fstat, _isdir=stat.S_ISDIR, _ischr=stat.S_ISCHR,
        _isblk=stat.S_ISBLK, _oserror=OSError,
        _decode=bytes.decode, _startswith=str.startswith, _split=str.split,
        _join="/".join, _append=list.append,
    ):  # fmt: skip
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
            specs = ((args[0], -1, "w" if (args[2] or 0) & _write_flags else "r"),)
        elif event in _path_event_names:
            specs = ()
            for name, indices in _path_events:
                if name == event:
                    specs = _tuple((args[i], args[d] if d >= 0 else -1, a) for i, d, a in indices)
        else:
            return
        # 1. each path as the exact str the kernel will see (a str subclass could lie in __eq__),
        # with the directory it is relative to (-1: the working directory)
        checks = []
        for path, dir_fd, access in specs:
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
            if _type(dir_fd) is not _int or dir_fd < 0:
                dir_fd = -1  # None, AT_FDCWD: the working directory
            _append(checks, (path, dir_fd, access))
            if event != "open" or _startswith(path, "/"):
                continue
            # The open event does not say which directory a relative path is relative to: the
            # working directory, or a dir_fd (os.open(path, dir_fd=fd) announces only path). A
            # path that stays below its directory stays inside wherever that is (descriptors of
            # directories outside are never handed out); one that climbs above it is checked
            # against every open directory descriptor as well.
            depth = 0
            for part in _split(path, "/"):
                if part == "..":
                    depth -= 1
                    if depth < 0:
                        break
                elif part and part != ".":
                    depth += 1
            if depth >= 0:
                continue
            for fd in _descriptors:
                try:
                    if _isdir(_fstat(fd).st_mode):
                        _append(checks, (path, fd, access))
                except _oserror:
                    pass  # not open
        # 2. each path, absolute and lexically normalized (the code cannot create symbolic
        # links), inside the directory or an allowed place outside
        for path, dir_fd, access in checks:
            if not _startswith(path, "/"):
                base = _getcwd() if dir_fd < 0 else _readlink("/proc/self/fd/" + _str(dir_fd))
                path = base + "/" + path
            parts = []
            climbed = False
            for part in _split(path, "/"):
                if part == "..":
                    climbed = True
                    if parts:
                        parts.pop()
                elif part and part != ".":
                    _append(parts, part)
            path = "/" + _join(parts)
            if path == _home or _startswith(path, _home_slash):
                if event == "open":
                    try:
                        mode = _stat(path).st_mode
                    except _oserror:
                        continue
                    if _ischr(mode) or _isblk(mode):
                        raise _violation(f"blocked: device files ({path!r})")
                continue
            verb = {"r": "reading", "w": "writing", "cd": "changing into"}[access]
            if climbed:  # outside, `..` may fold a symbolic link or /proc/self/fd/N lexically
                raise _violation(f"blocked: {files} ({event} {path!r} for {verb}, through ..)")
            if (access == "w" and path in _devices_rw) or (access == "r" and path in _devices_r):
                continue
            readable = access == "r" and (path in _roots or _startswith(path, _roots_slash))
            if readable and "/site-packages" not in path and "/dist-packages" not in path:
                if event != "open":
                    continue
                try:  # no descriptor of a directory outside: dir_fd tricks need one
                    if not _isdir(_stat(path).st_mode):
                        continue
                except _oserror:
                    continue
            raise _violation(f"blocked: {files} ({event} {path!r} for {verb})")

    return hook


def _install_hook(home, roots, fd_bound, unchecked_fds):
    """Install the audit hook (make_hook's arguments); it cannot be removed."""
    sys.addaudithook(make_hook(home, roots, fd_bound, unchecked_fds))


def _run(config):
    import builtins
    import os
    import posix
    import resource
    import types

    if config["child"] is not None:
        os.remove(config["child"])  # the work directory holds only what the code writes
    # every descriptor open now, before the hook: one may be above RLIMIT_NOFILE
    inherited = [int(name) for name in os.listdir("/proc/self/fd")]
    _limits(config)
    fd_bound = max([resource.getrlimit(resource.RLIMIT_NOFILE)[1], *(fd + 1 for fd in inherited)])
    with open(config["code"], "rb") as f:
        source = f.read()
    home = posix.getcwd()
    roots = standard_library_roots(sys.path)
    _install_hook(home, roots, fd_bound, frozenset(config["unchecked_fds"]))
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
        for tb, after in zip(kept, [*kept[1:], None], strict=True):
            tb.tb_next = after
        exc.__traceback__ = kept[0] if kept else None
        sys.excepthook(exc.__class__, exc, exc.__traceback__)
        raise SystemExit(1) from None  # not sys.exit: the code may have rebound it


if __name__ == "__main__":
    _run(parse_config(sys.argv[1]))
