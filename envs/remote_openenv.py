"""`agentrl/OpenEnv-v0`: a text env that lives in an OpenEnv server (another process, machine or hub).

Why an env and not an env-manager feature: the env manager runs every env the same way; a remote env is one
more `TextEnv` whose `reset`/`step` are WebSocket round trips. Config, validated by `RemoteEnvSettings`
(unknown keys are errors naming the key; the token is read from the variable `token_env` names, never
written in YAML):

    envs: {train: {sokoban: {env_id: agentrl/OpenEnv-v0,
                             kwargs: {url: "http://127.0.0.1:8810", token_env: ENV_TOKEN, timeout_s: 20}}}}

Sessions (one WebSocket each) are pooled per (url, env, token) in the process and reused across episodes, up
to `max_sessions`. A failed, closed or slow session raises `RemoteEnvError`: the env manager fails that
episode, counts it, and the run goes on; the broken socket is dropped, never reused.
"""

from __future__ import annotations

import json
import random
import string
import threading
import time
import urllib.parse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from agentrl.envs.base import REQUIRED_METRICS, TextEnv


class RemoteEnvError(RuntimeError):
    """The remote env failed this call (connection, timeout, server error): the episode fails, the run goes on.

    `broken`: the session is unusable (closed, timed out, ended by the server) and is dropped from the pool."""

    def __init__(self, message: str, broken: bool = True) -> None:
        super().__init__(message)
        self.broken = broken


# Error codes after which the server keeps the session open (a bad call, not a dead session).
_KEEPS_SESSION = frozenset({"EXECUTION_ERROR", "VALIDATION_ERROR", "UNKNOWN_TYPE", "INVALID_JSON"})


class RemoteEnvSettings(BaseModel):
    """`kwargs` of agentrl/OpenEnv-v0."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., description="server base URL, http(s):// or ws(s)://; /ws is appended")
    env: str | None = Field(None, description="env id on a multi-env `agentrl serve-envs` (default: its first)")
    token_env: str | None = Field(None, description="environment variable holding the bearer token")
    timeout_s: PositiveFloat = Field(20.0, description="per reset/step; keep below envs.call_timeout_s")
    connect_timeout_s: PositiveFloat = 10.0
    max_sessions: PositiveInt = Field(256, description="open sessions per process: >= episodes in flight")
    max_message_bytes: PositiveInt = 1 << 22
    max_steps: PositiveInt = Field(20, description="turn limit for servers that do not send theirs")
    system_prompt: str = Field("", description="prompt for servers that do not send one")
    observation_field: str | None = Field(
        None, description="observation key holding the text (default: read from the server's /schema, else text)"
    )
    action_field: str | None = Field(
        None, description="action key the text goes in (default: read from the server's /schema, else message)"
    )


def ws_url(settings: RemoteEnvSettings) -> str:
    parts = urllib.parse.urlsplit(settings.url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"url: expected http(s):// or ws(s)://host:port, got {settings.url!r}")
    path = parts.path.rstrip("/")
    path = path if path.endswith("/ws") else path + "/ws"
    query = urllib.parse.urlencode({"env_id": settings.env}) if settings.env else ""
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, query, ""))


OPENENV_OWN_FIELDS = frozenset({"metadata", "done", "reward"})  # every OpenEnv observation/action has these


def _text_field(schema: dict, default: str, skip: frozenset[str] = frozenset()) -> str:
    """The one string property of a JSON schema that holds the text (`default` when it is one of them, else the
    only required string one, else the only string one); ValueError naming the candidates when several fit."""
    props = schema.get("properties") or {}
    strings = [k for k, v in props.items() if k not in OPENENV_OWN_FIELDS | skip and _is_string(v)]
    if default in strings or not strings:
        return default
    required = [k for k in strings if k in (schema.get("required") or [])]
    for candidates in (required, strings):
        if len(candidates) == 1:
            return candidates[0]
    raise ValueError(f"several text fields fit in {schema.get('title', 'the schema')}: {strings}")


def _is_string(prop: dict) -> bool:
    return prop.get("type") == "string" or any(p.get("type") == "string" for p in prop.get("anyOf") or [])


def schema_fields(settings: RemoteEnvSettings, token: str | None) -> tuple[str, str]:
    """(observation field, action field): the settings' where given, else read from the server's `GET /schema`
    (OpenEnv servers publish their Action and Observation models there), else OpenEnv's usual `text` / `message`."""
    import httpx

    obs_field, action_field = settings.observation_field, settings.action_field
    if obs_field is not None and action_field is not None:
        return obs_field, action_field
    parts = urllib.parse.urlsplit(settings.url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    base = urllib.parse.urlunsplit((scheme, parts.netloc, parts.path.rstrip("/").removesuffix("/ws"), "", ""))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(f"{base}/schema", headers=headers, timeout=settings.connect_timeout_s,
                          trust_env=not _is_loopback_url(base))  # fmt: skip
        schemas = reply.json() if reply.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        schemas = {}  # no schema published (or not JSON): the usual field names
    try:
        observed = _text_field(schemas.get("observation") or {}, "text", skip=frozenset({"system_prompt"}))
        acted = _text_field(schemas.get("action") or {}, "message")
    except ValueError as err:
        raise ValueError(f"{settings.url}: {err}: name the one to use with observation_field / action_field") from None
    return obs_field or observed, action_field or acted


def _is_loopback_url(url: str) -> bool:
    from agentrl.addresses import is_loopback

    return is_loopback(urllib.parse.urlsplit(url).hostname or "")


class _Session:
    """One WebSocket: one request, one reply, in order (a timed-out socket is desynced and gets dropped)."""

    def __init__(self, url: str, token: str | None, s: RemoteEnvSettings) -> None:
        from websockets.exceptions import InvalidMessage, InvalidStatus
        from websockets.sync.client import connect

        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.timeout_s = s.timeout_s
        deadline = time.monotonic() + s.connect_timeout_s
        for attempt in range(1, 1000):
            try:
                # Entered by hand: the socket outlives this call (pooled), and websockets >= 17.1 warns otherwise.
                self.ws = connect(
                    url,
                    additional_headers=headers,
                    open_timeout=s.connect_timeout_s,
                    max_size=s.max_message_bytes,
                    proxy=None if _is_loopback_url(url) else True,
                ).__enter__()
                return
            except InvalidStatus as err:  # 503: at its session cap or a worker retiring; retry until the deadline
                if err.response.status_code != 503 or time.monotonic() + 0.1 * attempt > deadline:
                    raise RemoteEnvError(f"cannot open a session at {url}: {err}") from None
                time.sleep(0.1 * attempt)
            except InvalidMessage as err:  # the handshake was cut: queued on a worker's socket as it retired
                if time.monotonic() + 0.1 * attempt > deadline:
                    raise RemoteEnvError(f"cannot open a session at {url}: InvalidMessage: {err}") from None
                time.sleep(0.1 * attempt)
            except Exception as err:
                raise RemoteEnvError(f"cannot open a session at {url}: {type(err).__name__}: {err}") from None

    def request(self, kind: str, data: dict | None = None) -> dict:
        try:
            self.ws.send(json.dumps({"type": kind, "data": data or {}}))
            reply = json.loads(self.ws.recv(timeout=self.timeout_s))
        except TimeoutError:
            raise RemoteEnvError(f"{kind}: no reply within {self.timeout_s:g}s (session dropped)") from None
        except Exception as err:
            raise RemoteEnvError(f"{kind}: session failed: {type(err).__name__}: {err}") from None
        if reply.get("type") == "error":
            info = reply.get("data") or {}
            code = info.get("code", "?")
            message = f"{kind}: server error {code}: {info.get('message', '')}"
            raise RemoteEnvError(message, broken=code not in _KEEPS_SESSION)
        return reply.get("data") or {}

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass


class SessionPool:
    """Open sessions to one server, reused across episodes; at most `max_sessions` open at once."""

    def __init__(self, url: str, token: str | None, settings: RemoteEnvSettings) -> None:
        self.url, self.token, self.settings = url, token, settings
        self.idle: list[_Session] = []
        self.open = 0
        self.cond = threading.Condition()
        self._fields: tuple[str, str] | None = None

    def fields(self) -> tuple[str, str]:
        """The server's observation and action text fields, read once per pool (see `schema_fields`)."""
        with self.cond:
            if self._fields is None:
                self._fields = schema_fields(self.settings, self.token)
            return self._fields

    def acquire(self) -> tuple[_Session, bool]:
        """A session and whether it was reused (a reused one may have expired on the server meanwhile)."""
        with self.cond:
            if not self.cond.wait_for(lambda: bool(self.idle) or self.open < self.settings.max_sessions, 30.0):
                raise RemoteEnvError(f"all {self.settings.max_sessions} sessions to {self.url} busy for 30s")
            if self.idle:
                return self.idle.pop(), True
            self.open += 1
        try:
            return _Session(self.url, self.token, self.settings), False
        except BaseException:
            with self.cond:
                self.open -= 1
                self.cond.notify()
            raise

    def release(self, session: _Session, broken: bool = False) -> None:
        with self.cond:
            if broken:
                self.open -= 1
                session.close()
            else:
                self.idle.append(session)
            self.cond.notify()

    def close_idle(self) -> None:
        with self.cond:
            for s in self.idle:
                s.close()
            self.open -= len(self.idle)
            self.idle.clear()


_POOLS: dict[tuple, SessionPool] = {}
_POOLS_LOCK = threading.Lock()


def session_pool(settings: RemoteEnvSettings) -> SessionPool:
    from agentrl.tools.client import token_from_env

    url, token = ws_url(settings), token_from_env(settings.token_env, "token_env")
    key = (url, token, settings.timeout_s, settings.max_sessions, settings.observation_field, settings.action_field)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = SessionPool(url, token, settings)
        return _POOLS[key]


class RemoteOpenEnv(TextEnv):
    """A TextEnv whose episodes run on an OpenEnv server (see the module docstring for the config)."""

    def __init__(
        self,
        url: str,
        *,
        env: str | None = None,
        token_env: str | None = None,
        timeout_s: float = 20.0,
        connect_timeout_s: float = 10.0,
        max_sessions: int = 256,
        max_message_bytes: int = 1 << 22,
        max_steps: int = 20,
        system_prompt: str = "",
        observation_field: str | None = None,
        action_field: str | None = None,
        render_mode: str | None = None,
    ) -> None:
        # Explicit keywords so `agentrl envs` lists them; RemoteEnvSettings validates (its error names the key).
        given = dict(locals())
        given.pop("self")
        given.pop("render_mode")
        given.pop("__class__", None)
        self.settings = RemoteEnvSettings(**given)
        super().__init__(max_steps=self.settings.max_steps, render_mode=render_mode)
        self.pool = session_pool(self.settings)
        self.session: _Session | None = None
        self._prompt: str | None = None
        self._text = ""
        self._fields: tuple[str, str] | None = None  # (observation, action): read from /schema on first use
        self._agentrl_server: bool | None = None  # known from the first reply: it carries agentrl's metadata

    @property
    def contract(self) -> frozenset[str]:  # type: ignore[override]
        """An agentrl server (`serve-envs`) keeps the env's own promises; another OpenEnv server promises none of
        agentrl's rules (gymnasium seeding, unparsable output as a no-op, a system prompt)."""
        if self._agentrl_server is None:
            self.reset(seed=0)
        return TextEnv.contract if self._agentrl_server else frozenset()

    @property
    def fields(self) -> tuple[str, str]:
        if self._fields is None:
            self._fields = self.pool.fields()
        return self._fields

    # ---- session handling -----------------------------------------------------------------------------
    def _request(self, kind: str, data: dict | None = None) -> dict:
        reused = False
        if self.session is None:
            self.session, reused = self.pool.acquire()
        try:
            return self.session.request(kind, data)
        except RemoteEnvError as err:
            if not err.broken:
                raise
            session, self.session = self.session, None
            self.pool.release(session, broken=True)
            if reused and kind == "reset":  # a pooled socket the server expired or retired: one fresh try
                return self._request(kind, data)
            raise

    def _give_back(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            self.pool.release(session)

    def close(self) -> None:
        self._give_back()
        super().close()

    def __del__(self) -> None:  # an episode that ends without close() (the env manager's) returns its session
        try:
            self._give_back()
        except Exception:
            pass

    # ---- the contract ---------------------------------------------------------------------------------
    def _parse(self, data: dict) -> tuple[str, float, bool, bool, dict]:
        obs = data.get("observation") or {}
        text = obs.get(self.fields[0])
        if not isinstance(text, str):
            text = json.dumps({k: v for k, v in obs.items() if k != "metadata"})
        if isinstance(obs.get("system_prompt"), str):
            self._prompt = obs["system_prompt"]
        elif self._prompt is None:
            self._prompt = ""  # a server that sends none: `system_prompt` in the kwargs is the prompt
        ours = (data.get("metadata") or obs.get("metadata") or {}).get("agentrl")
        self._agentrl_server = isinstance(ours, dict)
        done = bool(data.get("done", False))
        reward = float(data.get("reward") or 0.0)
        if isinstance(ours, dict):
            self.max_steps = int(ours.get("max_steps", self.max_steps))
            info = dict(ours.get("info") or {})
            return text, reward, bool(ours.get("terminated")), bool(ours.get("truncated")), info
        # Another OpenEnv server: done is termination; the turn limit is ours; metrics from the reward.
        metrics = dict.fromkeys(REQUIRED_METRICS, 1.0)
        metrics["success"] = float(done and reward > 0)
        info = {"metrics": metrics, "metadata": data.get("metadata") or {}}
        truncated = not done and self.turns + 1 >= self.max_steps
        return text, reward, done, truncated, info

    def system_prompt(self) -> str:
        if self._prompt is None:  # the server sends its prompt (if any) with the first observation
            self.reset(seed=0)
        return self._prompt or self.settings.system_prompt

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super(TextEnv, self).reset(seed=seed)  # gymnasium's np_random; the episode itself is the server's
        data = {"seed": int(seed)} if seed is not None else {}
        self.turns = 0
        text, _, _, _, info = self._parse(self._request("reset", data))
        self._text = text
        return text, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}.step expects model output text, got {type(action).__name__}")
        obs, reward, terminated, truncated, info = self._parse(self._request("step", {self.fields[1]: action}))
        self.turns += 1
        self._text = obs
        return obs, reward, terminated, truncated, info

    def expert_action(self) -> str | None:
        try:
            return self._request("agentrl.expert_action").get("action")
        except RemoteEnvError as err:
            if "UNKNOWN_TYPE" in str(err):
                return None
            raise

    def random_action(self, rng: random.Random) -> str:
        """The server's random action; another OpenEnv server has none, and any text is a move of a text env:
        a few random letters."""
        seed = rng.getrandbits(31)
        try:
            return self._request("agentrl.random_action", {"seed": seed})["action"]
        except RemoteEnvError as err:
            if "UNKNOWN_TYPE" not in str(err):
                raise
        letters = random.Random(seed)
        return "".join(letters.choice(string.ascii_lowercase) for _ in range(letters.randint(1, 8)))

    def render(self) -> str | None:
        return self._text if self.render_mode == "ansi" else None


def close_idle_sessions() -> None:
    """Close every pooled idle session of this process (tests, shutdown); sessions in use are left alone."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        pool.close_idle()
