"""Schema-driven fuzzing (schemathesis + hypothesis) of a real tool server from its own OpenAPI document.

Every operation gets valid (positive) and invalid (negative) requests generated from the schema, with the bearer
token: no answer may be a 5xx, answers must match the documented responses, and the server must still be
healthy and correct afterwards. The python sandbox is left out (one subprocess per request would make this
minutes long); it is exercised in test_tools_builtins.py and test_tools_server.py.
"""

from __future__ import annotations

import time
from typing import Annotated

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import Field

from agentrl.tools import Session, tool
from agentrl.tools.calculator import calculator
from agentrl.tools.search import search
from agentrl.tools.serve import ServerThread
from agentrl.tools.server import ServerLimits, create_app
from agentrl.tools.sokoban_hint import sokoban_hint

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

TOKEN = "fuzz-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIN_REQUESTS = 1000


@tool
def note(text: Annotated[str, Field(max_length=200)], session: Session, clear: bool = False) -> str:
    """Append to a per-episode notebook and return it."""
    notes = session.state.setdefault("notes", [])
    if clear:
        notes.clear()
    notes.append(text)
    return " | ".join(notes[-5:])


@tool
async def echo(text: str, times: Annotated[int, Field(ge=1, le=3)] = 1, upper: bool = False) -> str:
    """Repeat a text."""
    return (text.upper() if upper else text) * times


@pytest.mark.heavy
def test_fuzz_openapi_no_server_errors():
    app = create_app([calculator, search, sokoban_hint, note, echo], token=TOKEN, limits=ServerLimits(max_sessions=100))
    search.fn(query="warm up the index")  # build the BM25 index outside the timed requests
    with ServerThread(app) as url:
        raw = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
        schema = schemathesis.openapi.from_dict(raw)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} >= {
            "POST /tools/calculator/call",
            "POST /tools/note/call",
            "POST /sessions/open",
            "POST /sessions/close",
        }
        statuses: dict[int, int] = {}
        failures: list[str] = []
        start = time.perf_counter()
        http = httpx.Client(base_url=url, headers=AUTH, timeout=30)

        def fuzz(op, mode) -> None:
            @settings(
                max_examples=90,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=url, headers=AUTH, timeout=30)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    failures.append(f"{op.label} [{mode.value}] -> {response.status_code}: {case.body!r:.200}")
                elif mode is GenerationMode.POSITIVE and response.status_code in (400, 422):
                    failures.append(f"{op.label}: schema-valid request rejected: {response.text[:200]}")
                elif response.status_code == 400 and response.text == "Invalid HTTP request received.":
                    pass  # uvicorn's HTTP parser refused it (e.g. `transfer-encoding: "`) before the app saw it
                else:
                    try:
                        case.validate_response(response, headers=AUTH)
                    except Exception as err:  # a documented-contract violation, kept with its reason
                        failures.append(f"{op.label} [{mode.value}]: {str(err).splitlines()[0][:300]}")

            run()

        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                has_input = any(True for _ in op.iter_parameters()) or op.body
                if mode is GenerationMode.NEGATIVE and not has_input:
                    continue
                fuzz(op, mode)

        total = sum(statuses.values())
        elapsed = time.perf_counter() - start
        assert total >= MIN_REQUESTS, f"only {total} requests generated"
        assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
        assert not any(code >= 500 for code in statuses), statuses
        assert statuses.get(200, 0) > 100 and statuses.get(422, 0) > 100, statuses  # both modes really ran
        # still healthy and still right after the storm
        assert http.get("/health").json()["status"] == "ok"
        r = http.post("/tools/calculator/call", json={"arguments": {"expression": "6*7"}})
        assert r.json()["content"] == "42"
        http.close()
        print(f"fuzz: {total} requests in {elapsed:.1f}s, statuses {dict(sorted(statuses.items()))}")
