"""keel env serve (keel.envs.server) as a real process, spoken to over HTTP with the standard
library: the keel-env protocol's calls, a retried step answered from the server's record,
and its errors (version, unknown session, a turn out of order, the environment raising)."""

import json
import urllib.error
import urllib.request

import pytest

from keel.envs.remote import VERSION
from tests.envs.env_servers import EnvServerProcess


@pytest.fixture(scope="module")
def server():
    proc = EnvServerProcess("builtin:guess_number", "--kwargs", '{"turn_cost": 0.25}')
    yield proc
    proc.close()


def post(url, endpoint, body):
    """(status, reply) of a POST to /v1/<endpoint>."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v1/{endpoint}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def reset(url, session, answer="7"):
    example = {"prompt": "guess 1-9:", "answer": answer, "source": "t#0"}
    return post(url, "reset", {"version": VERSION, "session": session, "example": example})


def test_an_episode_over_the_protocol(server):
    with urllib.request.urlopen(f"{server.url}/v1/health", timeout=10) as response:
        health = json.loads(response.read())
    assert health["protocol"] == "keel-env" and health["version"] == VERSION
    assert health["environment"] == "builtin:guess_number"

    assert reset(server.url, "s1") == (200, {"version": VERSION, "session": "s1",
                                             "observation": None, "tools": None})  # fmt: skip
    step = {"version": VERSION, "session": "s1", "turn": 1, "response": "3"}
    status, first = post(server.url, "step", step)
    assert status == 200
    assert first == {
        "version": VERSION,
        "observation": " higher\n",
        "reward": -0.25,
        "done": False,
        "info": {},
    }  # fmt: skip  (the server's --kwargs apply)
    # a retried step (its reply lost) is answered from the record: not stepped twice
    assert post(server.url, "step", step) == (200, first)
    status, won = post(server.url, "step", {**step, "turn": 2, "response": "7"})
    assert (won["reward"], won["done"], won["info"]) == (1.0, True, {"won": 1})
    assert post(server.url, "close", {"version": VERSION, "session": "s1"})[1]["closed"] is True
    assert post(server.url, "close", {"version": VERSION, "session": "s1"})[1]["closed"] is False


def test_the_servers_errors_say_what_is_wrong(server):
    status, reply = post(server.url, "reset", {"version": 99, "session": "x"})
    assert status == 400 and reply["error"]["code"] == "version"
    assert "version 1" in reply["error"]["message"]

    step = {"version": VERSION, "session": "never", "turn": 1, "response": "3"}
    status, reply = post(server.url, "step", step)
    assert status == 404 and reply["error"]["code"] == "unknown_session"

    reset(server.url, "s2")
    status, reply = post(server.url, "step", {**step, "session": "s2", "turn": 3})
    assert status == 409 and "at turn 0" in reply["error"]["message"]

    # the environment itself refuses the example: 422 with its own message
    status, reply = reset(server.url, "s3", answer="seven")
    assert status == 422 and reply["error"]["code"] == "environment"
    assert "needs an integer answer" in reply["error"]["message"]

    body = {"version": VERSION, "session": "s4", "example": {"prompt": "p"}, "kwargs": {"wn": 2}}
    status, reply = post(server.url, "reset", body)
    assert status == 400 and "kwargs do not fit" in reply["error"]["message"]


def test_keel_env_serve_refuses_what_it_cannot_serve(capsys, server):
    from keel.cli.main import main

    assert main(["env", "serve", "builtin:nope", "--port", "0"]) == 2
    assert "ENV: unknown built-in environment 'builtin:nope'" in capsys.readouterr().err
    assert main(["env", "serve", "builtin:guess_number", "--kwargs", '{"wn": 1}']) == 2
    assert "--kwargs do not fit builtin:guess_number" in capsys.readouterr().err
    assert main(["env", "serve", "builtin:guess_number", "--kwargs", "[1]"]) == 2
    assert "--kwargs: must be a JSON object" in capsys.readouterr().err
    assert main(["env", "serve", "builtin:guess_number", "--port", str(server.port)]) == 2
    assert f"--port: cannot listen on 127.0.0.1:{server.port}" in capsys.readouterr().err


def test_a_full_server_answers_busy_and_the_client_gives_up_after_its_retries():
    from keel.data import Example
    from keel.envs.builtin import GuessNumberEnvironment
    from keel.envs.remote import EnvServerError, http_environment_factory
    from keel.envs.server import EnvServer

    server = EnvServer(GuessNumberEnvironment, max_sessions=1).start()
    try:
        make_env = http_environment_factory(server.url, {}, retries=1, backoff_s=0.0)
        first, second = make_env(), make_env()
        first.reset(Example(prompt="guess 1-9:", answer="4"))
        with pytest.raises(EnvServerError, match=r"reset failed 2 times.*HTTP 503: busy"):
            second.reset(Example(prompt="guess 1-9:", answer="4"))
        first.close()  # its room is free again
        assert second.reset(Example(prompt="guess 1-9:", answer="4")) is None
    finally:
        server.close()
