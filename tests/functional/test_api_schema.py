"""The control API's OpenAPI schema is the API: schemathesis generates requests from the schema,
valid and invalid, for every operation but the endless event stream, and checks each answer
against it (no 5xx, only declared statuses and content types, bodies that fit the declared
models, invalid requests refused).

Runs in-process against the ASGI app over a real tiered store (cpu arena + disk directory),
with a bearer token as an agent off loopback would have.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvctl.agent.api import ProbeRequest, create_app
from tests.functional.agents import closed_port
from tests.unit.test_agent_api import _runtime, _settings, put_prompt, tokens

TOKEN = "schema-token"
#: examples per operation; ~20 operations run in well under a minute. KVCTL_SCHEMA_EXAMPLES
#: asks for more in a deeper run by hand
MAX_EXAMPLES = int(os.environ.get("KVCTL_SCHEMA_EXAMPLES", "25"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]


@pytest.fixture
def api_schema(tmp_path: Path) -> Iterator[Any]:
    rt = _runtime(dataclasses.replace(_settings(tmp_path), token=TOKEN), tmp_path)
    # chunks in both tiers, some pinned, so listings, flushes and moves have work to do
    keys = put_prompt(rt, tokens(6))
    rt.store.pin(keys[:1])
    schema = schemathesis.openapi.from_asgi(
        "/openapi.json", create_app(rt), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=MAX_EXAMPLES,
        with_security_parameters=False,  # our token goes in every request
    )
    yield schema
    rt.close()


# the SSE stream never ends, so a 200 from it would never finish a check
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path="/v1/events")


def _offline_probe_target(case: Any) -> None:
    """A probe's valid target becomes a closed loopback port: generated host names would be
    looked up in DNS and generated ports could reach anything. Invalid targets stay as they are,
    so a valid case stays valid and an invalid one invalid."""
    body = case.body
    if case.path != "/v1/probe" or not isinstance(body, dict):
        return
    target = body.get("target")
    if not isinstance(target, str):
        return
    try:
        ProbeRequest._tcp_address(target)
    except ValueError:
        return
    body["target"] = f"127.0.0.1:{closed_port()}"


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=MAX_EXAMPLES)
def test_api_answers_as_its_schema_says(case: Any) -> None:
    _offline_probe_target(case)
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, checks=CHECKS)


def test_schema_states_what_the_handlers_check(api_schema: Any) -> None:
    """The facts schemathesis relies on, stated once so a regression names them."""
    raw = api_schema.raw_schema
    comps = raw["components"]["schemas"]
    resize = comps["ResizeRequest"]["properties"]
    assert resize["tier"]["enum"] == ["cpu", "disk"]
    as_int, as_text = resize["capacity"]["anyOf"]
    assert (as_int["minimum"], as_int["maximum"]) == (0, 2**63 - 1)
    assert as_text["pattern"].startswith("^") and as_text["pattern"].endswith("$")
    key = comps["KeysRequest"]["properties"]["keys"]
    assert key["maxItems"] == 100_000
    assert key["items"]["pattern"] == "^[0-9a-fA-F]{32}$"
    assert comps["LookupRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["llama-3.1-8b"]
    resize_op = raw["paths"]["/v1/resize"]["post"]["responses"]
    assert {"200", "400", "401", "404", "409", "413", "422", "503", "507"} <= set(resize_op)
    assert resize_op["409"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorDetail"
    }
    assert raw["security"] == [{"bearer": []}]
    keys_params = {p["name"]: p["schema"] for p in raw["paths"]["/v1/keys"]["get"]["parameters"]}
    assert keys_params["tier"]["enum"] == ["cpu", "disk"]  # no null branch for a query value
    assert "anyOf" not in keys_params["after"]
    probe_name = comps["ProbeRequest"]["properties"]["name"]["anyOf"][0]
    assert (probe_name["minLength"], probe_name["maxLength"]) == (1, 255)
    probe_out = comps["ProbeResponse"]
    assert probe_out["properties"]["rtt_basis"]["enum"] == ["measured", "emulated"]
    assert {"rtt_basis", "emulated_delay_s"} <= set(probe_out["required"])
