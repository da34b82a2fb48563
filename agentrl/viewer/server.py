"""`agentrl view RUN_DIR`: a run in the browser: its curves, its config, and the episodes it logged.

A FastAPI app over the run dir, read-only, serving one static page that ships in the package (no build step, no
CDN). The page polls, so a run still training shows new metrics and new episode steps without a reload. It reads
only the run dir: `/api/files/...` resolves a name inside it and refuses anything that leaves it.

Loopback by default; bound elsewhere it needs a token (`--token-env VAR`), given as a bearer header or once as
`?token=` in the page's address (the page then sends it with each call).
"""

from __future__ import annotations

import functools
import hmac
import json
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from agentrl.run.episode_log import episodes_dir, episodes_file, read_episodes

STATIC = Path(__file__).parent / "static"
MAX_METRIC_ROWS = 5000  # rows per /api/metrics answer; the page asks again from where it stopped


def _rows_from(path: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    """metrics.jsonl rows from line `start` on (a last line still being written is left for the next call)."""
    if not path.exists():
        return [], start
    rows, n = [], 0
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if n <= start:
                continue
            if not line.endswith("\n") or len(rows) >= MAX_METRIC_ROWS:
                return rows, n - 1
            rows.append(json.loads(line))
    return rows, max(n, start)


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    """The steps that have episodes, each with its phases and env tags."""
    out = []
    for path in sorted(episodes_dir(run_dir).glob("step-*.jsonl")):
        try:
            step = int(path.stem.removeprefix("step-"))
        except ValueError:
            continue
        st = path.stat()
        out.append({"step": step, **_file_summary(path, st.st_mtime_ns, st.st_size)})
    return out


@functools.lru_cache(maxsize=4096)
def _file_summary(path: Path, mtime_ns: int, size: int) -> dict[str, Any]:
    """An episodes file's phases, env tags and episode count, read again only when the file changes (the page asks
    for the step list every 2 s)."""
    lines = read_episodes(path)
    return {
        "phases": sorted({e["phase"] for e in lines}),
        "tags": sorted({e["tag"] for e in lines}),
        "episodes": len(lines),
    }


def _token_check(token: str | None):
    """The dependency that guards the routes: the token as a bearer header or a `token` query parameter."""

    def authorized(request: Request, token_param: Annotated[str | None, Query(alias="token")] = None) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else (token_param or "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "a token is needed: open the page as /?token=... or send a bearer header")

    return authorized


def _inside(run_dir: Path, name: str) -> Path:
    """The file `name` of the run dir, links resolved; 403 for anything that leaves it, 404 for no such file."""
    path = (run_dir / name).resolve()
    if not path.is_relative_to(run_dir) or path == run_dir:
        raise HTTPException(403, "only files inside the run dir are served")
    if not path.is_file():
        raise HTTPException(404, f"no file {name} in the run dir")
    return path


def build_app(run_dir: Path, token: str | None = None) -> FastAPI:
    """The viewer of `run_dir`; with `token`, every route but /health and the static assets needs it."""
    run_dir = run_dir.resolve()

    app = FastAPI(title="agentrl view", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    guarded = [Depends(_token_check(token))]

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse, dependencies=guarded)
    def index() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/api/run", dependencies=guarded)
    def run() -> dict[str, Any]:
        config = run_dir / "config.yaml"
        return {
            "name": run_dir.name,
            "run_dir": str(run_dir),
            "config": config.read_text() if config.exists() else None,
        }

    @app.get("/api/metrics", dependencies=guarded)
    def metrics(since: Annotated[int, Query(ge=0, le=10**9)] = 0) -> dict[str, Any]:
        """metrics.jsonl rows after the first `since` lines, and where to ask from next."""
        rows, upto = _rows_from(run_dir / "metrics.jsonl", since)
        return {"rows": rows, "next": upto}

    @app.get("/api/steps", dependencies=guarded)
    def steps() -> list[dict[str, Any]]:
        return _steps(run_dir)

    @app.get("/api/episodes/{step}", dependencies=guarded)
    def episodes(
        step: Annotated[int, PathParam(ge=0, le=10**9)],
        phase: Annotated[str | None, Query(pattern="^(train|validation)$")] = None,
        tag: Annotated[str | None, Query(max_length=200)] = None,
    ) -> list[dict[str, Any]]:
        path = episodes_file(run_dir, step)
        if not path.exists():
            raise HTTPException(404, f"no episodes were logged at step {step}")
        lines = read_episodes(path)
        return [e for e in lines if (phase is None or e["phase"] == phase) and (tag is None or e["tag"] == tag)]

    @app.get("/api/files/{name:path}", dependencies=guarded)
    def files(name: str) -> FileResponse:
        """A file of the run dir (config.yaml, curves.png, ...); nothing outside it."""
        return FileResponse(_inside(run_dir, name))

    return app


def serve(run_dir: Path, host: str, port: int, token: str | None) -> None:
    import uvicorn

    uvicorn.run(build_app(run_dir, token), host=host, port=port, log_level="warning")
