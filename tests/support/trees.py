"""Random draft token trees for the tests (metadata/tree.py)."""

from __future__ import annotations

import numpy as np


def random_parents(rng: np.random.Generator, n: int, shape: str = "random") -> list[int]:
    """A tree of n tokens: a chain, a star (every token a child of the root), or random (each token's parent
    any earlier token)."""
    if shape == "chain":
        return [-1] + list(range(n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [int(rng.integers(0, j)) for j in range(1, n)]


def random_path(rng: np.random.Generator, parents: list[int], stop: float) -> list[int]:
    """An accepted path of the tree `parents`: a random walk down from the root (node 0), stopping at a leaf or,
    at each node, with probability `stop`."""
    path = [0]
    while True:
        kids = [j for j in range(len(parents)) if parents[j] == path[-1]]
        if not kids or rng.random() < stop:
            return path
        path.append(int(rng.choice(kids)))
