"""KOG_CHECK (a bad argument) and KOG_ASSERT (a broken invariant) leave C++ as different Python
types, and the server answers them with different HTTP statuses."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import kog
from kog import _C
from kog.errors import InternalError
from kog.server.errors import install_error_handlers, to_api_error


def test_check_is_invalid_request_and_assert_is_internal_error():
    with pytest.raises(kog.InvalidRequest, match="bad argument"):
        _C.raise_native_error_for_test("check")
    with pytest.raises(InternalError, match="internal error: a broken invariant") as e:
        _C.raise_native_error_for_test("assert")
    assert not isinstance(e.value, kog.InvalidRequest)
    _C.raise_native_error_for_test("neither")  # both conditions hold: nothing raised


@pytest.mark.parametrize("which, status, kind, code", [
    ("check", 400, "invalid_request_error", None),
    ("assert", 500, "server_error", "internal_error"),
])
def test_http_status_of_each_native_error_kind(which, status, kind, code):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/native")
    def native() -> dict:
        _C.raise_native_error_for_test(which)
        return {}

    res = TestClient(app, raise_server_exceptions=False).get("/native")
    assert res.status_code == status
    err = res.json()["error"]
    assert (err["type"], err["code"]) == (kind, code)
    try:
        _C.raise_native_error_for_test(which)
    except kog.KogError as exc:
        assert to_api_error(exc).status == status
