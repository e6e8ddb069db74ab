"""Re-export the fake-project fixtures (helpers live in patchset_fake.py so tests can import them)."""

from patchset_fake import fake, overlaid, two  # noqa: F401
