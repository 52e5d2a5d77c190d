"""Property-based API fuzzing from /openapi.json: whatever the body, never a 5xx, statuses and
JSON bodies as documented. Bounded examples keep it to seconds."""

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from kog.engine import AsyncEngine
from kog.server import ServerConfig, build_app

from server_helpers import TEMPLATE, TOK, make_engine

# a short context bounds max_tokens (and so the time of any generated request)
ENGINE = AsyncEngine(make_engine(max_model_len=48, max_num_seqs=64), max_waiting=1024)
APP = build_app(ENGINE, TOK, TEMPLATE, ServerConfig(served_model_names=["kog"]), drain_on_shutdown=False)
# NOTE: the coverage phase sends hundreds of boundary bodies per operation (minutes on 2 cores);
# the explicit-examples and fuzzing phases, bounded below, reach the same handlers.
CONFIG = schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False}}})
schema = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG)


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_never_fails_server_side(case):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "kog"  # reach generation, not only the 404 of an unknown model
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, response_schema_conformance])
