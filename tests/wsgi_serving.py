"""Serve a WSGI app (the dashboard) with waitress on a loopback port, in the test's process.

Waitress is not stopped safely by ``server.close()`` from another thread while ``server.run()``
loops: that closes its wake-up pipe at once, but a connection the browser keeps alive stays in
the loop, and the next request on it makes waitress write a byte to the pipe's old descriptor
number. By then the test process may have reused that number: a later ``subprocess.Popen``
took it for the pipe that reports a failed exec, read the stray byte as an error and waited for
ever on a child that had started fine (a CI run hung on it). The task threads were left running
too. So the server is stopped in order: its task threads first (no request is being answered
after that), then every socket and the pipe closed by the loop's own thread, then that thread
joined.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: seconds the loop thread may take to close everything and end
STOP_WITHIN_S = 30.0


@contextmanager
def serving_wsgi(app: Any, *, threads: int = 4) -> Iterator[str]:
    """The URL (``http://127.0.0.1:PORT``, no trailing slash) of ``app`` served on its own
    thread until exit."""
    from waitress import create_server

    server: Any = create_server(app, host="127.0.0.1", port=0, threads=threads)
    loop = threading.Thread(target=server.run, name="wsgi-loop", daemon=True)
    loop.start()
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        stop(server, loop)


def stop(server: Any, loop: threading.Thread) -> None:
    """Stop a waitress ``server`` whose ``run()`` loops on the thread ``loop``, as the module's
    docstring says."""
    server.task_dispatcher.shutdown()
    done = threading.Event()

    def close_all() -> None:  # runs on the loop's thread, which then finds its map empty
        try:
            for channel in list(server._map.values()):
                if channel is not server and channel is not server.trigger:
                    channel.close()
            server.close()  # the listening socket, then the pipe this call came through
        finally:
            done.set()

    server.trigger.pull_trigger(close_all)
    loop.join(STOP_WITHIN_S)
    if loop.is_alive() or not done.is_set():
        raise RuntimeError(f"the WSGI server did not stop within {STOP_WITHIN_S:g} s")
