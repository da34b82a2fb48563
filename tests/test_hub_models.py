"""Hub ids as model.path, resolved from an offline Hugging Face cache that the test lays out from the tiny model.

The cache holds `agentrl-test/tiny` at two commits: `main` (refs/main) and a tag `v1` (refs/v1), whose config.json
carries a marker so that the pinned snapshot is told apart. Nothing is downloaded: HF_HUB_OFFLINE=1, or an
HF_ENDPOINT that refuses connections.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentrl.config import ConfigError
from agentrl.config.loader import check_model_path
from agentrl.config.schema import Config
from agentrl.models.hub import hub_env, model_ref
from agentrl.models.tiny import resolve_model_path

REPO = "agentrl-test/tiny"
MAIN = "1" * 40
V1 = "2" * 40


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """HF_HOME whose hub cache holds REPO at MAIN (refs/main) and V1 (refs/v1), as snapshot_download lays it out."""
    tiny = Path(resolve_model_path("builtin:tiny"))
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    for commit in (MAIN, V1):
        shutil.copytree(tiny, repo / "snapshots" / commit)
    config = repo / "snapshots" / V1 / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "agentrl_test_revision": "v1"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return home


@pytest.fixture
def offline(monkeypatch, hf_home) -> Path:
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    return hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots"


def test_hub_id_resolves_to_its_cached_snapshot_and_revision_pin(offline) -> None:
    assert resolve_model_path(REPO) == str(offline / MAIN)
    assert resolve_model_path(REPO, "unused", "v1") == str(offline / V1)  # a tag
    assert resolve_model_path(REPO, "unused", V1) == str(offline / V1)  # a commit
    assert resolve_model_path(f"{REPO}@v1") == str(offline / V1)  # as model_ref hands it to actors
    # the local snapshot path, once resolved, is a local folder: returned as is
    assert resolve_model_path(str(offline / V1)) == str(offline / V1)
    # the config check (load_config) finds the pinned revision in the cache too
    check_model_path("model.path", REPO, revision="v1")
    with pytest.raises(ConfigError, match="no hub model in the local cache"):
        check_model_path("model.path", REPO, revision="v2")


def test_uncached_or_malformed_ids_are_one_line_config_errors(offline, tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_model_path("agentrl-test/missing", "unused", "v3")
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("agentrl-test/missing", "revision v3", "HF_HUB_OFFLINE", "hf download agentrl-test/missing"):
        assert part in msg, msg
    with pytest.raises(ConfigError, match=r"hub model agentrl-test/tiny \(revision v2\) is not in the HF cache"):
        resolve_model_path(REPO, "unused", "v2")
    for bad in (str(tmp_path / "no" / "such" / "dir"), "just-a-name", "a/b/c"):
        with pytest.raises(ConfigError, match="is neither a local folder nor a hub id"):
            resolve_model_path(bad)
    with pytest.raises(ConfigError, match=r"pins revision 'v1' but model\.revision is 'v2'"):
        resolve_model_path(f"{REPO}@v1", "unused", "v2")


def test_hub_unreachable_online_falls_back_to_cache_or_one_line_error(monkeypatch, hf_home) -> None:
    """Not offline, but the hub refuses connections: the cached snapshot is used (under the download lock);
    an uncached id is one line saying the hub cannot be reached."""
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    snapshots = hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert resolve_model_path(REPO, "unused", "v1") == str(snapshots / V1)
    assert (hf_home / "hub" / ".locks" / "agentrl-models--agentrl-test--tiny.lock").exists()
    with pytest.raises(ConfigError, match="cannot be reached") as err:
        resolve_model_path("agentrl-test/missing")
    assert "\n" not in str(err.value)


def test_model_ref_keeps_hub_ids_for_actors(offline, tiny_model_path) -> None:
    assert model_ref(REPO, None, "/driver/snapshot") == REPO
    assert model_ref(REPO, "v1", "/driver/snapshot") == f"{REPO}@v1"
    assert model_ref(f"{REPO}@v1", None, "/driver/snapshot") == f"{REPO}@v1"
    assert model_ref("builtin:tiny", None, tiny_model_path) == tiny_model_path
    assert model_ref(tiny_model_path, "v1", tiny_model_path) == tiny_model_path
    assert hub_env() == {"HF_HOME": str(offline.parent.parent.parent), "HF_HUB_OFFLINE": "1"}


def test_ray_actor_resolves_the_hub_id_on_its_own(offline, ray_session) -> None:
    """The driver's HF settings reach the actor through runtime_env (hub_env); the actor resolves the ref itself."""

    @ray_session.remote(num_cpus=0, runtime_env={"env_vars": hub_env()})
    def resolve(ref: str) -> tuple[str, str]:
        import os

        from agentrl.models.tiny import resolve_model_path

        return resolve_model_path(ref), os.environ.get("HF_HUB_OFFLINE", "")

    path, flag = ray_session.get(resolve.remote(model_ref(REPO, "v1", "/driver/only")))
    assert (path, flag) == (str(offline / V1), "1")


def test_trainer_group_from_hub_id_exports_config_and_tokenizer(offline, ray_session, tmp_path, monkeypatch) -> None:
    from agentrl.trainer import TrainerGroup

    handed: list[str] = []
    create = TrainerGroup._create_ranks

    def spy(self, cfg, path, plat):
        handed.append(path)
        return create(self, cfg, path, plat)

    monkeypatch.setattr(TrainerGroup, "_create_ranks", spy)
    cfg = Config()
    cfg.model.path, cfg.model.revision = REPO, "v1"
    cfg.trainer.num_ranks = 1
    group = TrainerGroup(cfg)
    try:
        assert group.model_path == str(offline / V1)  # the driver's own resolution
        assert handed == [f"{REPO}@v1"]  # the ranks got the hub id, not the driver's snapshot path
        out = Path(group.export_weights(str(tmp_path / "export")))
    finally:
        group.shutdown()
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names, names
    assert "tokenizer_config.json" in names and "chat_template.jinja" in names
    assert json.loads((out / "config.json").read_text())["agentrl_test_revision"] == "v1"  # the pinned snapshot
