"""The committed generated code matches the proto, and the proto keeps its hygiene rules."""

from __future__ import annotations

from jaxcpp.serving import codegen
from jaxcpp.serving.gen import jaxcpp_pb2_grpc


def test_committed_generated_code_is_up_to_date() -> None:
    """grpcio-tools is a declared test dependency, pinned to the version that generated the code: another
    protoc may format differently, so a mismatch fails here rather than retiring the comparison."""
    from importlib.metadata import version

    installed, committed = version("grpcio-tools"), jaxcpp_pb2_grpc.GRPC_GENERATED_VERSION
    assert installed == committed, (f"the code was generated with grpcio-tools {committed}, {installed} is "
                                    "installed: install that version (pyproject.toml's test extra pins it), "
                                    "or regenerate with python -m jaxcpp.serving.codegen and move the pin")
    stale = codegen.stale_files(codegen.generate())
    assert not stale, f"stale generated code {stale}: run python -m jaxcpp.serving.codegen"


def _descriptor_with_comments():
    import tempfile
    from pathlib import Path

    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        assert protoc.main(["protoc", f"-I{codegen.PROTO_ROOT}", "--include_source_info",
                            f"--descriptor_set_out={out}", str(codegen.PROTO_ROOT / codegen.PROTO_FILE)]) == 0
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return fds.file[0]


def test_every_field_enum_value_and_rpc_is_commented() -> None:
    f = _descriptor_with_comments()
    commented = {tuple(loc.path) for loc in f.source_code_info.location if loc.leading_comments.strip()}
    missing = []
    for i, msg in enumerate(f.message_type):
        for j, fld in enumerate(msg.field):
            if (4, i, 2, j) not in commented:
                missing.append(f"{msg.name}.{fld.name}")
    for i, enum in enumerate(f.enum_type):
        missing += [f"{enum.name}.{v.name}" for j, v in enumerate(enum.value)
                    if (5, i, 2, j) not in commented]
    for i, svc in enumerate(f.service):
        missing += [f"{svc.name}.{m.name}" for j, m in enumerate(svc.method)
                    if (6, i, 2, j) not in commented]
    assert f.package == "jaxcpp.v1"
    assert not missing, f"uncommented: {missing}"


def test_request_and_response_reserve_tags() -> None:
    f = _descriptor_with_comments()
    messages = {m.name: m for m in f.message_type}
    for name in ("GenerateRequest", "GenerateResponse", "SamplingParameters"):
        assert messages[name].reserved_range, name
    assert [o.name for o in messages["GenerateRequest"].oneof_decl] == ["prompt"]


def test_the_stats_message_has_every_engine_count() -> None:
    """`EngineStats` is the one schema: the server copies its counts into the message by name, and the
    client reads them back by name, so every count must be a field of the message (of an integer type)."""
    from jaxcpp.core.outputs import EngineStats
    from jaxcpp.serving.gen import jaxcpp_pb2 as pb

    fields = pb.GetServerStatsResponse.DESCRIPTOR.fields_by_name
    counts = [f.name for f in EngineStats.count_fields()]
    assert len(counts) == 18 and all(name in fields for name in counts), set(counts) - set(fields)
    stats = EngineStats(*range(9), {}, *range(9, 18))
    assert EngineStats.from_counts(pb.GetServerStatsResponse(**stats.counts()), {}) == stats
