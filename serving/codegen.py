"""Regenerate the committed gRPC/protobuf Python code from `proto/jaxcpp/v1/jaxcpp.proto`.

protoc writes `jaxcpp/v1/jaxcpp_pb2*.py` and imports `from jaxcpp.v1 import ...`, which would clash
with our own `jaxcpp` package; we flatten the files into `serving/gen/` and rewrite that import to
`jaxcpp.serving.gen`. The descriptor keeps its proto path (`jaxcpp/v1/jaxcpp.proto`), which is what
server reflection serves. `--check` exits 1 when the committed files are stale (a test runs it).

    python -m jaxcpp.serving.codegen [--check]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

SERVING_DIR = Path(__file__).resolve().parent
PROTO_ROOT = SERVING_DIR / "proto"
PROTO_FILE = "jaxcpp/v1/jaxcpp.proto"
GEN_DIR = SERVING_DIR / "gen"
GENERATED = ("jaxcpp_pb2.py", "jaxcpp_pb2.pyi", "jaxcpp_pb2_grpc.py")
_PROTOC_IMPORT = "from jaxcpp.v1 import jaxcpp_pb2"
_OUR_IMPORT = "from jaxcpp.serving.gen import jaxcpp_pb2"


def generate() -> dict[str, str]:
    """Run protoc and return {file name: fixed source} without touching the committed files."""
    from grpc_tools import protoc  # test-time dependency only (grpcio-tools)

    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                          f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO_ROOT / PROTO_FILE)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_ROOT / PROTO_FILE}")
        out = Path(tmp) / Path(PROTO_FILE).parent
        sources = {name: (out / name).read_text() for name in GENERATED}
    sources["jaxcpp_pb2_grpc.py"] = sources["jaxcpp_pb2_grpc.py"].replace(_PROTOC_IMPORT, _OUR_IMPORT)
    if _OUR_IMPORT not in sources["jaxcpp_pb2_grpc.py"]:
        raise RuntimeError("protoc's import line changed; update jaxcpp.serving.codegen")
    return sources


def stale_files(sources: dict[str, str]) -> list[str]:
    """Names of committed files that differ from freshly generated `sources`."""
    stale = []
    for name, text in sources.items():
        path = GEN_DIR / name
        if not path.exists() or path.read_text() != text:
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    args = parser.parse_args(argv)
    sources = generate()
    stale = stale_files(sources)
    if args.check:
        for name in stale:
            print(f"stale: serving/gen/{name} (run python -m jaxcpp.serving.codegen)")
        return 1 if stale else 0
    for name in stale:
        (GEN_DIR / name).write_text(sources[name])
        print(f"wrote serving/gen/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
