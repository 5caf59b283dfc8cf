"""Every relative link of every markdown file in the repository must name a file
or folder that git tracks (a link to a file someone has only locally, ANCHORS.md
say, is broken for everyone else), and a #anchor into a markdown file must name
one of its headings (GitHub's slugs).

    python tools/ci/check_links.py        # prints each broken link; exit status 1 if any
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    files = {Path(p) for p in out.splitlines()}
    return files, files | {d for f in files for d in f.parents}


def slug(heading):
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links():
    files, known = tracked()
    bad = []
    for md in sorted(f for f in files if f.suffix == ".md"):
        text = re.sub(r"```.*?```", "", (ROOT / md).read_text(), flags=re.S)  # code is not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (ROOT / md).resolve() if not path else (ROOT / md.parent / path).resolve()
            try:
                rel = resolved.relative_to(ROOT)
            except ValueError:
                bad.append(f"{md}: {target} (outside the repository)")
                continue
            if rel not in known and rel != Path("."):
                bad.append(f"{md}: {target} (no such tracked file)")
            elif anchor and rel.suffix == ".md" and slug(anchor) not in anchors(resolved):
                bad.append(f"{md}: {target} (no such heading)")
    return bad


def main():
    bad = broken_links()
    for line in bad:
        print(line)
    print(f"check_links: {len(bad)} broken link(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
