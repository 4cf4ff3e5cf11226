"""Builds the optional C encoder of token blocks; everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and block
hashing uses its pure-Python twin (same bytes, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kv_manager_service.core._token_cbor",
            ["kv_manager_service/core/_token_cbor.c"],
            optional=True,
        )
    ]
)
