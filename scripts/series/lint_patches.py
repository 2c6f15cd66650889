"""Check that the patch series keeps upstream's formatting.

Upstream formats with black, which ruff format does not match line for line, so a plain
`ruff format --check` of a patched file reports upstream's own lines too. Instead, for every
Python file the series touches, compare what ruff would change in the pristine file with what it
would change in the patched one: lines it would change only in the patched file are ours.
Also runs `ruff check` with upstream's own configuration on those files, and checks that every
commit message survives `git am`: a line starting with "---" ends the message there.
"""

import subprocess
import sys
from pathlib import Path

TREE = Path("vendor/mlx-lm")
RUFF = [sys.executable, "-m", "ruff"]


def git(*args):
    return subprocess.run(
        ["git", "-C", str(TREE), *args], capture_output=True, text=True, check=True
    ).stdout


def lines_ruff_would_change(source, name):
    diff = subprocess.run(
        [*RUFF, "format", "--diff", "--stdin-filename", name, "-"],
        input=source,
        capture_output=True,
        check=False,
        text=True,
    ).stdout
    return {
        line[1:].strip()
        for line in diff.splitlines()
        if line.startswith("-") and not line.startswith("---")
    }


def header_problems():
    """Commit messages that `git am` would cut short."""
    problems = 0
    for commit in git("rev-list", "upstream..HEAD").split():
        message = git("log", "-1", "--format=%B", commit)
        for line in message.splitlines():
            if line.startswith("---"):
                subject = message.splitlines()[0]
                print(f"{subject}: a message line starts with '---' ({line!r})")
                problems += 1
    return problems


def main():
    files = [
        f for f in git("diff", "--name-only", "upstream").split() if f.endswith(".py")
    ]
    problems = 0
    for name in files:
        patched = (TREE / name).read_text()
        try:
            pristine = git("show", f"upstream:{name}")
        except subprocess.CalledProcessError:
            pristine = ""
        ours = lines_ruff_would_change(patched, name) - lines_ruff_would_change(
            pristine, name
        )
        for line in sorted(ours):
            print(f"{name}: not formatted: {line}")
        problems += len(ours)
    if files:
        check = subprocess.run([*RUFF, "check", "-q", *files], cwd=TREE, check=False)
        problems += check.returncode
    problems += header_problems()
    print(f"lint-patches: {len(files)} patched file(s), {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
