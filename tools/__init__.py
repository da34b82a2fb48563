"""agentrl.tools (installed from the top-level tools/ folder): typed tools, tool servers and their client.

The interface env managers code against:

- `@tool` / `Tool.from_function(fn)`: a typed sync or async function becomes a tool; pydantic derives its
  OpenAI function schema from the signature and the docstring's Args section. A parameter annotated `Session`
  receives per-episode state (`session.state`, `session.add_cleanup`) and is not part of the schema.
- `build_toolbox(cfg.tools, set_names) -> Toolbox`: resolves config tool sets, local (`python: mod:fn`) and
  remote (`url: http://...`) alike. `Toolbox.schemas()`, `await Toolbox.call(name, arguments, session_id) ->
  ToolResult(content, ok, error, seconds)` (never raises for tool failures), `open_session` / `close_session`,
  `aclose`.
- `parse_tool_calls(text, parser="hermes") -> list[ToolCall | ParseError]`; `get_parser(name)`,
  `register_parser(name)` for other formats.
- `ToolClient`: the async HTTP client behind remote tools. `create_app` / `serve` / `ServerThread`: the
  FastAPI server behind `agentrl serve-tools` (see agentrl.tools.server for endpoints and limits).

Built-ins (use as `python: <module>:<name>` in config): `agentrl.tools.calculator:calculator`,
`agentrl.tools.pyexec:python`, `agentrl.tools.search:search`, `agentrl.tools.sokoban_hint:sokoban_hint`.
"""

from agentrl.tools.client import ToolClient, ToolServerError
from agentrl.tools.core import Session, Tool, ToolResult, tool
from agentrl.tools.parsers import (
    ParseError,
    ToolCall,
    get_parser,
    parse_tool_calls,
    register_parser,
    text_without_calls,
)
from agentrl.tools.toolbox import Toolbox, build_toolbox, load_python_tool

__all__ = [
    "ParseError",
    "Session",
    "Tool",
    "ToolCall",
    "ToolClient",
    "ToolResult",
    "ToolServerError",
    "Toolbox",
    "build_toolbox",
    "get_parser",
    "load_python_tool",
    "parse_tool_calls",
    "register_parser",
    "text_without_calls",
    "tool",
]
