"""fetch: checksum verification, caching, deterministic import."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import pytest
from conftest import Upstream, git

from keep.fetch import ensure_base, ensure_sdist, sdist_path
from lib.errors import ForkError
from lib.series import Base, read_base


def test_wrong_checksum_names_both_sums_and_keeps_nothing(upstream: Upstream):
    good = upstream.series.base()
    bad = Base(version=good.version, sdist_url=good.sdist_url, sdist_sha256="0" * 64)
    with pytest.raises(ForkError) as info:
        ensure_sdist(bad, upstream.series.base_file, upstream.cache)
    msg = str(info.value)
    assert "0" * 64 in msg and good.sdist_sha256 in msg
    assert "base.toml" in msg
    assert not sdist_path(bad, upstream.cache).exists()
    assert not list((upstream.cache / "sdist").glob("*.part"))


def test_corrupted_cache_file_is_reported(upstream: Upstream):
    base = upstream.series.base()
    path = ensure_sdist(base, upstream.series.base_file, upstream.cache)
    path.write_bytes(b"corrupted")
    with pytest.raises(ForkError, match="(?s)cached.*Delete"):
        ensure_sdist(base, upstream.series.base_file, upstream.cache)


def test_import_is_deterministic(upstream: Upstream, tmp_path):
    base = upstream.series.base()
    one = ensure_base(base, upstream.series.base_file, tmp_path / "c1")
    two = ensure_base(base, upstream.series.base_file, tmp_path / "c2")
    assert git(one, "rev-parse", base.tag) == git(two, "rev-parse", base.tag)
    files = git(one, "ls-tree", "-r", "--name-only", base.tag).split()
    assert "vllm/v1/core/block_pool.py" in files and "PKG-INFO" not in files


def test_two_processes_import_one_release_into_a_fresh_cache(
    upstream: Upstream, tmp_path
):
    """As two pytest-xdist workers that need the same release do: both get
    the tag, and neither fails on the other's tag or download."""
    base = upstream.series.base()
    cache = tmp_path / "fresh"
    with ProcessPoolExecutor(2) as pool:
        repos = list(
            pool.map(
                ensure_base, [base] * 2, [upstream.series.base_file] * 2, [cache] * 2
            )
        )
    assert repos[0] == repos[1]
    assert git(repos[0], "tag", "--list") == base.tag
    assert not list((cache / "sdist").glob("*.part"))


def test_unreachable_url_is_a_clear_error(upstream: Upstream, tmp_path):
    base = Base(
        version="1.0.0",
        sdist_url=(tmp_path / "nope.tar.gz").as_uri(),
        sdist_sha256="0" * 64,
    )
    with pytest.raises(ForkError, match="cannot download"):
        ensure_sdist(base, upstream.series.base_file, upstream.cache)


@pytest.mark.parametrize(
    "text, error",
    [
        ('version = "1"\n', "lacks sdist_url, sdist_sha256"),
        ('version = "1"\nsdist_url = "x"\nsdist_sha256 = "abc"\n', "64 lowercase hex"),
        ("version = \n", "not valid TOML"),
        (
            'version = "1"\nsdist_url = "x"\nsdist_sha256 = "'
            + "a" * 64
            + '"\nfoo = "1"\n',
            "unknown keys: foo",
        ),
    ],
)
def test_bad_base_file_is_a_clear_error(tmp_path, text, error):
    path = tmp_path / "base.toml"
    path.write_text(text)
    with pytest.raises(ForkError, match=error):
        read_base(path)
