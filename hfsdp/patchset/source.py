"""Find, download and verify the pinned upstream sdist.

Lookup order (first hit wins):

1. an explicit path (``--sdist`` or ``MEGATRON_PATCHSET_SDIST``);
2. wheelhouse folders (``MEGATRON_PATCHSET_FIND_LINKS``, ``os.pathsep``-separated, then
   ``PIP_FIND_LINKS``, space-separated as pip reads it);
3. the download cache (``MEGATRON_PATCHSET_CACHE``, else ``$XDG_CACHE_HOME/megatron-patchset``);
4. a download from the pinned URL (then the PEP 691 index), unless offline
   (``MEGATRON_PATCHSET_OFFLINE=1`` or ``PIP_NO_INDEX``).

Whatever the source, the sha256 is checked before a single member is extracted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from hfsdp.usererror import UserError, env_flag, not_a_regular_file, output_folder, quoted

from .errors import HashMismatch, SourceUnavailable, WrongBaseVersion
from .pin import BasePin

_SDIST_NAME = re.compile(r"^(?P<dist>[A-Za-z0-9_.]+?)-(?P<version>[0-9][^/]*?)\.tar\.gz$")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_offline(env: Mapping[str, str] | None = None) -> bool:
    """True when the user asked for no network access."""
    return any(env_flag(name, environ=env, unset_means="the index may be asked")
               for name in ("MEGATRON_PATCHSET_OFFLINE", "PIP_NO_INDEX"))


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where downloaded sdists are kept between installs."""
    environ = os.environ if env is None else env
    if environ.get("MEGATRON_PATCHSET_CACHE"):
        return Path(environ["MEGATRON_PATCHSET_CACHE"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-patchset"


def _wheelhouses(env: dict[str, str]) -> list[Path]:
    dirs = [Path(p) for p in env.get("MEGATRON_PATCHSET_FIND_LINKS", "").split(os.pathsep) if p]
    for item in env.get("PIP_FIND_LINKS", "").split():
        item = item.removeprefix("file://")
        if item and "://" not in item:
            dirs.append(Path(item))
    return dirs


def check_version(pin: BasePin, path: Path) -> None:
    """Refuse an sdist whose file name names another release than the pin."""
    match = _SDIST_NAME.match(path.name)
    if match is None:
        raise WrongBaseVersion(
            f"{path} is not an sdist (expected a file named {pin.filename})",
            f"pass the {pin.distribution}=={pin.version} sdist: "
            f"`pip download --no-deps --no-binary :all: {pin.distribution}=={pin.version}`",
        )
    if match["version"] != pin.version:
        raise WrongBaseVersion(
            f"{path.name} is {pin.distribution} {match['version']}, but this series is pinned to "
            f"{pin.version} (patches/base.toml)",
            f"use the {pin.filename} sdist, or rebase the series onto {match['version']} with "
            f"`scripts/patchset check --against {quoted(path)}` first",
        )


def published_sha256(pin: BasePin, filename: str, env: Mapping[str, str] | None = None,
                     timeout: float = 15.0) -> tuple[str | None, str]:
    """(the sha256 the index publishes for ``filename``, or None; why None: offline, no answer, not listed)."""
    where = pin.index_url.rstrip("/")
    if is_offline(env):
        return None, "offline (MEGATRON_PATCHSET_OFFLINE/PIP_NO_INDEX), so the index was not asked"
    try:
        files = index_files(pin, timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"{where} did not answer ({exc})"
    entry = next((f for f in files if f.get("filename") == filename), None)
    hashes = entry.get("hashes") if entry is not None else None
    digest = hashes.get("sha256") if isinstance(hashes, dict) else None
    if not isinstance(digest, str):
        return None, f"{where} lists no sha256 for {filename}"
    return digest.lower(), ""


def _mismatch(pin: BasePin, path: Path, actual: str, env: Mapping[str, str] | None, downloaded: bool) -> HashMismatch:
    """The refusal of a file whose sha256 is not the pin's, saying which of the two is wrong where the index
    can tell: a file with the sha256 the index publishes is the release, so the pin is what differs."""
    published, why = published_sha256(pin, pin.filename, env)
    where = pin.index_url.rstrip("/")
    cause = f"sha256 of {path} is {actual}, but patches/base.toml pins {pin.sha256}; nothing was extracted"
    fetch = f"`pip download --no-deps --no-binary :all: {pin.distribution}=={pin.version}`"
    if published == actual:
        return HashMismatch(
            f"{cause}. {where} publishes {actual} for {pin.filename}: the file is the release, the pin is wrong "
            "(downloading it again gives the same file)",
            "correct the sha256 in patches/base.toml: if you did not mean to change it, restore it "
            "(`git checkout patches/base.toml`); if you are moving the pin, set it to the index's sha256",
            pin_is_wrong=True)
    if published == pin.sha256:
        again = ("run the command again (it downloads a fresh copy)" if downloaded else
                 f"delete {path} and run the command again (it downloads a fresh copy), or fetch one with {fetch}")
        return HashMismatch(f"{cause}. {where} publishes the pinned sha256 for {pin.filename}: the pin is right "
                            "and this file is damaged or not the release", again)
    if published is not None:
        return HashMismatch(f"{cause}. {where} publishes {published} for {pin.filename}, which matches neither",
                            "check patches/base.toml against the index (url, version, sha256) before using any copy")
    return HashMismatch(
        f"{cause}. Which one is wrong cannot be told here: {why}",
        f"compare {actual} with the sha256 that {where}/{pin.distribution}/ publishes for {pin.filename}: if they "
        "are equal, the pin in patches/base.toml is wrong (restore it: `git checkout patches/base.toml`); if not, "
        + ("the download was damaged: run the command again" if downloaded else
           f"this copy is damaged: delete {path} and run the command again, or fetch one with {fetch}"))


def verify(pin: BasePin, path: Path, env: Mapping[str, str] | None = None, downloaded: bool = False) -> Path:
    """Check name and sha256; return the path. Nothing is extracted before this passes."""
    check_version(pin, path)
    actual = sha256_file(path)
    if actual != pin.sha256:
        raise _mismatch(pin, path, actual, env, downloaded)
    return path


def _download(url: str, dest: Path, timeout: float) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out)
        os.replace(tmp_name, dest)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def index_files(pin: BasePin, timeout: float) -> list[dict]:
    """The files the PEP 691 JSON simple index lists for the pin's distribution (each a dict with
    ``filename``, ``url``, ``hashes`` and, where the release was withdrawn, a truthy ``yanked``)."""
    req = urllib.request.Request(
        f"{pin.index_url.rstrip('/')}/{pin.distribution}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        files = json.load(resp).get("files", [])
    return [entry for entry in files if isinstance(entry, dict)] if isinstance(files, list) else []


def _index_url_for(pin: BasePin, timeout: float) -> str | None:
    """Ask the PEP 691 JSON simple index for the sdist's URL."""
    for entry in index_files(pin, timeout):
        if entry.get("filename") == pin.filename:
            return str(entry["url"])
    return None


def yank_note(pin: BasePin, filename: str, env: Mapping[str, str] | None = None, timeout: float = 15.0) -> str | None:
    """A sentence when the index says ``filename`` is yanked (PEP 592: pip installs a yanked release only when
    pinned exactly) or cannot be asked; None when it is listed and not yanked, or not listed at all."""
    where = pin.index_url.rstrip("/")
    if is_offline(env):
        return f"whether {filename} is yanked on {where} is unknown (offline: MEGATRON_PATCHSET_OFFLINE/PIP_NO_INDEX)"
    try:
        files = index_files(pin, timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"whether {filename} is yanked on {where} is unknown (the index did not answer: {exc})"
    entry = next((f for f in files if f.get("filename") == filename), None)
    yanked = None if entry is None else entry.get("yanked")
    if not yanked:
        return None
    reason = f" ({yanked})" if isinstance(yanked, str) and yanked.strip() else ""
    return (f"{filename} is yanked on {where}{reason}: pip installs it only when pinned exactly, so few users "
            "run it; compare against a release that is not yanked")


def cached_file(cached: Path, other_way: str) -> Path | None:
    """``cached`` (a file of the download cache) when a regular file is there (a link to one included), None
    when nothing is. Anything else is refused (``other_way``: how to do without the cache): a named pipe would
    block the read, and a download would replace what the user put there."""
    if os.path.lexists(cached) and (why := not_a_regular_file(cached)):
        raise SourceUnavailable(f"the cached sdist {cached} {why}, so it can neither be read nor replaced by a "
                                "download", f"move {quoted(cached)} away (the next run downloads a fresh copy), or "
                                f"{other_way}")
    return cached if cached.is_file() else None


def require_cache_folder(cached: Path, other_way: str) -> None:
    """Refuse, before asking the index, a download cache that ``cached`` cannot be downloaded into."""
    try:
        output_folder("the download cache", cached.parent)
    except UserError as exc:
        raise SourceUnavailable(f"{exc.cause}, so {cached.name} cannot be downloaded into it",
                                "point MEGATRON_PATCHSET_CACHE (or XDG_CACHE_HOME) at a folder you can write to, or "
                                f"{other_way}") from None


def require_sdist_file(path: Path, given_by: str, filename: str | None = None) -> None:
    """Refuse a path given for the sdist (``given_by``: ``--sdist`` or ``MEGATRON_PATCHSET_SDIST``) that is not a
    file, saying what it is; ``filename``: the pinned sdist's name, if known, to point at it inside a folder."""
    if path.is_file():
        return
    name = filename or "megatron_core-<version>.tar.gz"
    given = f"{given_by}=" if given_by.isupper() else f"{given_by} "
    if path.is_dir():
        inside = path / name
        held = f"it holds {name}: " if filename and inside.is_file() else ""
        raise SourceUnavailable(f"{given_by} {path} is a folder, not an sdist file",
                                f"{held}pass the sdist file itself, e.g. {given}{inside}")
    what = not_a_regular_file(path) or "is not a regular file"
    raise SourceUnavailable(f"{given_by} {path} {what}", f"pass the path of the {name} sdist file: {given}PATH")


def locate_sdist(
    pin: BasePin,
    explicit: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Path:
    """Return a verified local path to the pinned sdist, downloading it if allowed."""
    env = dict(os.environ) if env is None else env
    if explicit is not None:
        require_sdist_file(explicit, "--sdist", pin.filename)
    elif env.get("MEGATRON_PATCHSET_SDIST"):
        explicit = Path(env["MEGATRON_PATCHSET_SDIST"])
        require_sdist_file(explicit, "MEGATRON_PATCHSET_SDIST", pin.filename)
    if explicit is not None:
        return verify(pin, explicit, env)
    searched: list[str] = []
    for folder in _wheelhouses(env):
        candidate = folder / pin.filename
        searched.append(str(candidate))
        if candidate.is_file():
            return verify(pin, candidate, env)
    cached = cache_dir(env) / pin.filename
    searched.append(str(cached))
    if cached_file(cached, "pass the sdist with --sdist") is not None:
        return verify(pin, cached, env)
    if is_offline(env):
        raise SourceUnavailable(
            f"offline (MEGATRON_PATCHSET_OFFLINE/PIP_NO_INDEX set) and no {pin.filename} found; "
            f"looked in: {', '.join(searched)}",
            f"on a connected machine run `pip download --no-deps --no-binary :all: "
            f"{pin.distribution}=={pin.version} -d wheelhouse/`, copy it over, then set "
            "MEGATRON_PATCHSET_SDIST=wheelhouse/" + pin.filename + " (see README, Offline install)",
        )
    require_cache_folder(cached, "pass the sdist with --sdist")
    errors: list[str] = []
    for resolve in (lambda: pin.url, lambda: _index_url_for(pin, timeout)):
        try:
            url = resolve()
            if url:
                _download(url, cached, timeout)
                return verify(pin, cached, env, downloaded=True)
        except (urllib.error.URLError, OSError, ValueError, json.JSONDecodeError) as exc:
            errors.append(f"{exc}")
        except HashMismatch as exc:
            if not exc.pin_is_wrong:  # a damaged download goes; the published file stays (the pin is fixed next)
                cached.unlink(missing_ok=True)
            raise
    raise SourceUnavailable(
        f"could not download {pin.filename}: {'; '.join(errors) or 'not listed on the index'}",
        "check network access to the package index, or install offline with MEGATRON_PATCHSET_SDIST "
        "pointing at a downloaded sdist (see README, Offline install)",
    )
