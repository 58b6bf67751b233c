"""Split a file into parts small enough to carry, and put it back together where it lands.

A GPU machine reached only through a copy of the checkout takes at most 64 MiB per
command; a larger file (the embedded SmolLM2 package, 94 MiB) travels in parts over
successive commands on the same machine:

    python bench/carry_parts.py split FILE DIR [--parts N | --part-mib M]
        DIR/NAME.000, NAME.001, ... and DIR/NAME.parts.json (the whole file's size and
        sha256, and each part's)
    python bench/carry_parts.py stash DIR STORE
        copies every part found in DIR (each checked against its manifest) into STORE, a
        folder outside the checkout that outlives the command; prints what STORE holds
    python bench/carry_parts.py join STORE NAME DEST
        writes DEST from the parts in STORE once all are there and the whole file's sha256
        matches; exit status 3 (and the missing parts named) while some are missing

Only the standard library: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MANIFEST = ".parts.json"
CHUNK = 1 << 20
MISSING = 3  # join's exit status while parts are missing


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def part_name(name: str, index: int) -> str:
    return f"{name}.{index:03d}"


def split(src: Path, dest: Path, part_bytes: int) -> dict:
    """Write ``src`` as parts of at most ``part_bytes`` into ``dest``; return the manifest."""
    if part_bytes <= 0:
        raise ValueError("part size must be positive")
    dest.mkdir(parents=True, exist_ok=True)
    size = src.stat().st_size
    whole = hashlib.sha256()
    parts = []
    with open(src, "rb") as f:
        index = 0
        while True:
            data = f.read(part_bytes)
            if not data and index > 0:
                break
            whole.update(data)
            path = dest / part_name(src.name, index)
            path.write_bytes(data)
            parts.append({"file": path.name, "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})  # fmt: skip
            index += 1
            if len(data) < part_bytes:
                break
    manifest = {"name": src.name, "size": size, "sha256": whole.hexdigest(), "parts": parts}
    (dest / (src.name + MANIFEST)).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def manifests(folder: Path) -> dict[str, dict]:
    return {
        p.name[: -len(MANIFEST)]: json.loads(p.read_text())
        for p in sorted(folder.glob("*" + MANIFEST))
    }


def stash(src: Path, store: Path) -> dict[str, list[str]]:
    """Copy the parts in ``src`` that match their manifests into ``store``; return, per
    file, the parts ``store`` still lacks. A part that does not match is an error."""
    store.mkdir(parents=True, exist_ok=True)
    for name, manifest in manifests(src).items():
        shutil.copyfile(src / (name + MANIFEST), store / (name + MANIFEST))
        for part in manifest["parts"]:
            path = src / part["file"]
            if not path.exists():
                continue
            if path.stat().st_size != part["size"] or sha256_of(path) != part["sha256"]:
                raise ValueError(f"{path}: does not match its manifest")
            tmp = store / (part["file"] + ".tmp")
            shutil.copyfile(path, tmp)
            os.replace(tmp, store / part["file"])
    return missing(store)


def missing(store: Path) -> dict[str, list[str]]:
    return {
        name: [p["file"] for p in m["parts"] if not (store / p["file"]).exists()]
        for name, m in manifests(store).items()
    }


def join(store: Path, name: str, dest: Path) -> list[str]:
    """Write ``dest`` from ``store``'s parts of ``name``; return the missing parts (then
    nothing is written). A whole file whose size or sha256 differs is an error."""
    manifest = json.loads((store / (name + MANIFEST)).read_text())
    lacking = [p["file"] for p in manifest["parts"] if not (store / p["file"]).exists()]
    if lacking:
        return lacking
    dest.parent.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in manifest["parts"]:
                with open(store / part["file"], "rb") as f:
                    while block := f.read(CHUNK):
                        whole.update(block)
                        out.write(block)
        if os.path.getsize(tmp) != manifest["size"] or whole.hexdigest() != manifest["sha256"]:
            raise ValueError(f"{name}: the joined parts do not match the manifest")
        os.replace(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="cut FILE into parts in DIR, with a manifest")
    sp.add_argument("file", type=Path)
    sp.add_argument("dir", type=Path)
    size = sp.add_mutually_exclusive_group()
    size.add_argument("--parts", type=int, help="this many parts of equal size")
    size.add_argument("--part-mib", type=float, default=30.0, help="part size (default 30)")
    st = sub.add_parser("stash", help="copy the parts in DIR into STORE (checked)")
    st.add_argument("dir", type=Path)
    st.add_argument("store", type=Path)
    jn = sub.add_parser("join", help="reassemble NAME from STORE into DEST")
    jn.add_argument("store", type=Path)
    jn.add_argument("name")
    jn.add_argument("dest", type=Path)
    args = ap.parse_args(argv)

    if args.cmd == "split":
        size = args.file.stat().st_size
        if args.parts:
            part_bytes = max(1, -(-size // args.parts))
        else:
            part_bytes = int(args.part_mib * 2**20)
        m = split(args.file, args.dir, part_bytes)
        for p in m["parts"]:
            print(f"{args.dir / p['file']}  {p['size'] / 2**20:.1f} MiB")
        return 0
    if args.cmd == "stash":
        for name, lacking in stash(args.dir, args.store).items():
            print(f"{name}: " + (f"missing {' '.join(lacking)}" if lacking else "all parts here"))
        return 0
    lacking = join(args.store, args.name, args.dest)
    if lacking:
        print(f"{args.name}: missing {' '.join(lacking)} (carry them in earlier commands)")
        return MISSING
    print(f"{args.dest}: joined, sha256 checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
