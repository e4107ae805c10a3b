"""Integrations with other projects."""
