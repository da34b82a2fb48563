"""Package data for `agentrl init DIR`: the files of a new project (`project/`, written by agentrl.cli.init_cmd).

Files end in `.tmpl` (so that neither pytest nor ruff takes them for agentrl's own code). In their text,
`{{package}}` becomes the project's Python package name and `{{name}}` its folder name; the `package/` folder is
written as the package's folder, and `dot_x` as `.x`.
"""
