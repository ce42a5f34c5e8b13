"""Test sessions. CI calls nox; nox calls pytest. Every session installs from uv.lock (`uv sync --frozen`).

nox -s "tests(package='gcmoe-core')"   one component alone, in its own environment (proves it installs alone)
nox -s tests                           every component, one environment each
nox -s integration                     end to end: the CLI, the offline compile, docs consistency
nox -s compile                         CuTe DSL kernels compiled offline for sm_90a / sm_100a / sm_103a + SASS checks
nox -s lint                            ruff
nox -s docs                            the documentation site: mkdocs build --strict into site/
nox -s engines                         opt-in: the vLLM adapter against vLLM's real classes (installs vLLM from PyPI)
nox -s gpu                             what a GPU runner runs: the gpu/sm90/sm103-marked tests, then `gcmoe-lab bench`
nox -s ci                              lint + tests + integration + compile + docs, as .ci/run runs them
nox -s venv                            the project's .venv as `uv run` would make it (honours the override below)

uv.lock resolves from PyPI (torch: the CUDA build). GCMOE_TORCH_FIND_LINKS=<folder with a CPU torch wheel of the
locked version> makes every session take torch from that folder and skip the CUDA wheels only torch needs.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests", "integration", "compile", "docs"]

PACKAGES = ["gcmoe-core", "gcmoe-greenctx", "gcmoe-comm", "gcmoe-gemm-sm90", "gcmoe-gemm-sm103", "gcmoe", "gcmoe-lab"]
PYTHON = "3.11"
ROOT = Path(__file__).parent
# The override for CPU-only machines (CI sets it from PIP_FIND_LINKS, .ci/run): a folder holding a CPU build of the
# locked torch version. uv.lock resolves from PyPI, where torch is the CUDA build; with this set, the sessions install
# the lock without torch and the CUDA wheels only it needs, then torch itself from the folder.
TORCH_FIND_LINKS = "GCMOE_TORCH_FIND_LINKS"


def _locked_torch() -> tuple[str, list[str]]:
    """uv.lock's torch version, and the packages of the lock that only torch pulls in and that a CPU build does not
    need (nvidia-*, cuda-*, triton: reached from torch but from nothing else in the workspace or its groups)."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    pkgs = {p["name"]: p for p in lock["package"]}

    def deps(p: dict) -> list[dict]:
        out = list(p.get("dependencies", []))
        for group in p.get("dev-dependencies", {}).values():
            out += group
        for extras in p.get("optional-dependencies", {}).values():  # every extra: a superset is safe here
            out += extras
        return out

    def reach(start: list[str], skip: str | None) -> set[str]:
        seen: set[str] = set()
        todo = [n for n in start if n != skip]
        while todo:
            name = todo.pop()
            if name in seen or name not in pkgs:
                continue
            seen.add(name)
            todo += [d["name"] for d in deps(pkgs[name]) if d["name"] != skip]
        return seen

    roots = [p["name"] for p in pkgs.values() if "editable" in p["source"] or "virtual" in p["source"]]
    only_torch = reach(["torch"], None) - reach(roots, "torch")
    cuda = sorted(n for n in only_torch if n.startswith(("nvidia-", "cuda-")) or n == "triton")
    return pkgs["torch"]["version"], cuda


def _sync(session: nox.Session, *packages: str, group: str = "dev", venv: str | None = None) -> None:
    """Install `packages` (all of the workspace when none) plus a dependency group into the session's environment
    (or `venv`), from uv.lock. With GCMOE_TORCH_FIND_LINKS set: torch from that folder instead of PyPI's CUDA build."""
    venv = venv or session.virtualenv.location
    args = ["uv", "sync", "--frozen", "--inexact", "--group", group]
    for p in packages:
        args += ["--package", p]
    folder = os.environ.get(TORCH_FIND_LINKS)
    if not folder:
        session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": venv})
        return
    version, cuda = _locked_torch()
    for name in ["torch", *cuda]:
        args += ["--no-install-package", name]
    session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": venv})
    # the folder's build of the locked version (2.13.0 matches 2.13.0+cpu); its own dependencies (filelock, sympy,
    # ...) are in the lock and installed above, so nothing comes from an index
    session.run_install(
        "uv", "pip", "install", "--python", venv, "--no-index", "--find-links", folder, f"torch=={version}"
    )


@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests in an environment holding only that package and what it depends on."""
    _sync(session, package)
    session.run("pytest", f"packages/{package}/tests", "-m", "not slow", *session.posargs)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    _sync(session)
    session.run("pytest", "tests-integration", *session.posargs)


@nox.session(python=PYTHON)
def compile(session: nox.Session) -> None:
    _sync(session)
    session.run("pytest", "packages", "tests-integration", "-m", "compile", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    _sync(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The site (mkdocs.yml): strict, so a broken link, a page missing from the nav or an API name that does not
    resolve fails it. Offline: no plugin fetches anything at build time. `nox -s docs -- --site-dir DIR` elsewhere."""
    _sync(session, group="docs")
    site = session.posargs or ["--site-dir", "site"]
    session.run("mkdocs", "build", "--strict", *site, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=False)
def venv(session: nox.Session) -> None:
    """The project's .venv, as `uv run` makes it (the workspace and the dev group), but honouring
    GCMOE_TORCH_FIND_LINKS; then `uv run --no-sync gcmoe demo` uses it."""
    _sync(session, venv=os.environ.get("UV_PROJECT_ENVIRONMENT") or str(ROOT / ".venv"))


@nox.session(python=PYTHON)
def engines(session: nox.Session) -> None:
    """Opt-in (not in CI's list): the engine adapters against the engines' real classes, vLLM from PyPI (not uv.lock;
    it brings its own CUDA torch, several GB). CPU-runnable; the GPU-marked tests skip without one."""
    session.install("vllm==0.33.0", "pytest")
    session.install("--no-deps", *[f"-e./packages/{p}" for p in PACKAGES if p != "gcmoe-lab"])
    # vllm 0.33.0 pins nvidia-cutlass-dsl 4.8.0; the kernels are tested on 4.8.1 (installed over it, a known conflict)
    session.install("nvidia-cutlass-dsl[cu13]==4.8.1", "cuda-bindings>=12.8", "tqdm>=4.66", "safetensors>=0.4")
    session.run("pytest", "packages/gcmoe/tests/test_vllm_adapter.py", "-rs", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """On a GPU machine, in the interpreter that has CUDA torch (a self-hosted runner, or tools/gpu/run.sh)."""
    session.run(
        "python",
        "-m",
        "pytest",
        "packages",
        "tests-integration",
        "-m",
        "gpu or sm90 or sm103 or multigpu",
        "-rs",
        *session.posargs,
    )
    session.run(
        "python", "-m", "gcmoe_lab", "bench", "--json", "bench.json", "--markdown", "bench.md", "--plot", "bench.png"
    )


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    for name in nox.options.sessions:
        session.notify(name)
