"""Findings as data and the rules that raise them; explain, the scale comparison, the
scorecard and inspect: what the engine's numbers mean."""
