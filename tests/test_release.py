"""What a release carries: one version everywhere, its CHANGELOG entry, `py.typed`."""

import pathlib
import re
import tomllib

import lossscale

ROOT = pathlib.Path(__file__).parents[1]


def test_one_version_in_pyproject_the_package_and_the_changelog():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert lossscale.__version__ == project["version"], (
        lossscale.__version__,
        project["version"],
    )
    released = re.findall(
        r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.M
    )
    assert released and released[0] == project["version"], (
        released,
        project["version"],
    )


def test_the_package_says_it_is_typed():
    assert (pathlib.Path(lossscale.__file__).parent / "py.typed").is_file()
