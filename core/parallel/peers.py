"""Lost processes: the processes of a run leave together, or name the lost one (docs/scaling.md#when-a-process-is-lost).

JAX's coordination service declares a process lost when its heartbeats stop for
`HEARTBEAT_TIMEOUT_S`. By default the JAX client then aborts every other process with XLA's fatal
message and a C++ stack trace. The client's missed-heartbeat callback cannot be a Python function
in this jaxlib (the status it passes has no Python type: the process dies of std::bad_cast
instead), so dsv4 starts the service as recoverable (`jax_enable_recoverability`: a lost process is
reported to whoever asks, not fatal) and watches it:

- `watch(report)`: a daemon thread asks the service every `WATCH_PERIOD_S` which processes are
  alive (`get_live_nodes`, which answers once every live process has asked, or once a silent one is
  declared lost). A process gone without a goodbye is lost: `report(line)` once, then exit with
  ClusterError's code. A peer whose goodbye says "error" stops the others the same way.
- `leave(how)`: this process's goodbye under the key dsv4/left/<id>: "done" at an agreed end of the
  run (every process stops after the same step), "stopped" when it leaves for a peer's failure,
  "error" otherwise (at exit, unless it said goodbye before).
- At exit, process 0, which hosts the service, waits for the others to disconnect first (up to
  `SHUTDOWN_TIMEOUT_S`): a recoverable service keeps no shutdown barrier, and a client whose
  service vanished aborts.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable

import jax

from core.errors import ClusterError

# The service declares a process lost after this many seconds without a heartbeat (JAX's default);
# DSV4_HEARTBEAT_TIMEOUT_S overrides it (the tests' kill -9 case uses a short one).
HEARTBEAT_TIMEOUT_S = 100
HEARTBEAT_ENV = "DSV4_HEARTBEAT_TIMEOUT_S"
WATCH_PERIOD_S = 2.0          # between two questions to the service
SHUTDOWN_TIMEOUT_S = 300      # process 0 waits this long at exit for the others to disconnect
_LEFT = "dsv4/left/"


def heartbeat_timeout_s() -> int:
    """`HEARTBEAT_TIMEOUT_S`, or the `DSV4_HEARTBEAT_TIMEOUT_S` environment variable."""
    raw = os.environ.get(HEARTBEAT_ENV, "")
    return int(raw) if raw.strip().isdigit() and int(raw) > 0 else HEARTBEAT_TIMEOUT_S


class _State:
    stopped = threading.Event()   # set once this process leaves: the watch ends, nothing more is reported
    ending = threading.Event()    # the watch is ending this process with its line
    claimed = False               # a failed collective's own line is this process's one (`await_verdict`)
    line = threading.Lock()       # who says the one line: the watch or the failed collective
    left: str | None = None
    report: Callable[[str], None] | None = None
    progress: Callable[[], str] = staticmethod(lambda: kept(None))


def _client():
    from jax._src import distributed  # the client jax.distributed.initialize made (no public handle)

    return distributed.global_state.client


def kept(last_saved: int | None) -> str:
    """The last complete checkpoint, for a line that stops a multi-process run."""
    return (f"checkpoint step {last_saved} is the last complete one" if last_saved is not None
            else "no checkpoint was written yet")


def set_progress(describe: Callable[[], str]) -> None:
    """What a lost-process line says about the run's checkpoints, e.g. "checkpoint step 8 is the last
    complete one" (core/train/run.py sets it)."""
    _State.progress = staticmethod(describe)


def joined() -> None:
    """After `jax.distributed.initialize` (core/parallel/mesh.py): leave in order at exit."""
    atexit.register(_at_exit)


def watch(report: Callable[[str], None]) -> None:
    """Start watching the other processes of this multi-process run (after `joined`)."""
    _State.report = report
    threading.Thread(target=_watch, name="dsv4-peers", daemon=True).start()


def leave(how: str) -> None:
    """Say goodbye ("done", "stopped" or "error", module docstring) once; the watch ends."""
    _State.stopped.set()
    if _State.left is not None or jax.process_count() == 1 or _client() is None:
        return
    _State.left = how
    try:
        _client().key_value_set(f"{_LEFT}{jax.process_index()}", how)
    except Exception:  # noqa: BLE001  (the service is gone: nobody is left to tell)
        pass


def await_verdict() -> None:
    """Before a failed collective is reported: give the watch the time to declare a lost peer (it then
    ends this process with its own line, naming the process). Returns when no peer was declared lost in
    that time; the caller's line is then the process's only one (a later verdict of the watch says nothing)."""
    if _State.report is None or _State.left is not None:
        return
    deadline = time.monotonic() + heartbeat_timeout_s() + 2 * WATCH_PERIOD_S
    while time.monotonic() < deadline and not _State.ending.is_set():
        time.sleep(0.1)
    with _State.line:
        if not _State.ending.is_set():  # no peer declared lost in time: the caller's line, and no other
            _State.claimed = True
            return
    while True:  # the watch is ending the process with its line
        time.sleep(1)


def _goodbyes(client) -> dict[int, str]:
    return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(_LEFT)}


def _watch() -> None:
    client, me, count = _client(), jax.process_index(), jax.process_count()
    failing_since = None
    while not _State.stopped.wait(WATCH_PERIOD_S):
        try:
            failed = [p for p, how in _goodbyes(client).items() if how == "error" and p != me]
            if failed:  # this process may be failing alike: give its own line the time to come first
                if _State.stopped.wait(WATCH_PERIOD_S):
                    return
                return _end(f"process {failed[0]} of {count} stopped with an error (its own output says which)")
            live = client.get_live_nodes(list(range(count)))
            gone = set(range(count)) - set(live) - set(_goodbyes(client))
        except Exception as e:  # noqa: BLE001  (a slow answer on a loaded host, or the service is gone)
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since < heartbeat_timeout_s():
                continue
            cause = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            return _end(f"process 0 of {count}, which holds the coordination service, cannot be reached "
                        f"({cause[:200]})", reachable=False)
        failing_since = None
        if gone:
            return _end(f"process {min(gone)} of {count} was lost: it sent no heartbeat for {heartbeat_timeout_s()} s "
                        "(killed, or its host failed)")


def _end(what: str, reachable: bool = True) -> None:
    with _State.line:
        if _State.stopped.is_set() or _State.claimed:
            return
        _State.ending.set()
    leave("stopped")
    if _State.report is not None:
        _State.report(f"{what}; {_State.progress()}: rerun the same command on every process to resume from it.")
    sys.stdout.flush()
    sys.stderr.flush()
    if reachable:  # a client whose service is gone aborts when it disconnects
        _disconnect()
    os._exit(ClusterError.exit_code)


def _at_exit() -> None:
    leave("error")  # a goodbye said earlier ("done", "stopped") stands
    _disconnect()


def _disconnect() -> None:
    """Process 0 waits for the others to disconnect, then everyone disconnects (bounded)."""
    client = _client()
    if client is None:
        return
    me, count = jax.process_index(), jax.process_count()

    def run():
        try:
            if me == 0:
                while set(client.get_live_nodes(list(range(count)))) - {0}:
                    time.sleep(WATCH_PERIOD_S / 20)
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001  (a peer or the service is gone already)
            pass

    thread = threading.Thread(target=run, name="dsv4-leave", daemon=True)
    thread.start()
    thread.join(SHUTDOWN_TIMEOUT_S if me == 0 else WATCH_PERIOD_S * 5)
