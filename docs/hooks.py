"""mkdocs hook: the config and command-line references are generated from the code at every build (never
written by hand, so they cannot drift): `agentrl.config.reference` and `agentrl.cli.reference`."""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from agentrl.cli.reference import cli_reference
    from agentrl.config.reference import config_reference

    for path, text in (("reference/config.md", config_reference()), ("reference/cli.md", cli_reference())):
        files.append(File.generated(config, path, content=text))
    return files
