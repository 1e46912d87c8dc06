"""The sandbox against a suite of hostile snippets (issue 37), through the python tool, with
bubblewrap and without it (`bubblewrap=False`: the inner layers). CI runs as root, so this
covers the root path.

Each probe (PROBES) is the body of a function that returns what escaped when the forbidden
thing happened and raises when it was stopped; the probes run in batches, each batch one tool
call, and report one line each. The test asserts that every probe was contained (but the known
gaps, GAPS, which docs/tools.md lists) and that nothing on the host changed: the sysctls it
probes (read before and after; the probes open them for writing and close them without writing:
a test never writes a host setting), files outside the work folder, the listeners it started
(TCP, UDP, a unix socket by path and an abstract one), a process of uid 65534 it started, the
permissions of a file of its own. The parent holds a secret in its environment; no output may
hold it.

`test_what_each_layer_stops` runs the same probes with the audit hook left out, and with the
hook and the seccomp filter left out (run_python's `layers_off`), to measure what the other
layers stop on their own: the table in docs/tools.md ("What each layer stops") is its output
(`KEEL_HOSTILE_TABLE=1 pytest -s tests/envs/test_sandbox_hostile.py -k each_layer` prints it).
The probes that could harm the machine when nothing stops them (the fork bomb, the fills, the
races; PROBES_WITH_EVERY_LAYER) run with every layer only."""

from __future__ import annotations

import json
import os
import platform
import socket
import stat
import subprocess
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from keel.envs import sandbox
from keel.envs.python_tool import PythonTool
from keel.envs.sandbox import NOBODY, run_python
from keel.envs.sandbox_child import DENIED_SYSCALLS

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the root path (CI runs as root): it starts a uid 65534 process"
)
WITH_AND_WITHOUT_BWRAP = pytest.mark.parametrize(
    "bubblewrap", [True, False], ids=["bwrap", "inner"]
)
MARK = f"keel-hostile-{uuid.uuid4().hex[:12]}"
SECRET_NAME = "KEEL_HOSTILE_SECRET"
SECRET = f"s3cret-{uuid.uuid4().hex}"
SYSCTLS = [
    "/proc/sys/kernel/core_pattern", "/proc/sys/vm/overcommit_memory",
    "/proc/sys/kernel/panic_on_oops", "/proc/sys/fs/file-max", "/proc/sys/kernel/hostname",
    "/proc/sys/kernel/randomize_va_space", "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/kernel/modprobe", "/proc/sysrq-trigger",
    "/sys/kernel/mm/transparent_hugepage/enabled",
]  # fmt: skip
MACHINE = 0 if platform.machine() == "x86_64" else 1
SYSCALLS = {name: numbers[MACHINE] for name, numbers in DENIED_SYSCALLS.items()}
SYSCALLS["sethostname"] = (170, 161)[MACHINE]


@dataclass(frozen=True)
class Probe:
    name: str
    code: str  # a function body: return what escaped, raise when stopped
    host_file: str = ""  # created on the host when it escaped ({mark}: MARK), "": no such check


def probe(name: str, code: str, host_file: str = "") -> Probe:
    return Probe(name, textwrap.dedent(code).strip(), host_file)


def create(name: str, folder: str) -> Probe:
    """Create a file named after MARK in `folder`: escaped when it exists on the host after."""
    path = f"{folder}/{{mark}}-{name}"
    code = f"os.close(os.open({path!r}.format(mark=CTX['mark']), os.O_WRONLY | os.O_CREAT))"
    return probe(f"create in {folder}", code + "\nreturn 'created'", host_file=path)


def sysctl_probe(path: str) -> Probe:
    # opened for writing and closed without a write: a test never writes a host setting
    return probe(
        "sysctl:" + path.removeprefix("/proc/sys/"),
        f"os.close(os.open({path!r}, os.O_WRONLY))\nreturn 'opened for writing'",
    )


PROBES = [
    *(sysctl_probe(path) for path in SYSCTLS),
    # reading the machine and the parent
    probe("read /etc/passwd", "return open('/etc/passwd').read(40)"),
    probe("read /etc/shadow", "return open('/etc/shadow').read(40)"),
    probe("read a project file", "return open(CTX['project_file']).read(40)"),
    probe("list /root", "return os.listdir('/root')"),
    probe("list the parent's folder", "return os.listdir(os.path.dirname(CTX['project_file']))"),
    probe(
        "the parent's environment",
        """
        data = open(f"/proc/{CTX['host_pid']}/environ", 'rb').read()
        return 'the secret' if CTX['secret'].encode() in data else 'read'
        """,
    ),
    probe(
        "the parent's cmdline", "return open(f\"/proc/{CTX['host_pid']}/cmdline\", 'rb').read(60)"
    ),
    probe("the parent's memory map", "return open(f\"/proc/{CTX['host_pid']}/maps\").read(60)"),
    probe("the parent's memory", "return open(f\"/proc/{CTX['host_pid']}/mem\", 'rb')"),
    probe("the parent's descriptors", "return os.listdir(f\"/proc/{CTX['host_pid']}/fd\")"),
    probe("the parent's working directory", "return os.readlink(f\"/proc/{CTX['host_pid']}/cwd\")"),
    probe(
        "init's environment",
        """
        if os.getpid() == 1:
            raise LookupError('init is the code itself')
        return open('/proc/1/environ', 'rb').read(60)
        """,
    ),
    probe(
        "the secret in its own environment",
        """
        if any(CTX['secret'] in value for value in os.environ.values()):
            return 'the secret'
        raise LookupError('not there')
        """,
    ),
    probe(
        "the machine's processes",
        """
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        if len(pids) > 3:
            return f'{len(pids)} processes'
        raise LookupError(pids)
        """,
    ),
    probe("metadata of a project file", "return os.stat(CTX['project_file']).st_size"),
    probe("site-packages", "import pytest\nreturn pytest.__file__"),
    # writing outside the work folder
    create("tmp", "/tmp"),
    create("vartmp", "/var/tmp"),
    create("shm", "/dev/shm"),
    probe(
        "create in the project",
        """
            path = os.path.dirname(CTX['project_file']) + f"/{CTX['mark']}"
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT))
            return 'created'
        """,
    ),
    probe("mkdir in /tmp", "os.mkdir(f\"/tmp/{CTX['mark']}-dir\")\nreturn 'made'"),
    probe(
        "rename into /tmp",
        """
            open('moved', 'w').close()
            os.rename('moved', f"/tmp/{CTX['mark']}-moved")
            return 'moved'
        """,
    ),
    probe("mkfifo in /tmp", "os.mkfifo(f\"/tmp/{CTX['mark']}-fifo\")\nreturn 'made'"),
    probe(
        "a device node", "os.mknod('null', stat.S_IFCHR | 0o666, os.makedev(1, 3))\nreturn 'made'"
    ),
    probe("chmod a host file", "os.chmod(CTX['own_file'], 0o666)\nreturn 'changed'"),
    probe("truncate a host file", "os.truncate(CTX['own_file'], 0)\nreturn 'truncated'"),
    probe(
        "hard link to /etc/passwd",
        "os.link('/etc/passwd', 'passwd')\nreturn open('passwd').read(40)",
    ),
    probe("symbolic link out", "os.symlink('/etc/passwd', 'link')\nreturn open('link').read(40)"),
    probe("write the standard library", "return open(os.__file__, 'a')"),
    probe("become root", "os.setuid(0)\nreturn os.getuid()"),
    # the network
    probe(
        "TCP to a host listener",
        """
            import socket
            socket.create_connection(('127.0.0.1', CTX['tcp_port']), 1)
            return 'connected'
        """,
    ),
    probe(
        "UDP to a host listener",
        """
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(('127.0.0.1', CTX['udp_port']))
        s.send(b'x')
        s.settimeout(0.3)
        try:
            s.recv(1)
        except TimeoutError:
            return 'delivered (nothing refused it)'
        return 'answered'
        """,
    ),
    probe(
        "a host unix socket",
        """
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.connect(CTX['unix_path'])
            return 'connected'
        """,
    ),
    probe(
        "a host abstract socket",
        """
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.connect('\\0' + CTX['abstract'])
            return 'connected'
        """,
    ),
    probe("a socket pair", "import socket\nsocket.socketpair()\nreturn 'made'"),
    probe(
        "a netlink socket",
        "import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\nreturn 'made'",
    ),
    probe(
        "a raw packet socket",
        "import socket\nsocket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)\nreturn 'made'",
    ),
    probe(
        "out to the internet",
        """
        import socket
        s = socket.socket()
        s.settimeout(0.3)
        try:
            s.connect(('192.0.2.1', 80))
        except TimeoutError:
            return 'routed out (no answer)'
        return 'connected'
        """,
    ),
    # processes and signals
    probe(
        "os.system",
        """
            status = os.system('exit 7')
            if os.waitstatus_to_exitcode(status) == 7:
                return 'ran'
            raise OSError(status)
        """,
    ),
    probe("subprocess", "import subprocess\nreturn subprocess.run(['/bin/true']).returncode"),
    probe(
        "posix_spawn",
        "pid = os.posix_spawn('/bin/true', ['true'], {})\nos.waitpid(pid, 0)\nreturn 'spawned'",
    ),
    probe(
        "fork",
        "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nreturn 'forked'",
    ),
    probe(
        "unaudited fork_exec (_imp.create_builtin)",
        """
        import _imp, importlib.machinery
        spec = importlib.machinery.ModuleSpec('_posixsubprocess', None)
        native = _imp.create_builtin(spec)  # built in (Debian's Python): no import event
        if native is None or not hasattr(native, 'fork_exec'):  # an extension module
            spec.origin = [os.path.join(p, n) for p in sys.path if os.path.isdir(p)
                           for n in os.listdir(p) if n.startswith('_posixsubprocess.')][0]
            native = _imp.create_dynamic(spec)
        r, w = os.pipe()
        args = [[b'/bin/true'], [b'/bin/true'], True, (), None, None, -1, -1, -1, -1, -1, -1,
                r, w, False, False, -1, None, None, None, -1, None]
        try:
            pid = native.fork_exec(*args)
        except TypeError:
            pid = native.fork_exec(*args, False)
        os.waitpid(pid, 0)
        return 'ran /bin/true'
        """,
    ),
    probe("signal the parent", "os.kill(CTX['host_pid'], 0)\nreturn 'may signal it'"),
    probe("signal a uid 65534 process", "os.kill(CTX['victim_pid'], 0)\nreturn 'may signal it'"),
    probe("signal every process", "os.kill(-1, 0)\nreturn 'may signal some'"),
    probe(
        "signal init",
        """
            os.kill(1, 0)
            if os.getpid() == 1:
                raise LookupError('itself')
            return 'may signal it'
        """,
    ),
    probe(
        "a pidfd of a uid 65534 process",
        """
            import signal
            signal.pidfd_send_signal(os.pidfd_open(CTX['victim_pid']), 0)
            return 'may signal it'
        """,
    ),
    probe(
        "ptrace a uid 65534 process",
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.ptrace(0x4206, CTX['victim_pid'], 0, 0) == 0:  # PTRACE_SEIZE: never stops it
            return 'attached'
        raise OSError(ctypes.get_errno(), 'ptrace')
        """,
    ),
    probe("ptrace itself", "return sys_call('ptrace', 0, 0, 0, 0)"),  # PTRACE_TRACEME
    # the kernel's other doors (harmless arguments: each fails in the kernel when let through)
    probe("unshare a user namespace", "return sys_call('unshare', 0x10000000)"),
    probe("setns", "return sys_call('setns', -1, 0)"),
    probe("mount", "return sys_call('mount', 0, 0, 0, 0, 0)"),
    probe("keyctl", "return sys_call('keyctl', 0, -3, 0)"),  # the session keyring's id
    probe("bpf", "return sys_call('bpf', 0, 0, 0)"),
    probe("perf_event_open", "return sys_call('perf_event_open', 0, 0, -1, -1, 0)"),
    probe("userfaultfd", "return sys_call('userfaultfd', 0)"),
    probe("io_uring_setup", "return sys_call('io_uring_setup', 1, 0)"),
    probe("kexec_load", "return sys_call('kexec_load', 0, 0, 0, 0)"),
    probe("init_module", "return sys_call('init_module', 0, 0, 0)"),
    probe("sethostname", "return sys_call('sethostname', 0, 0)"),
    # past the hook: subinterpreters and native code
    probe(
        "a subinterpreter (_xxsubinterpreters)",
        """
        import _xxsubinterpreters as si
        si.run_string(si.create(), "open('sub1', 'w').write('ran')")
        return open('sub1').read()
        """,
    ),
    probe(
        "a subinterpreter (_testcapi)",
        """
        import _testcapi
        _testcapi.run_in_subinterp("open('sub2', 'w').write('ran')")
        return open('sub2').read()
        """,
    ),
    probe("ctypes", "import ctypes\nreturn ctypes.CDLL(None).getpid()"),
    # limits
    probe(
        "no process limit",
        """
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        if os.getuid() == 0 or soft == resource.RLIM_INFINITY:
            return f'uid {os.getuid()}, RLIMIT_NPROC {soft}'
        raise LookupError(f'uid {os.getuid()}, RLIMIT_NPROC {soft}')
        """,
    ),
    probe("a memory bomb", "x = bytearray(2**33)\nreturn 'allocated 8 GiB'"),
    probe(
        "an mmap bomb",
        "import mmap\nm = mmap.mmap(-1, 2**33)\nm[2**33 - 1] = 1\nreturn 'mapped 8 GiB'",
    ),
    probe(
        "a thread bomb",
        """
        import threading, time
        stop = threading.Event()
        threads = []
        try:
            for _ in range(1000):
                t = threading.Thread(target=stop.wait)
                t.start()
                threads.append(t)
        except RuntimeError as exc:
            raise RuntimeError(f'{len(threads)} threads: {exc}')
        finally:
            stop.set()
        return f'{len(threads)} threads'
        """,
    ),
    probe(
        "a 40 MiB file",
        """
        with open('big', 'wb') as f:
            for _ in range(40):
                f.write(bytes(2**20))
        return '40 MiB written'
        """,
    ),
    probe(
        "100 open files",
        """
        files = [open('many', 'w') for _ in range(100)]
        return f'{len(files)} open'
        """,
    ),
    probe(
        "the old dir_fd escape",
        """
        fd = os.open('.', os.O_RDONLY)
        os.makedirs('a/b/c/d/e/f/g/h', exist_ok=True)
        os.chdir('a/b/c/d/e/f/g/h')
        try:
            return os.read(os.open('../' * 8 + 'etc/passwd', os.O_RDONLY, dir_fd=fd), 40)
        finally:
            os.chdir(HOME)
        """,
    ),
]
# run with every layer only: harmful where nothing stops them (kept off the machine's memory,
# disk and process table when measuring the layers one by one)
FORK_BOMB = [
    probe(
        "a fork bomb",
        """
        children = 0
        try:
            while children < 10000:
                if os.fork() == 0:
                    os._exit(0)
                children += 1
        except OSError as exc:
            raise OSError(exc.errno, f'{children} forks: {exc}')
        return f'{children} forks'
        """,
    ),
]
# bounded by bubblewrap's tmpfs sizes: measured past the hook with bubblewrap only
FILLS = [
    probe(
        "fill /dev/shm",
        """
        written = 0
        for i in range(8):
            with open(f"/dev/shm/{CTX['mark']}-{i}", 'wb') as f:
                for _ in range(16):
                    f.write(bytes(2**20))
                    written += 1
        return f'{written} MiB'
        """,
    ),
    probe(
        "fill the work folder",
        """
        written = 0
        for i in range(8):
            with open(f'fill-{i}', 'wb') as f:
                for _ in range(16):
                    f.write(bytes(2**20))
                    written += 1
        return f'{written} MiB'
        """,
    ),
]
# a thread flips the working directory between the work folder and a folder 8 below it while
# the main thread opens '../' * 8 + target: lexically inside from below, /target from the top
RACE = """
import threading, time
os.makedirs('r/a/b/c/d/e/f/g', exist_ok=True)
deep = HOME + '/r/a/b/c/d/e/f/g'
done = threading.Event()
def flip():
    while not done.is_set():
        try:
            os.chdir(deep)
            os.chdir(HOME)
        except OSError:
            pass
thread = threading.Thread(target=flip)
thread.start()
errors = set()
end = time.monotonic() + 0.5
try:
    while time.monotonic() < end:
        try:
            os.close(os.open('../' * 8 + TARGET, MODE, 0o644))
            return 'opened ' + TARGET
        except OSError as exc:
            errors.add(type(exc).__name__ + ' ' + str(exc.errno))
finally:
    done.set()
    thread.join()
    os.chdir(HOME)
raise OSError(f'never opened in 0.5 s: {sorted(errors)}')
"""


def race(name: str, target: str, mode: str) -> Probe:
    code = f"TARGET = {target}\nMODE = {mode}\n" + RACE.strip()
    return probe(name, code)


PROBES += [
    race(
        "the cwd race (a process's environment)",
        "f\"proc/{CTX['holder_pid']}/environ\"",
        "os.O_RDONLY",
    ),
    probe(
        "a uid 65534 process's environment",
        """
        data = open(f"/proc/{CTX['victim_pid']}/environ", 'rb').read()
        return 'the secret' if CTX['secret'].encode() in data else 'read'
        """,
    ),
    probe(
        "a root process's environment",
        """
        data = open(f"/proc/{CTX['holder_pid']}/environ", 'rb').read()
        return 'the secret' if CTX['secret'].encode() in data else 'read'
        """,
    ),
]
# always last: when it is let through, the batch's process is replaced by one that says so
EXEC = probe(
    "exec", """os.execv('/bin/sh', ['sh', '-c', 'echo \\'["exec", "escaped", "ran sh"]\\''])"""
)
# without bubblewrap the race reaches what uid 65534 may write (GAPS): run with it only
PROBES_BWRAP_ONLY = [
    race(
        "the cwd race (create in /tmp)", "f\"tmp/{CTX['mark']}-race\"", "os.O_WRONLY | os.O_CREAT"
    ),
]
GAPS = {
    # known and documented (docs/tools.md, "What the sandbox does not stop"): without
    # bubblewrap, os.stat is not audited and the work folder's files are bounded one by one
    "bwrap": set(),
    "inner": {"metadata of a project file", "fill the work folder"},
}

PRELUDE = """\
import json, os, stat, sys
CTX = json.loads({context!r})
HOME = os.getcwd()
def sys_call(name, *args):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(CTX['syscalls'][name], *(ctypes.c_long(a) for a in args))
    error = ctypes.get_errno()
    if result >= 0 or error not in (1, 13, 38):  # EPERM, EACCES, ENOSYS: stopped
        return f'reached the kernel: {{result}}, errno {{error}}'
    raise OSError(error, os.strerror(error))
def report(name, function):
    try:
        detail = function()
    except BaseException as exc:
        how = 'hook' if type(exc).__name__ == 'SandboxViolation' else type(exc).__name__
        line = [name, 'contained', how + ': ' + str(exc)[:150]]
    else:
        line = [name, 'escaped', repr(detail)[:150]]
    os.chdir(HOME)
    print(json.dumps(line), flush=True)
"""


def snippet(probes: list[Probe], context: dict) -> str:
    parts = [PRELUDE.format(context=json.dumps(context))]
    for i, each in enumerate(probes):
        parts.append(f"def probe_{i}():\n" + textwrap.indent(each.code, "    "))
        parts.append(f"report({each.name!r}, probe_{i})")
    return "\n".join(parts) + "\n"


def batches(probes: list[Probe], size: int = 16) -> Iterator[list[Probe]]:
    for start in range(0, len(probes), size):
        yield probes[start : start + size]


LIMITS = {"cpu_s": 5, "wall_s": 20, "memory_mb": 256, "max_output_bytes": 65536}


def outcomes(output: str, probes: list[Probe]) -> dict[str, tuple[str, str]]:
    """name: (contained | escaped | lost, detail) from a batch's output (the tool's observation
    or stdout); a probe without its line was lost (the batch ended before it)."""
    seen = {}
    for line in output.splitlines():
        if line.startswith("["):
            name, outcome, detail = json.loads(line)
            seen[name] = (outcome, detail)
    found = {p.name: seen.get(p.name, ("lost", output[-300:])) for p in probes}
    for p in probes:  # the sandbox's own /dev/shm is not the host's
        outcome, detail = found[p.name]
        if (
            p.host_file
            and outcome == "escaped"
            and not Path(p.host_file.format(mark=MARK)).exists()
        ):
            found[p.name] = ("contained", f"only in the sandbox's own folder: {detail}")
    return found


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """What the probes aim at, and the check that none of it changed: listeners (TCP, UDP, a
    unix socket by path in a folder uid 65534 may enter, an abstract one), a process of uid
    65534 and one of root holding the secret in their environments, a file of the test's own,
    the secret in this process's environment too."""
    monkeypatch.setenv(SECRET_NAME, SECRET)
    own = Path(f"/tmp/{MARK}-own")
    own.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    own_file = own / "file"
    own_file.write_text("own")
    os.chmod(own_file, 0o644)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(own / "sock"))
    os.chmod(own / "sock", 0o777)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + MARK)
    abstract.listen()
    env = {"PATH": "/usr/bin:/bin", SECRET_NAME: SECRET}
    victim = subprocess.Popen(["sleep", "120"], env=env, user=NOBODY, group=NOBODY, extra_groups=[])
    holder = subprocess.Popen(["sleep", "120"], env=env)
    before = read_sysctls()
    context = {
        "host_pid": os.getpid(), "victim_pid": victim.pid, "holder_pid": holder.pid,
        "tcp_port": tcp.getsockname()[1], "udp_port": udp.getsockname()[1],
        "unix_path": str(own / "sock"), "abstract": MARK, "mark": MARK, "secret": SECRET,
        "project_file": str(Path(sandbox.__file__).resolve()), "own_file": str(own_file),
        "syscalls": SYSCALLS,
    }  # fmt: skip
    try:
        yield context
        # nothing on the host changed
        assert read_sysctls() == before
        assert victim.poll() is None and holder.poll() is None  # alive
        assert own_file.read_text() == "own" and stat.S_IMODE(own_file.stat().st_mode) == 0o644
        if context.get("measuring"):  # with layers left out, escapes are expected
            return
        for listener in (tcp, unix, abstract):
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        udp.setblocking(False)
        with pytest.raises(BlockingIOError):
            udp.recv(1)  # nothing arrived
        assert sorted(os.listdir(own)) == ["file", "sock"]
        assert left_behind() == []
    finally:
        for process in (victim, holder):
            process.kill()
            process.wait()
        for listener in (tcp, udp, unix, abstract):
            listener.close()
        remove_left_behind()
        subprocess.run(["rm", "-rf", "--", str(own)], check=False)


def read_sysctls() -> dict[str, str]:
    values = {}
    for path in SYSCTLS:
        try:
            values[path] = Path(path).read_text()
        except OSError as exc:  # write-only (sysrq-trigger) or missing: its errno
            values[path] = f"errno {exc.errno}"
    return values


def left_behind() -> list[Path]:
    folders = [Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path(sandbox.__file__).parent]
    return sorted(
        path
        for folder in folders
        for path in folder.glob(f"{MARK}*")
        if path != Path(f"/tmp/{MARK}-own")
    )


def remove_left_behind() -> None:
    """What an escape left (so that a failure, or a run with layers left out, leaves nothing)."""
    for path in left_behind():
        subprocess.run(["rm", "-rf", "--", str(path)], check=False)


def run_through_the_tool(
    probes: list[Probe], context: dict, bubblewrap: bool
) -> dict[str, tuple[str, str]]:
    tool = PythonTool(**LIMITS, bubblewrap=bubblewrap)
    found = {}
    for batch in batches(probes):
        observation = tool({"code": snippet(batch, context)})
        assert SECRET not in observation
        found.update(outcomes(observation, batch))
    return found


@WITH_AND_WITHOUT_BWRAP
def test_hostile_snippets_are_contained_and_the_host_is_unchanged(host, bubblewrap):
    if bubblewrap:
        assert "bwrap" in sandbox.isolation().layers, sandbox.isolation().note
    probes = [*PROBES, *FORK_BOMB, *FILLS, *(PROBES_BWRAP_ONLY if bubblewrap else []), EXEC]
    assert len({p.name for p in probes}) == len(probes) >= 60
    found = run_through_the_tool(probes, host, bubblewrap)
    gaps = GAPS["bwrap" if bubblewrap else "inner"]
    escaped = {name: detail for name, (outcome, detail) in found.items() if outcome != "contained"}
    assert {name: escaped[name][0] for name in escaped if name not in gaps} == {}, escaped
    assert set(escaped) == gaps  # a gap that closed: update GAPS and docs/tools.md


def run_with_layers_off(
    probes: list[Probe], context: dict, bubblewrap: bool, layers_off: tuple[str, ...]
) -> dict[str, tuple[str, str]]:
    found = {}
    for batch in batches(probes):
        result = run_python(
            snippet(batch, context), bubblewrap=bubblewrap, layers_off=layers_off, **LIMITS
        )
        assert not set(layers_off) & set(result.layers)
        assert SECRET not in result.stdout + result.stderr
        found.update(outcomes(result.stdout + result.stderr, batch))
    return found


# Past the hook (the audit hook left out: what code that gets past it can do), by design or as a
# documented gap (docs/tools.md): the rest of PROBES must stay contained by the other layers.
PAST_THE_HOOK = {
    # the interpreter's own folder (/root holds only its prefix), and what is harmless inside
    "bwrap": {"list /root", "a subinterpreter (_xxsubinterpreters)",
              "a subinterpreter (_testcapi)", "ctypes"},
    # what uid 65534 may read and write on the host; another uid 65534 process's environment
    "inner": {"read /etc/passwd", "read a project file", "list the parent's folder",
              "the parent's cmdline", "the machine's processes", "metadata of a project file",
              "create in /tmp", "create in /var/tmp", "create in /dev/shm", "mkdir in /tmp",
              "rename into /tmp", "symbolic link out", "the old dir_fd escape",
              "a uid 65534 process's environment", "a subinterpreter (_xxsubinterpreters)",
              "a subinterpreter (_testcapi)", "ctypes"},
}  # fmt: skip
# past the hook with Landlock too (a kernel that has it): what the code may reach is the work
# folder, the standard library and /usr, its own /proc; os.stat is not Landlock's
PAST_THE_HOOK_AND_LANDLOCK = {
    "bwrap": {"a subinterpreter (_xxsubinterpreters)", "a subinterpreter (_testcapi)", "ctypes"},
    "inner": {"metadata of a project file", "a subinterpreter (_xxsubinterpreters)",
              "a subinterpreter (_testcapi)", "ctypes"},
}  # fmt: skip
# what the seccomp filter stops on its own (past the hook, with or without bubblewrap)
SECCOMP_STOPS = {
    "a socket pair", "a netlink socket", "os.system", "subprocess", "posix_spawn", "fork",
    "unaudited fork_exec (_imp.create_builtin)", "exec", "ptrace itself",
    "unshare a user namespace", "setns", "mount", "keyctl", "bpf", "perf_event_open",
    "io_uring_setup", "mkfifo in /tmp", "a host unix socket", "signal a uid 65534 process",
    "signal every process", "a pidfd of a uid 65534 process", "ptrace a uid 65534 process",
}  # fmt: skip


@WITH_AND_WITHOUT_BWRAP
def test_what_each_layer_stops(host, bubblewrap):
    host["measuring"] = True
    mode = "bwrap" if bubblewrap else "inner"
    probes = [*PROBES, *FILLS, *PROBES_BWRAP_ONLY, EXEC] if bubblewrap else [*PROBES, EXEC]
    landlock = "landlock" in sandbox.isolation(bubblewrap=bubblewrap).layers
    found = {(): run_through_the_tool(probes, host, bubblewrap)}
    for off in [("audit_hook",), ("audit_hook", "seccomp"), ("audit_hook", "landlock"),
                ("audit_hook", "landlock", "seccomp")]:  # fmt: skip
        found[off] = run_with_layers_off(probes, host, bubblewrap, off)
        remove_left_behind()
    escaped = {
        off: {name for name, (outcome, _) in result.items() if outcome != "contained"}
        for off, result in found.items()
    }
    past_the_hook = escaped[("audit_hook",)]
    assert escaped[()] == GAPS[mode] & {p.name for p in probes}
    assert past_the_hook <= PAST_THE_HOOK[mode], {
        n: found[("audit_hook",)][n] for n in past_the_hook
    }
    if landlock:
        assert past_the_hook <= PAST_THE_HOOK_AND_LANDLOCK[mode]
    assert not SECCOMP_STOPS & past_the_hook
    # what the seccomp filter stops alone (it let through without it, past the hook): these
    # reach the kernel without it; bubblewrap, the uid and Landlock stop the rest in the kernel
    seccomp_alone = escaped[("audit_hook", "seccomp")] - past_the_hook
    assert {"fork", "a netlink socket", "keyctl"} <= seccomp_alone <= SECCOMP_STOPS
    landlock_alone = escaped[("audit_hook", "landlock")] - past_the_hook
    if landlock and not bubblewrap:  # the host's files, as uid 65534 may reach them
        assert {"read /etc/passwd", "create in /tmp", "the parent's cmdline"} <= landlock_alone
    if os.environ.get("KEEL_HOSTILE_TABLE"):
        bare = escaped[("audit_hook", "landlock", "seccomp")]
        hook = {n for n, (o, d) in found[()].items() if o == "contained" and d.startswith("hook:")}
        print(
            f"\n{mode}: {len(probes)} probes; contained with every layer "
            f"{len(probes) - len(escaped[()])}; the audit hook stops {len(hook)}; past the hook "
            f"contained {len(probes) - len(past_the_hook)}; seccomp alone stops "
            f"{len(seccomp_alone)}; Landlock alone stops {len(landlock_alone)}; without hook, "
            f"seccomp and Landlock contained {len(probes) - len(bare)}"
        )
        print("seccomp alone:", sorted(seccomp_alone))
        print("Landlock alone:", sorted(landlock_alone))
        print("past the hook:", sorted(past_the_hook))
        for p in probes:
            print(f"{p.name:45s} | " + " | ".join(
                f"{found[off][p.name][0]:9s} {found[off][p.name][1][:30]:30s}" for off in found
            ))  # fmt: skip


@WITH_AND_WITHOUT_BWRAP
@pytest.mark.parametrize(
    ("code", "observation"),
    [
        ("print(", '  File "main.py", line 1\n    print(\n         ^\n'
                   "SyntaxError: '(' was never closed"),
        ("print(1)\0", "SyntaxError: source code string cannot contain null bytes"),
        ("x = '\udc80'\n", '  File "main.py", line 1\n    x = \'\ufffd\ufffd\ufffd\'\n'
                            "             ^\nSyntaxError: (unicode error) 'utf-8' codec can't "
                            "decode byte 0xed in position 0: invalid continuation byte"),
    ],
    ids=["syntax-error", "nul-byte", "lone-surrogate"],
)  # fmt: skip
def test_bad_source_is_the_programs_syntax_error(bubblewrap, code, observation):
    """A syntax error, a NUL byte, a lone surrogate: the program's SyntaxError, shown as any
    program's error is (the bootstrap used to crash on the first two, the tool to raise on the
    third)."""
    result = run_python(code, bubblewrap=bubblewrap, cpu_s=1, wall_s=5)
    assert (result.stdout, result.stderr, result.exit_code, result.error) == (
        "",
        observation + "\n",
        1,
        None,
    )
    assert PythonTool(bubblewrap=bubblewrap)({"code": code}) == (
        f"[stderr]\n{observation}\n[exit code 1]"
    )
