"""Thin Ray actor shells over the pure logic in `app/`."""
