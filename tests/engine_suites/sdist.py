"""Engine releases from PyPI: the list of a project's releases, and one release's files, downloaded once into a cache
and verified against the sha256 that PyPI's JSON API gives.

    fetch("flashinfer-python", "0.4.0rc3", members=["tests/test_sampling.py"]) -> Path of the extracted members
    releases("transformers") -> ["4.0.0", ..., "5.25.0"] (oldest first; pre-releases left out unless asked)

The cache is $SPECDEC_ENGINE_CACHE (default ~/.cache/specdec_ext/engines): <project>/<file> as downloaded, and
<project>/<version>-<kind>-<key>/ with the members extracted (an sdist's top folder, <name>-<version>/, removed, so
that member paths are those of the source tree; a wheel's paths are kept). Nothing is imported from what is extracted.
"""
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

INDEX = "https://pypi.org/pypi"
TIMEOUT_S = 120


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_ENGINE_CACHE") or "~/.cache/specdec_ext/engines").expanduser()


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return json.load(response)


def project_json(project: str) -> dict:
    return _get_json(f"{INDEX}/{project}/json")


def release_files(project: str, version: str) -> list:
    """The files of one release (PyPI's JSON entries), with absolute URLs. Asks the release's own JSON first and,
    where the index does not serve it (404), the project's JSON, which lists every release's files."""
    base = f"{INDEX}/{project}/{version}/json"
    try:
        files = _get_json(base)["urls"]
    except urllib.error.HTTPError as error:
        if error.code != 404:
            raise
        base = f"{INDEX}/{project}/json"
        files = project_json(project)["releases"].get(version)
        if files is None:
            raise LookupError(f"{project} has no release {version} on PyPI") from None
    # Some indexes give relative URLs (../../packages/...): they are relative to the JSON document's URL.
    return [dict(f, url=urllib.parse.urljoin(base, f["url"])) for f in files if not f.get("yanked")]


def releases(project: str, pre: bool = False) -> list:
    """The project's release versions on PyPI, oldest first (pre-releases only with pre=True)."""
    out = []
    for version, files in project_json(project)["releases"].items():
        try:
            v = Version(version)
        except InvalidVersion:
            continue
        if files and (pre or not v.is_prerelease):
            out.append(v)
    return [str(v) for v in sorted(out)]


def _wheel_fits(filename: str) -> bool:
    """A wheel this machine could install: pure Python, or CPython 3 on x86-64 Linux."""
    tags = filename[:-len(".whl")].split("-")[-3:]
    return tags[2] == "any" or ("x86_64" in tags[2] and "linux" in tags[2] and
                                (tags[1] == "abi3" or tags[0] == f"cp{sys.version_info[0]}{sys.version_info[1]}"))


def choose(files: list, kind: str = "sdist") -> dict:
    """The release file to use: kind "sdist" (else a wheel) or "wheel" (else the sdist)."""
    sdists = [f for f in files if f["packagetype"] == "sdist"]
    wheels = sorted((f for f in files if f["packagetype"] == "bdist_wheel" and _wheel_fits(f["filename"])),
                    key=lambda f: "none-any" not in f["filename"])
    ordered = sdists + wheels if kind == "sdist" else wheels + sdists
    if not ordered:
        raise LookupError(f"no sdist or usable wheel among {[f['filename'] for f in files]}")
    return ordered[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(project: str, entry: dict) -> Path:
    """The release file, downloaded once and checked against PyPI's sha256 (a mismatch deletes it and raises)."""
    folder = cache_dir() / project
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / entry["filename"]
    expected = entry["digests"]["sha256"]
    verified = path.with_name(path.name + ".sha256")
    if path.exists() and verified.exists() and verified.read_text().strip() == expected:
        return path
    with tempfile.NamedTemporaryFile(dir=folder, delete=False) as tmp:
        with urllib.request.urlopen(entry["url"], timeout=TIMEOUT_S) as response:
            shutil.copyfileobj(response, tmp, 1 << 20)
    got = _sha256(Path(tmp.name))
    if got != expected:
        os.unlink(tmp.name)
        raise ValueError(f"{entry['filename']}: sha256 {got} differs from PyPI's {expected}")
    os.replace(tmp.name, path)
    verified.write_text(expected + "\n")
    return path


def _members(archive: Path):
    """(member path in the source tree, reader) for each regular file of an sdist or wheel."""
    if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                if not info.is_dir():
                    yield info.filename, lambda info=info, z=z: z.read(info)
        return
    with tarfile.open(archive) as t:
        for info in t:
            if info.isfile() and "/" in info.name:
                yield info.name.split("/", 1)[1], lambda info=info, t=t: t.extractfile(info).read()


def fetch(project: str, version: str, members=("*",), kind: str = "sdist") -> Path:
    """The folder holding the members (glob patterns over the source tree's paths, `*` crossing folders) of the
    project's release, downloaded and extracted once. Raises LookupError when a pattern matches nothing."""
    entry = choose(release_files(project, version), kind)
    members = sorted(set(members))
    key = hashlib.sha256(json.dumps([entry["filename"], members]).encode()).hexdigest()[:12]
    out = cache_dir() / project / f"{version}-{entry['packagetype']}-{key}"
    if (out / ".complete").exists():
        return out
    archive = download(project, entry)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".extract-"))
    matched = set()
    for name, read in _members(archive):
        hits = [m for m in members if fnmatch.fnmatchcase(name, m)]
        if not hits or ".." in Path(name).parts or name.startswith("/"):
            continue
        matched.update(hits)
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read())
    missing = [m for m in members if m not in matched]
    if missing:
        shutil.rmtree(tmp)
        raise LookupError(f"{entry['filename']} has no member matching {missing}")
    (tmp / ".complete").write_text(json.dumps({"file": entry["filename"], "sha256": entry["digests"]["sha256"],
                                               "members": members}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def source(path: Path) -> dict:
    """What fetch() recorded for an extracted folder: the file it came from, its sha256 and the member patterns."""
    return json.loads((Path(path) / ".complete").read_text())
