"""Fixtures of the `container` tier: the image built from deploy/Dockerfile and the
project's docker-compose.yml started for real with podman (see podman.py).

Selection: a plain ``pytest`` runs them, as CI does after ``.ci/run`` has installed podman
and made the stand-in base images; PHASEWATCH_CONTAINERS=0 (or ``-m "not container"``)
leaves them out. They never skip: a missing podman or stand-in image is a test error
with the reason and the fix.
"""

from __future__ import annotations

import os

import pytest

from .podman import ContainersMissing, Podman


@pytest.fixture(scope="session")
def podman():
    try:
        return Podman()
    except ContainersMissing as exc:
        pytest.fail(f"containers cannot run here: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def image(podman):
    """phasewatch's image, built from this checkout under a tag of this run's own (other
    checkouts on the machine may be building theirs)."""
    podman.remove_stale_images("localhost/phasewatch", "test-")
    tag = f"localhost/phasewatch:test-{os.getpid()}"
    seconds = podman.build(tag)
    print(f"\nimage {tag} built in {seconds:.1f} s")
    yield tag
    podman.run("rmi", "-f", tag, check=False)
