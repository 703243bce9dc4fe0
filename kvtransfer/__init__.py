"""Placeholder: filled in by a later issue (see DESIGN.md)."""
