"""Keep the series: fetch the base, apply, refresh, rebase onto another
release (with its recorded resolutions), import a fix, the release matrix and
table, and upstream's history (stand-in, cut, bisect, canary).

Imports `lib` only.
"""
