"""keel.envs.sandbox_child in-process where that is safe: its config, the standard-library roots,
and the audit hook's decisions called directly (made, never installed: an installed hook cannot
be removed); its rlimits in a forked process; the whole child run by path as the sandbox runs it,
without the outer layers (tests/envs/test_sandbox.py runs it inside them)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from keel.envs import sandbox, sandbox_child
from keel.envs.sandbox_child import SandboxViolation, make_hook, parse_config

CONFIG = {
    "code": "main.py", "cpu_s": 2, "memory_bytes": 2**30, "file_bytes": 2**20,
    "open_files": 64, "processes": None, "unchecked_fds": [], "pid1": False, "seccomp": False,
    "landlock": False, "audit_hook": True, "child": None,
}  # fmt: skip
STDLIB = os.path.dirname(os.__file__)


def test_the_config_names_what_is_wrong_with_it():
    assert parse_config(json.dumps(CONFIG)) == CONFIG
    for key in ("cpu_s", "child"):
        broken = {k: v for k, v in CONFIG.items() if k != key}
        with pytest.raises(ValueError, match=f"'{key}' is missing"):
            parse_config(json.dumps(broken))
    with pytest.raises(ValueError, match="'pid1' is 1"):
        parse_config(json.dumps({**CONFIG, "pid1": 1}))
    with pytest.raises(ValueError, match="'cpu_s' is True"):
        parse_config(json.dumps({**CONFIG, "cpu_s": True}))
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        parse_config(json.dumps({**CONFIG, "extra": 1}))
    with pytest.raises(ValueError, match="expected a JSON object"):
        parse_config("[1]")


def test_the_sandbox_writes_the_config_the_child_reads():
    """keel.envs.sandbox's config keys are the child's (a run checks them; this says which)."""
    assert set(sandbox_child.CONFIG_KEYS) >= {"code", "child", "unchecked_fds"}
    assert sandbox_child.__file__ == sandbox.CHILD_MODULE


def test_standard_library_roots_are_normalized_without_site_packages():
    lib = "/usr/lib/python3.11"
    site = "/opt/py/lib/python3.11/site-packages"
    entries = [
        "",
        f"{lib}/",
        f"{lib}/../python3.11/lib-dynload",
        "/usr/lib/python3/dist-packages",
        site,
    ]
    roots = sandbox_child.standard_library_roots(entries)
    assert roots == ("/usr/lib/python3.11", "/usr/lib/python3.11/lib-dynload")


@pytest.fixture
def hook(tmp_path, monkeypatch):
    """The hook of a sandbox whose work directory is tmp_path (also the working directory)."""
    monkeypatch.chdir(tmp_path)
    return make_hook(str(tmp_path), (STDLIB,), 64, frozenset())


def blocked(hook, event: str, *args) -> str:
    with pytest.raises(SandboxViolation) as err:
        hook(event, args)
    return str(err.value)


def test_opens_inside_the_work_directory_and_of_the_standard_library_pass(hook, tmp_path):
    write = os.O_WRONLY | os.O_CREAT
    assert hook("open", (str(tmp_path / "out.txt"), "w", write)) is None
    assert hook("open", ("out.txt", "w", write)) is None  # relative to the working directory
    assert hook("open", (b"sub/../out.txt", "r", 0)) is None
    assert hook("open", (tmp_path / "out.txt", "r", 0)) is None  # a path-like object
    assert hook("open", (os.__file__, "r", 0)) is None  # reading the standard library
    assert hook("open", (5, "r", 0)) is None  # a descriptor, checked when it was opened
    assert hook("open", ("/dev/null", "w", os.O_WRONLY)) is None
    assert hook("open", ("/dev/urandom", "r", 0)) is None
    assert hook("compile", (b"", "<string>")) is None  # not a refused event


def test_opens_outside_are_blocked_naming_the_path_and_the_access(hook):
    assert "file access outside the sandbox (open '/etc/passwd' for reading)" in blocked(
        hook, "open", "/etc/passwd", "r", 0
    )
    assert "for writing" in blocked(hook, "open", os.__file__, "w", os.O_WRONLY)
    assert "through .." in blocked(hook, "open", "../outside", "r", 0)
    assert "for writing" in blocked(hook, "open", "/dev/zero", "w", os.O_WRONLY)
    site = sysconfig.get_paths()["purelib"]
    hooked = make_hook(os.getcwd(), (os.path.dirname(site),), 64, frozenset())
    assert "/site-packages" in blocked(hooked, "open", os.path.join(site, "x.py"), "r", 0)

    class Sly(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    assert "path)" in blocked(hook, "open", Sly("/etc/passwd"), "r", 0)


def test_path_events_check_every_path_and_their_dir_fd(hook, tmp_path):
    assert hook("os.listdir", (None,)) is None  # the working directory
    assert "os.listdir '/'" in blocked(hook, "os.listdir", "/")
    assert "changing into" in blocked(hook, "os.chdir", "/tmp")
    assert "'/tmp/x'" in blocked(hook, "os.rename", str(tmp_path / "a"), "/tmp/x", None, None)
    inside = os.open(tmp_path, os.O_RDONLY)
    outside = os.open("/", os.O_RDONLY)
    try:
        assert hook("os.mkdir", ("d", 0o777, inside)) is None
        assert "os.mkdir '/d'" in blocked(hook, "os.mkdir", "d", 0o777, outside)
    finally:
        os.close(inside)
        os.close(outside)
    assert hook("sqlite3.connect", (":memory:",)) is None
    assert "sqlite3.connect" in blocked(hook, "sqlite3.connect", "file:/etc/db?mode=ro")


@pytest.mark.parametrize(
    ("event", "args", "reason"),
    [
        ("os.system", ("ls",), "process creation"),
        ("subprocess.Popen", ("ls", ["ls"], None, None), "process creation"),
        ("os.kill", (1, 9), "sending signals"),
        ("socket.connect", (None, ("1.1.1.1", 80)), "network access"),
        ("ctypes.dlopen", ("libc.so.6",), "native code"),
        ("import", ("socket", None, None, None, None), "network access (import socket)"),
        ("import", ("a.ctypes.b", None, None, None, None), "native code"),
        ("sys.settrace", (None,), "tracing"),
        ("gc.get_referrers", (), "gc introspection"),
        ("os.symlink", ("a", "b", None), "symbolic links"),
        ("cpython.PyInterpreterState_New", (), "subinterpreters"),
        ("import", ("_xxsubinterpreters", None, None, None, None), "subinterpreters"),
        ("import", ("_interpreters", None, None, None, None), "subinterpreters"),
        ("import", ("_testcapi", None, None, None, None), "native code"),
        ("import", ("_testinternalcapi", None, None, None, None), "native code"),
    ],
)
def test_refused_events(hook, event, args, reason):
    assert f"blocked: {reason}" in blocked(hook, event, *args)


def test_allowed_imports_pass(hook):
    assert hook("import", ("json", None, None, None, None)) is None
    assert hook("import", ("socketserver_like", None, None, None, None)) is None


def test_limits_in_a_forked_process():
    pid = os.fork()
    if pid == 0:  # the child: set the limits, report by exit status
        try:
            sandbox_child._limits({**CONFIG, "processes": 50})
            kinds = (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NOFILE,
                     resource.RLIMIT_CORE, resource.RLIMIT_NPROC)  # fmt: skip
            got = [resource.getrlimit(kind) for kind in kinds]
            want = [(2, 3), (2**30, 2**30), (64, 64), (0, 0), (50, 50)]
            os._exit(0 if got == want else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def run_child(tmp_path: Path, code: str, config: dict | None = None) -> subprocess.CompletedProcess:
    """The child run by path in tmp_path, as keel.envs.sandbox runs it, without the outer layers."""
    (tmp_path / "main.py").write_text(code)
    child = tmp_path / sandbox.CHILD_FILE
    shutil.copyfile(sandbox.CHILD_MODULE, child)
    config = {**CONFIG, "child": str(child)} if config is None else config
    argv = [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", str(child), json.dumps(config)]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=30)


def test_the_child_runs_by_path_removes_its_copy_and_shows_only_the_users_frames(tmp_path):
    code = "import os\nprint(sorted(os.listdir('.')))\nopen('/etc/hostname')\n"
    proc = run_child(tmp_path, code)
    assert proc.returncode == 1 and proc.stdout == "['main.py']\n"
    assert proc.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert "SandboxViolation: blocked: file access outside the sandbox" in proc.stderr
    assert "sandbox_child" not in proc.stderr and "keel_sandbox_child" not in proc.stderr
    assert not (tmp_path / sandbox.CHILD_FILE).exists()


def test_a_config_the_child_cannot_use_fails_before_any_code_runs(tmp_path):
    proc = run_child(tmp_path, "print('ran')", {k: v for k, v in CONFIG.items() if k != "pid1"})
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert "'pid1' is missing" in proc.stderr


def test_sqlite_in_memory_still_opens(hook):
    """The hook allows what the standard library needs for an in-memory database."""
    assert hook("sqlite3.connect", (":memory:",)) is None
    sqlite3.connect(":memory:").close()


def test_the_seccomp_program_checks_the_architecture_first():
    """The filter's first instructions: load the audit architecture, kill the process on any
    other (x32 system calls on x86_64 too); every denied call's number is compared."""
    for machine, arch in sandbox_child.AUDIT_ARCHES.items():
        program = sandbox_child.seccomp_program(machine, 1234)
        assert program[:3] == [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, 0x80000000)]
        assert program[-1] == (0x06, 0, 0, 0x7FFF0000)  # the rest is allowed
        compared = {k for code, _, _, k in program if code == 0x15}
        index = 0 if machine == "x86_64" else 1
        wanted = {n[index] for n in sandbox_child.DENIED_SYSCALLS.values() if n[index] is not None}
        assert wanted <= compared and 1234 in compared  # signals to itself
        assert len(program) < 4096  # the kernel's BPF_MAXINSNS
    with pytest.raises(KeyError):
        sandbox_child.seccomp_program("sparc64", 1)


def test_the_seccomp_filter_in_the_child_without_the_hook(tmp_path):
    """The child with seccomp and without the hook (the filter alone): threads and signals to
    itself work, fork, exec and sockets fail with EPERM."""
    code = (
        "import os, signal, socket, threading\n"
        "t = threading.Thread(target=print, args=['thread']); t.start(); t.join()\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('signalled'))\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "for name, call in [('fork', os.fork), ('exec', lambda: os.execv('/bin/true', ['t'])),\n"
        "                   ('socket', socket.socket)]:\n"
        "    try:\n"
        "        call()\n"
        "    except PermissionError as exc:\n"
        "        print(name, exc.errno)\n"
    )
    proc = run_child(tmp_path, code, {**CONFIG, "seccomp": True, "audit_hook": False})
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "thread\nsignalled\nfork 1\nexec 1\nsocket 1\n"


def test_landlock_in_the_child_without_the_hook(tmp_path):
    """The child with Landlock and without the hook: the work folder and the standard library
    work, every other path is refused by the kernel (EACCES)."""
    if sandbox_child.landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock (Linux 5.13+, enabled in its LSM list)")
    code = (
        "import os, json\n"
        "open('mine', 'w').write('x')\n"
        "print(open('mine').read(), len(open(json.__file__).read()) > 0)\n"
        "for path, mode in [('/etc/hostname', 'r'), ('/tmp/keel-landlock-x', 'w'),\n"
        "                   (f'/proc/{os.getppid()}/cmdline', 'r')]:\n"
        "    try:\n"
        "        open(path, mode)\n"
        "    except PermissionError as exc:\n"
        "        print(exc.errno)\n"
    )
    proc = run_child(tmp_path, code, {**CONFIG, "landlock": True, "audit_hook": False})
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == "x True\n13\n13\n13\n"
    assert not Path("/tmp/keel-landlock-x").exists()
