"""docs/contract.md says what the `.proto` files of kvcache.v1 and the error table of the code say.

- Its message reference is what tools/contract_reference.py generates from
  the commented `.proto` files now (run it after changing them).
- Every RPC of every service has a section of its own, with its errors,
  and every section names an RPC that exists.
- Every reason of the typed errors (`shared/errors.py`) is in its table of
  errors, with the gRPC code `shared/status.py` gives it, and no other.
- The generator's parse agrees with the modules protoc generated: the same
  services, rpcs, messages, enums, fields and numbers.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from processes import ROOT

from kv_manager_service.shared import errors
from kv_manager_service.shared.status import status_code
from kvcache.v1 import kv_manager_pb2, worker_pb2

spec = importlib.util.spec_from_file_location("contract_reference", ROOT / "tools" / "contract_reference.py")
contract_reference = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = contract_reference  # its dataclasses look their module up there
spec.loader.exec_module(contract_reference)

DOC = ROOT / "docs" / "contract.md"
DECLARATIONS = contract_reference.contract()


def hand_written() -> str:
    return contract_reference.split(DOC.read_text(encoding="utf-8"))[0]


def test_the_message_reference_is_generated_from_the_proto_as_it_is():
    generated = contract_reference.split(DOC.read_text(encoding="utf-8"))[1]
    assert generated == contract_reference.render(DECLARATIONS), (
        "docs/contract.md's message reference differs from the .proto files: run python tools/contract_reference.py"
    )


def test_every_rpc_has_a_section_with_its_errors_and_every_section_is_an_rpc():
    text = hand_written()
    services = {d.name: [rpc.name for rpc in d.rpcs] for d in DECLARATIONS if d.kind == "service"}
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    for service, rpcs in services.items():
        (body,) = [s for s in sections if s.startswith(f"{service}\n")]
        written = re.findall(r"^### (\w+)$", body, flags=re.MULTILINE)
        assert written == rpcs, f"{service}: sections {written}, rpcs in the .proto {rpcs} (same names, same order)"
        for rpc, section in zip(rpcs, re.split(r"^### \w+$", body, flags=re.MULTILINE)[1:]):
            assert "Errors:" in section, f"{service}.{rpc}'s section says nothing of its errors"


def test_every_error_reason_is_in_the_table_with_its_code():
    rows = set(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", hand_written(), flags=re.MULTILINE))
    reasons = [cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.KVCacheError)]
    expected = {(status_code(cls.__new__(cls)).name, cls.reason) for cls in reasons if cls is not errors.KVCacheError}
    assert expected <= rows, f"missing from the table of errors: {sorted(expected - rows)}"
    assert rows <= expected, f"the table of errors names reasons the code lacks: {sorted(rows - expected)}"


@pytest.mark.parametrize("module", [kv_manager_pb2, worker_pb2], ids=lambda m: m.__name__)
def test_the_parse_agrees_with_the_generated_modules(module):
    file_name = module.DESCRIPTOR.name.rsplit("/", 1)[1]
    parsed = {d.name: d for d in DECLARATIONS if d.file == file_name}
    descriptor = module.DESCRIPTOR
    expected = {
        **{name: ("service", [(m.name, m.input_type.name, m.output_type.name) for m in s.methods])
           for name, s in descriptor.services_by_name.items()},
        **{name: ("message", [(f.name, f.number) for f in m.fields]) for name, m in descriptor.message_types_by_name.items()},
        **{name: ("enum", [(v.name, v.number) for v in e.values]) for name, e in descriptor.enum_types_by_name.items()},
    }  # fmt: skip
    seen = {}
    for name, d in parsed.items():
        if d.kind == "service":
            seen[name] = ("service", [(r.name, r.request, r.response.split()[-1]) for r in d.rpcs])
        else:
            seen[name] = (d.kind, [(f.name, f.number) for f in d.fields])
    assert seen == expected
