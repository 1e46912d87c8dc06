"""The sandbox against hostile code: the parent survives, limits hold, blocked operations are
reported, and nothing is left behind (processes, the temporary directory, files outside).

Most tests run twice: with bubblewrap (`bwrap`, which scripts/install-test-tools installs; a
missing or failing bwrap fails them, never skips them) and with the inner layers only
(`bubblewrap=False`: the audit hook, rlimits and the uid and network switches the machine
allows). Each sandbox call is a process of its own (about 50-100 ms), so each test makes few."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from keel.envs import sandbox
from keel.envs.sandbox import SandboxResult, isolation, run_python

FAST = {"cpu_s": 1, "wall_s": 3}
WITH_AND_WITHOUT_BWRAP = pytest.mark.parametrize(
    "bubblewrap", [True, False], ids=["bwrap", "inner"]
)

Run = Callable[..., SandboxResult]


def require_bwrap() -> sandbox.Isolation:
    """This machine's isolation with bubblewrap; fails (never skips) when bwrap is missing or
    not used."""
    if shutil.which("bwrap") is None:
        pytest.fail(
            "`bwrap` is not installed: install Debian's `bubblewrap` package "
            "(scripts/install-test-tools does, as `make test` runs it)",
            pytrace=False,
        )
    layers = isolation()
    if not layers.bwrap:
        pytest.fail(f"bwrap is installed but the sandbox does not use it: {layers.note}")
    return layers


@pytest.fixture
def run(bubblewrap: bool) -> Run:
    """run_python with or without bubblewrap, checking that the layers ran as asked."""
    if bubblewrap:
        require_bwrap()

    def run(code: str, **limits) -> SandboxResult:
        result = run_python(code, bubblewrap=bubblewrap, **limits)
        assert ("bwrap" in result.layers) == bubblewrap, result.layers
        assert result.layers[-2:] == ("audit_hook", "rlimits")
        return result

    return run


def processes_in_group(pgid: int) -> list[int]:
    """The pids whose process group is `pgid` (from /proc/PID/stat: pid (comm) state ppid pgrp)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        if int(stat.rpartition(")")[2].split()[2]) == pgid:
            found.append(int(entry.name))
    return found


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """The processes the sandbox starts during the test (subprocess.Popen recorded)."""
    records: list[subprocess.Popen] = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            records.append(self)

    isolation()  # probed before, so that only sandboxed runs are recorded
    isolation(bubblewrap=False)
    monkeypatch.setattr(subprocess, "Popen", Recording)
    return records


@WITH_AND_WITHOUT_BWRAP
def test_normal_code_and_the_standard_library_work(run):
    result = run(
        "import math, json, itertools, collections, decimal, sqlite3, zlib, lzma, hashlib\n"
        "print(sum(range(10)))\n"
        "print(json.dumps([math.factorial(5), list(itertools.islice(itertools.count(), 3))]))\n",
        **FAST,
    )
    assert result.stdout == "45\n[120, [0, 1, 2]]\n"
    assert (result.exit_code, result.error, result.timed_out, result.output_truncated) == (
        0,
        None,
        False,
        False,
    )


@WITH_AND_WITHOUT_BWRAP
def test_files_inside_work_and_the_directory_is_removed(run, bubblewrap):
    code = (
        "import os, shutil, tempfile\n"
        "open('a.txt', 'w').write('hello')\n"
        "os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n"
        "fd, path = tempfile.mkstemp(); os.write(fd, b'x'); os.close(fd)\n"
        "with tempfile.TemporaryDirectory() as t:\n"
        "    os.makedirs(t + '/u/v'); open(t + '/u/v/w', 'w').close()\n"
        "os.makedirs('p/q'); os.chdir('p/q'); open('../../p/r', 'w').close(); os.chdir('../..')\n"
        "shutil.rmtree('p'); list(os.fwalk('.'))\n"
        "print(open('d/b.txt').read(), sorted(os.listdir('.')).count('d'), os.getcwd())\n"
    )
    result = run(code, **FAST)
    assert result.error is None, result.stderr
    content, count, home = result.stdout.split()
    assert (content, count) == ("hello", "1")
    if bubblewrap:
        assert home == sandbox.BWRAP_WORK_DIR  # a tmpfs of its own, gone with the sandbox
    else:
        assert Path(home).name.startswith("keel-sandbox-")
        assert not Path(home).exists()


@WITH_AND_WITHOUT_BWRAP
def test_an_exception_is_reported_with_the_users_frames_only(run):
    result = run("def f():\n    raise ValueError('boom')\nf()\n", **FAST)
    assert (result.exit_code, result.error) == (1, None)
    assert result.stderr.rstrip().endswith("ValueError: boom")
    assert 'File "main.py", line 2, in f' in result.stderr
    assert "<string>" not in result.stderr  # the bootstrap's own frames are cut


@WITH_AND_WITHOUT_BWRAP
def test_syntax_errors_exit_codes_and_signals(run):
    broken = run("print(", **FAST)  # the program's error, not the bootstrap's
    assert (broken.stdout, broken.exit_code, broken.error) == ("", 1, None)
    assert broken.stderr == (
        "  File \"main.py\", line 1\n    print(\n         ^\nSyntaxError: '(' was never closed\n"
    )
    assert run("import sys; sys.exit(3)", **FAST).exit_code == 3
    # bwrap reports 128 + N: read as signal N (SIGABRT; as a PID namespace's init, the code
    # ignores it and glibc's abort() ends in SIGSEGV)
    aborted = run("import os; os.abort()", **FAST)
    assert aborted.exit_code in (-6, -11), aborted
    assert aborted.error in ("killed by SIGABRT", "killed by SIGSEGV")


@WITH_AND_WITHOUT_BWRAP
def test_an_infinite_loop_hits_a_time_limit(run):
    start = time.monotonic()
    result = run("while True: pass", cpu_s=1, wall_s=3)
    assert result.timed_out
    assert result.error in ("CPU time limit exceeded", "wall time limit (3 s) exceeded")
    assert time.monotonic() - start < 4.5


@WITH_AND_WITHOUT_BWRAP
def test_wall_time_kills_and_keeps_the_output_so_far(run, started):
    start = time.monotonic()
    result = run("import time\nprint('started')\ntime.sleep(60)", cpu_s=5, wall_s=1)
    assert result.timed_out and result.exit_code is None
    assert result.error == "wall time limit (1 s) exceeded"
    assert result.stdout == "started\n"
    assert time.monotonic() - start < 3
    assert processes_in_group(started[-1].pid) == []


@WITH_AND_WITHOUT_BWRAP
def test_a_fork_bomb_is_blocked_and_leaves_no_process(run, started):
    result = run("import os\nwhile True:\n    os.fork()\n", **FAST)
    assert result.error == "blocked: process creation"
    assert "SandboxViolation: blocked: process creation (os.fork)" in result.stderr
    assert len(started) == 1
    assert processes_in_group(started[0].pid) == []


@WITH_AND_WITHOUT_BWRAP
@pytest.mark.parametrize(
    "code",
    ["print('x' * 10**8)", "while True:\n    print('y' * 100)"],
    ids=["one-huge-print", "printing-forever"],
)
def test_a_flood_of_output_is_cut_at_the_cap(run, code):
    start = time.monotonic()
    result = run(code, cpu_s=2, wall_s=5, max_output_bytes=1000)
    assert result.output_truncated
    assert len(result.stdout) == 1000 and set(result.stdout) <= {"x", "y", "\n"}
    assert result.error == "output limit (1000 bytes per stream) exceeded"
    assert time.monotonic() - start < 3  # killed at the cap, not at a time limit


@WITH_AND_WITHOUT_BWRAP
def test_a_memory_hog_hits_the_memory_limit(run):
    result = run("x = bytearray(10**10)\nprint('allocated')", memory_mb=128, **FAST)
    assert result.error == "memory limit exceeded"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


@WITH_AND_WITHOUT_BWRAP
@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("print(open('/etc/passwd').read())", "blocked: file access outside the sandbox"),
        ("import socket\nprint('imported')", "blocked: network access"),
        ("import subprocess\nsubprocess.run(['ls'])", "blocked: process creation"),
        ("import os\nos.system('echo hi')", "blocked: process creation"),
    ],
    ids=["read-passwd", "import-socket", "subprocess", "os-system"],
)
def test_a_blocked_operation_ends_the_program_with_its_reason(run, code, error):
    result = run(code, **FAST)
    assert result.error == error
    assert result.stdout == ""


ESCAPE = f"keel-escape-{uuid.uuid4().hex}"  # names of files the snippets try to create in /tmp

# Defined before the attempts: deep(target) opens '../' * 8 + target relative to a descriptor of
# the work directory, from 8 folders below it: lexically that stays inside the working
# directory, for the kernel it is /target (the escape an attack found: the open event does not
# name its dir_fd). The work directory is /tmp/keel-sandbox-… or /sandbox: 8 levels reach /.
PRELUDE = """\
import os, sys
HOME = os.getcwd()
def deep(target, flags=os.O_RDONLY):
    fd = os.open('.', os.O_RDONLY)
    os.makedirs('a/b/c/d/e/f/g/h', exist_ok=True)
    os.chdir('a/b/c/d/e/f/g/h')
    try:
        got = os.open('../' * 8 + target, flags, dir_fd=fd)
        return os.read(got, 200) if flags == os.O_RDONLY else got
    finally:
        os.chdir(HOME)
        os.close(fd)
def near():
    os.makedirs('m/n/o', exist_ok=True)
    fd = os.open('m/n', os.O_RDONLY)
    os.chdir('m/n/o')
    try:  # ../x: m/n/x from the working directory, m/x from the descriptor: inside either way
        os.close(os.open('../x', os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.chdir(HOME)
        os.close(fd)
"""

# Each line tries one operation; the snippet prints "name: blocked" when it raised the sandbox's
# PermissionError, "name: ran" otherwise. os.__file__ is the child's (the standard library as the
# sandbox's interpreter names it).
ATTEMPTS = {
    "fork": "os.fork()",
    "forkpty": "os.forkpty()",
    "posix_spawn": "os.posix_spawn('/bin/true', ['true'], {})",
    "execv": "os.execv('/bin/true', ['true'])",
    "kill": "os.kill(1, 0)",
    "posixsubprocess": "import _posixsubprocess",
    "ctypes": "import ctypes",
    "_socket": "import _socket",
    "urllib": "import urllib.request",
    "listdir_root": "os.listdir('/')",
    "scandir_etc": "list(os.scandir('/etc'))",
    "os_open_passwd": "os.open('/etc/passwd', os.O_RDONLY)",
    "dotdot": "open('../../../../etc/passwd')",
    "proc_mem": "open('/proc/self/mem', 'rb')",
    "parent_cmdline": "open(f'/proc/{os.getppid()}/cmdline', 'rb').read()",
    "parent_environ": "open(f'/proc/{os.getppid()}/environ', 'rb').read()",
    "dir_fd_passwd": "deep('etc/passwd')",
    "dir_fd_parent_cmdline": "deep(f'proc/{os.getppid()}/cmdline')",
    "dir_fd_parent_environ": "deep(f'proc/{os.getppid()}/environ')",
    "dir_fd_tmp_write": f"deep('tmp/{ESCAPE}-deep', os.O_WRONLY | os.O_CREAT)",
    "dir_fd_root_dir": "deep('', os.O_RDONLY | os.O_DIRECTORY)",
    "dir_fd_mkdir": f"os.mkdir('../' * 8 + 'tmp/{ESCAPE}-d', dir_fd=os.open('.', os.O_RDONLY))",
    "fchdir_root": "os.fchdir(os.open('/', os.O_RDONLY))",
    "site_packages": "open(os.__file__.replace('os.py', 'site-packages/x.py'), 'rb')",
    "stdlib_dir_fd": "os.open(os.path.dirname(os.__file__), os.O_RDONLY)",
    "stdlib_dotdot": "open(os.path.dirname(os.__file__) + '/../' + "
    "os.path.basename(os.path.dirname(os.__file__)) + '/os.py')",
    "stdlib_write": "open(os.__file__, 'a')",
    "tmp_write": f"open('/tmp/{ESCAPE}', 'w').write('escaped')",
    "mkdir_outside": f"os.mkdir('/tmp/{ESCAPE}-dir')",
    "remove_outside": "os.remove('/tmp/keel-no-such-file')",
    "rename_out": f"open('r', 'w').close(); os.rename('r', '/tmp/{ESCAPE}-r')",
    "chmod_outside": "os.chmod('/tmp', 0o777)",
    "chdir_up": "os.chdir('..')",
    "symlink": "os.symlink('/etc/passwd', 'p')",
    "hardlink": "os.link('/etc/passwd', 'p')",
    "sqlite_outside": f"import sqlite3; sqlite3.connect('/tmp/{ESCAPE}.db')",
    "setrlimit": "import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
    "settrace": "sys.settrace(lambda *a: None)",
    "gc_objects": "import gc; gc.get_objects()",
    "rebound_builtins": "import builtins; builtins.isinstance = lambda *a: 1; open('/etc/hosts')",
    "rebound_posixpath": "import posixpath; posixpath.normpath = lambda p: '.'; os.listdir('/')",
}
ALLOWED = {
    "stdlib_read": "open(os.__file__).read(10)",
    "dev_null": "open('/dev/null', 'w').write('x')",
    "listdir_here": "os.listdir()",
    "dir_fd_inside": "near()",
    "scandir_fd_here": "list(os.scandir(os.open('.', os.O_RDONLY)))",
    "sqlite_memory": "import sqlite3; sqlite3.connect(':memory:').execute('select 1')",
    "threads": "import threading; t = threading.Thread(target=len, args=[()]); t.start(); t.join()",
}


def attempts_snippet(attempts: dict[str, str]) -> str:
    lines = [PRELUDE]
    for name, attempt in attempts.items():
        lines += [
            "try:",
            f"    {attempt}",
            f"    print({name!r} + ': ran')",
            "except PermissionError as exc:",
            f"    print({name!r} + (': blocked' if 'blocked:' in str(exc) else ': denied'))",
            "except Exception as exc:",
            f"    print({name!r} + ': failed', repr(exc))",
        ]
    return "\n".join(lines)


def escapes_left() -> list[Path]:
    return sorted(Path("/tmp").glob(f"{ESCAPE}*"))


@WITH_AND_WITHOUT_BWRAP
def test_the_audit_hook_blocks_escapes_and_allows_the_rest(run):
    result = run(
        attempts_snippet({**ALLOWED, **ATTEMPTS}), cpu_s=2, wall_s=10, max_output_bytes=65536
    )
    seen = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert {name: seen.get(name) for name in ATTEMPTS} == dict.fromkeys(ATTEMPTS, "blocked")
    assert {name: seen.get(name) for name in ALLOWED} == dict.fromkeys(ALLOWED, "ran")
    assert escapes_left() == []
    for secret in host_secrets():
        assert secret not in result.stdout


def host_secrets() -> list[str]:
    """Strings of the caller's own that the sandbox must not be able to print: its command line
    and its environment at its start (but the variables the sandbox sets itself)."""
    cmdline = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    own = tuple(f"{name}=" for name in sandbox._environment("/"))
    environ = Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
    return [cmdline, *(entry for entry in environ if len(entry) > 8 and not entry.startswith(own))]


BARE_HOSTILE = """\
import json, os, socket, sys
found = {}
found['passwd'] = os.path.exists('/etc/passwd')
found['visible'] = sorted(p for p in sys.argv[1:] if os.path.exists(p))
fd = os.open('.', os.O_RDONLY)
os.makedirs('a/b/c/d/e/f/g/h'); os.chdir('a/b/c/d/e/f/g/h')
try:
    os.open('../' * 8 + 'etc/passwd', os.O_RDONLY, dir_fd=fd)
    found['dir_fd'] = 'opened'
except OSError as exc:
    found['dir_fd'] = exc.errno
found['ppid'] = os.getppid()
found['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
found['parent'] = {}
for pid in {os.getppid(), 1, 2}:
    for name in ('cmdline', 'environ'):
        try:
            with open(f'/proc/{pid}/{name}', 'rb') as f:
                found['parent'][f'{pid}/{name}'] = f.read().decode(errors='replace')
        except OSError as exc:
            found['parent'][f'{pid}/{name}'] = exc.errno
for name in ('tmp', 'root'):
    try:
        open('/' + name + '/escape', 'w')
        found[name] = 'written'
    except OSError as exc:
        found[name] = exc.errno
s = socket.socket()
s.settimeout(2)
found['loopback'] = s.connect_ex(('127.0.0.1', int(os.environ['PORT'])))
found['outside'] = socket.socket().connect_ex(('192.0.2.1', 80))
print(json.dumps(found))
"""


def test_bubblewrap_alone_hides_the_machine_and_its_network(tmp_path):
    """The bwrap layer without the inner ones (plain code, no audit hook): the file system, the
    caller's processes and the network are not there."""
    layers = require_bwrap()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    visible = [str(Path(sandbox.__file__).parent), str(Path.cwd()), str(tmp_path), "/root"]
    argv = [*sandbox._bwrap_argv(layers, {}), "-c", BARE_HOSTILE, *visible]
    env = {**sandbox._popen_options(layers, sandbox.BWRAP_WORK_DIR)["env"], "PORT": str(port)}
    options = {**sandbox._popen_options(layers, sandbox.BWRAP_WORK_DIR), "env": env}
    with listener:
        done = subprocess.run(argv, cwd="/", capture_output=True, text=True, timeout=30, **options)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["passwd"] is False
    # /root holds the interpreter's prefix when it lives there, nothing else of it
    assert [p for p in found["visible"] if p != "/root"] == []
    if "/root" in found["visible"]:
        assert sys.base_prefix.startswith("/root/")
    assert found["dir_fd"] == errno.ENOENT  # the kernel resolves it: no /etc inside
    # a PID namespace of its own, the code its init: no parent to read, nothing of the caller's
    assert (found["ppid"], found["pids"]) == (0, [1])
    assert found["parent"]["0/cmdline"] == errno.ENOENT
    assert found["parent"]["2/environ"] == errno.ENOENT
    for secret in host_secrets():
        assert secret not in json.dumps(found["parent"])
    assert found["tmp"] == errno.ENOENT and found["root"] in (errno.EROFS, errno.EACCES)
    assert found["loopback"] == errno.ECONNREFUSED  # its own loopback: nothing listens there
    assert found["outside"] == errno.ENETUNREACH


def test_bubblewrap_is_used_where_it_is_installed():
    layers = require_bwrap()
    assert layers.layers[0] == "bwrap" and layers.network_namespace and layers.uid == 65534
    assert layers.note == "" and "seccomp" in layers.layers
    # as root, bubblewrap runs as uid 65534: the code is host uid 65534, never host root
    assert layers.host_uid == (65534 if os.geteuid() == 0 else os.geteuid())
    assert ("uid65534" in layers.layers) == (os.geteuid() == 0)
    result = run_python("import os; print(os.getuid(), os.getcwd())", **FAST)
    assert result.stdout.split() == ["65534", sandbox.BWRAP_WORK_DIR]
    assert result.layers == layers.layers


@pytest.mark.parametrize("bwrap", [None, "/bin/false"], ids=["missing", "failing"])
def test_without_bubblewrap_the_inner_layers_run_and_a_warning_says_so(monkeypatch, caplog, bwrap):
    monkeypatch.setattr(sandbox, "_isolation_cache", {})
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: bwrap)
    with caplog.at_level(logging.WARNING, logger="keel.envs.sandbox"):
        layers = isolation()
        result = run_python("print(open('/etc/passwd').read())", **FAST)
    assert "bwrap" not in layers.layers and layers.layers[-2:] == ("audit_hook", "rlimits")
    assert result.layers == layers.layers
    assert result.error == "blocked: file access outside the sandbox"
    why = "not on PATH" if bwrap is None else "failed its self-check"
    assert why in layers.note
    warnings = [
        r.getMessage() for r in caplog.records if "bubblewrap is not used" in r.getMessage()
    ]
    assert len(warnings) == 1 and why in warnings[0]
    assert "audit_hook, rlimits" in warnings[0]


def test_asking_for_no_bubblewrap_is_not_warned_about(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_isolation_cache", {})
    with caplog.at_level(logging.WARNING, logger="keel.envs.sandbox"):
        layers = isolation(bubblewrap=False)
    assert "bwrap" not in layers.layers and layers.note == "bubblewrap=False"
    assert not [r for r in caplog.records if "bubblewrap" in r.getMessage()]


@WITH_AND_WITHOUT_BWRAP
def test_the_environment_is_minimal_and_site_packages_are_out_of_reach(run, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("KEEL_SECRET", "s3cret")
    code = "import os\nprint(sorted(os.environ))\nimport pytest\n"
    result = run(code, **FAST)
    names = set(eval(result.stdout))  # a printed list of str
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PYTHONHOME", "LD_LIBRARY_PATH",
                     "PWD"}  # fmt: skip
    assert "No module named 'pytest'" in result.stderr


@WITH_AND_WITHOUT_BWRAP
def test_the_code_runs_as_the_uid_isolation_reports(run, bubblewrap):
    layers = isolation(bubblewrap=bubblewrap)
    result = run("import os\nprint(os.getuid(), os.getgroups())", **FAST)
    expected = layers.uid if layers.uid is not None else os.geteuid()
    assert result.stdout.split()[0] == str(expected)
    if layers.uid is not None:
        assert result.stdout.split(maxsplit=1)[1].strip() == "[]"  # no supplementary groups


def test_limits_are_checked_and_other_platforms_refused(monkeypatch):
    with pytest.raises(ValueError, match="must be > 0"):
        run_python("pass", wall_s=0)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(RuntimeError, match="Linux only"):
        run_python("pass")
    assert sandbox.SandboxResult.__dataclass_params__.frozen


def descendants_uids() -> dict[int, set[int]]:
    """pid: {real, effective, saved, filesystem uid} of the sandboxes this process started (their
    bubblewrap and interpreter), as the host sees them (/proc/PID/status)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        ancestor = sandbox._parent(pid)
        while ancestor not in (None, 0, 1, os.getpid()):
            ancestor = sandbox._parent(ancestor)
        if ancestor != os.getpid():
            continue
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        # bubblewrap and the interpreter once they run (not unshare, which switches the uid
        # itself, nor a child of Popen's before its exec, which switches it then)
        comm = status.split("\n", 1)[0].split(":", 1)[1].strip()
        if comm == "unshare" or (comm != "bwrap" and sandbox.CHILD_FILE.encode() not in command):
            continue
        uids = next(line for line in status.splitlines() if line.startswith("Uid:"))
        found[pid] = {int(uid) for uid in uids.split()[1:]}
    return found


@WITH_AND_WITHOUT_BWRAP
def test_the_code_is_never_host_root(run, bubblewrap):
    """Whatever the caller, the code's processes are not host uid 0: their uids as the host's
    /proc shows them, read by this process while the code sleeps."""
    layers = isolation(bubblewrap=bubblewrap)
    assert layers.host_uid != 0
    seen: dict[int, set[int]] = {}
    result_box = []
    worker = threading.Thread(
        target=lambda: result_box.append(run("import time\ntime.sleep(1)\nprint('slept')", **FAST))
    )
    worker.start()
    while worker.is_alive():
        seen.update(descendants_uids())
        time.sleep(0.05)
    worker.join()
    assert result_box[0].stdout == "slept\n"
    assert seen  # the sandbox's processes (bubblewrap's, the interpreter) were seen
    assert all(0 not in uids for uids in seen.values()), seen
    assert ("uid65534" in result_box[0].layers) == (os.geteuid() == 0)


def test_as_root_a_candidate_that_would_run_the_code_as_root_is_refused(monkeypatch, caplog):
    """The probe never picks a way that runs the code as the caller's uid 0 (bubblewrap started
    as root maps the sandbox's uid to host root; so does running the interpreter directly):
    with nothing else, run_python refuses."""
    if os.geteuid() != 0:
        pytest.skip("the root path: CI runs as root")
    as_root = [
        sandbox.Isolation(None, False, (sys.executable, "-I", "-S")),
        sandbox.Isolation(65534, True, (sys.executable,), bwrap=("/usr/bin/bwrap",)),
    ]
    monkeypatch.setattr(sandbox, "_isolation_cache", {})
    monkeypatch.setattr(sandbox, "_candidates", lambda *args: iter(as_root))
    assert [candidate.host_uid for candidate in as_root] == [0, 0]
    with caplog.at_level(logging.ERROR, logger="keel.envs.sandbox"):
        layers = isolation()
        with pytest.raises(sandbox.SandboxUnavailable, match="never runs as root"):
            run_python("print('ran')", **FAST)
    assert layers.command == () and layers.layers == ()
    assert any("refusing to run code" in r.getMessage() for r in caplog.records)


def test_bubblewrap_can_be_required(monkeypatch):
    monkeypatch.setattr(sandbox, "_isolation_cache", {})
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: None)
    with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap is required"):
        run_python("print('ran')", require_bubblewrap=True, **FAST)
    with pytest.raises(ValueError, match="layers_off may hold"):
        run_python("print('ran')", layers_off=("rlimits",), **FAST)


def test_an_interpreter_uid_65534_cannot_reach_runs_from_a_copy_in_bubblewrap(tmp_path):
    """The runtime copy (what bubblewrap binds when the interpreter's prefix is under a folder
    uid 65534 cannot search, as a pyenv Python under /root): made whatever this machine's
    layout, then bubblewrap started as uid 65534 runs the interpreter from it and sees nothing
    of the prefix but the copy (no site-packages)."""
    require_bwrap()
    if os.geteuid() != 0:
        pytest.skip("the root path: CI runs as root")
    described = sandbox._describe(sys.executable)
    assert described is not None
    copy = sandbox._runtime_copy(described)
    assert copy is not None and sandbox._reachable_by_nobody(copy)
    for top, dirs, _ in os.walk(copy):
        for name in dirs:
            assert os.stat(os.path.join(top, name)).st_mode & 0o005 == 0o005
    prefix = sandbox._bwrap_prefix(sandbox._find_bwrap(), described, copy)
    layers = sandbox.Isolation(
        65534, True, (described["executable"], "-I", "-S"), popen_user=65534, bwrap=prefix
    )
    code = (
        "import json, os, sys, site\n"
        "print(json.dumps([os.getuid(), sys.prefix, os.path.exists(site.getsitepackages()[0]),"
        " sorted(os.listdir(sys.prefix))]))"
    )
    argv = [*sandbox._bwrap_argv(layers, {}), "-c", code]
    done = subprocess.run(
        argv, cwd="/", capture_output=True, text=True, timeout=30,
        **sandbox._popen_options(layers, sandbox.BWRAP_WORK_DIR),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    uid, prefix_inside, site_there, listing = json.loads(done.stdout)
    assert (uid, prefix_inside, site_there) == (65534, described["base_prefix"], False)
    assert set(listing) <= {"bin", "lib"}
