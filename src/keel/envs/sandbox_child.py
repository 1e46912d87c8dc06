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
    "seccomp": bool,  # install SECCOMP_FILTER (seccomp_program) before the hook; fail if it fails
    "landlock": bool,  # restrict the file system with Landlock (install_landlock); fail if it fails
    "audit_hook": bool,  # install the hook (False only where a test measures the other layers)
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


# ---------------------------------------------------------------- seccomp
# The seccomp filter: a classic BPF program over struct seccomp_data {int nr; u32 arch; u64 ip;
# u64 args[6]} (little-endian: an argument's low 32 bits at 16 + 8 * i), written here in pure
# Python and installed with prctl before the hook. System calls that tool code never needs fail
# with EPERM; a system call of another architecture (x32, a 32-bit ABI) kills the process.
AUDIT_ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""The audit architecture (AUDIT_ARCH_*) of each machine the filter knows (platform.machine())."""
_X32_BIT = 0x40000000  # x86_64's x32 ABI: its system call numbers have this bit set
# name: (x86_64 number, aarch64 number or None where the architecture lacks it)
DENIED_SYSCALLS = {
    # process creation without a thread (clone is checked by its flags), programs
    "fork": (57, None), "vfork": (58, None),
    "execve": (59, 221), "execveat": (322, 281),
    # other processes: tracing, their memory and descriptors, signals by pidfd
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_open": (434, 434), "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424), "tkill": (200, 130),
    # namespaces and mounts
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    # the network (every socket family: AF_UNIX and abstract sockets too)
    "socket": (41, 198), "socketpair": (53, 199),
    # the kernel's keyrings, BPF, perf, userfaultfd, io_uring (its operations bypass seccomp)
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    # the machine: kexec, modules, swap, reboot, clocks, accounting, quotas, handles, ports
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89), "quotactl": (179, 60),
    "quotactl_fd": (443, 443), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "lookup_dcookie": (212, 18), "iopl": (172, None),
    "ioperm": (173, None), "syslog": (103, 116), "vhangup": (153, 58),
    "fanotify_init": (300, 262), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171), "personality": (135, 92),
    "uselib": (134, None), "_sysctl": (156, None), "modify_ldt": (154, None),
    "nfsservctl": (180, 42), "move_pages": (279, 239), "migrate_pages": (256, 238),
    # device nodes, sessions, System V IPC (memory outside RLIMIT_AS)
    "mknod": (133, None), "mknodat": (259, 33), "setsid": (112, 157), "setpgid": (109, 154),
    "shmget": (29, 194), "msgget": (68, 186), "semget": (64, 190),
}  # fmt: skip
# allowed only towards this process (arg 0 is the pid, or the thread group's): kill also to 0
# (its own process group)
SIGNAL_SYSCALLS = {"kill": (62, 129), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
                   "rt_tgsigqueueinfo": (297, 240)}  # fmt: skip
CLONE = (56, 220)
"""clone: allowed for a thread (CLONE_THREAD) that makes no namespace; EPERM otherwise."""
CLONE3 = (435, 435)
"""clone3: ENOSYS (its flags are in memory, out of a filter's reach), so that the C library
falls back to clone for a thread."""
CLONE_THREAD = 0x00010000
CLONE_NAMESPACES = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_EPERM = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM
_RET_ENOSYS = 0x00050000 | 38  # SECCOMP_RET_ERRNO | ENOSYS


def seccomp_program(machine, pid):
    """The filter for `machine` (a key of AUDIT_ARCHES) and the process `pid` it is installed in
    (signals to itself allowed), as a list of (code, jt, jf, k) BPF instructions; a KeyError
    for a machine it does not know."""
    index = 0 if machine == "x86_64" else 1
    arch = AUDIT_ARCHES[machine]
    ld_nr, ld_arch, ld_arg0 = (0x20, 0, 0, 0), (0x20, 0, 0, 4), (0x20, 0, 0, 16)

    def jeq(k, jt, jf):
        return (0x15, jt, jf, k)

    def jset(k, jt, jf):
        return (0x45, jt, jf, k)

    def ret(k):
        return (0x06, 0, 0, k)

    program = [ld_arch, jeq(arch, 1, 0), ret(_RET_KILL_PROCESS), ld_nr]
    if machine == "x86_64":
        program += [(0x35, 0, 1, _X32_BIT), ret(_RET_KILL_PROCESS)]  # jge x32 -> kill
    for numbers in DENIED_SYSCALLS.values():
        if numbers[index] is not None:
            program += [jeq(numbers[index], 0, 1), ret(_RET_EPERM)]
    program += [jeq(CLONE3[index], 0, 1), ret(_RET_ENOSYS)]
    for name, numbers in SIGNAL_SYSCALLS.items():
        also = 0 if name == "kill" else pid  # kill(0, sig): its own process group
        program += [
            jeq(numbers[index], 0, 5),
            ld_arg0,
            jeq(pid, 2, 0),
            jeq(also, 1, 0),
            ret(_RET_EPERM),
            ret(_RET_ALLOW),
        ]
    program += [
        jeq(CLONE[index], 0, 4),
        ld_arg0,
        jset(CLONE_NAMESPACES, 1, 0),
        jset(CLONE_THREAD, 1, 0),
        ret(_RET_EPERM),
        ret(_RET_ALLOW),
    ]
    return [*program, ret(_RET_ALLOW)]


def install_seccomp(machine, pid):
    """Install seccomp_program(machine, pid) in this process (no_new_privs first), through
    ctypes; ctypes is forgotten afterwards (sys.modules), so that the code's own import of it
    reaches the hook. Raises OSError or KeyError when it cannot."""
    import ctypes
    import os
    import struct

    program = seccomp_program(machine, pid)
    filters = b"".join(struct.pack("<HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(filters, len(filters))
    fprog = struct.pack("<HxxxxxxQ", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]  # fmt: skip
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    for option, argument, pointer in (
        (pr_set_no_new_privs, 1, None),
        (pr_set_seccomp, seccomp_mode_filter, ctypes.addressof(fprog_buffer)),
    ):
        if libc.prctl(option, argument, pointer, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl({option}) failed: {os.strerror(errno)}")
    _forget_ctypes()


def _forget_ctypes():
    """Drop ctypes from sys.modules, so that the code's own import of it reaches the hook."""
    for name in [name for name in sys.modules if name == "ctypes" or name.startswith("ctypes.")]:
        del sys.modules[name]
    sys.modules.pop("_ctypes", None)


# ---------------------------------------------------------------- Landlock
# Landlock (Linux 5.13+): an unprivileged process restricts its own file system access, by
# folder. System calls 444-446 (landlock_create_ruleset, _add_rule, _restrict_self) on x86_64
# and aarch64 alike; the access bits of <linux/landlock.h>.
LANDLOCK_SYSCALLS = (444, 445, 446)
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
LANDLOCK_DEVICES = {"/dev/null": "rw", "/dev/zero": "r", "/dev/urandom": "r", "/dev/random": "r"}
"""Device files the code may open (as the hook allows them): r: reading, rw: also writing."""


def landlock_abi():
    """The Landlock ABI version this kernel has, 0 where it has none (or it is disabled)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(
        ctypes.c_long(LANDLOCK_SYSCALLS[0]), None, ctypes.c_long(0), ctypes.c_long(1)
    )  # LANDLOCK_CREATE_RULESET_VERSION; fmt: skip
    return max(0, version)


def install_landlock(home, read_roots):
    """Restrict this process (and what it starts) to: everything in `home`, reading files and
    listing folders under `read_roots` and its own /proc/PID, the LANDLOCK_DEVICES. Every
    other path is refused (EACCES) for every access the kernel's Landlock ABI handles (reading,
    writing, creating, removing, linking, executing; renaming across folders from ABI 2,
    truncating from ABI 3). no_new_privs is set first. Raises OSError when it cannot."""
    import ctypes
    import os
    import stat
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def call(*args):
        result = libc.syscall(*(ctypes.c_long(a) for a in args))
        if result < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"landlock system call {args[0]}: {os.strerror(error)}")
        return result

    abi = call(LANDLOCK_SYSCALLS[0], 0, 0, 1)
    handled = (1 << 13) - 1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    on_files = (_FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE) & handled
    attr = ctypes.create_string_buffer(struct.pack("<Q", handled), 8)
    ruleset = call(LANDLOCK_SYSCALLS[0], ctypes.addressof(attr), 8, 0)
    try:

        def allow(path, access):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return  # not there: nothing to allow
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= on_files
                rule = ctypes.create_string_buffer(struct.pack("<Qi", access & handled, fd), 12)
                call(LANDLOCK_SYSCALLS[1], ruleset, 1, ctypes.addressof(rule), 0)
            finally:
                os.close(fd)

        allow(home, handled)
        for root in (*read_roots, f"/proc/{os.getpid()}"):
            allow(root, _FS_READ_FILE | _FS_READ_DIR)
        for device, mode in LANDLOCK_DEVICES.items():
            writing = _FS_WRITE_FILE | _FS_TRUNCATE if mode == "rw" else 0
            allow(device, _FS_READ_FILE | writing)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        call(LANDLOCK_SYSCALLS[2], ruleset, 0)
    finally:
        os.close(ruleset)
    return abi


SETUP_FAILED = "keel sandbox setup failed: "
"""How the child's stderr starts when a layer could not be set up (nothing of the code ran)."""
SETUP_FAILED_STATUS = 125
"""The child's exit status then."""


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
    subinterpreters = "subinterpreters"
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
        ("cpython.PyInterpreterState_New", subinterpreters),
    )  # fmt: skip
    # events whose name starts with one of these
    refused_prefixes = (("socket.", network), ("syslog.", network), ("ctypes.", native))
    # import of a module with one of these names as a dotted component
    refused_modules = (
        ("socket", network), ("_socket", network), ("ssl", network), ("_ssl", network),
        ("ctypes", native), ("_ctypes", native), ("_posixsubprocess", process),
        ("readline", files), ("_dbm", files), ("_gdbm", files), ("ossaudiodev", files),
        # a subinterpreter has no audit hook (3.11/3.12: _xxsubinterpreters, 3.13: _interpreters)
        ("_xxsubinterpreters", subinterpreters), ("_interpreters", subinterpreters),
        ("_xxinterpchannels", subinterpreters), ("_interpchannels", subinterpreters),
        ("_interpqueues", subinterpreters),
        # CPython's test modules: subinterpreters (_testcapi.run_in_subinterp), raw memory
        ("_testcapi", native), ("_testinternalcapi", native), ("_testmultiphase", native),
        ("_testsinglephase", native), ("_testimportmultiple", native), ("_testbuffer", native),
        ("_testclinic", native), ("_testlimitedcapi", native), ("_ctypes_test", native),
        ("_xxtestfuzz", native), ("_testexternalinspection", native), ("xxsubtype", native),
        ("xxlimited", native), ("xxlimited_35", native),
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
    if config["landlock"]:
        try:  # what the code may read: the standard library, /usr's shared libraries
            reads = [*standard_library_roots(sys.path), "/usr"]
            reads += [path for path in ("/lib", "/lib32", "/lib64") if not os.path.islink(path)]
            install_landlock(os.getcwd(), reads)
        except (OSError, ImportError, AttributeError) as exc:
            sys.stderr.write(f"{SETUP_FAILED}Landlock could not be set up: {exc!r}\n")
            os._exit(SETUP_FAILED_STATUS)
    if config["seccomp"]:
        try:
            install_seccomp(os.uname().machine, os.getpid())
        except (OSError, KeyError, ImportError, AttributeError) as exc:
            sys.stderr.write(f"{SETUP_FAILED}the seccomp filter could not be installed: {exc!r}\n")
            os._exit(SETUP_FAILED_STATUS)
    _forget_ctypes()
    fd_bound = max([resource.getrlimit(resource.RLIMIT_NOFILE)[1], *(fd + 1 for fd in inherited)])
    with open(config["code"], "rb") as f:
        source = f.read()
    home = posix.getcwd()
    roots = standard_library_roots(sys.path)
    if config["audit_hook"]:
        _install_hook(home, roots, fd_bound, frozenset(config["unchecked_fds"]))
    main = types.ModuleType("__main__")
    main.__file__ = config["code"]
    main.__dict__["__builtins__"] = builtins  # the attribute (ModuleType's stub lacks it)
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
        for i, tb in enumerate(kept):  # a SyntaxError (compile's own frame) keeps none
            tb.tb_next = kept[i + 1] if i + 1 < len(kept) else None
        exc.__traceback__ = kept[0] if kept else None
        sys.excepthook(exc.__class__, exc, exc.__traceback__)
        raise SystemExit(1) from None  # not sys.exit: the code may have rebound it


if __name__ == "__main__":
    _run(parse_config(sys.argv[1]))
