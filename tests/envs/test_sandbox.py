"""The sandbox against hostile code: the parent survives, limits hold, blocked operations are
reported, and nothing is left behind (processes, the temporary directory, files outside)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from keel.envs import sandbox
from keel.envs.sandbox import isolation, run_python

FAST = {"cpu_s": 1, "wall_s": 3}


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
    monkeypatch.setattr(subprocess, "Popen", Recording)
    return records


def test_normal_code_and_the_standard_library_work():
    result = run_python(
        "import math, json, itertools, collections, decimal\n"
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


def test_files_inside_work_and_the_directory_is_removed():
    code = (
        "import os, tempfile\n"
        "open('a.txt', 'w').write('hello')\n"
        "os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n"
        "fd, path = tempfile.mkstemp(); os.write(fd, b'x'); os.close(fd)\n"
        "print(open('d/b.txt').read(), sorted(os.listdir('.')).count('d'), os.getcwd())\n"
    )
    result = run_python(code, **FAST)
    content, count, home = result.stdout.split()
    assert (content, count, result.error) == ("hello", "1", None)
    assert Path(home).name.startswith("keel-sandbox-")
    assert not Path(home).exists()


def test_an_exception_is_reported_with_the_users_frames_only():
    result = run_python("def f():\n    raise ValueError('boom')\nf()\n", **FAST)
    assert (result.exit_code, result.error) == (1, None)
    assert result.stderr.rstrip().endswith("ValueError: boom")
    assert 'File "main.py", line 2, in f' in result.stderr
    assert "<string>" not in result.stderr  # the bootstrap's own frames are cut


def test_syntax_errors_and_exit_codes():
    assert "SyntaxError" in run_python("print(", **FAST).stderr
    assert run_python("import sys; sys.exit(3)", **FAST).exit_code == 3


def test_an_infinite_loop_hits_a_time_limit():
    start = time.monotonic()
    result = run_python("while True: pass", cpu_s=1, wall_s=3)
    assert result.timed_out
    assert result.error in ("CPU time limit exceeded", "wall time limit (3 s) exceeded")
    assert time.monotonic() - start < 4.5


def test_wall_time_kills_and_keeps_the_output_so_far(started):
    start = time.monotonic()
    result = run_python("import time\nprint('started')\ntime.sleep(60)", cpu_s=5, wall_s=1)
    assert result.timed_out and result.exit_code is None
    assert result.error == "wall time limit (1 s) exceeded"
    assert result.stdout == "started\n"
    assert time.monotonic() - start < 3
    assert processes_in_group(started[-1].pid) == []


def test_a_fork_bomb_is_blocked_and_leaves_no_process(started):
    result = run_python("import os\nwhile True:\n    os.fork()\n", **FAST)
    assert result.error == "blocked: process creation"
    assert "SandboxViolation: blocked: process creation (os.fork)" in result.stderr
    assert len(started) == 1
    assert processes_in_group(started[0].pid) == []


@pytest.mark.parametrize(
    "code",
    ["print('x' * 10**8)", "while True:\n    print('y' * 100)"],
    ids=["one-huge-print", "printing-forever"],
)
def test_a_flood_of_output_is_cut_at_the_cap(code):
    start = time.monotonic()
    result = run_python(code, cpu_s=2, wall_s=5, max_output_bytes=1000)
    assert result.output_truncated
    assert len(result.stdout) == 1000 and set(result.stdout) <= {"x", "y", "\n"}
    assert result.error == "output limit (1000 bytes per stream) exceeded"
    assert time.monotonic() - start < 3  # killed at the cap, not at a time limit


def test_a_memory_hog_hits_the_memory_limit():
    result = run_python("x = bytearray(10**10)\nprint('allocated')", memory_mb=128, **FAST)
    assert result.error == "memory limit exceeded"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_reading_a_file_outside_is_blocked():
    result = run_python("print(open('/etc/passwd').read())", **FAST)
    assert result.error == "blocked: file access outside the sandbox"
    assert "root:" not in result.stdout


def test_writing_a_file_outside_is_blocked():
    target = Path(f"/tmp/keel-escape-{uuid.uuid4().hex}")
    result = run_python(f"open({str(target)!r}, 'w').write('escaped')", **FAST)
    assert result.error == "blocked: file access outside the sandbox"
    assert not target.exists()


def test_importing_socket_is_blocked():
    result = run_python("import socket\nprint('imported')", **FAST)
    assert result.error == "blocked: network access"
    assert result.stdout == ""


@pytest.mark.parametrize(
    "code", ["import subprocess\nsubprocess.run(['ls'])", "import os\nos.system('echo hi')"]
)
def test_running_commands_is_blocked(code):
    result = run_python(code, **FAST)
    assert result.error == "blocked: process creation"
    assert "hi" not in result.stdout


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
    "site_packages": "open(os.__file__.replace('os.py', 'site-packages/x.py'), 'rb')",
    "stdlib_dir_fd": "os.open(os.path.dirname(os.__file__), os.O_RDONLY)",
    "stdlib_write": "open(os.__file__, 'a')",
    "mkdir_outside": "os.mkdir('/tmp/keel-escape-dir')",
    "remove_outside": "os.remove('/tmp/keel-no-such-file')",
    "rename_out": "open('r', 'w').close(); os.rename('r', '/tmp/keel-escape-r')",
    "chmod_outside": "os.chmod('/tmp', 0o777)",
    "chdir_up": "os.chdir('..')",
    "symlink": "os.symlink('/etc/passwd', 'p')",
    "hardlink": "os.link('/etc/passwd', 'p')",
    "sqlite_outside": "import sqlite3; sqlite3.connect('/tmp/keel-escape.db')",
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
    "sqlite_memory": "import sqlite3; sqlite3.connect(':memory:').execute('select 1')",
    "threads": "import threading; t = threading.Thread(target=len, args=[()]); t.start(); t.join()",
}


def test_the_audit_hook_blocks_escapes_and_allows_the_rest():
    lines = ["import os, sys"]
    for name, attempt in {**ATTEMPTS, **ALLOWED}.items():
        lines += [
            "try:",
            f"    {attempt}",
            f"    print({name!r} + ': ran')",
            "except PermissionError as exc:",
            f"    print({name!r} + (': blocked' if 'blocked:' in str(exc) else ': denied'))",
            "except Exception as exc:",
            f"    print({name!r} + ': failed', repr(exc))",
        ]
    result = run_python("\n".join(lines), cpu_s=2, wall_s=10, max_output_bytes=65536)
    seen = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert {name: seen.get(name) for name in ATTEMPTS} == dict.fromkeys(ATTEMPTS, "blocked")
    assert {name: seen.get(name) for name in ALLOWED} == dict.fromkeys(ALLOWED, "ran")
    for name in ("/tmp/keel-escape-dir", "/tmp/keel-escape-r", "/tmp/keel-escape.db"):
        assert not Path(name).exists()


def test_the_environment_is_minimal_and_site_packages_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("KEEL_SECRET", "s3cret")
    code = "import os\nprint(sorted(os.environ))\nimport pytest\n"
    result = run_python(code, **FAST)
    names = set(eval(result.stdout))  # a printed list of str
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PYTHONHOME", "LD_LIBRARY_PATH"}
    assert "No module named 'pytest'" in result.stderr


def test_the_code_runs_as_the_uid_isolation_reports():
    layers = isolation()
    result = run_python("import os\nprint(os.getuid(), os.getgroups())", **FAST)
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
