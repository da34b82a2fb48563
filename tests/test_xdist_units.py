"""`make test`'s work units (tests/conftest.py) reach pytest-xdist: every test of a file on one worker, so a file's
module fixtures (a Megatron launch, a Ray cluster) start once. pytest 9.2 silently dropped them (pytest-xdist
#1386); this fails if an upgrade does that again."""

from __future__ import annotations


def test_a_file_is_one_xdist_unit(request):
    assert request.node.get_closest_marker("xdist_group").args == ("tests/test_xdist_units.py",)
    if getattr(
        request.config.option, "loadgroup", False
    ):  # a worker of `pytest -n 2 --dist loadgroup`: xdist saw the unit
        assert request.node.nodeid.endswith("@tests/test_xdist_units.py"), request.node.nodeid
