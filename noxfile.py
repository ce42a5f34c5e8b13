"""Test sessions. CI calls nox; nox calls pytest. Every session installs from uv.lock (`uv sync --frozen`).

nox -s "tests(package='gcmoe-core')"   one component alone, in its own environment (proves it installs alone)
nox -s tests                           every component, one environment each
nox -s integration                     end to end: the CLI, the offline compile, docs consistency
nox -s compile                         CuTe DSL kernels compiled offline for sm_90a / sm_100a / sm_103a + SASS checks
nox -s lint                            ruff
nox -s docs                            the documentation site: mkdocs build --strict into site/
nox -s gpu                             what a GPU runner runs: the gpu/sm90/sm103-marked tests, then `gcmoe-lab bench`
nox -s ci                              lint + tests + integration + compile + docs, as .ci/run runs them
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests", "integration", "compile", "docs"]

PACKAGES = ["gcmoe-core", "gcmoe-greenctx", "gcmoe-comm", "gcmoe-gemm-sm90", "gcmoe-gemm-sm103", "gcmoe", "gcmoe-lab"]
PYTHON = "3.11"


def _sync(session: nox.Session, *packages: str, group: str = "dev") -> None:
    """Install `packages` (all of the workspace when none) plus a dependency group into the session's environment."""
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
        env["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]  # the local CPU torch build, where the machine has one
    args = ["uv", "sync", "--frozen", "--inexact", "--group", group]
    for p in packages:
        args += ["--package", p]
    session.run_install(*args, env=env)


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
