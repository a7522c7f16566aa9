"""End-to-end runs that build data and train a drafter, then measure it."""
