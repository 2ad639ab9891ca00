from fastapi.testclient import TestClient

from api.app import create_app


def test_healthz_answers_ok() -> None:
    with TestClient(create_app()) as client:
        response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
