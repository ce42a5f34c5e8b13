"""The lock installs anywhere (PyPI only) and every package ships what a release needs (one CuTe DSL range, the
license, py.typed)."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())
PYPROJECTS = sorted((ROOT / "packages").glob("*/pyproject.toml"))
PACKAGES = [p.parent.name for p in PYPROJECTS]
PYPI = "https://pypi.org/simple"


def _project(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())


def _walk(node, path=()):
    """Every (key path, value) pair under a TOML node."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, (*path, k))
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, path)
    else:
        yield path, node


def test_the_lock_names_no_local_path():
    bad = []
    for path, value in _walk(LOCK):
        local_key = bool(path) and path[-1] in ("path", "filename", "directory")
        local_value = isinstance(value, str) and (value.startswith(("/", "file:", "~")) or ".." in value.split("/"))
        if local_key or local_value:
            bad.append(f"{'.'.join(path)} = {value!r}")
    assert not bad, "uv.lock points at local files (re-lock without UV_FIND_LINKS):\n" + "\n".join(bad[:20])


def test_the_lock_resolves_from_pypi_only():
    for pkg in LOCK["package"]:
        source = pkg["source"]
        if "registry" in source:
            assert source["registry"] == PYPI, pkg["name"]
            assert "+" not in pkg["version"], f"{pkg['name']} {pkg['version']}: a local version is no PyPI release"
            for dist in [pkg.get("sdist", {}), *pkg.get("wheels", [])]:
                if dist:
                    assert dist["url"].startswith("https://files.pythonhosted.org/"), (pkg["name"], dist["url"])
        else:
            assert set(source) <= {"editable", "virtual"}, (pkg["name"], source)
    for c in LOCK.get("manifest", {}).get("constraints", []):
        assert "+" not in c.get("specifier", ""), c


@pytest.mark.parametrize("name", ["torch"])
def test_torch_is_locked_once(name):
    versions = {p["version"] for p in LOCK["package"] if p["name"] == name}
    assert len(versions) == 1, versions


def test_every_package_asks_for_one_cutlass_dsl_range():
    ranges = {}
    for name in PACKAGES:
        for dep in _project(name)["project"].get("dependencies", []):
            req = Requirement(dep)
            if req.name == "nvidia-cutlass-dsl":
                ranges[name] = (str(req.specifier), tuple(sorted(req.extras)))
    assert len(ranges) >= 4, ranges
    assert len(set(ranges.values())) == 1, ranges
    spec = Requirement("nvidia-cutlass-dsl" + next(iter(ranges.values()))[0]).specifier
    locked = next(p["version"] for p in LOCK["package"] if p["name"] == "nvidia-cutlass-dsl")
    assert spec.contains(locked), (locked, str(spec))


def test_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    for name in PACKAGES:
        project = _project(name)
        assert project["project"]["license"] == "Apache-2.0", name
        # a copy in each package's root: hatchling puts it in the sdist and in the wheel's .dist-info/licenses,
        # whether the wheel is built from the sdist or straight from the tree (uv build --wheel)
        assert (ROOT / "packages" / name / "LICENSE").read_text() == text, f"packages/{name}/LICENSE"


@pytest.mark.parametrize("name", PACKAGES)
def test_each_package_ships_py_typed(name):
    project = _project(name)
    (src,) = project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]  # the wheel takes this whole folder
    assert (ROOT / "packages" / name / src / "py.typed").is_file(), f"packages/{name}/{src}/py.typed"
    assert src == "src/" + name.replace("-", "_")


@pytest.mark.parametrize("name", PACKAGES)
def test_project_urls(name):
    urls = _project(name)["project"]["urls"]
    assert {"Homepage", "Repository", "Issues"} <= set(urls), urls
    assert all(u.startswith("https://") for u in urls.values()), urls
