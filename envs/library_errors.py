"""What an env library could not fetch here (no network): one line naming the data and where it goes.

Libraries fetch what they lack at construction (TextArena's and GEM's word games load nltk corpora; GEM's math and
QA envs load Hugging Face datasets). Offline that is a LookupError or a hub error deep in the library; the adapters
turn it into a one-line ValueError at env construction, before any engine starts.
"""

from __future__ import annotations

import re


def offline_data_error(env_id: str, err: BaseException) -> ValueError | None:
    """A one-line error for `err` when it is a library asking for data it could not download; None otherwise."""
    if isinstance(err, LookupError):
        found = re.search(r"Resource '?(?:\x1b\[\d+m)?([\w.-]+)", str(err))
        resource = found.group(1) if found else "its data"
        import nltk

        return ValueError(
            f"{env_id} needs the nltk data {resource!r}, which it could not download here: run "
            f"`python -m nltk.downloader {resource}` where there is network and copy it into one of "
            f"{', '.join(nltk.data.path[:3])} (or set NLTK_DATA)"
        )
    text = f"{type(err).__name__}: {err}"
    if "No module named 'datasets'" in text or "huggingface" in text.lower() or "hf_hub" in text:
        from huggingface_hub.constants import HF_HUB_CACHE

        return ValueError(
            f"{env_id} loads its tasks from the Hugging Face hub, which is not reachable here ({text.splitlines()[0]}"
            f"): pip install datasets and download them where there is network into {HF_HUB_CACHE} (or set HF_HOME)"
        )
    return None
