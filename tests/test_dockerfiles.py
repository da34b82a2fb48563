"""The container images (docker/Dockerfile.cuda, .ascend, .sglang), read without a container daemon.

Each Dockerfile is parsed into instructions (comments dropped, line continuations joined) and checked: it starts
from the official base image of its platform (the Ascend one with a build argument choosing the A2 or A3 tag), it
copies the package in before installing it, it installs agentrl with the platform's extra and constraints file
(which must exist), the base image's release agrees with the versions that file pins, and its last step is
`RUN agentrl --help`. docker/README.md must give every build command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[1]
DOCKER = ROOT / "docker"

# platform -> (Dockerfile, extra, constraints file, accepted base image repositories)
PLATFORMS = {
    "cuda": (
        "Dockerfile.cuda",
        "cuda",
        "constraints-cuda.txt",
        {"vllm/vllm-openai", "pytorch/pytorch", "nvcr.io/nvidia/pytorch"},
    ),
    "ascend": ("Dockerfile.ascend", "ascend", "constraints-ascend.txt", {"quay.io/ascend/vllm-ascend"}),
    "sglang": ("Dockerfile.sglang", "sglang", "constraints-sglang.txt", {"lmsysorg/sglang"}),
}
# base image repository -> the package whose release its tag names
IMAGE_PACKAGE = {"vllm/vllm-openai": "vllm", "quay.io/ascend/vllm-ascend": "vllm-ascend", "lmsysorg/sglang": "sglang"}
# The build argument that chooses the Atlas A3 image instead of the A2 (910B) one, and its value.
A3_ARG, A3_VALUE = "ASCEND_TAG_SUFFIX", "-a3"
RELEASE_TAG = re.compile(r"v(\d+\.\d+\.\d+(?:rc\d+)?(?:\.post\d+)?)")


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. A line ending in a backslash continues on the next one; comment lines (parser
    directives included) and blank lines are dropped, also inside a continued instruction, as Docker does."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            joined = " ".join(p for p in parts if p)
            keyword, _, args = joined.partition(" ")
            out.append(Instruction(keyword.upper(), args.strip(), start))
            parts = []
    assert not parts, "the Dockerfile ends inside a continued instruction"
    return out


def _args_before_from(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def _substitute(text: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"{name} is used in FROM but not declared by an ARG before it"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, text)


def base_image(instructions: list[Instruction], build_args: dict[str, str] | None = None) -> tuple[str, str]:
    """(repository, tag) of the single FROM, with the ARG defaults declared before it (and `build_args`) applied."""
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    assert len(froms) == 1, f"expected one build stage, found {len(froms)} FROM instructions"
    image = _substitute(froms[0].args.split()[0], {**_args_before_from(instructions), **(build_args or {})})
    repo, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
    return repo, tag


def _copied_sources(instructions: list[Instruction], before: int) -> set[str]:
    sources: set[str] = set()
    for ins in instructions[:before]:
        if ins.keyword in ("COPY", "ADD"):
            words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            sources.update(w.rstrip("/") or "." for w in words[:-1])
    return sources


def _constraint_files(words: list[str]) -> list[str]:
    found = []
    for i, w in enumerate(words):
        if w in ("-c", "--constraint") and i + 1 < len(words):
            found.append(words[i + 1])
        elif w.startswith("--constraint="):
            found.append(w.split("=", 1)[1])
        elif w.startswith("-c") and len(w) > 2:
            found.append(w[2:])
    return found


def project_install(instructions: list[Instruction]) -> tuple[int, list[str]]:
    """(index, words) of the one `pip install` command that installs the project (`.[extra]`)."""
    hits = []
    for index, ins in enumerate(instructions):
        if ins.keyword != "RUN":
            continue
        for command in re.split(r"&&|;|\|\|", ins.args):
            words = shlex.split(command)
            if "pip" in words and "install" in words and any(re.fullmatch(r"\.\[[\w,-]+\]", w) for w in words):
                hits.append((index, words))
    assert len(hits) == 1, f"expected one `pip install` of the project, found {len(hits)}"
    return hits[0]


def _pins(constraints: Path) -> dict[str, Version]:
    pins = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[canonicalize_name(req.name)] = Version(exact[0])
    return pins


def _release(version: Version) -> tuple[int, ...]:
    return version.release[:3]


@pytest.fixture(scope="module", params=sorted(PLATFORMS))
def platform(request):
    name = request.param
    dockerfile, extra, constraints, bases = PLATFORMS[name]
    path = DOCKER / dockerfile
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return name, parse_dockerfile(path.read_text()), extra, constraints, bases


def test_parser_joins_continuations_and_drops_comments():
    text = "# syntax=docker/dockerfile:1\nARG A=1\nFROM x:${A}\nRUN a \\\n  # inside\n  && b \\\n\n  && c\nRUN d\n"
    got = [(i.keyword, i.args, i.line) for i in parse_dockerfile(text)]
    assert got == [("ARG", "A=1", 2), ("FROM", "x:${A}", 3), ("RUN", "a && b && c", 4), ("RUN", "d", 9)]
    assert base_image(parse_dockerfile(text)) == ("x", "1")
    assert base_image(parse_dockerfile(text), {"A": "2-a3"}) == ("x", "2-a3")


def test_from_official_base_image(platform):
    name, instructions, _, _, bases = platform
    repo, tag = base_image(instructions)
    assert repo in bases, f"{name}: FROM {repo}:{tag} is not one of the official images {sorted(bases)}"
    assert tag != "latest", f"{name}: pin the base image's tag"


def test_ascend_build_arg_chooses_a2_or_a3_image():
    instructions = parse_dockerfile((DOCKER / "Dockerfile.ascend").read_text())
    assert A3_ARG in _args_before_from(instructions), f"declare ARG {A3_ARG} before FROM"
    _, a2 = base_image(instructions)
    _, a3 = base_image(instructions, {A3_ARG: A3_VALUE})
    assert RELEASE_TAG.fullmatch(a2), f"the default tag {a2!r} should be a plain release (the Atlas A2 / 910B image)"
    assert a3 == a2 + A3_VALUE, f"--build-arg {A3_ARG}={A3_VALUE} should give the Atlas A3 tag, got {a3!r}"


def test_installs_with_matching_extra_and_constraints(platform):
    name, instructions, extra, constraints, _ = platform
    _, words = project_install(instructions)
    targets = [w for w in words if re.fullmatch(r"\.\[[\w,-]+\]", w)]
    assert targets == [f".[{extra}]"], f"{name}: install `.[{extra}]`, found {targets}"
    assert constraints in _constraint_files(words), f"{name}: the install must use -c {constraints}"
    assert (ROOT / constraints).is_file(), f"{constraints} is missing from the repository root"


def test_copies_the_package_before_installing_it(platform):
    name, instructions, _, constraints, _ = platform
    index, _ = project_install(instructions)
    copied = _copied_sources(instructions, index)
    if "." in copied:
        return
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", constraints, project["project"]["readme"]}
    needed |= set(project["tool"]["setuptools"]["package-dir"].values())
    missing = needed - copied
    assert not missing, f"{name}: COPY these before the install: {sorted(missing)}"


def test_last_instruction_runs_the_cli(platform):
    name, instructions, _, _, _ = platform
    last = instructions[-1]
    assert (last.keyword, last.args) == ("RUN", "agentrl --help"), f"{name}: last instruction is {last}"


def test_base_image_release_matches_constraints(platform):
    """The image's vLLM (vllm-ascend, SGLang) must be the versions the constraints file pins, so that installing
    agentrl keeps them."""
    name, instructions, _, constraints, _ = platform
    repo, tag = base_image(instructions)
    if repo not in IMAGE_PACKAGE:
        return  # a PyTorch base image holds no engine: the constraints file's pins are what pip installs
    match = RELEASE_TAG.match(tag)
    assert match, f"{name}: cannot read a release from the tag {tag!r}"
    image_release = Version(match.group(1))
    path = ROOT / constraints
    assert path.is_file(), f"{constraints} is missing from the repository root"
    pins = _pins(path)
    main = IMAGE_PACKAGE[repo]
    assert main in pins, f"{name}: {constraints} must pin {main}, the release of image {tag}"
    for package in ("vllm", "vllm-ascend", "sglang"):
        if package not in pins:
            continue
        if package == main:
            assert pins[package] == image_release, f"{name}: {constraints} pins {package}=={pins[package]}, image {tag}"
        else:
            assert _release(pins[package]) == _release(image_release), (
                f"{name}: {constraints} pins {package}=={pins[package]}, which is not the release of image {tag}"
            )


def test_readme_gives_both_build_commands():
    readme = (DOCKER / "README.md").read_text()
    for dockerfile, _, _, _ in PLATFORMS.values():
        assert re.search(rf"docker build [^\n]*-f docker/{re.escape(dockerfile)}\b[^\n]* \.", readme), (
            f"docker/README.md: give the build command for docker/{dockerfile}"
        )
    assert f"--build-arg {A3_ARG}={A3_VALUE}" in readme, "docker/README.md: show how to build the Atlas A3 image"
