"""Build the Python protobuf/gRPC code from proto/ into gen/ (never committed).

The one step that produces generated code: `make proto` (run by `make setup`),
and the Dockerfiles. tests/test_proto.py fails when gen/ is stale.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ["loadplan/v1/registry.proto"]


def main() -> int:
    from grpc_tools import protoc
    import grpc_tools

    out = ROOT / "gen"
    (out / "loadplan" / "v1").mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    for proto in PROTOS:
        rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"-I{include}",
                          f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
                          str(ROOT / "proto" / proto)])
        if rc != 0:
            print(f"protoc failed on {proto}", file=sys.stderr)
            return rc
    (out / "loadplan" / "v1" / "__init__.py").write_text('"""Generated from proto/ by scripts/gen_proto.py."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
