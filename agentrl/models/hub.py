"""Hub ids as `model.path`: each node resolves the id to a snapshot in its own Hugging Face cache.

`snapshot_path` downloads (or, offline, finds) the weights, config, tokenizer and generation-config files of
`org/name` at a revision, under `HF_HUB_CACHE` / `HF_HOME` and honouring `HF_HUB_OFFLINE`, all read when called,
so that the snapshot holds everything an exported weight snapshot copies next to its weights. A snapshot path
is only valid on the node that made it, so the driver hands actors a `model_ref` (the hub id, with `@revision`
when pinned) and each actor resolves it on its own node (`agentrl.models.tiny.resolve_model_path`), under a
file lock so that the actors of one node download once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from agentrl.config.errors import ConfigError

# org/name, as the hub spells repo ids (letters, digits, `-`, `_`, `.`; no `--` or `..`; at most 96 characters)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a snapshot needs to serve and to be exported: weights, config, tokenizer, chat template, generation config.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
    "preprocessor_config.json",
]
# The driver's Hugging Face settings, handed to actors so that every node uses the same cache layout and mode.
# (Tokens are not forwarded: Ray shows runtime env vars; a node reads its own HF_TOKEN or token file.)
HUB_ENV_VARS = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def offline() -> bool:
    return _true(os.environ.get("HF_HUB_OFFLINE")) or _true(os.environ.get("TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> str:
    """HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default: read now (its constants are read at
    import, before a test or a launcher may have set them)."""
    if os.environ.get("HF_HUB_CACHE"):
        return str(Path(os.environ["HF_HUB_CACHE"]).expanduser())
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_env() -> dict[str, str]:
    """The HF_* settings of this process to pass to actors (runtime_env env_vars)."""
    return {k: os.environ[k] for k in HUB_ENV_VARS if os.environ.get(k)}


def split_ref(ref: str) -> tuple[str, str | None]:
    """`org/name@revision` -> (`org/name`, `revision`); `org/name` -> (`org/name`, None)."""
    repo_id, sep, revision = ref.partition("@")
    return repo_id, (revision if sep else None)


def is_hub_id(path: str) -> bool:
    """`org/name` (or `org/name@revision`) that is not a local path."""
    repo_id, _ = split_ref(path)
    return (
        bool(HUB_ID.match(repo_id))
        and len(repo_id) <= 96
        and "--" not in repo_id
        and ".." not in repo_id
        and not Path(path).expanduser().exists()
    )


def model_ref(path: str, revision: str | None, local: str) -> str:
    """What the driver hands an actor for `path`: a hub id stays a hub id (`@revision` appended when pinned),
    so the actor resolves it on its own node; anything else is `local`, the driver's resolved path."""
    if not is_hub_id(path):
        return local
    repo_id, pinned = split_ref(path)
    rev = _revision(path, pinned, revision)
    return f"{repo_id}@{rev}" if rev else repo_id


def _revision(path: str, pinned: str | None, revision: str | None) -> str | None:
    if pinned and revision and pinned != revision:
        raise ConfigError(f"model.path {path} pins revision {pinned!r} but model.revision is {revision!r}")
    return pinned or revision


def snapshot_path(path: str, revision: str | None = None) -> str:
    """The local snapshot folder of hub id `path` (`org/name` or `org/name@revision`) at `revision`: downloaded
    into this node's HF cache unless there already (offline: found there, or one ConfigError line)."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, pinned = split_ref(path)
    rev = _revision(path, pinned, revision)
    cache = hub_cache_dir()
    is_offline = offline()
    what = f"hub model {repo_id} (revision {rev or 'main'})"
    fix = (
        f"pre-download it with `hf download {repo_id}{f' --revision {rev}' if rev else ''}` "
        "or set model.path to a local folder"
    )
    try:
        if is_offline:  # nothing is written: no lock (the cache may be read-only)
            return snapshot_download(
                repo_id, revision=rev, cache_dir=cache, allow_patterns=ALLOW_PATTERNS, local_files_only=True
            )
        locks = Path(cache) / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(locks / f"agentrl-models--{repo_id.replace('/', '--')}.lock")):
            return snapshot_download(
                repo_id,
                revision=rev,
                cache_dir=cache,
                allow_patterns=ALLOW_PATTERNS,
                endpoint=os.environ.get("HF_ENDPOINT") or None,  # read now, as the cache dir
            )
    except GatedRepoError:
        why = "is gated: accept its terms on the hub and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        why = "is not on the hub (or is private: log in with `hf auth login`)"
    except RevisionNotFoundError:
        why = "does not exist on the hub (check model.revision)"
    except IncompleteSnapshotError:
        why = f"is only partly in the HF cache {cache} and the hub cannot be reached"
    except LocalEntryNotFoundError as err:
        why = (
            f"is not in the HF cache {cache} and HF_HUB_OFFLINE is set"
            if is_offline
            else f"is not in the HF cache {cache} and the hub cannot be reached ({_first_line(err)})"
        )
    except Exception as err:  # network and HTTP errors, a cache that cannot be written, a malformed id
        why = f"cannot be fetched into {cache} ({type(err).__name__}: {_first_line(err)})"
    raise ConfigError(f"model.path: {what} {why}: {fix}")


def _first_line(err: BaseException) -> str:
    return next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
