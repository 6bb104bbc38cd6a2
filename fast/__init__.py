"""foxhunt."""
