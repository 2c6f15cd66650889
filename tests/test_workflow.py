"""The vendor and patch-series scripts (scripts/series/) on a scratch copy of the project.

Uses the sdist that `make vendor` keeps in vendor/.cache (no download).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIN = dict(
    line.split("=", 1)
    for line in (ROOT / "vendor/mlx-lm.pin").read_text().splitlines()
    if "=" in line and not line.startswith("#")
)


@pytest.fixture
def project(tmp_path):
    sdist = ROOT / "vendor/.cache" / PIN["file"]
    if not sdist.exists():
        subprocess.run([ROOT / "scripts/series/vendor.sh"], check=True)
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "patches", tmp_path / "patches")
    (tmp_path / "vendor/.cache").mkdir(parents=True)
    shutil.copy(ROOT / "vendor/mlx-lm.pin", tmp_path / "vendor")
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(sdist, tmp_path / "vendor/.cache")
    return tmp_path


def run(project, *args):
    return subprocess.run(
        [str(project / "scripts/series" / args[0]), *args[1:]],
        cwd=project,
        capture_output=True,
        text=True,
        check=False,
    )


def git(tree, *args):
    return subprocess.run(
        ["git", "-C", str(tree), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_hash_mismatch_is_a_clear_error(project):
    pin = project / "vendor/mlx-lm.pin"
    pin.write_text(pin.read_text().replace(PIN["sha256"], "0" * 64))
    result = run(project, "vendor.sh")
    assert result.returncode != 0
    assert "sha256 mismatch" in result.stderr
    assert not (project / "vendor/mlx-lm").exists()


def test_series_applies_one_commit_per_patch(project):
    result = run(project, "patches.sh", "apply")
    assert result.returncode == 0, result.stderr
    names = (project / "patches/series").read_text().split()
    log = git(project / "vendor/mlx-lm", "log", "--format=%s", "upstream..HEAD")
    assert len(log.splitlines()) == len(names)
    # applying again is idempotent
    head = git(project / "vendor/mlx-lm", "rev-parse", "HEAD^{tree}")
    assert run(project, "patches.sh", "apply").returncode == 0
    assert git(project / "vendor/mlx-lm", "rev-parse", "HEAD^{tree}") == head


def test_patch_that_does_not_apply_leaves_the_tree_pristine(project):
    names = (project / "patches/series").read_text().split()
    broken = project / "patches" / names[-1]
    header, diff = broken.read_text().split("\ndiff --git", 1)
    # context lines that are not in the file any more
    broken.write_text(header + "\ndiff --git" + diff.replace("\n ", "\n #", 5))
    result = run(project, "patches.sh", "apply")
    assert result.returncode != 0
    assert f"{names[-1]} does not apply" in result.stderr
    tree = project / "vendor/mlx-lm"
    assert git(tree, "rev-parse", "HEAD") == git(tree, "rev-parse", "upstream")
    assert git(tree, "status", "--porcelain") == ""


def test_empty_series_and_refresh(project):
    (project / "patches/series").write_text("")
    assert run(project, "patches.sh", "apply").returncode == 0
    tree = project / "vendor/mlx-lm"
    assert git(tree, "rev-parse", "HEAD") == git(tree, "rev-parse", "upstream")
    # a commit on top becomes a patch file listed in series
    (tree / "NOTE.txt").write_text("a change\n")
    git(tree, "add", "NOTE.txt")
    git(tree, "commit", "-q", "-m", "Add a note")
    assert run(project, "patches.sh", "refresh").returncode == 0
    assert (project / "patches/series").read_text().split() == ["0001-Add-a-note.patch"]
    assert run(project, "patches.sh", "unapply").returncode == 0
    assert not (tree / "NOTE.txt").exists()


def test_upstream_check_is_a_gate(project):
    # every patch applies to the pinned release; a patch that does not fails the check
    names = (project / "patches/series").read_text().split()
    result = run(project, "patches.sh", "check", PIN["version"])
    assert result.returncode == 0, result.stderr
    assert f"{len(names)} patch(es) apply cleanly, 0 do not" in result.stdout
    broken = project / "patches" / names[-1]
    header, diff = broken.read_text().split("\ndiff --git", 1)
    broken.write_text(header + "\ndiff --git" + diff.replace("\n ", "\n #", 5))
    result = run(project, "patches.sh", "check", PIN["version"])
    assert result.returncode != 0
    assert f"FAILS     {names[-1]}" in result.stdout


def make(project, *args):
    return subprocess.run(
        ["make", "-s", *args], cwd=project, capture_output=True, text=True, check=False
    )


def pristine(project, name):
    """A fresh copy of upstream's pristine tree (the pinned sdist, one commit)."""
    tree = project / "vendor" / name
    assert run(project, "vendor.sh", str(tree)).returncode == 0
    return tree


def test_pr_1_applies_to_pristine_upstream(project):
    result = make(project, "pr", "1")
    assert result.returncode == 0, result.stderr
    out = project / "build/pr/0001"
    names = (project / "patches/series").read_text().split()
    assert (out / names[0]).read_text() == (project / "patches" / names[0]).read_text()
    # what make pr 1 wrote applies with git am to upstream's pristine tree
    tree = pristine(project, "upstream-clone")
    git(tree, "am", "-q", str(out / names[0]))
    series = project / "vendor/mlx-lm"
    assert git(tree, "rev-parse", "HEAD^{tree}") == git(
        series, "rev-parse", "pr/0001^{tree}"
    )
    # the PR text is the patch's commit message, with nothing to build on
    subject = git(tree, "log", "-1", "--format=%s")
    assert (out / "title.txt").read_text().strip() == subject
    body = (out / "body.md").read_text()
    assert body.strip() == git(tree, "log", "-1", "--format=%b")
    assert "Builds on" not in body


def test_pr_stacks_the_earlier_patches(project):
    # patch 3 needs 1 and 2: the mbox carries all three, the text says so, and
    # with CLONE the branch is made in a clone at the release tag
    clone = pristine(project, "clone")
    version = PIN["version"]
    git(clone, "tag", f"v{version}")
    result = make(project, "pr", "3", f"CLONE={clone}")
    assert result.returncode == 0, result.stderr
    names = (project / "patches/series").read_text().split()
    log = git(clone, "log", "--format=%s", f"v{version}..pr/0003").splitlines()
    assert len(log) == 3
    series = project / "vendor/mlx-lm"
    assert git(series, "rev-list", "--count", "upstream..pr/0003") == "3"
    assert git(clone, "rev-parse", "pr/0003^{tree}") == git(
        series, "rev-parse", "pr/0003^{tree}"
    )
    body = (project / "build/pr/0003/body.md").read_text()
    assert body.startswith("**Builds on**")
    for k, subject in ((1, log[2]), (2, log[1])):
        assert f"- {k:04d} {subject}" in body
    assert (project / "build/pr/0003/title.txt").read_text().strip() == log[0]
    assert (project / "build/pr/0003" / names[2]).exists()


def test_pr_needs_a_patch_number(project):
    count = len((project / "patches/series").read_text().split())
    for args in (["pr"], ["pr", "0"], ["pr", str(count + 1)], ["pr", "N=x"]):
        result = make(project, *args)
        assert result.returncode != 0
        assert f"N = 1..{count}" in result.stderr, (args, result.stderr)
