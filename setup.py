"""Build steps that pyproject.toml cannot express.

1. Generate the gRPC/protobuf modules from `proto/` into the `kvcache`
   package (a build artifact, never edited by hand, not in git).
2. Build the optional C extensions of block hashing: the encoder of token
   blocks, and the sha256_cbor chain (which also needs OpenSSL's headers,
   libssl-dev on Debian, and links libcrypto). `optional=True`: without a
   C compiler or the headers the install still succeeds and block hashing
   uses the pure-Python twins (same bytes, slower).
"""

from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted((ROOT / "proto").rglob("*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    kvcache = ROOT / "kvcache"
    for module in kvcache.rglob("*_pb2.py"):
        for package in module.relative_to(kvcache).parents:  # the module's folder and each above it
            (kvcache / package / "__init__.py").touch()


generate_protos()

setup(
    ext_modules=[
        Extension(
            "kv_manager_service.core._token_cbor",
            ["kv_manager_service/core/_token_cbor.c"],
            depends=["kv_manager_service/core/_token_cbor.h"],
            optional=True,
        ),
        Extension(
            "kv_manager_service.core._chain_hash",
            ["kv_manager_service/core/_chain_hash.c"],
            depends=["kv_manager_service/core/_token_cbor.h"],
            libraries=["crypto"],
            optional=True,
        ),
    ]
)
