"""Starting the HTTP front end leaves the program's logging alone: uvicorn's default log config ran
`logging.config.dictConfig`, which closes every handler that exists. absl's handler (imported with flax)
closes its stream when that is no longer `sys.stderr`, so under pytest it closed the session's captured
stderr and a later test failed with "I/O operation on closed file" (`make test-fast` stopped in
tests/serving/test_cli.py)."""

from __future__ import annotations

import io
import logging

from tests.serving.fakes import fake_engine


class _Watched(logging.StreamHandler):
    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


def test_the_http_front_end_closes_no_handler_of_the_program(serve) -> None:
    handler = _Watched(io.StringIO())  # exists, as absl's does, without being attached to a logger
    root_handlers = list(logging.getLogger().handlers)
    server = serve(fake_engine())
    assert server.http_port
    assert not handler.closed, "starting uvicorn closed a handler the program owns"
    assert logging.getLogger().handlers == root_handlers
    handler.close()
