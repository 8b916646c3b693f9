"""Session-wide worlds of 1, 2, 4 and 8 Gloo ranks (see multiprocess.py)."""

from __future__ import annotations

import pytest
from multiprocess import World

_worlds: dict[int, World] = {}


def get_world(size: int) -> World:
    world = _worlds.get(size)
    if world is None or not world.alive:
        world = _worlds[size] = World(size)
    return world


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}ranks")
def world(request) -> World:
    """Every test that takes ``world`` runs at 1, 2 and 4 ranks."""
    return get_world(request.param)


@pytest.fixture
def world2() -> World:
    return get_world(2)


@pytest.fixture
def world4() -> World:
    return get_world(4)


@pytest.fixture
def world8() -> World:
    """Eight ranks for 3D (tp x pp x dp = 2 x 2 x 2) runs: tiny models only, on two cores."""
    return get_world(8)


def pytest_sessionfinish(session, exitstatus) -> None:
    for world in _worlds.values():
        world.close()
