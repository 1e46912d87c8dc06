"""The pipe between an engine pool (keel.rollout.pool) and one engine's process: the pool's
handle on the process and its pipe (`EngineHandle`), a request sent (`send_request`: a weight
bucket as a header and its raw bytes, `pack_bucket`; the engine rebuilds the tensors as views,
`unpack_bucket`) and its answer read (`read_answer`: the result, or the engine's exception
raised here with its traceback as a note, `send_error` on the engine's side; `EngineDied` when
the process is gone), and the process ended (`kill_engine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

ALIGN_BYTES = 16  # every tensor of a bucket starts at a multiple of this (any dtype's size)


class EngineDied(Exception):
    """One engine's process is gone (its pipe closed)."""


# ------------------------------------------------------------------- buckets over a pipe
def pack_bucket(
    weights: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], torch.Tensor]:
    """(header, payload): every tensor's bytes one after the other in one uint8 tensor (the
    bucket's one copy), each at an offset aligned to ALIGN_BYTES (so that the receiver views
    them in their dtype), and per tensor (name, dtype, shape, offset, byte count)."""
    header = []
    offset = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        header.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                       offset, nbytes))  # fmt: skip
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    payload = torch.zeros(offset, dtype=torch.uint8)
    for (_, tensor), (_, _, _, start, nbytes) in zip(weights, header, strict=True):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        payload[start : start + nbytes] = flat
    return header, payload


def unpack_bucket(
    header: Sequence[tuple[str, str, tuple[int, ...], int, int]], payload: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """`pack_bucket`'s tensors, as views of `payload` (no copy)."""
    out = []
    for name, dtype, shape, offset, nbytes in header:
        raw = payload[offset : offset + nbytes]
        out.append((name, raw.view(getattr(torch, dtype)).reshape(shape)))
    return out


def send_error(conn: Connection, error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    try:
        conn.send(("error", (error, text)))
    except Exception:  # an exception that does not pickle
        conn.send(("error", (RuntimeError(f"{error!r}"), text)))


@dataclasses.dataclass
class EngineHandle:
    """One engine's process and pipe; `lock` serialises the pipe's request/answer pairs."""

    index: int
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    alive: bool = True
    joining: bool = False  # a replacement starting: it takes the next push, then requests
    routed: bool = True  # the router gives it prompts (a replacement: once its push is done)
    requests: int = 0  # rows served since the last metrics()
    tokens: int = 0  # tokens generated since the last metrics()
    busy_s: float = 0.0  # seconds spent generating since the last metrics()
    queue_max: int = 0  # the most rows given to it at once since the last metrics()


def send_request(handle: EngineHandle, op: str, args: tuple[Any, ...], payload: Any = None) -> None:
    """A request down the engine's pipe (a bucket: its header and byte count, then its bytes)."""
    try:
        if op == "bucket":
            (header,) = args
            handle.conn.send((op, (header, sum(entry[4] for entry in header))))
            if payload is not None and payload.numel():
                handle.conn.send_bytes(payload.numpy().data)
        else:
            handle.conn.send((op, args))
    except (OSError, EOFError) as e:  # BrokenPipeError: the process is gone
        raise EngineDied(f"vLLM engine {handle.index} is gone") from e


def read_answer(handle: EngineHandle, timeout: float | None = None) -> Any:
    """The engine's answer to its current request: its result, or its error raised here."""
    try:
        if timeout is not None and not handle.conn.poll(timeout):
            raise TimeoutError(f"vLLM engine {handle.index} did not start in {timeout:.0f} s")
        kind, value = handle.conn.recv()
    except (OSError, EOFError) as e:
        raise EngineDied(f"vLLM engine {handle.index} is gone") from e
    if kind == "error":
        error, text = value
        raise _with_note(error, f"in vLLM engine {handle.index}:\n{text}")
    return value


def _with_note(error: BaseException, note: str) -> BaseException:
    error.add_note(note)
    return error


def kill_engines(handles: Sequence[EngineHandle]) -> None:
    for handle in handles:
        with contextlib.suppress(Exception):
            kill_engine(handle)


def kill_engine(handle: EngineHandle) -> None:
    """End the engine's process (if still running) and reap it; its pipe is closed."""
    handle.alive = False
    process = handle.process
    if process.is_alive():
        process.kill()
    process.join(5.0)
    with contextlib.suppress(Exception):
        handle.conn.close()
