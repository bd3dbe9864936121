"""Scenario libraries the tests share: cross attention (cross_pages), draft rounds (draft_rounds), per-group page
lists (group_pages), shared-prefix batches (prefix_batches)."""
