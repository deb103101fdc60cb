"""The stage control channel's framing: headers and arrays round-trip exactly, nothing is unpickled."""

from __future__ import annotations

from multiprocessing.connection import Pipe

import numpy as np

from jaxcpp.pipe import wire


def test_header_and_arrays_round_trip():
    a, b = Pipe()
    arrays = [np.arange(12, dtype=np.int32).reshape(3, 4), np.linspace(0, 1, 5, dtype=np.float32),
              np.zeros((0, 7), np.float32), np.array(7, np.uint32)]
    wire.send(a, {"op": "step", "id": 3, "flags": [True, False]}, arrays)
    header, got = wire.recv(b)
    assert header == {"op": "step", "id": 3, "flags": [True, False]}
    assert len(got) == len(arrays)
    for g, want in zip(got, arrays, strict=True):
        assert g.dtype == want.dtype and g.shape == want.shape
        np.testing.assert_array_equal(g, want)


class _CreatesAFileWhenUnpickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # unpickling calls open(path, "w"): a side effect the test can see
        return open, (self.path, "w")


def test_a_pickle_is_not_executed(tmp_path):
    """A peer that sends a pickle gets a parse error, never its code run (recv only reads JSON + bytes)."""
    import pickle

    import pytest

    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_CreatesAFileWhenUnpickled(str(marker)))
    pickle.loads(payload).close()  # the control: unpickling this payload does create the file
    assert marker.exists()
    marker.unlink()
    a, b = Pipe()
    a.send_bytes(payload)
    with pytest.raises(Exception):  # noqa: B017 - any parse error; what matters is that nothing ran
        wire.recv(b)
    assert not marker.exists(), "recv unpickled what the peer sent"
