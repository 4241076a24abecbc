"""Testing helpers shipped with sandfleet (like trio.testing): a fake tier and an in-process node,
so code built on the SDK, and the service itself, can be tested without root and in milliseconds.

    from sandfleet.testing import InProcessNode

They are never the proof that a feature works on a real tier (tests/conformance/ runs real ones).
"""

from sandfleet.testing.fake_agent import FakeAgent
from sandfleet.testing.fake_backend import FakeBackend
from sandfleet.testing.inprocess import InProcessNode

__all__ = ["FakeAgent", "FakeBackend", "InProcessNode"]
