"""Real English text for the fidelity tasks, prepared once, offline afterwards.

    python -m vllm_kvevict.eval.texts      # setup step (scripts/setup.sh runs it)

Downloads two Debian packages with ``apt-get download`` (no root needed) and
unpacks them with ``dpkg -x`` into a temp dir:

  jargon-text          the Jargon File 4.4.7, plain text (~400K tokens)
  r-cran-janeaustenr   six Austen novels (100K-220K tokens each), stored as an
                       R lazy-load database, read by :mod:`vllm_kvevict.eval.rdata`

and writes clean UTF-8 ``.txt`` files (hard-wrapped lines reflowed into one
line per paragraph, paragraphs separated by a blank line) plus ``index.json``
into :func:`vllm_kvevict.passages.texts_dir`. Idempotent: once ``index.json``
lists every source it returns at once. Nothing here runs at harness time: the
harness and ``python -m vllm_kvevict.calibrate`` read the texts through
:mod:`vllm_kvevict.passages`, which never downloads.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_kvevict.eval.rdata import load_lazy_db
from vllm_kvevict.passages import AUSTEN, JARGON, texts_dir


def reflow(lines: list[str]) -> str:
    """Hard-wrapped lines -> one line per paragraph, paragraphs split by "\\n\\n".

    NOTE: the sources wrap at ~70 columns; a line break mid-sentence is not
    text a model would see in the wild and costs a token each, so unwrap.
    """
    paragraphs, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(re.sub(r"\s+", " ", p) for p in paragraphs) + "\n"


def _apt_fetch(package: str, workdir: Path) -> Path:
    """``apt-get download`` + ``dpkg -x`` ``package`` under ``workdir``; returns the root."""
    cmd = ["apt-get", "download", "-q", package]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=False)
    if proc.returncode != 0 and os.geteuid() == 0:
        # A fresh machine may have no package lists yet; root can make them.
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, check=False)
        proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (need Debian's package lists: "
                           f"`apt-get update` as root):\n{proc.stderr.strip()}")
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    root = workdir / package
    subprocess.run(["dpkg", "-x", str(debs[-1]), str(root)], check=True)
    return root


def _jargon(root: Path) -> dict[str, str]:
    """The Jargon File: the introduction chapters and every lexicon entry.

    Skipped: the table of contents and the glossary's list of entry names
    (thousands of one-word lines, which would make a strange haystack) and
    box-drawn tables.
    """
    path = root / "usr/share/doc/jargon-text/jargon.txt.gz"
    lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    # NOTE: headings use no-break spaces ("Chapter\xa01."), hence \s.
    start = next(i for i, ln in enumerate(lines) if re.match(r"Chapter\s1\.", ln))
    glossary = next(i for i, ln in enumerate(lines) if ln == "Glossary")
    first_entry = next(i for i in range(glossary, len(lines)) if lines[i].startswith("   :"))
    text = reflow(lines[start:glossary] + [""] + lines[first_entry:])
    # Drop the box-drawn tables (a few hundred paragraphs of "─┼│"): reflowed,
    # they are long runs of line-art, not text.
    kept = [p for p in text.split("\n\n") if sum("\u2500" <= c <= "\u257f" for c in p) < 3]
    return {JARGON: "\n\n".join(kept)}


def _austen(root: Path) -> dict[str, str]:
    """The six novels: R character vectors, one element per printed line."""
    db = load_lazy_db(root / "usr/lib/R/site-library/janeaustenr/data/Rdata")
    missing = [n for n in AUSTEN if n not in db]
    if missing:
        raise RuntimeError(f"janeaustenr database lacks {missing}; has {sorted(db)}")
    return {f"austen_{n}": reflow([ln or "" for ln in db[n]]) for n in AUSTEN}


SOURCES = {"jargon-text": _jargon, "r-cran-janeaustenr": _austen}


def ensure_texts(dest: Path | None = None, quiet: bool = False) -> Path:
    """Download and convert every source not yet in ``dest`` (default :func:`texts_dir`)."""
    dest = Path(dest) if dest else texts_dir()
    index_path = dest / "index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    todo = [pkg for pkg in SOURCES if pkg not in index.get("packages", {})]
    if not todo:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm_kvevict-texts-") as tmp:
        for package in todo:
            if not quiet:
                print(f"[texts] {package}: apt-get download + dpkg -x", file=sys.stderr)
            texts = SOURCES[package](_apt_fetch(package, Path(tmp)))
            for name, text in texts.items():
                # Write beside, then rename: a killed run never leaves half a file.
                part = dest / f".{name}.txt.partial"
                part.write_text(text, encoding="utf-8")
                os.replace(part, dest / f"{name}.txt")
            index.setdefault("packages", {})[package] = sorted(texts)
            index.setdefault("chars", {}).update({n: len(t) for n, t in texts.items()})
            index_path.write_text(json.dumps(index, indent=1, sort_keys=True))
    return dest


def main() -> int:
    if not shutil.which("apt-get") and not (texts_dir() / "index.json").is_file():
        print("apt-get not found: the texts come from Debian packages", file=sys.stderr)
        return 1
    dest = ensure_texts()
    index = json.loads((dest / "index.json").read_text())
    for name, chars in sorted(index["chars"].items()):
        print(f"{dest / (name + '.txt')}  {chars:,} chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
