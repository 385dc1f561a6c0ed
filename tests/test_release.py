"""What a release carries: one version everywhere, its CHANGELOG entry, `py.typed`."""

import pathlib
import re
import tomllib

from packaging.version import Version

import lossscale

ROOT = pathlib.Path(__file__).parents[1]


def test_one_version_in_pyproject_the_package_and_the_changelog():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert lossscale.__version__ == project["version"], (
        lossscale.__version__,
        project["version"],
    )
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## \[(\d[^\]]*)\]", changelog, re.M)
    version = Version(project["version"])
    if version.is_devrelease:  # between releases: changes under "Unreleased"
        assert released and Version(released[0]) < version, (released, str(version))
        assert "\n## [Unreleased]\n" in changelog
    else:
        assert released and released[0] == project["version"], (released, version)


def test_the_package_says_it_is_typed():
    assert (pathlib.Path(lossscale.__file__).parent / "py.typed").is_file()
