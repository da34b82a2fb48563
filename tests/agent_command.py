"""An agent program run as an external command (`agent: "cmd: python tests/agent_command.py MODE ..."`): the plain
openai SDK on OPENAI_BASE_URL / OPENAI_API_KEY, the env stepped over HTTP, the reward printed as JSON."""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import openai

mode, *urls = sys.argv[1:] or ["play"]
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
task = json.loads(os.environ["AGENTRL_TASK"])
if mode == "escape":  # what the jail must keep from it: other addresses, files outside its code and Python
    escaped = [path for path in ("/etc/passwd", *urls) if path.startswith("/") and os.path.exists(path)]
    for url in (u for u in urls if not u.startswith("/")):
        try:
            httpx.get(url, timeout=3)
            escaped.append(url)
        except httpx.HTTPError:
            pass
    try:
        open("written-by-agent", "w").close()  # its code folder is read-only
        escaped.append("wrote into its code folder")
    except OSError:
        pass
    if escaped:
        print("escaped:", escaped)
        sys.exit(5)
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
system = {"role": "system", "content": task["system_prompt"]}
reply = client.chat.completions.create(
    model=task["model"], messages=[system, {"role": "user", "content": task["prompt"]}]
)
auth = {"Authorization": f"Bearer {key}"}
step = httpx.post(f"{base}/agentrl/step", json={"action": reply.choices[0].message.content}, headers=auth).json()
if mode == "fail":
    print("something went wrong", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)
print(json.dumps({"reward": 0.5 + step["reward"], "steps": 1.0}))
