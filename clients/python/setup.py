"""Build hook: generate the `aliquot.v1` stubs from the repository's protos.

The protos are the API's one source: they are compiled here, at install
time, with grpcio-tools (a build requirement), never checked in. Set
ALIQUOT_PROTO_DIR to build from a copy elsewhere.
"""

import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


def proto_dir() -> pathlib.Path:
    d = pathlib.Path(os.environ.get("ALIQUOT_PROTO_DIR", HERE.parent.parent / "proto"))
    if not (d / "aliquot" / "v1" / "allocator.proto").exists():
        raise SystemExit(
            f"aliquot-client: no aliquot/v1/*.proto under {d}; install from the "
            "repository (pip install clients/python) or set ALIQUOT_PROTO_DIR"
        )
    return d


class BuildWithStubs(build_py):
    def run(self):
        from grpc_tools import protoc  # a build requirement (pyproject.toml)

        src = proto_dir()
        out = pathlib.Path(self.build_lib)
        protos = sorted(str(p.relative_to(src)) for p in (src / "aliquot" / "v1").glob("*.proto"))
        include = pathlib.Path(protoc.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{src}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *protos,
        ]
        out.mkdir(parents=True, exist_ok=True)
        if protoc.main(args) != 0:
            raise SystemExit(f"aliquot-client: protoc failed on {protos}")
        for pkg in ("aliquot", "aliquot/v1"):
            (out / pkg / "__init__.py").touch()
        super().run()


setup(
    packages=["aliquot_client"],
    cmdclass={"build_py": BuildWithStubs},
)
