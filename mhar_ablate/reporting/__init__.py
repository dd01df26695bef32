"""Reporting: routing heatmaps, study tables and plots."""
