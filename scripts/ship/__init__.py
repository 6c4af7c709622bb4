"""Ship it: install, the patched wheel, the container context and the image
proven in it, and each patch as an upstream pull request (`make export`).

Imports `lib`, `keep` (the tree) and `prove` (`export` checks a branch as
`make test` does).
"""
