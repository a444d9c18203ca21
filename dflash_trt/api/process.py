# SPDX-License-Identifier: Apache-2.0
"""The embedded LLM in a process of its own, behind the interface a server talks to (api/serving.py).

Why: inside a server, the engine thread shares its interpreter with the response path (the Triton
stub's event loop, its metrics thread, the tokenizer pool). Every ATen call of a round releases the
GIL and takes it back, and each time another thread may hold it: on `tiny` a served round took 2.2-3.1
ms against 1.4-1.8 ms in process. With the engine in a child process (the layout of vLLM's EngineCore
and of TensorRT-LLM's executor workers), the round runs on an interpreter with nothing else to do.
Measured: bench/README.md, "The engine in a process of its own".

`ProcessLLM(**llm_args)` starts `python -m dflash_trt.api.process`, builds `LLM(**llm_args)` there and
proxies `generate_async`, `shutdown`, `engine_error`, `get_stats` and `drain_round_times`. Requests are
tokenized and validated once, by the child's LLM: a bad request raises the same RequestError (field
and hint included) from `generate_async` here.

Wire (pickled tuples over multiprocessing.connection on two os.pipe()s):
    parent -> child  ("init", llm_args) once, then ("submit", key, inputs, sampling_params, streaming),
                     ("abort", key), ("shutdown",)
    child -> parent  ("ready", pid, stats) or ("failed", exc) once, then ("accepted", key, request_id, prompt,
                     prompt_ids) or ("rejected", key, exc); ("out", [output, ...]): one message per
                     engine step, with what the parent's handles keep (_ChildHandle), each output in
                     the compact form of api/output_codec.py;
                     ("dead", cause); ("stats", stats, round_times) every STATS_PERIOD_S while something
                     changed; ("log", level, name, text)
Lifetime: the child ignores SIGINT and SIGTERM (a signal to the server's process group must not end the
engine under requests that are still draining); it exits on ("shutdown",), after failing what is still
in flight, or when its parent is gone (its end of the pipe reads EOF). A child that dies any other way
(killed, a crash in native code) makes `engine_error` name its exit, and every request in flight ends
with EngineDeadError at once, as when the engine thread dies in process.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, cast

from dflash_trt.api.handle import GenerationHandle, Wakes
from dflash_trt.api.llm import LLM
from dflash_trt.api.output_codec import OutputDecoder, OutputEncoder
from dflash_trt.api.outputs import RequestOutput
from dflash_trt.errors import DFlashTrtError, EngineDeadError
from dflash_trt.utils.child import child_env, module_command

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.1  # the child's counters reach the parent at most this late
SHUTDOWN_TIMEOUT_S = 45.0  # the child's LLM.shutdown() joins its engine thread for up to 30 s


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "the engine process closed its pipe but is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the engine process was killed by {name}"
    return f"the engine process exited with code {returncode}"


class ProcessLLM:
    """A ServingLLM whose LLM runs in a child process (module docstring)."""

    def __init__(self, **llm_args: Any) -> None:
        # Two locks, so that no thread waits on the pipe while holding the state: the reader only ever
        # takes _lock, and a send that blocks on a full pipe holds only _tx_lock.
        self._lock = threading.Lock()  # _live, _replies, _stats, _round_times, _closed, _dead, _link_open
        self._tx_lock = threading.Lock()
        self._replied = threading.Condition(self._lock)
        self._live: dict[int, GenerationHandle] = {}  # key -> handle, until its final output
        self._replies: dict[int, tuple[Any, ...]] = {}  # key -> ("accepted" | "rejected", ...)
        self._decoder = OutputDecoder()  # the reader thread's
        self._keys = itertools.count()
        self._stats: dict[str, Any] = {}
        self._round_times: list[float] = []
        self._closed = False  # shutdown() was called
        self._dead: str | None = None
        self._link_open = True
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                module_command("dflash_trt.api.process", str(to_child_r), str(from_child_w)),
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                env=child_env(),
            )
        except BaseException:
            for fd in (to_child_w, from_child_r):
                os.close(fd)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._tx = Connection(to_child_w, readable=False)
        self._rx = Connection(from_child_r, writable=False)
        try:
            self._tx.send(("init", llm_args))
            self.pid = self._await_ready()
        except BaseException:
            self._proc.kill()
            self._proc.wait()
            self._tx.close()
            self._rx.close()
            raise
        self._reader = threading.Thread(target=self._read, name="dflash-engine-link", daemon=True)
        self._reader.start()

    def _await_ready(self) -> int:
        """Relay the child's logs until it reports its LLM built; raise what it raised otherwise."""
        while True:
            try:
                msg = self._rx.recv()
            except (EOFError, OSError):
                code = self._proc.wait()
                raise DFlashTrtError(
                    f"{describe_exit(code)} while it loaded the model",
                    hint="see the engine's log above (out of memory? a crash in native code?)",
                ) from None
            if msg[0] == "ready":
                self._stats = msg[2]
                return int(msg[1])
            if msg[0] == "failed":
                self._proc.wait(timeout=10)
                raise msg[1]
            if msg[0] == "log":
                _relay_log(*msg[1:])

    # --- requests --------------------------------------------------------------------------------------
    def generate_async(
        self, inputs: Any, sampling_params: Any = None, streaming: bool = False
    ) -> GenerationHandle:
        """Queue one request in the child; its RequestError (a bad request) is raised here."""
        with self._lock:
            self._check_open()
            key = next(self._keys)
            # Registered before it is sent: the child may publish outputs before it answers.
            handle = GenerationHandle(
                prompt=None,
                prompt_ids=[],
                sampling_params=sampling_params,
                streaming=streaming,
                on_abort=functools.partial(self._abort, key),
            )
            self._live[key] = handle
        self._send(("submit", key, inputs, sampling_params, streaming))
        with self._lock:
            while key not in self._replies and self._link_open:
                self._replied.wait()
            reply = self._replies.pop(key, None)
            if reply is None:  # the child went away first; the reader has failed the handle
                self._live.pop(key, None)
                self._check_open()
                raise EngineDeadError("the engine process went away", hint="restart the server")
            if reply[0] == "rejected":
                self._live.pop(key, None)
                raise reply[2]
        _, _, handle.request_id, handle.prompt, handle.prompt_token_ids = reply
        return handle

    def _abort(self, key: int, _handle: GenerationHandle) -> None:
        self._send(("abort", key))

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(
                f"the engine is dead: {self._dead}", hint="create a new LLM (restart the server)"
            )
        if self._closed:
            raise DFlashTrtError("the LLM was shut down", hint="create a new LLM")

    def _send(self, msg: tuple[Any, ...]) -> None:
        # OSError: the child is gone; the reader fails what is left (and a late abort has no work)
        with self._tx_lock, contextlib.suppress(OSError):
            self._tx.send(msg)

    # --- the child's messages ----------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._rx.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not unpickle here: skip it, keep reading
                log.exception("engine process link: could not read a message")
                continue
            try:
                self._dispatch(msg)
            except (
                Exception
            ):  # one bad message must not stop the reading: the child would block on a full pipe
                log.exception("engine process link: could not handle a %r message", msg[0])
        self._link_closed()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        """One message from the child (the wire format is in the module docstring)."""
        kind = msg[0]
        if kind == "out":
            wakes = Wakes()
            try:
                for wire in msg[1]:
                    self._push(wire, wakes)
            finally:  # what was delivered reaches its consumers whatever failed after it
                wakes.send()
        elif kind in ("accepted", "rejected"):
            with self._lock:
                self._replies[msg[1]] = msg
                self._replied.notify_all()
        elif kind == "stats":
            with self._lock:
                self._stats = msg[1]
                self._round_times.extend(msg[2])
        elif kind == "dead":
            with self._lock:
                if self._dead is None:
                    self._dead = msg[1]
        elif kind == "log":
            _relay_log(*msg[1:])

    def _push(self, wire: tuple[Any, ...], wakes: Wakes) -> None:
        """One output to its request's handle (decoded even when nobody waits for it: the decoder
        keeps what later outputs build on)."""
        try:
            key, out = self._decoder.decode(wire)
        except Exception:  # a bug in the codec: end that request explicitly, never leave it waiting
            log.exception("engine process link: could not decode an output of request key %r", wire[0])
            self._decoder.forget(wire[0])
            with self._lock:
                handle = self._live.pop(wire[0], None)
            if handle is not None:
                handle.fail("the engine process sent an output this server could not decode")
            return
        handle = self._live.get(key)
        if handle is None:
            return
        handle.prompt, handle.prompt_token_ids = out.prompt, out.prompt_token_ids
        if out.finished:
            with self._lock:
                self._live.pop(key, None)
        handle.push(out, wakes)

    def _link_closed(self) -> None:
        """The child's end is closed: it exited (asked to, or not). Fail whatever is still pending."""
        try:
            code = self._proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            self._link_open = False
            if not self._closed and self._dead is None:
                self._dead = describe_exit(code)
                log.error("%s: every request in flight fails; new requests are refused", self._dead)
            cause = self._dead or "the LLM was shut down"
            handles = list(self._live.values())
            self._live.clear()
            self._replied.notify_all()
        for handle in handles:
            handle.fail(cause)

    # --- ServingLLM ---------------------------------------------------------------------------------------
    @property
    def engine_error(self) -> str | None:
        """None while the child's engine serves (or after a clean shutdown); else why it stopped."""
        return self._dead

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)

    def drain_round_times(self) -> list[float]:
        with self._lock:
            times, self._round_times = self._round_times, []
        return times

    def shutdown(self) -> None:
        """Shut the child's LLM down (requests in flight end with EngineDeadError) and wait for it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._send(("shutdown",))
        try:
            self._proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "the engine process did not exit within %.0f s of shutdown: killed", SHUTDOWN_TIMEOUT_S
            )
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10)
        with self._tx_lock:
            self._tx.close()
        self._rx.close()

    def __enter__(self) -> ProcessLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _relay_log(level: int, name: str, text: str) -> None:
    logging.getLogger(name).log(level, "%s", text)


# --- the child ------------------------------------------------------------------------------------------
class _Link:
    """The child's sending end. Messages from any of its threads leave in the order they were sent,
    pickled and written by one writer thread: the engine thread hands over a step's outputs and goes
    on with the next round instead of pickling them and waiting on the pipe (the parent's reader may
    be slow to take them). `close` sends what is queued and stops the writer."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._encoder = OutputEncoder()
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="dflash-link-writer", daemon=True)
        self._writer.start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self._queue.put(msg)

    def close(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        self._queue.put(None)
        self._writer.join(timeout)

    def _write(self) -> None:
        while (msg := self._queue.get()) is not None:
            try:
                if msg[0] == "out":  # coded here: one thread codes every output, in the pipe's order
                    msg = ("out", [self._encoder.encode(key, out) for key, out in msg[1]])
                self._conn.send(msg)
            except OSError:  # the parent is gone; the main thread reads EOF and shuts the engine down
                continue
            except Exception:  # a message that does not code or pickle: say so, keep the link
                log.exception("engine process link: could not send a %r message", msg[0])
                if msg[0] == "out":
                    self._encoder.forget([wire[0] for wire in msg[1]])


class _PipeLogHandler(logging.Handler):
    def __init__(self, link: _Link) -> None:
        super().__init__()
        self._link = link

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._link.send(("log", record.levelno, record.name, self.format(record)))
        except Exception:
            self.handleError(record)


class _ChildHandle(GenerationHandle):
    """A request's handle in the child. What crosses the pipe is only what the parent's handle keeps:
    every output of a streaming request and the final one of any request (in the compact form of
    api/output_codec.py). The newest output stays here for fail(), which builds the error output from
    what the request had produced."""

    key: int
    link: _Link

    def forward(self, out: RequestOutput) -> tuple[int, RequestOutput] | None:
        """(key, out) when the parent has a use for `out`, else None."""
        self._last = out
        if not (self.streaming or out.finished):
            return None
        return self.key, out

    def push(self, item: RequestOutput, wakes: Wakes | None = None) -> None:  # fail() ends here
        wire = self.forward(item)
        if wire is not None:
            self.link.send(("out", [wire]))


class _ChildLLM(LLM):
    """The LLM in the child: each step's outputs go to the parent in one message, under the parent's
    keys; its death is announced before the requests it fails."""

    def __init__(self, link: _Link, **llm_args: Any) -> None:
        self._link = link
        self.next_key = -1  # the key of the request being submitted (only the main thread submits)
        self.by_key: dict[int, _ChildHandle] = {}
        super().__init__(**llm_args)

    def _new_handle(self, **fields: Any) -> GenerationHandle:
        handle = _ChildHandle(**fields)
        handle.key, handle.link = self.next_key, self._link
        self.by_key[handle.key] = handle
        return handle

    def _publish(self, outputs: list[tuple[GenerationHandle, RequestOutput]]) -> None:
        batch = []
        for handle, out in cast("list[tuple[_ChildHandle, RequestOutput]]", outputs):
            if out.finished:
                self.by_key.pop(handle.key, None)
            wire = handle.forward(out)
            if wire is not None:
                batch.append(wire)
        if batch:
            self._link.send(("out", batch))

    def _die(self, cause: str) -> None:
        self._link.send(("dead", cause))
        super()._die(cause)


def _child_main(rx_fd: int, tx_fd: int) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    rx = Connection(rx_fd, writable=False)
    link = _Link(Connection(tx_fd, readable=False))
    try:
        return _serve_parent(rx, link)
    finally:
        link.close()


def _serve_parent(rx: Connection, link: _Link) -> int:
    """Build the LLM the parent asks for, then take its requests until it says shutdown or goes away."""
    engine_log = logging.getLogger("dflash_trt")
    engine_log.addHandler(_PipeLogHandler(link))
    engine_log.setLevel(logging.INFO)
    engine_log.propagate = False
    try:
        _, llm_args = rx.recv()
    except (EOFError, OSError):
        return 1
    try:
        llm = _ChildLLM(link, **llm_args)
    except BaseException as exc:
        link.send(("failed", _portable(exc)))
        return 1
    sent = llm.get_stats()
    link.send(("ready", os.getpid(), sent))
    due = time.monotonic() + STATS_PERIOD_S
    while True:
        try:
            # the stats go out every STATS_PERIOD_S, however busy the parent keeps this loop
            ready = rx.poll(max(0.0, due - time.monotonic()))
            if time.monotonic() >= due:
                sent, due = _send_stats(llm, link, sent), time.monotonic() + STATS_PERIOD_S
            if not ready:
                continue
            msg = rx.recv()
        except (EOFError, OSError):  # the parent is gone: nobody is left to answer
            llm.shutdown()
            return 0
        if not _handle(llm, link, msg):
            _send_stats(llm, link, sent)
            return 0


def _handle(llm: _ChildLLM, link: _Link, msg: tuple[Any, ...]) -> bool:
    """One message from the parent; False once it said shutdown (the LLM is shut down then)."""
    kind = msg[0]
    if kind == "submit":
        _, key, inputs, sampling_params, streaming = msg
        llm.next_key = key
        try:
            handle = llm.generate_async(inputs, sampling_params, streaming=streaming)
        except BaseException as exc:
            llm.by_key.pop(key, None)
            link.send(("rejected", key, _portable(exc)))
            return True
        link.send(("accepted", key, handle.request_id, handle.prompt, handle.prompt_token_ids))
    elif kind == "abort":
        child = llm.by_key.get(msg[1])
        if child is not None:
            child.abort()
    elif kind == "shutdown":
        llm.shutdown()
        return False
    return True


def _send_stats(llm: LLM, link: _Link, sent: dict[str, Any]) -> dict[str, Any]:
    stats, times = llm.get_stats(), llm.drain_round_times()
    if times or stats != sent:
        link.send(("stats", stats, times))
    return stats


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a DFlashTrtError that names it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return DFlashTrtError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    status = _child_main(int(sys.argv[1]), int(sys.argv[2]))
    # Everything the parent needs has been sent: skip the interpreter's teardown, whose native
    # destructors (triton's bindings, at-exit hooks of the compiled rounds) only add noise here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
